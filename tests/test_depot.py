"""What a host keeps for environments (amesh._depot): the blob store, venvs built from
wheels, workspace manifests and the trees made of them."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from amesh._depot import (
    MARKER,
    BlobStore,
    DigestError,
    HashCache,
    PythonError,
    VenvError,
    _python,
    _venv,
    _workspace,
    materialise,
    realise_venv,
    scan,
)

from .depot_wheels import requirement, tiny_wheel

pytestmark = pytest.mark.timeout(60)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(root: Path) -> list[str]:
    """The part files of blobs not stored, under ``root``."""
    return sorted(p.name for p in (root / "blobs" / "parts").iterdir())


# -- the blob store ------------------------------------------------------------------


def test_a_blob_is_stored_under_its_digest_and_only_what_is_missing_is_asked(
    tmp_path: Path,
) -> None:
    store = BlobStore(tmp_path)
    data = b"x" * 10_000
    digest = sha(data)
    assert store.missing([digest, digest]) == [digest]
    path = store.put(digest, [data[:4000], data[4000:]])
    assert path == tmp_path / "blobs" / digest[:2] / digest
    assert path.read_bytes() == data
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    other = sha(b"other")
    assert store.missing([digest, other]) == [other]
    assert leftovers(tmp_path) == []


def test_a_blob_whose_bytes_are_not_its_digest_is_refused_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    store = BlobStore(tmp_path)
    digest = sha(b"what was announced")
    with pytest.raises(DigestError, match="refused"):
        store.put(digest, [b"what ", b"arrived"])
    assert not store.has(digest)
    assert leftovers(tmp_path) == []


def test_chunks_must_arrive_in_order(tmp_path: Path) -> None:
    store = BlobStore(tmp_path)
    data = b"abcdef"
    with store.writer(sha(data)) as w:
        w.write(b"abc", 0)
        with pytest.raises(ValueError, match="offset 4, expected 3"):
            w.write(b"ef", 4)
    assert leftovers(tmp_path) == []
    with pytest.raises(ValueError, match="not a SHA-256"):
        store.path("../../etc/passwd")


def test_the_part_file_of_a_killed_writer_is_removed_by_the_next_store(tmp_path: Path) -> None:
    BlobStore(tmp_path)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    part = tmp_path / "blobs" / "parts" / f"{'a' * 64}.{dead.stdout.strip()}.0"
    part.write_bytes(b"half a blob")
    BlobStore(tmp_path)
    assert not part.exists()


# -- venvs ---------------------------------------------------------------------------


class Env:
    """A tiny environment: one wheel in a store, its requirements."""

    def __init__(self, tmp: Path, version: str = "1.0", value: int = 1) -> None:
        self.store = BlobStore(tmp / "depot")
        self.root = tmp / "depot"
        wheel = tiny_wheel(
            tmp / "wheels", "tinypkg", version, {"tinypkg/__init__.py": f"VALUE = {value}\n"}
        )
        self.wheels = [(wheel.name, self.store.put_file(wheel))]
        self.requirements = requirement(wheel) + "\n"
        self.hash = sha(self.requirements.encode())[:32]

    def realise(self, **kwargs: object) -> Path:
        return realise_venv(
            self.store, self.root, self.hash, self.requirements, self.wheels, **kwargs
        )  # type: ignore[arg-type]


def run_in(python: Path, code: str) -> str:
    done = subprocess.run(
        [str(python), "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"]},  # (no PYTHONPATH: only the venv's own)
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_venv_is_built_once_and_then_reused_without_uv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = Env(tmp_path)
    python = env.realise(python_spec=">=3.8")
    assert python == env.root / "venvs" / env.hash / "bin" / "python"
    assert run_in(python, "import tinypkg, sys; print(tinypkg.VALUE, sys.prefix)") == (
        f"1 {python.parent.parent}"
    )
    assert (python.parent.parent / MARKER).exists()

    def no_uv(*args: object) -> None:
        raise AssertionError("uv ran again")

    monkeypatch.setattr(_venv, "_uv", no_uv)
    assert env.realise() == python


def test_concurrent_builders_of_one_env_build_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = Env(tmp_path)
    builds: list[str] = []
    real = _venv._build

    def counted(*args: object) -> None:
        builds.append(threading.current_thread().name)
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_venv, "_build", counted)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(env.realise())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3 and len(set(results)) == 1
    assert len(builds) == 1
    assert run_in(results[0], "import tinypkg; print(tinypkg.VALUE)") == "1"


def test_a_failing_install_names_the_package_and_leaves_no_venv(tmp_path: Path) -> None:
    env = Env(tmp_path)
    digest = env.wheels[0][1]
    wrong = env.requirements.replace(digest, sha(b"another wheel"))
    with pytest.raises(VenvError, match="tinypkg") as info:
        realise_venv(env.store, env.root, env.hash, wrong, env.wheels)
    assert "Hash mismatch" in str(info.value)
    assert not (env.root / "venvs" / env.hash).exists()
    # a wheel that is no zip file, with its own hash in the lock
    bad = tmp_path / "broken" / "brokenpkg-1.0-py3-none-any.whl"
    bad.parent.mkdir()
    bad.write_bytes(b"not a zip file")
    wheels = [(bad.name, env.store.put_file(bad))]
    with pytest.raises(VenvError, match="brokenpkg"):
        realise_venv(env.store, env.root, "broken", requirement(bad), wheels)
    assert not (env.root / "venvs" / "broken").exists()
    # a wheel that never reached this host
    with pytest.raises(VenvError, match="never sent here"):
        realise_venv(
            BlobStore(tmp_path / "empty"),
            tmp_path / "empty",
            env.hash,
            env.requirements,
            env.wheels,
        )


def test_a_python_that_does_not_satisfy_the_env_is_named_with_both_versions(
    tmp_path: Path,
) -> None:
    env = Env(tmp_path)
    ours = ".".join(map(str, sys.version_info[:3]))
    with pytest.raises(
        PythonError,
        match=rf"host h1: Python {ours} .* does not satisfy the environment's python '<3.0'",
    ):
        env.realise(python_spec="<3.0", host="h1")
    assert not (env.root / "venvs" / env.hash).exists()
    assert _python.satisfies((3, 11, 7), ">=3.11,<3.14")
    assert _python.satisfies((3, 11, 7), "==3.11.*")
    assert not _python.satisfies((3, 12, 0), "~=3.11.2")
    assert not _python.satisfies((3, 11, 7), "!=3.11.7")
    with pytest.raises(ValueError, match="not a Python version spec"):
        _python.satisfies((3, 11, 7), ">=three")


CHILD_BUILDER = """
import sys
from amesh._depot import BlobStore, _venv

