"""Packages are used through their front doors: the front-door contract of
pyproject.toml fails on an import of another package's private module (a reach-in),
and this checkout has none."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def copy_of_the_package(to: Path) -> Path:
    """``src/amesh`` and ``pyproject.toml`` under ``to``; returns the copy's ``amesh``."""
    shutil.copy(ROOT / "pyproject.toml", to / "pyproject.toml")
    shutil.copytree(
        ROOT / "src" / "amesh",
        to / "src" / "amesh",
        ignore=shutil.ignore_patterns("__pycache__", "*.so"),
    )
    return to / "src" / "amesh"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """The front-door contract checked over the package under ``root``."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-logo", "--no-cache", "--contract", "front-doors"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root / "src")},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "reach_in", "named"),
    [
        # at module level: the model layer into a private module of the runtime
        (
            "_model/_endpoint.py",
            "from .._runtime._context import call_context as _reached\n",
            "amesh._model._endpoint -> amesh._runtime._context",
        ),
        # the runtime into the wire's shared-memory segments, past its front door
        (
            "_runtime/_calls.py",
            "from .._wire._segments import release_payload as _reached\n",
            "amesh._runtime._calls -> amesh._wire._segments",
        ),
        # inside a function, as a lazy import: the hosts into the transport's TLS module
        (
            "_hosts/_admin.py",
            "\n\ndef _reached() -> object:\n    from .._transport import _tls\n\n    return _tls\n",
            "amesh._hosts._admin -> amesh._transport._tls",
        ),
    ],
)
def test_a_reach_in_breaks_the_front_door_contract(
    tmp_path: Path, module: str, reach_in: str, named: str
) -> None:
    package = copy_of_the_package(tmp_path)
    clean = lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    path = package / module
    path.write_text(path.read_text() + reach_in)
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert named in broken.stdout
    assert "1 broken" in broken.stdout


@pytest.mark.timeout(120)
def test_this_checkout_has_no_reach_in() -> None:
    # the report counts imports under `if TYPE_CHECKING:` too, which the contract skips
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structure_report.py"), "--no-trace", "--json"],
        capture_output=True,
        text=True,
        timeout=100,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["reach_ins"] == {"total": {"files": 0, "private_modules": 0, "imports": 0}}
    # and no contract lets an import through: the C extension has a package of its own,
    # so even it is a node of the graph (it read as an import of amesh itself)
    assert report["layer_ignores"] == {"layers": 0, "all contracts": 0}
