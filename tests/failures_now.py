"""A pytest plugin that prints each failure's report the moment it fails, not only in the session's summary.

A tier stopped by its time limit, or a CI run stopped by its own, then still leaves in its log why each
of its failures failed (the summary would never come). The tiers load it (`tests.tiers run`).
"""

from __future__ import annotations

import sys

import pytest

_MAX_CHARS = 6000  # the end of a report: the assertion and its nearest frames


_on_worker = False


def pytest_configure(config: pytest.Config) -> None:
    global _on_worker
    _on_worker = hasattr(config, "workerinput")  # an xdist worker: its controller reports its failures


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed and not _on_worker:
        text = report.longreprtext
        sys.stderr.write(f"\n--- FAILED {report.nodeid} ({report.when}):\n{text[-_MAX_CHARS:]}\n--- end\n")
        sys.stderr.flush()
