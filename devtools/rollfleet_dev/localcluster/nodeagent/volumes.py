"""Pod volumes as directories under the pod's state dir, and each container's mount plan.

`volume_files` (pure) computes the files of configMap, secret, downwardAPI and
projected volumes; `write_atomic` publishes them the way kubelet does (a `..data`
symlink swapped in one rename, so readers never see a half-written update);
`mount_plan` (pure) says what gets bind-mounted where inside a container's mount
namespace (done by `launcher`); `claim_volume` (pure) turns a persistentVolumeClaim
volume into the hostPath its bound PersistentVolume names. Token requests go through `pods`, which talks to
the API server; this module only touches the pod's own directories and hostPaths
(mapped to this machine's directories by the pools file's extraMounts).
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.errors import RollfleetError
from rollfleet_dev.localcluster.nodeagent.downward import FieldError, field_value, resource_value
from rollfleet_dev.localcluster.nodeagent.env import Refs

Obj = dict[str, Any]
Files = dict[str, tuple[bytes, int]]
TokenKey = tuple[str, int]  # (audience, expirationSeconds)

DEFAULT_MODE = 0o644
DEFAULT_TOKEN_SECONDS = 3600


class VolumeError(RollfleetError, ValueError):
    """A volume cannot be set up yet (missing ConfigMap, bad hostPath, ...); retried later."""


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


def token_requests(pod: Obj) -> set[TokenKey]:
    """The ServiceAccount tokens the pod's projected volumes ask for."""
    keys: set[TokenKey] = set()
    for vol in pod.get("spec", {}).get("volumes") or []:
        for src in (vol.get("projected") or {}).get("sources") or []:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                keys.add((t.get("audience", ""), int(t.get("expirationSeconds", DEFAULT_TOKEN_SECONDS))))
    return keys


def _items(kind: str, name: str, data: dict[str, str] | None, source: Obj, default_mode: int) -> Files:
    if data is None:
        if source.get("optional"):
            return {}
        raise VolumeError(f'{kind} "{name}" not found')
    items = source.get("items")
    if not items:
        return {k: (v.encode(), default_mode) for k, v in data.items()}
    out: Files = {}
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise VolumeError(f'{kind} "{name}" has no key {item["key"]!r}')
        out[item["path"]] = (data[item["key"]].encode(), int(item.get("mode", default_mode)))
    return out


def _downward(pod: Obj, items: list[Obj], default_mode: int, allocatable: dict[str, str]) -> Files:
    out: Files = {}
    for item in items:
        try:
            if "fieldRef" in item:
                value = field_value(pod, item["fieldRef"]["fieldPath"])
            else:
                ref = item["resourceFieldRef"]
                value = resource_value(pod, ref["containerName"], ref["resource"], ref.get("divisor"), allocatable)
        except FieldError as e:
            raise VolumeError(str(e)) from e
        out[item["path"]] = (value.encode(), int(item.get("mode", default_mode)))
    return out


def volume_files(
    volume: Obj, pod: Obj, refs: Refs, tokens: dict[TokenKey, str], allocatable: dict[str, str]
) -> Files | None:
    """The files of an API-backed volume (relative path -> content, mode); None for other kinds."""
    if "configMap" in volume:
        src = volume["configMap"]
        return _items(
            "configmap", src["name"], refs.config_map_data(src["name"]), src, int(src.get("defaultMode", DEFAULT_MODE))
        )
    if "secret" in volume:
        src = volume["secret"]
        return _items(
            "secret",
            src["secretName"],
            refs.secret_data(src["secretName"]),
            src,
            int(src.get("defaultMode", DEFAULT_MODE)),
        )
    if "downwardAPI" in volume:
        src = volume["downwardAPI"]
        return _downward(pod, src.get("items") or [], int(src.get("defaultMode", DEFAULT_MODE)), allocatable)
    if "projected" in volume:
        proj = volume["projected"]
        mode = int(proj.get("defaultMode", DEFAULT_MODE))
        files: Files = {}
        for src in proj.get("sources") or []:
            if "serviceAccountToken" in src:
                t = src["serviceAccountToken"]
                key = (t.get("audience", ""), int(t.get("expirationSeconds", DEFAULT_TOKEN_SECONDS)))
                files[t["path"]] = (tokens[key].encode(), mode)
            elif "configMap" in src:
                c = src["configMap"]
                files.update(_items("configmap", c["name"], refs.config_map_data(c["name"]), c, mode))
            elif "secret" in src:
                s = src["secret"]
                files.update(_items("secret", s["name"], refs.secret_data(s["name"]), s, mode))
            elif "downwardAPI" in src:
                files.update(_downward(pod, src["downwardAPI"].get("items") or [], mode, allocatable))
            else:
                raise VolumeError(f"unsupported projected source {sorted(src)}")
        return files
    return None


