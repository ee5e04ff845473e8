"""Kept mappings of staging files: one mapping per file, reused while the file keeps its size, seeing what
another process's mapping wrote, and forgotten once the file is not in use."""

from __future__ import annotations

import mmap
from pathlib import Path

from rollfleet_engine.mappings import Mappings
from rollfleet_engine.pinning import address


def test_a_file_is_mapped_once_and_a_reader_sees_what_the_writer_wrote_over(tmp_path: Path) -> None:
    file = tmp_path / "shard-0.safetensors"
    writer, reader = Mappings(), Mappings()  # the stager's and the loader's (two processes in an engine)
    written = writer.view(file, 8)
    written[:] = b"version1"
    assert bytes(reader.view(file)) == b"version1"
    again = writer.view(file, 8)
    assert again.obj is written.obj  # the same mapping: no page tables populated again
    again[:] = b"version2"
    kept = reader.view(file)
    assert bytes(kept) == b"version2"


def test_a_file_of_another_size_is_mapped_again_at_that_size(tmp_path: Path) -> None:
    file = tmp_path / "shard-0.safetensors"
    writer, reader = Mappings(), Mappings()
    writer.view(file, 8)[:] = b"12345678"
    assert len(reader.view(file)) == 8
    bigger = writer.view(file, 16)
    bigger[:] = b"0123456789abcdef"
    assert file.stat().st_size == 16
    assert bytes(reader.view(file)) == b"0123456789abcdef"


def test_keep_only_forgets_the_files_not_in_use(tmp_path: Path) -> None:
    used, gone = tmp_path / "shard-0.safetensors", tmp_path / "shard-1.safetensors"
    mappings = Mappings()
    first_used, first_gone = mappings.view(used, 8), mappings.view(gone, 8)
    gone.unlink()  # a set of fewer shards: its memory is freed once nothing maps it
    mappings.keep_only([used, gone])
    assert mappings.view(used).obj is first_used.obj
    recreated = mappings.view(gone, 8)
    assert recreated.obj is not first_gone.obj
    mappings.keep_only([])
    assert mappings.view(used).obj is not first_used.obj


class RecordingPinning:
    """Stands in for CUDA (no GPU here; the lent GPU's measurement is bench/bench_gpu_load.py)."""

    def __init__(self) -> None:
        self.pinned: list[int] = []

    def pin(self, mapped: mmap.mmap) -> None:
        self.pinned.append(address(mapped))

    def unpin(self, mapped: mmap.mmap) -> None:
        self.pinned.remove(address(mapped))


def test_a_kept_mapping_is_pinned_once_and_unpinned_when_forgotten_or_replaced(tmp_path: Path) -> None:
    file, other = tmp_path / "shard-0.safetensors", tmp_path / "shard-1.safetensors"
    pinning = RecordingPinning()
    mappings = Mappings(pinning)
    first = mappings.view(file, 8)
    mappings.view(file, 8)  # the next push, written over: still pinned, not pinned again
    assert pinning.pinned == [address(first.obj)]
    bigger = mappings.view(file, 16)  # remapped at its new size: the old range is let go first
    mappings.view(other, 8)
    assert address(bigger.obj) in pinning.pinned and len(pinning.pinned) == 2
    mappings.keep_only([other])
    assert len(pinning.pinned) == 1 and address(bigger.obj) not in pinning.pinned
    mappings.keep_only([])
    assert pinning.pinned == []
