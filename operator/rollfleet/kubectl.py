"""Run kubectl against one kubeconfig: used by the demo and the end-to-end suite.

kubectl (not the Python client) on purpose where a person would type the same command:
the walkthrough prints and runs exactly what the README tells people to run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollfleet.errors import RollfleetError


class KubectlError(RollfleetError, RuntimeError):
    """kubectl exited non-zero; the message holds its arguments and stderr."""


@dataclass(frozen=True)
class Kubectl:
    kubeconfig: Path
    binary: str = "kubectl"

    def __post_init__(self) -> None:
        if shutil.which(self.binary) is None:
            raise KubectlError(f"{self.binary} not found on PATH: run `make env` (kubectl is in .venv/bin)")

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [self.binary, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr.strip()}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)