def write_atomic(target: Path, files: Files) -> None:
    """Publish `files` under `target` like kubelet's AtomicWriter: contents live in a fresh
    `..<stamp>` dir, `..data` points at it (swapped by rename), and each top-level name is a
    symlink through `..data`. A reader sees the old set or the new set, never a mix."""
    target.mkdir(parents=True, exist_ok=True)
    stamp = target / f"..{time.strftime('%Y_%m_%d_%H_%M_%S')}.{secrets.token_hex(4)}"
    stamp.mkdir()
    for rel, (content, mode) in files.items():
        path = stamp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode & 0o777)
    old = os.readlink(target / "..data") if (target / "..data").is_symlink() else None
    tmp_link = target / "..data_tmp"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(stamp.name)
    tmp_link.rename(target / "..data")
    top = {rel.split("/", 1)[0] for rel in files}
    for name in top:
        link = target / name
        if not link.is_symlink():
            link.symlink_to(f"..data/{name}")
    for entry in target.iterdir():
        if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in top:
            entry.unlink()
    if old and old != stamp.name:
        shutil.rmtree(target / old, ignore_errors=True)


def claim_volume(volume: Obj, claim: Obj | None, pv: Obj | None) -> Obj:
    """A persistentVolumeClaim volume as the hostPath (or local) volume its bound PersistentVolume is,
    as kubelet mounts it. Only those two kinds of PersistentVolume exist on this cluster's nodes."""
    name = volume["persistentVolumeClaim"]["claimName"]
    if claim is None:
        raise VolumeError(f'persistentvolumeclaim "{name}" not found')
    if (claim.get("status") or {}).get("phase") != "Bound" or pv is None:
        raise VolumeError(f'persistentvolumeclaim "{name}" is not bound')
    spec = pv["spec"]
    if "hostPath" in spec:
        return {"name": volume["name"], "hostPath": spec["hostPath"]}
    if "local" in spec:  # a local volume is a directory that exists
        return {"name": volume["name"], "hostPath": {"path": spec["local"]["path"], "type": "Directory"}}
    kinds = sorted(k for k in spec if k not in ("capacity", "accessModes", "claimRef", "storageClassName"))
    raise VolumeError(f"persistentvolume {pv['metadata']['name']!r} is not hostPath or local: {kinds}")


def prepare_host_volume(volume: Obj, volume_dir: Path, host_path: Callable[[str], Path]) -> str | None:
    """Create emptyDir / check hostPath volumes; the host path to bind, or None if API-backed.

    `host_path` says where a node path is on this machine (the pools file's extraMounts).
    """
    if "emptyDir" in volume:
        # medium: Memory and sizeLimit are not honoured: the directory lives on the state dir's disk.
        volume_dir.mkdir(parents=True, exist_ok=True)
        return str(volume_dir)
    if "hostPath" in volume:
        hp = volume["hostPath"]
        path, kind = host_path(hp["path"]), hp.get("type", "")
        # Name both paths when they differ: the pod names the node's, the fix is on this machine's.
        shown = hp["path"] if str(path) == hp["path"] else f"{hp['path']} (on this machine {path})"
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        elif kind == "Directory" and not path.is_dir():
            raise VolumeError(f"hostPath type check failed: {shown} is not a directory")
        elif kind == "File" and not path.is_file():
            raise VolumeError(f"hostPath type check failed: {shown} is not a file")
        elif kind in ("Socket", "CharDevice", "BlockDevice") and not path.exists():
            raise VolumeError(f"hostPath type check failed: {shown} does not exist")
        return str(path)
    if any(k in volume for k in ("configMap", "secret", "downwardAPI", "projected")):
        volume_dir.mkdir(parents=True, exist_ok=True)
        return None
    raise VolumeError(f"unsupported volume type in {sorted(k for k in volume if k != 'name')}")


def mount_plan(container: Obj, volume_sources: dict[str, tuple[str, bool]]) -> list[Mount]:
    """The binds of one container: each volumeMount's source (with subPath) at its mountPath.

    `volume_sources` maps a volume to (host path, read-only). API-backed volumes and claims
    with `readOnly` are always read-only, as in kubelet; others honour the mount's `readOnly`.
    """
    mounts = []
    for vm in container.get("volumeMounts") or []:
        name = vm["name"]
        if name not in volume_sources:
            raise VolumeError(f"volumeMount {name!r} names no volume of the pod")
        source, volume_read_only = volume_sources[name]
        read_only = volume_read_only or bool(vm.get("readOnly"))
        sub = vm.get("subPath") or ""
        if sub:
            if sub.startswith("/") or ".." in Path(sub).parts:
                raise VolumeError(f"invalid subPath {sub!r}")
            source = str(Path(source) / sub)
        mounts.append(Mount(source=source, target=vm["mountPath"], read_only=read_only))
    return mounts
