"""Page-locking the staged weights for the GPU, so that the load in the pause is a direct copy.

A copy to a GPU from pageable host memory goes through the driver's bounce buffer: 7.8
GiB/s on an H100 PCIe gen5, where page-locked (pinned) memory copies at 51 GiB/s
(docs/weight-sync.md). Staged weights are pageable: a memory file mapped shared. So the
loader, in vLLM's worker (the process with the CUDA context), registers each staging
mapping with CUDA (``cudaHostRegister``) when it maps it. The loader keeps its mappings from
one push to the next (``mappings``) and the stager writes the next set into the same pages,
so the registration, and its cost, come once per staging file, at the first load.

A registration that fails leaves the copy pageable (slower, still correct), with a warning.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_CUDA_SUCCESS = 0
_CUDA_HOST_REGISTER_DEFAULT = 0


class Pinning(Protocol):
    """What ``Mappings`` calls on each mapping it makes and on each it forgets."""

    def pin(self, mapped: mmap.mmap) -> None: ...

    def unpin(self, mapped: mmap.mmap) -> None: ...


def address(mapped: mmap.mmap) -> int:
    """The address of a mapping's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mapped))


class CudaPinning:
    """Registers mappings with the CUDA runtime of this process (torch's)."""

    def __init__(self, cudart: Any) -> None:
        self._cudart = cudart
        self._pinned: set[int] = set()

    def pin(self, mapped: mmap.mmap) -> None:
        start = address(mapped)
        err = self._cudart.cudaHostRegister(start, len(mapped), _CUDA_HOST_REGISTER_DEFAULT)
        if int(err) != _CUDA_SUCCESS:
            logger.warning(
                "could not page-lock %d bytes of staged weights (CUDA error %s): they load at pageable speed",
                len(mapped),
                err,
            )
            return
        self._pinned.add(start)

    def unpin(self, mapped: mmap.mmap) -> None:
        start = address(mapped)
        if start in self._pinned:
            self._pinned.discard(start)
            self._cudart.cudaHostUnregister(start)


def cuda_pinning() -> CudaPinning | None:
    """Pinning for this process's GPU, or None where there is none (a CPU engine: nothing to gain)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return CudaPinning(torch.cuda.cudart())
