"""The staging area's files, mapped once and kept mapped while they are in use.

The staging area keeps its files from one push to the next and writes over them
(``staging``): fresh memory costs more than the transfer. Mapping those files anew at every
push costs too: populating the page tables of a 1 GiB shared mapping took 0.1 s on the 2-core
dev box, and a mapping faulted in lazily costs as much during the copy. So each process keeps
its mappings: the stager the ones it receives into, the loader (in vLLM's worker, another
process) the ones it loads from. Both map the files shared, so the loader reads what the
stager wrote into the same pages.

A mapping holds its file's memory even after the file is deleted: ``keep_only`` unmaps all
but the files in use, and each user calls it after every set. The loader of a GPU engine also
page-locks its mappings (``pinning``), for as long as it keeps them.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from rollfleet_engine.pinning import Pinning


def _key(st: os.stat_result) -> tuple[int, int]:
    # While it is mapped a file's inode cannot be freed, so its number cannot name another file meanwhile.
    return st.st_dev, st.st_ino


class Mappings:
    """Shared, populated mappings of files, one per file, reused while the file keeps its size."""

    def __init__(self, pinning: Pinning | None = None) -> None:
        self._lock = threading.Lock()
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._pinning = pinning

    def view(self, file: Path, size: int | None = None) -> memoryview:
        """`file` mapped for reading and writing. With `size`, the file is created or resized to it first.

        A mapping is never closed here, only forgotten: a view of it (in a tensor, or an exception's
        traceback) may outlive it, and the mapping goes when the last one does.
        """
        fd = os.open(file, os.O_RDWR | (os.O_CREAT if size is not None else 0), 0o600)
        try:
            st = os.fstat(fd)
            if size is not None and st.st_size != size:
                os.ftruncate(fd, size)
            length = st.st_size if size is None else size
            with self._lock:
                mapped = self._maps.get(_key(st))
                if mapped is None or len(mapped) != length:
                    if mapped is not None:
                        self._forget(_key(st))
                    mapped = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                    if self._pinning is not None:
                        self._pinning.pin(mapped)
                    self._maps[_key(st)] = mapped
        finally:
            os.close(fd)
        return memoryview(mapped)

    def keep_only(self, files: Iterable[Path]) -> None:
        """Forget the mappings of every file but `files` (a file gone is forgotten too)."""
        keep = set()
        for file in files:
            try:
                keep.add(_key(file.stat()))
            except FileNotFoundError:
                continue
        with self._lock:
            for key in [k for k in self._maps if k not in keep]:
                self._forget(key)

    def _forget(self, key: tuple[int, int]) -> None:
        mapped = self._maps.pop(key)
        if self._pinning is not None:
            self._pinning.unpin(mapped)
