"""The cycle collector, for a process whose hot path is many small HTTP exchanges (the gateway, a request runner).

Most of what such an exchange allocates is freed by reference counting; the collector's passes over everything
alive (modules, the Kubernetes client's classes, the app) cost ~10% of the CPU per request (bench_gateway).
"""

from __future__ import annotations

import gc

GC_THRESHOLDS = (20_000, 20, 20)  # allocations between young collections (CPython's default: 700, 10, 10)


def settle_gc() -> None:
    """Once set up: leave what exists now out of the collector's passes, and run them less often."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
