"""`rollfleet results` for results on a PersistentVolumeClaim: a reader pod that serves the file.

The volume is mounted where pods run, not where `rollfleet results` runs. So the command
starts a short-lived reader pod (`reader_pod`, pure) that mounts the claim read-only and
runs `rollfleet results-server` (`serve`): one file over HTTP, only to a caller holding
the token whose digest is in its arguments. The command reads it through the API server's
pod proxy (the caller's own credentials and RBAC: `pods` create/get/delete and
`pods/proxy` get), then deletes the pod. The pod is owned by the request (gone with it)
and ends on its own after `SERVE_S`.

Trainers in pods need none of this: they mount the claim and read the file.

Talks to kube-apiserver (the reader pod, the proxy).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import hashlib
import hmac
import http.server
import secrets
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

from rollfleet.api.common import ROLLFLEET_IMAGE_UID
from rollfleet.api.request import RolloutRequest
from rollfleet.contract import APP_NAME, LABEL_COMPONENT, LABEL_MANAGED_BY, LABEL_NAME, LABEL_REQUEST, MANAGER
from rollfleet.controller.owner import RequestRef
from rollfleet.controller.requests.results_volume import RESULTS_MOUNT, relative_path
from rollfleet.errors import RollfleetError
from rollfleet.kube import POD, ApiError, Kube

COMPONENT_READER = "results-reader"
READER_PORT = 8080
TOKEN_HEADER = "X-Rollfleet-Results-Token"
FILE_PATH = "/samples.jsonl"
SERVE_S = 3600  # a reader nobody deleted ends after this
START_TIMEOUT_S = 180.0
CHUNK = 1 << 20

Manifest = dict[str, Any]


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def reader_pod(rr: RolloutRequest, ref: RequestRef, image: str, digest: str) -> Manifest:
    """The reader pod of a request's results: the claim read-only, the file served to the token's holder."""
    claim = rr.spec.results.persistent_volume_claim
    if claim is None:
        raise ValueError("the request keeps its results in ConfigMaps")
    uid = ROLLFLEET_IMAGE_UID
    path = f"{RESULTS_MOUNT}/{relative_path(claim, ref.name, ref.uid)}"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{ref.name[:40]}-{COMPONENT_READER}-",
            "namespace": ref.namespace,
            "labels": {
                LABEL_NAME: APP_NAME,
                LABEL_COMPONENT: COMPONENT_READER,
                LABEL_MANAGED_BY: MANAGER,
                LABEL_REQUEST: ref.name,
            },
            "ownerReferences": [ref.owner_reference()],
        },
        "spec": {
            "restartPolicy": "Never",
            "activeDeadlineSeconds": SERVE_S,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": uid,
                "runAsGroup": uid,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "reader",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "args": ["results-server", "--file", path, "--token-sha256", digest, "--port", str(READER_PORT)],
                    "ports": [{"name": "http", "containerPort": READER_PORT}],
                    "readinessProbe": {"httpGet": {"path": "/healthz", "port": READER_PORT}, "periodSeconds": 1},
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
                    "volumeMounts": [{"name": "results", "mountPath": RESULTS_MOUNT, "readOnly": True}],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "volumes": [
                {"name": "results", "persistentVolumeClaim": {"claimName": claim.claim_name, "readOnly": True}}
            ],
        },
    }


def whole_lines_end(f: IO[bytes]) -> int:
    """Where the last whole line of `f` ends (0: none); leaves `f` at its start."""
    pos = f.seek(0, 2)
    while pos > 0:
        step = min(CHUNK, pos)
        f.seek(pos - step)
        block = f.read(step)
        newline = block.rfind(b"\n")
        if newline >= 0:
            f.seek(0)
            return pos - step + newline + 1
        pos -= step
    f.seek(0)
    return 0


def serve(file: str, token_sha256: str, host: str, port: int) -> int:
    """`rollfleet results-server`: serve `file` (its whole lines) to callers holding the token."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._answer(200, b"ok\n")
                return
            if self.path != FILE_PATH:
                self._answer(404, b"only " + FILE_PATH.encode() + b"\n")
                return
            given = token_digest(self.headers.get(TOKEN_HEADER, ""))
            if not hmac.compare_digest(given, token_sha256):
                self._answer(403, b"wrong or missing " + TOKEN_HEADER.encode() + b"\n")
                return
            try:
                with open(file, "rb") as f:
                    self._send_whole_lines(f)
            except FileNotFoundError:
                self._answer(404, b"no results stored yet\n")

        def _send_whole_lines(self, f: IO[bytes]) -> None:
            end = whole_lines_end(f)  # a torn last line (a runner killed mid-write) is not a sample
            self.send_response(200)
            self.send_header("Content-Type", "application/jsonl")
            self.send_header("Content-Length", str(end))
            self.end_headers()
            while end > 0 and (chunk := f.read(min(CHUNK, end))):
                self.wfile.write(chunk)
                end -= len(chunk)

        def _answer(self, code: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            sys.stderr.write(f"results-server: {format % args}\n")

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.timeout = 1.0
    print(f"results-server: serving {file} on :{port}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + SERVE_S
    while time.monotonic() < deadline:
        server.handle_request()
    return 0


def new_token() -> tuple[str, str]:
    token = secrets.token_urlsafe(32)
    return token, token_digest(token)


class ReaderError(RollfleetError):
    """The reader pod could not start or serve the results."""


def check_started(pod: Manifest) -> bool:
    """Whether the reader pod serves (True), still starts (False); ReaderError when it will not."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        raise ReaderError(f"the reader pod {pod['metadata']['name']} ended ({status.get('phase')}): {status}")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason"):
            raise ReaderError(
                f"the reader pod {pod['metadata']['name']} cannot be scheduled ({cond['reason']}): "
                f"{cond.get('message', '')}"
            )
        if cond.get("type") == "Ready" and cond.get("status") == "True":
            return True
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerError"):
            raise ReaderError(f"the reader pod cannot start: {waiting['reason']}: {waiting.get('message', '')}")
    return False


async def read_volume_results(kube: Kube, body: Manifest, image: str, out: IO[str]) -> None:
    """Start the request's reader pod, copy its results to `out` as JSONL, delete the pod."""
    rr = RolloutRequest.model_validate(body)
    ref = RequestRef.of(body)
    token, digest = new_token()
    pod = await kube.create(reader_pod(rr, ref, image, digest))
    name = pod["metadata"]["name"]
    try:
        print(f"rollfleet results: starting reader pod {ref.namespace}/{name}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not check_started(pod):
            if time.monotonic() > deadline:
                raise ReaderError(f"the reader pod {name} did not start within {START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.5)  # polling the pod's readiness: a watch is more code for a one-off
            pod = await kube.get(POD, ref.namespace, name)
        await asyncio.to_thread(_copy, kube, pod, token, out)
    finally:
        with contextlib.suppress(ApiError):
            await kube.delete(POD, ref.namespace, name, {"gracePeriodSeconds": 0})


def _copy(kube: Kube, pod: Manifest, token: str, out: IO[str]) -> None:
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    headers = {TOKEN_HEADER: token}
    try:
        _write(kube.pod_proxy_stream(ns, name, READER_PORT, FILE_PATH, headers, CHUNK), out)
    except ApiError as err:
        raise ReaderError(f"reading through the API server's pod proxy: {err}") from err


def _write(chunks: Iterable[bytes], out: IO[str]) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()  # a chunk may end inside a character
    for chunk in chunks:
        out.write(decoder.decode(chunk))
    out.write(decoder.decode(b"", final=True))
