"""The public API is exactly what amesh/__init__.py re-exports, and importing is light."""

from __future__ import annotations

import subprocess
import sys

import amesh


def test_every_public_name_is_exported() -> None:
    public = {n for n in vars(amesh) if not n.startswith("_")} - {"annotations"}
    assert set(amesh.__all__) <= public
    # submodules that Python binds as attributes on import are not API
    leaked = {
        n for n in public - set(amesh.__all__) if not isinstance(getattr(amesh, n), type(sys))
    }
    assert leaked == set(), f"public names missing from __all__: {leaked}"
    for name in amesh.__all__:
        obj = getattr(amesh, name)
        assert getattr(obj, "__doc__", None), f"amesh.{name} has no docstring"


def test_import_does_not_pull_in_torch_or_trio() -> None:
    code = "import sys, amesh; print(sorted({'torch', 'trio'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
