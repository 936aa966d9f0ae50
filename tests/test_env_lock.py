"""An environment's lock and wheels (issue 38, items 2 and 3, the controller's half),
offline: the tests resolve and fetch from directories of tiny distributions they write
themselves (``--find-links DIR --no-index``), never from an index."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from amesh import _cli
from amesh._env import (
    EnvError,
    amesh_wheel,
    fetch_wheels,
    load_spec,
    lock_env,
    lock_path,
    open_env,
    read_lock,
)

pytestmark = pytest.mark.timeout(60)


def write_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of ``name`` (one module) in ``folder``, written by hand."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n"
        f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return out


#: an in-tree build backend: builds the sdist's wheel with no build requirement, so
#: that pip builds it offline even in an isolated build environment
BACKEND = textwrap.dedent(
    """\
    import base64, hashlib, zipfile

    NAME, VERSION = "srconly", "2.0"

    def _files():
        dist = f"{NAME}-{VERSION}.dist-info"
        return {
            f"{NAME}/__init__.py": "BUILT = True\\n",
            f"{dist}/METADATA": f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n",
            f"{dist}/WHEEL": "Wheel-Version: 1.0\\nGenerator: t\\nRoot-Is-Purelib: true\\n"
            "Tag: py3-none-any\\n",
        }

    def get_requires_for_build_wheel(config_settings=None):
        return []

    def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
        files, name = _files(), f"{NAME}-{VERSION}-py3-none-any.whl"
        dist = f"{NAME}-{VERSION}.dist-info"
        rows = []
        for path, text in files.items():
            d = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
            rows.append(f"{path},sha256={d.decode()},{len(text.encode())}")
        files[f"{dist}/RECORD"] = "\\n".join([*rows, f"{dist}/RECORD,,"]) + "\\n"
        with zipfile.ZipFile(f"{wheel_directory}/{name}", "w") as zf:
            for path, text in files.items():
                zf.writestr(path, text)
        return name
    """
)


def write_sdist(folder: Path, backend: str = BACKEND) -> Path:
    """An sdist (no wheel) of ``srconly`` 2.0 with an in-tree ``backend``, in ``folder``."""
    top = "srconly-2.0"
    files = {
        "pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\n'
        'backend-path = ["."]\n[project]\nname = "srconly"\nversion = "2.0"\n',
        "backend.py": backend,
        "PKG-INFO": "Metadata-Version: 2.1\nName: srconly\nVersion: 2.0\n",
    }
    out = folder / f"{top}.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return out


@pytest.fixture
def links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of tiny wheels (``tinya`` 1.0 needs ``tinyb``; ``tinyb`` 1.0 and
    1.1), and a cache of the test's own (``AMESH_CACHE_DIR``)."""
    monkeypatch.setenv("AMESH_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "links"
    folder.mkdir()
    write_wheel(folder, "tinya", "1.0", ("tinyb>=1.0",))
    write_wheel(folder, "tinyb", "1.0")
    write_wheel(folder, "tinyb", "1.1")
    return folder


def env_file(tmp_path: Path, deps: str = '["tinya"]') -> Path:
    path = tmp_path / "envs" / "exp.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f'name = "exp"\npython = ">=3.11"\ndependencies = {deps}\n')
    return path


def test_lock_resolves_offline_with_hashes_and_reads_back(links: Path, tmp_path: Path) -> None:
    spec = load_spec(env_file(tmp_path))
    lock = lock_env(spec, include_amesh=False, find_links=[links], no_index=True)
    assert [(r.name, r.version) for r in lock.requirements] == [("tinya", "1.0"), ("tinyb", "1.1")]
    tinya = hashlib.sha256((links / "tinya-1.0-py3-none-any.whl").read_bytes()).hexdigest()
    assert lock.requirements[0].hashes == (tinya,)
    written = lock_path(spec.file)
    assert written == tmp_path / "envs" / "exp.lock"
    assert read_lock(written) == lock
    assert written.read_text().startswith("# amesh lock, format 1\n# env: exp\n")


def test_a_stale_lock_is_refused_when_locked_and_made_again_otherwise(
    links: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = env_file(tmp_path)
    with pytest.raises(EnvError, match=r"exp\.lock: there is no lock, and locked=True"):
        open_env(path, locked=True)
    first = open_env(path, include_amesh=False, find_links=[links], no_index=True)
    assert "there is no lock: locking exp" in caplog.text
    assert open_env(path, locked=True) == first  # the lock is read, not made again
    env_file(tmp_path, '["tinya", "tinyb==1.0"]')
    with pytest.raises(EnvError, match="the dependencies changed since it was made"):
        open_env(path, locked=True)
    second = open_env(path, include_amesh=False, find_links=[links], no_index=True)
    assert [r.version for r in second.lock.requirements] == ["1.0", "1.0"]
    assert second.hash != first.hash and len(second.short_hash) == 12


def test_a_dependency_that_does_not_resolve_says_so(links: Path, tmp_path: Path) -> None:
    spec = load_spec(env_file(tmp_path, '["tinyb>=2"]'))
    with pytest.raises(EnvError, match=r"(?s)exp: the dependencies do not resolve:.*tinyb>=2"):
        lock_env(spec, include_amesh=False, find_links=[links], no_index=True)
    assert not lock_path(spec.file).exists()


def test_wheels_are_fetched_once_and_a_changed_one_again(links: Path, tmp_path: Path) -> None:
    write_sdist(links)
    spec = load_spec(env_file(tmp_path, '["tinya", "srconly"]'))
    lock = lock_env(spec, include_amesh=False, find_links=[links], no_index=True)
    cache = tmp_path / "cache"
    wheels = fetch_wheels(lock, cache=cache, find_links=[links], no_index=True)
    assert [w.filename for w in wheels] == [
        "srconly-2.0-py3-none-any.whl",  # built from its sdist, once
        "tinya-1.0-py3-none-any.whl",
        "tinyb-1.1-py3-none-any.whl",
    ]
    for wheel in wheels:
        assert Path(wheel.path) == cache / "wheels" / wheel.sha256 / wheel.filename
        assert hashlib.sha256(Path(wheel.path).read_bytes()).hexdigest() == wheel.sha256
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    # a second fetch moves nothing, and needs no source at all
    assert fetch_wheels(lock, cache=cache, no_index=True) == wheels
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == before
    # a wheel changed in the cache is found out, and fetched again
    bad = Path(wheels[1].path)
    bad.write_bytes(b"not a wheel")
    again = fetch_wheels(lock, cache=cache, find_links=[links], no_index=True)
    assert again == wheels
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == wheels[1].sha256


def test_a_package_whose_wheel_fails_to_build_is_named_and_nothing_is_cached(
    links: Path, tmp_path: Path
) -> None:
    """An sdist whose build fails (a missing compiler, say): the error names it, and
    the cache keeps nothing of it (the next open builds it again)."""
    broken = BACKEND.replace(
        "    files, name = _files()",
        '    raise RuntimeError("no C compiler here")\n    files, name = _files()',
    )
    assert broken != BACKEND
    write_sdist(links, broken)
    spec = load_spec(env_file(tmp_path, '["srconly"]'))
    cache = tmp_path / "cache"
    with pytest.raises(EnvError, match=r"(?s)srconly.*no C compiler here"):
        lock = lock_env(spec, include_amesh=False, find_links=[links], no_index=True)
        fetch_wheels(lock, cache=cache, find_links=[links], no_index=True)
    assert not list(cache.rglob("srconly*.whl"))


def test_a_wheel_whose_hash_is_not_the_locks_is_refused(links: Path, tmp_path: Path) -> None:
    spec = load_spec(env_file(tmp_path, '["tinyb==1.0"]'))
    lock = lock_env(spec, include_amesh=False, find_links=[links], no_index=True)
    write_wheel(links, "tinyb", "1.0", ("tampered>=0",))  # same name, other bytes
    with pytest.raises(EnvError, match="downloading the environment's wheels failed"):
        fetch_wheels(lock, cache=tmp_path / "cache", find_links=[links], no_index=True)
    assert not list((tmp_path / "cache" / "wheels").glob("[0-9a-f]*"))


def test_amesh_wheel_is_built_once_per_source(tmp_path: Path) -> None:
    """A stand-in source tree, which the test may edit (amesh's own is not the test's
    to change); the same code builds amesh's (the next test)."""
    tree = tmp_path / "tree"
    (tree / "src" / "standin").mkdir(parents=True)
    (tree / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "standin"\nversion = "0.1"\n'
    )
    module = tree / "src" / "standin" / "__init__.py"
    module.write_text("X = 1\n")
    cache = tmp_path / "cache"
    first = amesh_wheel(cache, tree)
    assert first.filename.startswith("standin-0.1-") and Path(first.path).is_file()
    assert sorted(p.name for p in tree.rglob("*")) == [
        "__init__.py",
        "pyproject.toml",
        "src",
        "standin",
    ]  # nothing built in the tree
    assert amesh_wheel(cache, tree) == first  # cached: no build
    module.write_text("X = 2\n")
    second = amesh_wheel(cache, tree)
    assert second.sha256 != first.sha256
    with zipfile.ZipFile(second.path) as zf:
        assert zf.read("standin/__init__.py") == b"X = 2\n"


def test_the_cli_locks_and_shows_locked_versions(
    links: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    env_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = ["env", "lock", "exp", "--find-links", str(links), "--no-index", "--without-amesh"]
    assert _cli.main(argv) == 0
    assert "wrote envs/exp.lock: 2 requirements for Python" in capsys.readouterr().out
    assert _cli.main(["env", "show", "exp"]) == 0
    out = capsys.readouterr().out
    assert "  tinya -> 1.0\n" in out and "also locked (1): tinyb==1.1" in out
    assert _cli.main(["env", "check", "envs/exp.toml"]) == 0
    assert "satisfies python = '>=3.11'" in capsys.readouterr().out


def test_amesh_own_wheel_builds_from_the_tree_this_amesh_runs_from(tmp_path: Path) -> None:
    import amesh

    wheel = amesh_wheel(tmp_path / "cache")
    assert wheel.filename.startswith(f"amesh-{amesh.__version__}-")
    with zipfile.ZipFile(wheel.path) as zf:
        names = set(zf.namelist())
    assert {"amesh/__init__.py", "amesh/_env/_wheels.py", "amesh/py.typed"} <= names
    assert amesh_wheel(tmp_path / "cache") == wheel
