"""The gateway's Python as the control-plane image ships it, for benchmarks of the gateway as deployed.

The image (`Dockerfile`) runs `rollfleet` in a venv of its base image's `python3.11`: the public
`python:3.11-slim` for users, Debian bookworm's `python3.11` where the images are built here
(`hack/base-images.sh`). Both interpreters are release builds with profile-guided optimization. The
development venv's interpreter on this host is pyenv's build (no PGO or LTO, libpython shared), whose
interpreter loop is slower on the gateway's Python hot path, which is where its CPU per request goes
(docs/gateway.md, "Server choice"). A benchmark of the gateway as users run it runs it on the image's
interpreter.

`deployed_rollfleet()` makes (once, cached by interpreter and dependency versions) a venv of that
interpreter with the project's runtime dependencies at the versions of the running environment and
the checkout installed editable, as the Dockerfile installs them; it returns its `rollfleet` command.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from rollfleet_dev.localcluster.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
# Debian bookworm's interpreter: the one the images built here run (hack/base-images.sh); this host is bookworm.
DEFAULT_INTERPRETER = "/usr/bin/python3.11"
INTERPRETER_ENV = "ROLLFLEET_DEPLOYED_PYTHON"


class Unavailable(RuntimeError):
    """No interpreter of the image's kind here: the message says how to name one."""


def pinned_requirements() -> list[str]:
    """The project's runtime dependencies (pyproject, as the Dockerfile reads them) at the running versions."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [f"{Requirement(d).name}=={metadata.version(Requirement(d).name)}" for d in deps]


def deployed_rollfleet(cache: Path | None = None) -> Path:
    """The `rollfleet` command of a venv on the image's interpreter (built on first use, about a minute)."""
    interpreter = os.environ.get(INTERPRETER_ENV, DEFAULT_INTERPRETER)
    if not Path(interpreter).is_file():
        raise Unavailable(f"no {interpreter} here: set {INTERPRETER_ENV} to the image's python3.11")
    version = subprocess.run(
        [interpreter, "-c", "import sys; print(sys.version)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    requirements = pinned_requirements()
    key = hashlib.sha256("\n".join([interpreter, version, *requirements]).encode()).hexdigest()[:12]
    cache = cache or cache_dir()
    venv = cache / "bench" / f"gateway-python-{key}"
    command, done = venv / "bin" / "rollfleet", venv / ".complete"
    if done.is_file():
        return command
    print(f"building {venv} ({interpreter}: {version.split()[0]}; the image's interpreter)", file=sys.stderr)
    shutil.rmtree(venv, ignore_errors=True)  # a build that did not finish
    try:
        subprocess.run([interpreter, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *requirements], check=True)
        subprocess.run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
    except subprocess.CalledProcessError as err:
        raise Unavailable(f"could not build the venv of {interpreter}: {err}") from err
    done.touch()
    return command
