"""Rollfleet's images into the kind nodes, each node sent only the layers it lacks.

Why not `kind load docker-image` every time: it sends a whole image to every node on every change. The
engine image is 6.4 GiB of torch and vLLM under a few MiB of Rollfleet's code, so a code change cost
6.4 GiB of writes per GPU-pool node (a quarter of an hour beside the test tiers on 2 cores). A node that
holds the image's lower layers (as containerd snapshots) is sent here an OCI archive of the manifest, the
config and only the layers above them: containerd's import does not unpack a layer whose snapshot
exists (what its CRI does for images pulled with `discard_unpacked_layers`), and the image it records
has the id `kind load` gives (Docker's config digest), checked after each import. A node that holds
none of the image gets `kind load` itself. Talks to Docker (`docker save`) and each node's `ctr`,
`crictl` and `containerd`.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field

from rollfleet.errors import RollfleetError

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"  # docker save's layers: uncompressed, digest = diff id
# A layer kept in memory between `docker save` and the imports (twice that in all): the code layers are
# KiBs to MiBs; a changed base layer (GiBs) is sent the way kind sends it.
KEEP_LIMIT = 512 * 2**20


class ImageLoadError(RollfleetError, RuntimeError):
    """An image could not be loaded into a node; the message says which and why."""


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The OCI chain id of each layer (what containerd names a layer's snapshot by): a layer's content
    together with every layer under it."""
    chains: list[str] = []
    for diff_id in diff_ids:
        chains.append(_sha256(f"{chains[-1]} {diff_id}".encode()) if chains else diff_id)
    return chains


def missing_layers(diff_ids: list[str], snapshots: set[str]) -> list[str]:
    """The layers a node must be sent: those above the highest one it holds as a snapshot."""
    held = [i for i, chain in enumerate(chain_ids(diff_ids)) if chain in snapshots]
    return diff_ids[held[-1] + 1 :] if held else list(diff_ids)


def snapshotter(config_dump: str) -> str:
    """The snapshotter containerd's CRI unpacks images with, from `containerd config dump` (as kind
    reads it: config version 2, or 3 and later)."""
    config = tomllib.loads(config_dump)
    plugins = config.get("plugins", {})
    if int(config.get("version", 0)) >= 3:
        name = plugins.get("io.containerd.cri.v1.images", {}).get("snapshotter")
    else:
        name = plugins.get("io.containerd.grpc.v1.cri", {}).get("containerd", {}).get("snapshotter")
    if not name:
        raise ImageLoadError("containerd's config names no CRI snapshotter: load the image with `kind load`")
    return str(name)


def oci_archive(ref: str, config: bytes, layers: list[tuple[str, int]], blobs: dict[str, bytes]) -> bytes:
    """An OCI image layout (as a tar) of image `ref`: its manifest names every layer (`layers`: diff id and
    size, bottom first); `blobs` holds the bytes of those the receiver lacks."""
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": _sha256(config), "size": len(config)},
            "layers": [{"mediaType": OCI_LAYER, "digest": d, "size": size} for d, size in layers],
        }
    ).encode()
    tag = ref.rsplit(":", 1)[-1]
    index = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": _sha256(manifest),
                    "size": len(manifest),
                    "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
                }
            ],
        }
    ).encode()
    files = {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": index,
        "blobs/sha256/" + _sha256(manifest).removeprefix("sha256:"): manifest,
        "blobs/sha256/" + _sha256(config).removeprefix("sha256:"): config,
    }
    files |= {"blobs/sha256/" + d.removeprefix("sha256:"): blob for d, blob in blobs.items()}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def full_ref(image: str) -> str:
    """The name containerd records for a Docker Hub style name (`rollfleet/x:1` -> `docker.io/rollfleet/x:1`)."""
    first = image.split("/", 1)[0]
    return image if "." in first or ":" in first or first == "localhost" else f"docker.io/{image}"


@dataclass
class Saved:
    """What `docker save` gave of an image: its config, each layer's size, and the bytes of the wanted ones."""

    config: bytes = b""
    sizes: dict[str, int] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)


