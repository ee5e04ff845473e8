#!/usr/bin/env bash
# Lint the GitHub Actions workflows with actionlint, built once from its Go module.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=v1.7.12
bin="${ROLLFLEET_CACHE:-$HOME/.cache/rollfleet}/bin/actionlint-$VERSION/actionlint"
if [ ! -x "$bin" ]; then
  echo "[actionlint] building $VERSION"
  GOBIN=$(dirname "$bin") GOTOOLCHAIN=local go install "github.com/rhysd/actionlint/cmd/actionlint@$VERSION"
fi
"$bin" -no-color .github/workflows/*.yml
