"""The pools file: which nodes the agent registers, how image names run locally, and which
node directories (hostPath volumes) live elsewhere on this machine.

Pure data (pydantic); read by `agent` at start. The packaged default is
`rollfleet_dev/localcluster/pools.yaml`.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path, PurePosixPath

import yaml
from pydantic import BaseModel, ConfigDict, Field

DEFAULT_POOLS = Path(__file__).resolve().parent.parent / "pools.yaml"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Taint(_Model):
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def to_api(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect}


class Pool(_Model):
    """Nodes `<name>-0` .. `<name>-(nodes-1)`, all alike."""

    name: str
    nodes: int = Field(ge=0)
    capacity: dict[str, str]
    labels: dict[str, str] = {}
    taints: list[Taint] = []


class ImageRule(_Model):
    """How one family of images runs locally (no image is ever pulled).

    `entrypoint` plays the image's ENTRYPOINT and `cmd` its CMD: a container without
    `command` runs `entrypoint + (args or cmd)`; a container with `command` runs it as-is.
    """

    image: str = Field(description="glob on the image reference, e.g. 'rollfleet/engine*'")
    entrypoint: list[str] = []
    cmd: list[str] = []
    env: dict[str, str] = Field(default={}, description="extra environment, like an image's ENV")


class ExtraMount(_Model):
    """A node directory backed by a directory of this machine, like kind's `extraMounts`.

    Pods' hostPath volumes at or under `containerPath` read the same place under `hostPath`.
    """

    container_path: str = Field(
        alias="containerPath", pattern=r"^/", description="the node path that pods' hostPath volumes name"
    )
    host_path: str = Field(
        alias="hostPath",
        pattern=r"^(/|\{cache\})",
        description="the directory of this machine behind it; `{cache}` stands for the cache "
        "dir ($ROLLFLEET_CACHE, default ~/.cache/rollfleet)",
    )


class PoolsFile(_Model):
    pools: list[Pool]
    images: list[ImageRule] = []
    extra_mounts: list[ExtraMount] = Field(default=[], alias="extraMounts")
    pass_env: list[str] = Field(
        default=["HOME", "LANG", "LC_*", "TZ", "TMPDIR", "ROLLFLEET_*", "HF_*"],
        alias="passEnv",
        description="globs of the agent's own environment variables that every container inherits",
    )

    def node_names(self) -> list[str]:
        return [f"{p.name}-{i}" for p in self.pools for i in range(p.nodes)]

    def host_path(self, path: str, cache: Path) -> Path:
        """Where a pod's hostPath `path` is on this machine: under the longest extraMount that holds it
        (whole path components: `/var/lib/rollfleet` holds `/var/lib/rollfleet/x`, not
        `/var/lib/rollfleet-sync`), else `path` itself."""
        pure = PurePosixPath(path)
        best: tuple[PurePosixPath, ExtraMount] | None = None
        for mount in self.extra_mounts:
            root = PurePosixPath(mount.container_path)
            if pure.is_relative_to(root) and (best is None or len(root.parts) > len(best[0].parts)):
                best = (root, mount)
        if best is None:
            return Path(path)
        root, mount = best
        return Path(mount.host_path.replace("{cache}", str(cache))) / pure.relative_to(root)

    def image_rule(self, image: str) -> ImageRule | None:
        """The first rule whose glob matches the image, with or without its registry host."""
        for candidate in _image_names(image):
            for rule in self.images:
                if fnmatch.fnmatchcase(candidate, rule.image):
                    return rule
        return None


def _image_names(image: str) -> list[str]:
    """`ghcr.io/acme/rollfleet/engine:1` also answers to `acme/rollfleet/engine:1`; `busybox` to `library/busybox`."""
    names = [image]
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        names.append(rest)
    if names[-1].startswith("library/"):
        names.append(names[-1].removeprefix("library/"))
    return names


def load(path: Path | None = None) -> PoolsFile:
    return PoolsFile.model_validate(yaml.safe_load((path or DEFAULT_POOLS).read_text()))
