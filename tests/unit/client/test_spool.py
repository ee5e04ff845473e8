"""A push's file in the spool is written over the memory of a superseded push's file (real files)."""

from __future__ import annotations

from pathlib import Path

from rollfleet_client.spool import keep_as_spare, open_over_spare
from rollfleet_client.sync_protocol import SPOOL_SPARE_FILE


def write(incoming: Path, target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open_over_spare(incoming, target) as f:
        f.write(data)
        f.truncate()


def test_a_superseded_push_is_kept_once_and_the_next_push_is_written_over_it(tmp_path: Path) -> None:
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    write(incoming, tmp_path / "v1" / "model.safetensors", b"first push, longer")  # no spare yet: a new file
    inode = (tmp_path / "v1" / "model.safetensors").stat().st_ino
    keep_as_spare(incoming, tmp_path / "v1" / "model.safetensors")
    spare = incoming / SPOOL_SPARE_FILE
    assert spare.stat().st_ino == inode and spare.stat().st_mode & 0o777 == 0o666  # the trainer may write it
    (tmp_path / "other.safetensors").write_bytes(b"x")
    keep_as_spare(incoming, tmp_path / "other.safetensors")  # one spare at most
    assert spare.stat().st_ino == inode and (tmp_path / "other.safetensors").exists()

    write(incoming, tmp_path / "v2" / "model.safetensors", b"second")
    v2 = tmp_path / "v2" / "model.safetensors"
    assert v2.stat().st_ino == inode and v2.read_bytes() == b"second"  # the same memory, cut to its size
    assert not spare.exists()
    write(incoming, tmp_path / "v3" / "model.safetensors", b"third")  # taken already: a new file
    assert (tmp_path / "v3" / "model.safetensors").stat().st_ino != inode
