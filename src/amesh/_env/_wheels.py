"""The controller's wheel cache: every locked requirement as a wheel, fetched once.

The cache is content-addressed: ``<cache>/wheels/<sha256>/<wheel file name>``, each
directory made in a temporary place and renamed into place whole, so a reader sees a
wheel completely or not at all, even after a crash. A wheel is checked against its
hash when it enters; a stamp beside it (its size and mtime then) lets later reads trust
it without reading it again, and a wheel changed since (its stamp no longer matches) is
hashed again, and fetched again if it is no longer what the lock says.

Missing wheels come from ``pip download --no-deps --require-hashes`` run by this
interpreter, in one batch. A requirement with no wheel for this platform arrives as its
sdist and is built into a wheel once (``pip wheel``); ``<cache>/built/<sdist sha256>``
then names that wheel. amesh's own wheel is built from its source tree, once per
content of that tree (``<cache>/amesh/<source sha256>``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from ._base import EnvError, cache_dir
from ._lock import Lock, Locked

__all__ = ["Wheel", "amesh_wheel", "fetch_wheels", "file_sha256"]

#: a download or a build this long is stuck (pip's own network waits have deadlines)
_PIP_TIMEOUT = 1800.0
_STAMP = ".verified"
_SDIST_SUFFIXES = (".tar.gz", ".zip", ".tar.bz2", ".tgz")


class Wheel(msgspec.Struct, frozen=True):
    """One wheel of an environment, in the cache.

    Attributes:
        filename: the wheel's file name.
        sha256: its hash (hex), the name of its directory in the cache.
        path: where it is.
    """

    filename: str
    sha256: str
    path: str


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _cached(wheels: Path, sha: str) -> Wheel | None:
    """The wheel of hash ``sha`` in the cache, if it is there and still that wheel (a
    changed one is removed, to be fetched again)."""
    folder = wheels / sha
    found = sorted(folder.glob("*.whl"))
    if len(found) != 1:
        return None
    wheel = found[0]
    stamp = folder / _STAMP
    try:
        trusted = stamp.read_text() == _stamp(wheel)
    except OSError:
        trusted = False
    if not trusted:
        if file_sha256(wheel) != sha:
            shutil.rmtree(folder, ignore_errors=True)
            return None
        stamp.write_text(_stamp(wheel))
    return Wheel(wheel.name, sha, str(wheel))


def _insert(wheels: Path, source: Path) -> Wheel:
    """The wheel file ``source`` moved into the cache under its hash (atomically)."""
    sha = file_sha256(source)
    wheels.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=wheels, prefix=".tmp-"))
    try:
        target = staging / source.name
        shutil.move(str(source), target)
        (staging / _STAMP).write_text(_stamp(target))
        final = wheels / sha
        if final.exists():  # a stale or half-trusted copy: ours replaces it
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(staging, final)
        except OSError:  # another process put the same wheel there first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Wheel(source.name, sha, str(final / source.name))


def _pointer(cache: Path, kind: str, key: str) -> Wheel | None:
    """The wheel that ``<cache>/<kind>/<key>`` names (a built sdist, amesh's source)."""
    try:
        sha = (cache / kind / key).read_text().strip()
    except OSError:
        return None
    return _cached(cache / "wheels", sha)


def _point(cache: Path, kind: str, key: str, wheel: Wheel) -> None:
    folder = cache / kind
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as out:
        out.write(wheel.sha256)
    os.replace(tmp, folder / key)


def _compatible(filename: str) -> bool:
    """Whether the wheel ``filename`` installs on this interpreter and platform."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    *_, tags = parse_wheel_filename(filename)
    return not tags.isdisjoint(sys_tags())


def _lookup(cache: Path, req: Locked) -> Wheel | None:
    for sha in req.hashes:
        wheel = _cached(cache / "wheels", sha) or _pointer(cache, "built", sha)
        if wheel is not None and _compatible(wheel.filename):
            return wheel
    return None


def _pip(args: Sequence[str], what: str) -> None:
    # (--no-cache-dir: this cache is the one; pip's would hold a second copy of each)
    command = [sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"]
    command.append("--no-cache-dir")
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_PIP_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise EnvError(f"{what}: pip took more than {_PIP_TIMEOUT:g} s") from None
    if done.returncode != 0:
        raise EnvError(f"{what}:\n{(done.stderr or done.stdout).strip()}")


def _pip_wheel(args: Sequence[str], out: Path, what: str) -> Path:
    """The one wheel that ``pip wheel --no-deps ARGS`` builds into ``out`` (of
    ``what``, as errors name it).

    Raises:
        EnvError: the build failed (with pip's own words), or made no wheel or several.
    """
    _pip(["wheel", "--no-deps", "-w", str(out), *args], f"building a wheel of {what} failed")
    built = list(out.glob("*.whl"))
    if len(built) != 1:
        raise EnvError(f"building {what} made {len(built)} wheels, not one")
    return built[0]


def _sources(find_links: Iterable[str | Path], no_index: bool) -> list[str]:
    out = [arg for link in find_links for arg in ("--find-links", str(link))]
    return [*out, "--no-index"] if no_index else out


def _download(
    cache: Path, missing: list[Locked], sources: list[str], tmp: Path
) -> dict[str, Wheel]:
    """Fetch ``missing`` (by name: their wheels, sdists built)."""
    wanted = tmp / "requirements.txt"
    wanted.write_text(
        "".join(
            f"{r.name}=={r.version} {' '.join(f'--hash=sha256:{h}' for h in r.hashes)}\n"
            for r in missing
        )
    )
    got = tmp / "downloads"
    _pip(
        [
            "download",
            "--no-deps",
            "--require-hashes",
            "--prefer-binary",
            "-d",
            str(got),
            "-r",
            str(wanted),
            *sources,
        ],
        "downloading the environment's wheels failed",
    )
    by_hash = {h: r for r in missing for h in r.hashes}
    out: dict[str, Wheel] = {}
    for file in sorted(got.iterdir()):
        sha = file_sha256(file)
        req = by_hash.get(sha)
        if req is None:  # (--require-hashes makes this pip's bug, not a bad index)
            raise EnvError(f"pip downloaded {file.name}, whose hash no requirement has")
        if file.name.endswith(".whl"):
            out[req.name] = _insert(cache / "wheels", file)
        elif file.name.endswith(_SDIST_SUFFIXES):
            out[req.name] = _build_sdist(cache, file, sha, sources, tmp)
    return out


def _build_sdist(cache: Path, sdist: Path, sha: str, sources: list[str], tmp: Path) -> Wheel:
    built = Path(tempfile.mkdtemp(dir=tmp, prefix="built-"))
    wheel = _insert(cache / "wheels", _pip_wheel([str(sdist), *sources], built, sdist.name))
    _point(cache, "built", sha, wheel)
    return wheel


def fetch_wheels(
    lock: Lock,
    *,
    cache: Path | None = None,
    find_links: Sequence[str | Path] = (),
    no_index: bool = False,
    amesh_source: Path | None = None,
) -> list[Wheel]:
    """Every requirement of ``lock`` as a wheel in the cache, fetching (or building)
    only what it lacks; with amesh's requirements locked (``lock.amesh``), amesh's own
    wheel too.

    Args:
        lock: the environment's lock, made for this Python and platform.
        cache: the cache's directory (default: ``AMESH_CACHE_DIR``, ``~/.cache/amesh``).
        find_links: directories (or pages) of distributions, besides the index.
        no_index: fetch from ``find_links`` only.
        amesh_source: amesh's source tree (default: the one this amesh runs from).

    Returns:
        The wheels: the lock's, in its order, then amesh's.

    Raises:
        EnvError: the lock is for another Python or platform, or a wheel fails to
            download, verify or build.
    """
    from ._lock import this_platform, this_python

    if (lock.python, lock.platform) != (this_python(), this_platform()):
        raise EnvError(
            f"{lock.env}: the lock is for Python {lock.python} on {lock.platform}; this "
            f"controller fetches for {this_python()} on {this_platform()} only"
        )
    cache = cache or cache_dir()
    found = {req.name: _lookup(cache, req) for req in lock.requirements}
    missing = [req for req in lock.requirements if found[req.name] is None]
    if missing:
        (cache / "wheels").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
            found.update(_download(cache, missing, _sources(find_links, no_index), Path(tmp)))
    out = []
    for req in lock.requirements:
        wheel = found.get(req.name)
        if wheel is None:
            raise EnvError(f"{lock.env}: no wheel of {req.name}=={req.version} was fetched")
        out.append(wheel)
    if lock.amesh:
        out.append(amesh_wheel(cache, amesh_source))
    return out


#: what of a source tree goes into its wheel, and so into its hash
_SOURCE_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "README.md", "MANIFEST.in")
_SOURCE_DIRS = ("src", "ext")
#: build outputs: compiled extensions, byte code, setuptools' metadata
_SKIPPED_SUFFIXES = (".so", ".pyc", ".pyd")


def _source_files(root: Path) -> list[Path]:
    files = [root / name for name in _SOURCE_FILES if (root / name).is_file()]
    for folder in _SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*")):
            parts = path.relative_to(root).parts
            built = any(p == "__pycache__" or p.endswith(".egg-info") for p in parts)
            if path.is_file() and not built and path.suffix not in _SKIPPED_SUFFIXES:
                files.append(path)
    return files


def _amesh_source() -> Path:
    package = Path(__file__).resolve().parents[1]  # (this module is amesh/_env/_wheels.py)
    root = package.parents[1]
    if (root / "pyproject.toml").is_file() and (root / "src" / "amesh").is_dir():
        return root
    raise EnvError(
        f"amesh runs from {package}, not from its source tree: give amesh_source= "
        "(a checkout of this version) to build its wheel"
    )


def amesh_wheel(cache: Path | None = None, source: Path | None = None) -> Wheel:
    """A wheel of amesh built from its source tree (``source``, default the one this
    amesh runs from), once per content of that tree.

    The files that go into the wheel (``pyproject.toml``, ``setup.py``, ``src/``,
    ``ext/``...) are hashed, copied to a temporary tree and built there (``pip wheel
    --no-deps --no-build-isolation``: with this interpreter's setuptools), so that the
    build leaves nothing in the source tree and the wheel is of exactly those files.

    Raises:
        EnvError: no source tree, or the build failed.
    """
    cache = cache or cache_dir()
    root = source or _amesh_source()
    files = _source_files(root)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file_sha256(path).encode() + b"\n")
    key = digest.hexdigest()
    wheel = _pointer(cache, "amesh", key)
    if wheel is not None:
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
        tree = Path(tmp) / "tree"
        for path in files:
            target = tree / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        built = _pip_wheel(["--no-build-isolation", str(tree)], Path(tmp) / "out", str(root))
        wheel = _insert(cache / "wheels", built)
    _point(cache, "amesh", key, wheel)
    return wheel
