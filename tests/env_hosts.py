"""What the tests of environments on hosts with nothing but Python share
(tests/test_env_slurm.py, tests/test_env_ssh.py): how a node of scripts/cluster hides
the controller's files, the agent's bundle, an environment with a package the nodes
lack, and a workspace with an actor that imports it."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from amesh._depot import file_digest
from amesh._env import amesh_wheel
from amesh._hosts import AgentBundle, EnvPackages, agent_bundle

from .depot_wheels import requirement, tiny_wheel

__all__ = ["LOOKUP", "NOTHING", "PROBE", "SYSTEM_PYTHON", "env_project", "hide", "made"]

SYSTEM_PYTHON = "/usr/bin/python3"
#: a node's home of its own over /root (hiding the controller's interpreter, ~/.cache
#: and everything else of root's), then tmpfs over /work (the checkout and its venv),
#: /tmp (worktrees, pytest's directories, the controller's wheel cache) and /run; then
#: the command. Arguments: the directory of the nodes' homes, the command.
HIDE = (
    'mount --bind "$1/$(hostname)" /root && mount -t tmpfs tmpfs /work '
    '&& mount -t tmpfs tmpfs /tmp && mount -t tmpfs tmpfs /run && shift && exec "$@"'
)
#: what a node says to LOOKUP when it has nothing but the system's Python
NOTHING = f"{SYSTEM_PYTHON} [True, True, True, True, True] False"
LOOKUP = (
    "import importlib.util as u, os, sys; "
    "print(sys.executable, [u.find_spec(m) is None for m in "
    "('amesh', 'msgspec', 'tinypkg', 'uv', 'tomli_w')], os.path.exists('/work/main'))"
)

PROBE = """
import sys

import amesh


class Probe(amesh.Actor):
    @amesh.endpoint
    def where(self) -> dict:
        import tinypkg

        return {"python": sys.executable, "amesh": amesh.__file__, "tinypkg": tinypkg.VALUE}
"""


def hide(homes: Path) -> tuple[str, ...]:
    """The command prefix that runs a command on a node with the controller's files
    hidden and ``homes/<its name>`` as /root."""
    return (
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        HIDE,
        "sh",
        str(homes),
    )


def made(tmp_path: Path) -> tuple[AgentBundle, EnvPackages]:
    """The agent's bundle (amesh built from this checkout, its dependencies repacked)
    and an environment of those wheels and ``tinypkg``, which no node has."""
    bundle = agent_bundle(amesh_wheel(tmp_path / "cache").path, tmp_path / "deps")
    tiny = tiny_wheel(tmp_path / "tiny", "tinypkg", "1.0", {"tinypkg/__init__.py": "VALUE = 41\n"})
    wheels = [Path(path) for _, _, path in bundle.wheels] + [tiny]
    requirements = "".join(requirement(w) + "\n" for w in sorted(wheels))
    env = EnvPackages(
        env_hash=hashlib.sha256(requirements.encode()).hexdigest()[:32],
        requirements=requirements,
        wheels=[(w.name, file_digest(w), w) for w in wheels],
        python_spec=">=3.11",
    )
    return bundle, env


@pytest.fixture
def env_project(tmp_path: Path) -> Iterator[Path]:
    """A workspace with the probe's module (the controller imports it too)."""
    root = tmp_path / "project"
    root.mkdir()
    (root / "env_probe.py").write_text(PROBE)
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("env_probe", None)
