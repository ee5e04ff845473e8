"""The Helm chart's own files (charts/rollfleet): its copies of the repository's CRDs, policies and monitoring
objects are current (`python -m rollfleet_dev.chart`), and its values name the contract's image and ports (YAML
cannot import them). What it renders: e2e/test_chart.py."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from rollfleet.api.common import DEFAULT_ROLLFLEET_IMAGE, IMAGE_TAG
from rollfleet.contract import OPERATOR_HEALTH_PORT, OPERATOR_METRICS_PORT
from rollfleet_dev import chart

CHART = chart.repo_root() / chart.CHART


def test_the_chart_copies_are_current() -> None:
    for path, text in chart.outputs(chart.repo_root()).items():
        assert path.exists() and path.read_text() == text, f"{path} is stale: run `{chart.COMMAND}`"


def test_check_mode_names_stale_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for source in ("crds", "manifests/monitoring"):
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).symlink_to(chart.repo_root() / source)
    assert chart.main(["--root", str(tmp_path), "--check"]) == 1
    assert "Chart.yaml" in capsys.readouterr().err
    assert chart.main(["--root", str(tmp_path)]) == 0
    assert chart.main(["--root", str(tmp_path), "--check"]) == 0


def test_the_values_name_the_contracts_image_and_ports_and_meet_the_schema() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = f"{values['image']['repository']}:{values['image']['tag'] or meta['appVersion']}"
    assert image == DEFAULT_ROLLFLEET_IMAGE and meta["version"] == IMAGE_TAG
    assert (values["operator"]["healthPort"], values["operator"]["metricsPort"]) == (
        OPERATOR_HEALTH_PORT,
        OPERATOR_METRICS_PORT,
    )
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(values, schema)
    with pytest.raises(jsonschema.ValidationError, match="Sometimes"):
        jsonschema.validate({**values, "image": {**values["image"], "pullPolicy": "Sometimes"}}, schema)
