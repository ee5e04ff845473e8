"""Page-locking staged weights: CUDA's register/unregister calls as the loader makes them, and no pinning on
a host without a GPU. The CUDA runtime is faked at its boundary (no GPU here); bench/bench_gpu_load.py
measures the real registration on a GPU."""

from __future__ import annotations

import logging
import mmap

import pytest

from rollfleet_engine.pinning import CudaPinning, address, cuda_pinning

_ERROR_MEMORY_ALLOCATION = 2


class FakeCudart:
    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, start: int, size: int, flags: int) -> int:
        if self.result == 0:
            self.registered[start] = size
        return self.result

    def cudaHostUnregister(self, start: int) -> int:
        del self.registered[start]
        return 0


def test_a_mapping_is_registered_whole_and_unregistered() -> None:
    cudart = FakeCudart()
    pinning = CudaPinning(cudart)
    mapped = mmap.mmap(-1, 4096)
    pinning.pin(mapped)
    assert cudart.registered == {address(mapped): 4096}
    pinning.unpin(mapped)
    assert cudart.registered == {}


def test_a_registration_refused_warns_and_leaves_the_mapping_pageable(caplog: pytest.LogCaptureFixture) -> None:
    cudart = FakeCudart(result=_ERROR_MEMORY_ALLOCATION)
    pinning = CudaPinning(cudart)
    mapped = mmap.mmap(-1, 4096)
    with caplog.at_level(logging.WARNING):
        pinning.pin(mapped)
    assert "load at pageable speed" in caplog.text
    pinning.unpin(mapped)  # nothing to unregister: the fake would raise KeyError if it were asked
    assert cudart.registered == {}


def test_only_a_host_with_a_gpu_gets_pinning() -> None:
    import torch

    pinning = cuda_pinning()
    assert isinstance(pinning, CudaPinning) if torch.cuda.is_available() else pinning is None
