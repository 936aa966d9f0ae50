#!/usr/bin/env bash
# What only a newer CPython does: on 3.12 and 3.13 the zygote makes what it loaded
# immortal (PEP 683) before it forks (amesh._hosts._zygote_heap._settle). Sets up
# .venv-newer with that interpreter (amesh, its C extension, the test tools; no torch,
# whose local CPU build is for 3.11 only), then runs the tests of worker starts, output,
# lifecycles, host agents and the debugger (pdb changed in 3.13) with it. Run by
# scripts/test.sh.
#
# The interpreter: $AMESH_NEWER_PYTHON, else python3.13 or python3.12 on PATH, else one
# that pyenv has. With none, it says so and does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

fits() {  # a CPython 3.12 or 3.13 with the GIL
    "$1" -c 'import sys, sysconfig
sys.exit(not ((3, 12) <= sys.version_info[:2] <= (3, 13)
              and sys.implementation.name == "cpython"
              and not sysconfig.get_config_var("Py_GIL_DISABLED")))' 2>/dev/null
}

PY=""
for candidate in ${AMESH_NEWER_PYTHON:-} python3.13 python3.12 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3; do
    if command -v "$candidate" > /dev/null && fits "$candidate"; then
        PY=$(command -v "$candidate")
        break
    fi
done
if [ -z "$PY" ]; then
    echo "no CPython 3.12 or 3.13 here (AMESH_NEWER_PYTHON, PATH, pyenv):" \
        "the zygote's immortal heap is not tested on this machine"
    exit 0
fi
echo "with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
if [ ! -x .venv-newer/bin/python ] || ! fits .venv-newer/bin/python; then
    rm -rf .venv-newer
    "$PY" -m venv .venv-newer
fi
.venv-newer/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv-newer/bin/python -m pip install -q --disable-pip-version-check -e '.[test-core]'
.venv-newer/bin/python -m compileall -q src/amesh
.venv-newer/bin/python -c 'import amesh._native._ext as e, sys; sys.exit(not e.CAN_IMMORTALIZE)'
# (test_agent.py: a host agent's zygote, which settles again after the TLS stack; its
# two tests that train with torch run in the main suite only)
.venv-newer/bin/python -m pytest tests/test_spawn.py tests/test_lifecycle.py \
    tests/test_output.py tests/test_mesh.py tests/test_agent.py \
    tests/test_debug.py tests/test_debug_remote.py \
    --deselect tests/test_agent.py::test_a_process_group_across_hosts \
    --deselect tests/test_agent.py::test_train_ddp_over_agents "$@"
