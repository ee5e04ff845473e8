"""Engine-side pull of a weights server's snapshot: manifest, then every shard, verified.

Uses only the standard library's HTTP client: each tensor is read straight from the
socket into its own buffer (one copy) and hashed before it is handed on.
"""

from __future__ import annotations

import hashlib
import http.client
from typing import Any
from urllib.parse import urlsplit

from rollfleet_engine.protocol import WeightManifest
from rollfleet_engine.safetensors_stream import TransferError, read_shard


def fetch_weights(url: str, manifest_sha256: str | None, timeout_s: float) -> list[tuple[str, Any]]:
    """Download every tensor a weights server offers, each verified; raise on any mismatch."""
    parts = urlsplit(url.rstrip("/"))
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"weights URL must be http://host:port, got {url!r}")
    base = parts.path

    def get(path: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout_s)
        conn.request("GET", base + path)
        resp = conn.getresponse()
        if resp.status != 200:
            conn.close()
            raise TransferError(f"GET {url}{path}: HTTP {resp.status}")
        return conn, resp

    conn, resp = get("/manifest")
    raw = resp.read()
    conn.close()
    if manifest_sha256 is not None and hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise TransferError("manifest sha256 differs from the one in update_info (server serves other weights)")
    manifest = WeightManifest.model_validate_json(raw)
    weights: list[tuple[str, Any]] = []
    for shard in manifest.shards:
        conn, resp = get(shard.path)
        try:
            if resp.length is not None and resp.length != shard.size:
                raise TransferError(f"{shard.path}: {resp.length} bytes offered, manifest says {shard.size}")
            weights.extend(read_shard(resp.readinto, shard))
        finally:
            conn.close()
    return weights
