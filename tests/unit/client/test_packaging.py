"""The client is a distribution of its own: it installs and imports in a fresh venv with httpx and
pydantic only, none of the operator's, the engine's or a trainer's heavy dependencies."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HEAVY = {"kopf", "kubernetes", "vllm", "torch", "fastapi", "rollfleet", "rollfleet-engine"}


def test_the_client_installs_and_imports_in_a_fresh_venv_without_the_operators_dependencies(tmp_path: Path) -> None:
    source = shutil.copytree(REPO / "client", tmp_path / "client")  # pip builds in the source tree: not ours
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    installed = subprocess.run([*pip, "install", "-q", str(source)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    listed = subprocess.run([*pip, "list", "--format", "json"], capture_output=True, text=True, check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"rollfleet-client", "httpx", "pydantic"} <= names and not HEAVY & names, names
    probe = "import sys, rollfleet_client; from rollfleet_client import AsyncRolloutClient, RolloutClient; "
    probe += f"loaded = {sorted(m.replace('-', '_') for m in HEAVY)!r}; print([m for m in loaded if m in sys.modules])"
    imported = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"
