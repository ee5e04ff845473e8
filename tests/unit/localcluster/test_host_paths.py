"""Node directories backed by this machine's (the pools file's extraMounts, like kind's)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

from rollfleet_dev.localcluster.nodeagent import config
from rollfleet_dev.localcluster.nodeagent.volumes import VolumeError, prepare_host_volume
from rollfleet_engine.tiny_model import NODE_MODEL_DIR, WEIGHTS_B_DIR, default_model_dir

SAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "samples"


def pools_with(*mounts: tuple[str, str]) -> config.PoolsFile:
    return config.PoolsFile.model_validate(
        {"pools": [], "extraMounts": [{"containerPath": c, "hostPath": h} for c, h in mounts]}
    )


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/var/lib/rollfleet", "/cache"),
        ("/var/lib/rollfleet/", "/cache"),
        ("/var/lib/rollfleet/models/tiny-v2", "/cache/models/tiny-v2"),
        ("/var/lib/rollfleet-sync", "/var/lib/rollfleet-sync"),  # whole components only
        ("/var/lib", "/var/lib"),
        ("/data/x", "/data/x"),
    ],
)
def test_paths_under_a_mount_move_to_its_host_path(path: str, expected: str) -> None:
    pools = pools_with(("/var/lib/rollfleet", "{cache}"))
    assert pools.host_path(path, Path("/cache")) == Path(expected)


def test_the_longest_mount_wins_whatever_the_order() -> None:
    pools = pools_with(("/var/lib/rollfleet", "/big"), ("/var/lib/rollfleet/models", "/models-disk"), ("/var", "/v"))
    assert pools.host_path("/var/lib/rollfleet/models/m", Path("/c")) == Path("/models-disk/m")
    assert pools.host_path("/var/lib/rollfleet/other", Path("/c")) == Path("/big/other")
    assert pools.host_path("/var/log", Path("/c")) == Path("/v/log")


def test_mounts_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="containerPath"):
        pools_with(("relative", "/x"))
    with pytest.raises(ValueError, match="hostPath"):
        pools_with(("/x", "cache"))


def test_default_pools_keep_the_samples_model_in_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The node path the samples read is where `ensure_tiny_model` builds by default."""
    monkeypatch.setenv("ROLLFLEET_CACHE", str(tmp_path))
    pools = config.load()
    assert pools.host_path(NODE_MODEL_DIR, tmp_path) == default_model_dir() == tmp_path / "models" / "tiny-v2"
    sample_paths = [
        doc["spec"]["model"]["hostPath"] for doc in yaml.safe_load_all((SAMPLES / "tiny-fleet.yaml").read_text())
    ]
    trainer = yaml.safe_load((SAMPLES / "demo-trainer.yaml").read_text())
    sample_paths += [v["hostPath"]["path"] for v in trainer["spec"]["volumes"] if "hostPath" in v]
    assert sample_paths == [NODE_MODEL_DIR, f"{NODE_MODEL_DIR}/{WEIGHTS_B_DIR}"]


def test_host_path_volumes_are_checked_and_created_at_the_mapped_path(tmp_path: Path) -> None:
    host_path = functools.partial(pools_with(("/var/lib/rollfleet", "{cache}")).host_path, cache=tmp_path)
    (tmp_path / "models" / "m").mkdir(parents=True)
    vol = {"hostPath": {"path": "/var/lib/rollfleet/models/m", "type": "Directory"}}
    assert prepare_host_volume(vol, tmp_path / "unused", host_path) == str(tmp_path / "models" / "m")
    made = {"hostPath": {"path": "/var/lib/rollfleet/spool/a", "type": "DirectoryOrCreate"}}
    assert prepare_host_volume(made, tmp_path / "unused", host_path) == str(tmp_path / "spool" / "a")
    assert (tmp_path / "spool" / "a").is_dir()
    missing = {"hostPath": {"path": "/var/lib/rollfleet/models/none", "type": "Directory"}}
    shown = rf"/var/lib/rollfleet/models/none \(on this machine {tmp_path}/models/none\) is not a directory"
    with pytest.raises(VolumeError, match=shown):
        prepare_host_volume(missing, tmp_path / "unused", host_path)
