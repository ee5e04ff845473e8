"""Two real engines with the collective ``gloo`` backend and a sync sidecar in static mode.

The same processes as tests/sync (its helpers start them), with the engines joined to a
gloo group whose rank 0 is the test process itself, as a trainer's would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollfleet_engine.protocol import GLOO_WEIGHT_BACKEND
from tests.sync.conftest import EngineProcess, Sidecar, running_fleet, running_sidecar, tiny_weights_dirs, write_token
from tests.sync.test_sync_live import reference_outputs


@pytest.fixture(scope="package")
def collective_token(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_token(tmp_path_factory.mktemp("gloo-token"))


@pytest.fixture(scope="package")
def collective_engines(
    tmp_path_factory: pytest.TempPathFactory, collective_token: Path
) -> Iterator[list[EngineProcess]]:
    with running_fleet(tmp_path_factory.mktemp("gloo-engines"), collective_token, GLOO_WEIGHT_BACKEND) as fleet:
        yield fleet


@pytest.fixture(scope="package")
def collective_sidecar(
    tmp_path_factory: pytest.TempPathFactory, collective_engines: list[EngineProcess], collective_token: Path
) -> Iterator[Sidecar]:
    with running_sidecar(tmp_path_factory.mktemp("gloo-sidecar"), collective_engines, collective_token) as car:
        yield car


@pytest.fixture(scope="package")
def weights_dirs() -> dict[str, Path]:
    return tiny_weights_dirs()


@pytest.fixture(scope="package")
def references(weights_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    return reference_outputs(weights_dirs)