def save(image: str, config_digest: str, diff_ids: list[str], wanted: set[str]) -> Saved:
    """Stream `docker save` once, keeping the layers of at most KEEP_LIMIT bytes each (which are wanted is
    only known at the end: its manifest, which maps the archive's layer files to positions, comes last)."""
    config_name = config_digest.removeprefix("sha256:") + ".json"
    sizes: dict[str, int] = {}
    kept: dict[str, bytes] = {}
    saved, order = Saved(), []
    proc = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
        for member in tar:
            data = tar.extractfile(member) if member.isfile() else None
            if data is None:
                continue
            if member.name == config_name:
                saved.config = data.read()
            elif member.name == "manifest.json":
                order = json.loads(data.read())[0]["Layers"]
            elif member.name.endswith("/layer.tar"):
                sizes[member.name] = member.size
                if member.size <= KEEP_LIMIT and sum(map(len, kept.values())) + member.size <= 2 * KEEP_LIMIT:
                    kept[member.name] = data.read()
    if proc.wait() != 0:
        raise ImageLoadError(f"docker save {image} failed: {proc.stderr.read().decode().strip()[-2000:]}")
    if _sha256(saved.config) != config_digest or len(order) != len(diff_ids):
        raise ImageLoadError(f"docker save {image} gave another image than {config_digest}: was it rebuilt meanwhile?")
    for name, diff_id in zip(order, diff_ids, strict=True):
        saved.sizes[diff_id] = sizes[name]
        if diff_id in wanted and name in kept:
            if _sha256(kept[name]) != diff_id:
                raise ImageLoadError(f"docker save {image}: {name} is not layer {diff_id}")
            saved.blobs[diff_id] = kept[name]
    return saved


def _on_node(node: str, *argv: str, stdin: bytes | None = None, check: bool = True) -> str:
    proc = subprocess.run(["docker", "exec", "-i", node, *argv], input=stdin, capture_output=True, timeout=900)
    if check and proc.returncode != 0:
        raise ImageLoadError(f"{' '.join(argv[:4])} on {node} failed: {proc.stderr.decode().strip()[-2000:]}")
    return proc.stdout.decode()


def node_image_id(node: str, ref: str) -> str | None:
    """The id (config digest) of the image a node holds under `ref`, as kind reads it (crictl)."""
    out = _on_node(node, "crictl", "inspecti", "-o", "json", ref, check=False)
    try:
        return str(json.loads(out)["status"]["id"])
    except (ValueError, KeyError, TypeError):
        return None


def _snapshots(node: str, name: str) -> set[str]:
    out = _on_node(node, "ctr", "-n", "k8s.io", "snapshots", f"--snapshotter={name}", "ls")
    return {line.split()[0] for line in out.splitlines()[1:] if line.strip()}


def load(image: str, nodes: list[str], kind_load: Callable[[list[str]], None], log: Callable[[str], None]) -> None:
    """Make every node of `nodes` hold `image` as Docker has it; nodes that already do are left alone."""
    found = json.loads(subprocess.run(["docker", "image", "inspect", image], capture_output=True).stdout or "[]")
    if not found:
        raise ImageLoadError(f"{image} is not built: run `make images` first")
    image_id, diff_ids = found[0]["Id"], list(found[0]["RootFS"]["Layers"])
    ref = full_ref(image)
    todo = [n for n in nodes if node_image_id(n, ref) != image_id]
    if not todo:
        return
    sends: dict[str, tuple[str, list[str]]] = {}
    for node in todo:
        name = snapshotter(_on_node(node, "containerd", "config", "dump"))
        sends[node] = (name, missing_layers(diff_ids, _snapshots(node, name)))
    cold = [n for n in todo if len(sends[n][1]) == len(diff_ids)]
    warm = [n for n in todo if n not in cold]
    if warm:
        saved = save(image, image_id, diff_ids, {d for n in warm for d in sends[n][1]})
        layers = [(d, saved.sizes[d]) for d in diff_ids]
        for node in warm:
            name, missing = sends[node]
            if not all(d in saved.blobs for d in missing):  # a base layer changed: too large to keep
                cold.append(node)
                continue
            size = sum(saved.sizes[d] for d in missing)
            log(f"kind: {node}: sending {image}'s {len(missing)} new layers ({size / 2**20:.1f} MiB)")
            archive = oci_archive(ref, saved.config, layers, {d: saved.blobs[d] for d in missing})
            _on_node(node, "ctr", "-n", "k8s.io", "images", "import", f"--snapshotter={name}", "-", stdin=archive)
            if node_image_id(node, ref) != image_id:
                raise ImageLoadError(f"{node} holds another {ref} than {image_id} after its import: `make kind-down`")
    if cold:
        log(f"kind: loading the whole of {image} into {', '.join(cold)}")
        kind_load(cold)
