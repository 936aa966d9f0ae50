#!/usr/bin/env bash
# Create .venv (if missing) and install amesh with its test tools into it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
# Byte-compile amesh, as `pip install` of a wheel does: an editable install is compiled
# on import, and not written back where PYTHONDONTWRITEBYTECODE is set, so that every
# controller, zygote and exec'd worker would compile ~60 modules again (~0.1 s each
# start). Python ignores a stale .pyc after an edit (it checks the source's mtime).
.venv/bin/python -m compileall -q src/amesh
# A real package from PyPI for the environment tests on hosts that lack it
# (tests/env_targets.py): fetched here, once, into the tests' wheelhouse, so that the
# tests themselves resolve and install it offline.
if [ ! -f .cache/test-wheels/tomli_w-1.0.0-py3-none-any.whl ]; then
    .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
        --only-binary=:all: -d .cache/test-wheels 'tomli-w==1.0.0'
fi
