#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run ruff, mypy and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "== ruff"
ruff check src tests examples bench
ruff format --check src tests examples bench
echo "== mypy"
mypy
echo "== pytest"
python -m pytest "$@"
