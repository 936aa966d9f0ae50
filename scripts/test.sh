#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run ruff, mypy, the layer check, the docs build, the
# sanitizer build of the C extension and the whole test suite (with the highest versions
# of the dependencies that pyproject.toml allows); then the tests that exercise the
# dependencies with the lowest ones; then the tests of worker starts on CPython 3.12 or
# 3.13 where the machine has one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
echo "== ruff"
ruff check src tests examples bench
ruff format --check src tests examples bench
echo "== mypy"
mypy
echo "== layers (import-linter, see [tool.importlinter] in pyproject.toml)"
lint-imports --no-logo
echo "== docs (mkdocs.yml, strict: a broken link or reference fails)"
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir site
echo "== the C extension under AddressSanitizer and UBSan (scripts/sanitize.sh)"
bash scripts/sanitize.sh
echo "== pytest"
python -m pytest "$@"
echo "== the lowest versions of the dependencies (scripts/test_lowest.sh)"
bash scripts/test_lowest.sh
echo "== the zygote's immortal heap on CPython 3.12/3.13 (scripts/test_newer_python.sh)"
bash scripts/test_newer_python.sh
