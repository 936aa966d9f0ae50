"""scripts/structure_report.py (issue 37's before/after figures) counts what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "structure_report.py"


def report(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=100,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.timeout(120)
def test_counts_of_a_small_tree(tmp_path: Path) -> None:
    write(tmp_path / "src/amesh/__init__.py", "")
    write(tmp_path / "src/amesh/_top.py", "from ._pkg._priv import X\nfrom ._pkg import _priv\n")
    write(tmp_path / "src/amesh/_pkg/__init__.py", "from ._priv import X as X\n")
    write(
        tmp_path / "src/amesh/_pkg/_priv.py",
        "class X:\n    a = 1\n\n    def f(self):\n        self.b = 2\n",
    )
    write(tmp_path / "src/amesh/_pkg/_inner.py", "from amesh._pkg._priv import X\n")
    write(tmp_path / "src/amesh/_other/__init__.py", "import amesh._pkg\nimport amesh._top\n")
    write(tmp_path / "ext/a.c", "int x;\nint y;\n")
    write(
        tmp_path / "pyproject.toml",
        '[[tool.importlinter.contracts]]\nid = "layers"\nignore_imports = ["a -> b", "c -> d"]\n'
        '[[tool.importlinter.contracts]]\nid = "acyclic"\nignore_imports = ["a -> b"]\n',
    )
    r: dict[str, Any] = json.loads(report("--root", str(tmp_path), "--no-trace", "--json"))
    assert r["packages"] == {
        "amesh": {"files": 2, "lines": 2},
        "amesh._other": {"files": 1, "lines": 2},
        "amesh._pkg": {"files": 3, "lines": 7},
    }
    assert r["c_extension"] == {"files": 1, "lines": 2}
    assert r["classes_by_members"][0] == {
        "name": "amesh._pkg._priv.X",
        "lines": 5,
        "methods": 1,
        "attributes": 2,
        "members": 3,
    }
    assert r["layer_ignores"] == {"layers": 2, "all contracts": 3}
    # _top reaches into _pkg._priv twice; _inner is inside _pkg; _other uses front doors
    assert r["reach_ins"] == {
        "amesh._pkg": {"files": 1, "private_modules": 1, "imports": 2},
        "total": {"files": 1, "private_modules": 1, "imports": 2},
    }


@pytest.mark.timeout(120)
def test_this_checkout_round_trip_and_headings() -> None:
    r: dict[str, Any] = json.loads(report("--json", "--warmup", "5", "--rounds", "1"))
    files = [p for p in (ROOT / "src/amesh").rglob("*.py") if "__pycache__" not in p.parts]
    assert sum(p["files"] for p in r["packages"].values()) == len(files)
    for trip in r["round_trip"].values():
        assert 2 <= trip["modules"] <= trip["module_changes"] < trip["python_calls"]
    text = report("--warmup", "5", "--rounds", "1")
    for heading in (
        "Packages",
        "Largest files",
        "Largest classes by lines",
        "Round trip",
        "Layer contract",
        "Private reach-ins",
        "Duplicates",
    ):
        assert f"\n{heading}" in text
