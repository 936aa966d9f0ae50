"""Wheels the environment tests make themselves: tiny pure-Python ones, written as zip
files, and amesh's own with its dependencies (for workers in a venv)."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from amesh._depot import file_digest, repack

ROOT = Path(__file__).resolve().parent.parent


def tiny_wheel(out: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A wheel of distribution ``name`` holding ``files`` (path -> text)."""
    info = f"{name}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    members[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: amesh-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in members.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    members[f"{info}/RECORD"] = "\n".join(record) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, text in members.items():
            z.writestr(zipfile.ZipInfo(member, (1980, 1, 1, 0, 0, 0)), text)
    return path


def requirement(path: Path) -> str:
    """The pinned, hashed requirement line of the wheel at ``path``."""
    dist, version = path.name.split("-")[:2]
    return f"{dist}=={version} --hash=sha256:{file_digest(path)}"


def dependencies_of(name: str) -> list[str]:
    """The distributions that ``name`` needs here, recursively (not ``name``)."""
    seen: dict[str, None] = {}
    todo = [name]
    while todo:
        dist = md.distribution(todo.pop())
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            key = req.name.lower().replace("_", "-")
            if key not in seen:
                seen[key] = None
                todo.append(key)
    return list(seen)


def amesh_wheels(out: Path) -> list[Path]:
    """amesh's wheel, built from this checkout (its C extension compiled: ~3.5 s on 2
    CPUs), and its dependencies' wheels, repacked from what this interpreter has
    installed (~0.6 s): the wheels that make a venv that runs amesh workers."""
    out.mkdir(parents=True, exist_ok=True)
    source = out / "source"
    for part in ("src", "ext"):
        shutil.copytree(
            ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    for part in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, source / part)
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-index", "--no-deps"),
            *("--no-build-isolation", "-w", str(out), str(source)),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    shutil.rmtree(source)
    wheels = list(out.glob("amesh-*.whl"))
    wheels += [repack(dep, out) for dep in dependencies_of("amesh")]
    return wheels
