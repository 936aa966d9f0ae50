#!/usr/bin/env bash
# The lowest versions of the dependencies: pyproject.toml allows ranges (`anyio>=4.14`,
# ...), and the main run (scripts/setup.sh) installs the highest; this sets up
# .venv-lowest with the floors (scripts/lowest.txt, as pip constraints) and runs the
# tests that exercise them there: the wire format (msgspec), transports and TLS
# (cryptography, uvloop), lifecycles, host agents and persistent meshes held for
# several heartbeat periods (anyio, on both backends: trio too). Run by scripts/test.sh.
#
# amesh itself is installed from this checkout as a user would (a wheel, not an
# editable install: the C extension in src/amesh that .venv uses is left alone).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-lowest/bin/python ]; then
    "$PY" -m venv .venv-lowest
fi
# Each floor in pyproject.toml (the dependencies and the trio extra) must be pinned in
# scripts/lowest.txt; what to install: the dependencies and the test tools.
requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT
.venv-lowest/bin/python - "$requirements" <<'PY'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = {}
for line in open("scripts/lowest.txt"):
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = line.split("==")
        pins[name.strip().lower()] = version.strip()
def release(version):  # 4.14 and 4.14.0 are one release
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return parts

extras = project["optional-dependencies"]
for req in project["dependencies"] + extras["trio"]:
    name, version = re.match(r"([A-Za-z0-9_.-]+)\s*(?:>=|==)\s*([^;,\s]+)", req).groups()
    if release(pins.get(name.lower(), "-1")) != release(version):
        sys.exit(f"scripts/lowest.txt: pin {name}=={version}, the floor in pyproject.toml")
with open(sys.argv[1], "w") as f:
    f.write("\n".join(project["dependencies"] + extras["test-core"]) + "\n")
PY
pip=(.venv-lowest/bin/python -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" -c scripts/lowest.txt -r "$requirements"
# (setuptools builds the wheel in build/: a copy left from an earlier build would keep
# a module since removed from src/)
rm -rf build
"${pip[@]}" --no-deps --force-reinstall .
rm -rf build
echo "with $(.venv-lowest/bin/python -m pip freeze | grep -iE \
    '^(anyio|cloudpickle|cryptography|greenlet|msgspec|pynng|sniffio|uvloop|trio)==' | tr '\n' ' ')"
# (test_agent.py: its two tests that train with torch run in the main suite only)
.venv-lowest/bin/python -m pytest tests/test_wire.py tests/test_transport.py tests/test_tls.py \
    tests/test_lifecycle.py tests/test_adverbs.py tests/test_agent.py tests/test_persistent.py \
    --deselect tests/test_agent.py::test_a_process_group_across_hosts \
    --deselect tests/test_agent.py::test_train_ddp_over_agents "$@"