real = _venv._uv

def uv(host, cmd, env, lock, timeout):
    real(host, cmd, env, lock, timeout)
    if cmd[1] == "venv":  # made, nothing installed: wait to be killed
        print("half-built", flush=True)
        sys.stdin.read()

_venv._uv = uv
root, env_hash, requirements, name, digest = sys.argv[1:]
_venv.realise_venv(BlobStore(root), root, env_hash, requirements, [(name, digest)])
"""


def test_a_builder_killed_mid_install_leaves_a_venv_that_the_next_one_rebuilds(
    tmp_path: Path,
) -> None:
    env = Env(tmp_path)
    name, digest = env.wheels[0]
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD_BUILDER,
            str(env.root),
            env.hash,
            env.requirements,
            name,
            digest,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "half-built\n"
        venv = env.root / "venvs" / env.hash
        assert (venv / "bin" / "python").exists() and not (venv / MARKER).exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
    python = env.realise()
    assert run_in(python, "import tinypkg; print(tinypkg.VALUE)") == "1"
    assert (venv / MARKER).exists()


# -- workspaces ----------------------------------------------------------------------


def make_project(root: Path) -> None:
    files = {
        "main.py": "print('main')\n",
        "pkg/__init__.py": "",
        "pkg/mod.py": "X = 1\n",
        "pkg/data.bin": "data\n",
        "pkg/build/out.o": "object\n",
        "pkg/.gitignore": "*.bin\nbuild/\n",
        ".gitignore": "*.log\nsecret/\n",
        "run.log": "log\n",
        "secret/key.txt": "k\n",
        "ckpt/big.ckpt": "weights\n",
        "pkg/__pycache__/mod.cpython-311.pyc": "compiled\n",
        ".git/HEAD": "ref\n",
        ".venv/pyvenv.cfg": "home = /usr\n",
        ".venv/lib/site.py": "venv\n",
        "tool.sh": "#!/bin/sh\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "tool.sh").chmod(0o755)


def test_a_scan_honours_gitignore_files_excludes_and_skips_caches_and_venvs(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    make_project(project)
    found = scan([project], excludes=["ckpt/"])
    assert sorted(found.manifest.files) == [
        ".gitignore",
        "main.py",
        "pkg/.gitignore",
        "pkg/__init__.py",
        "pkg/mod.py",
        "tool.sh",
    ]
    entry = found.manifest.files["pkg/mod.py"]
    assert (entry.digest, entry.size, entry.mode) == (sha(b"X = 1\n"), 6, 0o644)
    assert found.manifest.files["tool.sh"].mode == 0o755
    assert found.sources[entry.digest] == project / "pkg" / "mod.py"
    assert scan([project], excludes=["ckpt/"]).manifest.digest() == found.manifest.digest()


def test_a_tree_is_made_of_hard_links_once_and_reused(tmp_path: Path) -> None:
    project = tmp_path / "project"
    make_project(project)
    found = scan([project])
    store = BlobStore(tmp_path / "depot")
    with pytest.raises(LookupError, match="never sent here"):
        materialise(store, tmp_path / "depot", found.manifest)
    assert not (tmp_path / "depot" / "workspaces" / found.manifest.digest()).exists()
    for path in found.sources.values():
        store.put_file(path)
    tree = materialise(store, tmp_path / "depot", found.manifest)
    assert tree == tmp_path / "depot" / "workspaces" / found.manifest.digest()
    mod = tree / "pkg" / "mod.py"
    assert mod.read_text() == "X = 1\n"
    assert mod.stat().st_ino == store.path(sha(b"X = 1\n")).stat().st_ino
    assert os.access(tree / "tool.sh", os.X_OK)
    assert materialise(store, tmp_path / "depot", found.manifest) == tree
    assert [p.name for p in tree.parent.iterdir()] == [tree.name]  # no temporary left


def test_a_rescan_of_unchanged_files_reads_none_and_a_sync_moves_only_the_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "project"
    for i in range(5000):
        path = project / f"d{i % 50}" / f"m{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"N = {i}\n")
    long_ago = 1_600_000_000
    for path in project.rglob("*.py"):
        os.utime(path, (long_ago, long_ago))  # (not modified within the racy window)
    cache = HashCache()
    first = scan([project], cache=cache)
    assert len(first.manifest.files) == 5000
    host = BlobStore(tmp_path / "host")
    for path in first.sources.values():
        host.put_file(path)
    old_tree = materialise(host, tmp_path / "host", first.manifest)

    read: list[str] = []
    real = _workspace.file_digest

    def counted(path: str) -> str:
        read.append(path)
        return real(path)

    monkeypatch.setattr(_workspace, "file_digest", counted)
    assert scan([project], cache=cache).manifest == first.manifest
    assert read == []
    edited = project / "d7" / "m7.py"
    edited.write_text("N = 'edited'\n")
    again = scan([project], cache=cache)
    assert read == [str(edited)]
    assert host.missing(again.manifest.blobs()) == [sha(b"N = 'edited'\n")]
    host.put_file(again.sources[sha(b"N = 'edited'\n")])
    tree = materialise(host, tmp_path / "host", again.manifest)
    assert tree != old_tree
    assert (tree / "d7" / "m7.py").read_text() == "N = 'edited'\n"
    assert (old_tree / "d7" / "m7.py").read_text() == "N = 7\n"
