"""A workspace: the user's code, as a manifest of content-addressed files, and the
trees that a host makes of it.

The controller :func:`scan`\\ s the workspace's roots into a :class:`Manifest`
(relative path -> digest, size, mode); a host that has every blob of it
:func:`materialise`\\ s ``root/workspaces/<manifest digest>``: hard links to the
store's blobs, made in a temporary directory and renamed into place in one step, so
a tree is whole or absent, and one made once is used again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ._store import BlobStore, file_digest, pid_alive

if TYPE_CHECKING:
    from pathspec import GitIgnoreSpec

__all__ = ["Entry", "HashCache", "Manifest", "Scanned", "materialise", "scan"]

#: directories never part of a workspace (version control, caches)
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".mypy_cache", ".ruff_cache"})
#: files never part of one
SKIPPED_SUFFIXES = (".pyc", ".pyo")
#: a file modified this recently (seconds) is hashed again at the next scan: an edit
#: within the file system's mtime granularity would keep its size and mtime
_RACY = 2.0


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One file of a workspace."""

    #: SHA-256 (hex) of its bytes: the blob it is made from
    digest: str
    size: int
    #: 0o755 (executable) or 0o644
    mode: int


class Manifest(msgspec.Struct, frozen=True):
    """A workspace's files: relative path (``/``-separated) -> :class:`Entry`."""

    files: dict[str, Entry] = {}

    def digest(self) -> str:
        """The manifest's own SHA-256 (hex): it names the tree made of it."""
        return hashlib.sha256(msgspec.msgpack.encode(self, order="sorted")).hexdigest()

    def blobs(self) -> set[str]:
        """The digests of its files."""
        return {e.digest for e in self.files.values()}

    def size(self) -> int:
        """Bytes in its files."""
        return sum(e.size for e in self.files.values())


@dataclass(frozen=True)
class Scanned:
    """What :func:`scan` found: the manifest, and a local file for each of its blobs."""

    manifest: Manifest
    sources: dict[str, Path] = field(default_factory=dict)


class HashCache:
    """The digests of files already hashed, by path, kept while their size, mtime and
    inode stay the same: a scan of unchanged files reads none of them."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, int, int, str]] = {}

    def digest(self, path: str, st: os.stat_result) -> str:
        """The digest of the file at ``path``, whose status is ``st``."""
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        known = self._known.get(path)
        if known is not None and known[:3] == key:
            return known[3]
        digest = file_digest(path)
        if time.time() - st.st_mtime > _RACY:
            self._known[path] = (*key, digest)
        return digest


def _spec(lines: Iterable[str]) -> GitIgnoreSpec:
    from pathspec import GitIgnoreSpec  # (the amesh[env] extra)

    return GitIgnoreSpec.from_lines(lines)


class _Ignored:
    """What a walk of one root leaves out: ``excludes`` (gitignore patterns relative
    to the root) and the ``.gitignore`` of each directory, for what is under it."""

    def __init__(self, excludes: Sequence[str]) -> None:
        self._specs: list[tuple[str, GitIgnoreSpec]] = [("", _spec(excludes))]

    def enter(self, rel_dir: str, path: str) -> None:
        """Read the ``.gitignore`` of directory ``rel_dir`` (at ``path``), if any."""
        try:
            with open(os.path.join(path, ".gitignore")) as f:
                lines = f.read().splitlines()
        except OSError:
            return
        self._specs.append((rel_dir, _spec(lines)))

    def __call__(self, rel: str, is_dir: bool) -> bool:
        for base, spec in self._specs:
            if base and not rel.startswith(base + "/"):
                continue
            sub = rel[len(base) + 1 :] if base else rel
            if spec.match_file(sub + "/" if is_dir else sub):
                return True
        return False


def _is_venv(path: str) -> bool:
    return os.path.exists(os.path.join(path, "pyvenv.cfg"))


def _scan_root(root: Path, excludes: Sequence[str], cache: HashCache) -> dict[str, Path]:
    """The files of one root to take: relative path -> absolute path."""
    ignored = _Ignored(excludes)
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        ignored.enter(rel_dir, dirpath)
        prefix = rel_dir + "/" if rel_dir else ""
        dirnames[:] = sorted(
            d
            for d in dirnames
            if d not in SKIPPED_DIRS
            and not ignored(prefix + d, True)
            and not _is_venv(os.path.join(dirpath, d))
        )
        for name in filenames:
            rel = prefix + name
            if not name.endswith(SKIPPED_SUFFIXES) and not ignored(rel, False):
                found[rel] = Path(dirpath, name)
    return found


def scan(
    roots: Sequence[str | os.PathLike[str]],
    excludes: Sequence[str] = (),
    cache: HashCache | None = None,
) -> Scanned:
    """The workspace made of ``roots``: their files, each relative to its root (the
    roots' contents side by side at the top of the tree), but for ``excludes``
    (gitignore patterns, relative to each root), what a ``.gitignore`` file leaves
    out, version control and cache directories, compiled Python and venvs.

    Args:
        roots: directories.
        excludes: patterns to leave out, as in a ``.gitignore``.
        cache: digests from earlier scans (see :class:`HashCache`), kept up to date.

    Raises:
        ValueError: two roots hold different files at one relative path.
        NotADirectoryError: a root is not a directory.
    """
    cache = cache if cache is not None else HashCache()
    files: dict[str, Entry] = {}
    sources: dict[str, Path] = {}
    origin: dict[str, Path] = {}
    for r in roots:
        root = Path(r).resolve()
        if not root.is_dir():
            raise NotADirectoryError(f"a workspace root is not a directory: {root}")
        for rel, path in _scan_root(root, excludes, cache).items():
            try:
                st = path.stat()
            except OSError:  # a dangling link, or removed meanwhile
                continue
            entry = Entry(cache.digest(str(path), st), st.st_size, _mode(st.st_mode))
            if rel in files and files[rel] != entry:
                raise ValueError(f"two workspace roots hold {rel}: {origin[rel]} and {path}")
            files[rel], origin[rel] = entry, path
            sources.setdefault(entry.digest, path)
    return Scanned(Manifest(dict(sorted(files.items()))), sources)


def _mode(st_mode: int) -> int:
    return 0o755 if st_mode & 0o100 else 0o644


def _safe(rel: str) -> str:
    """``rel`` if it names a file inside a tree.

    Raises:
        ValueError: it is absolute, empty, or climbs out (``..``).
    """
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a path inside a workspace: {rel!r}")
    return rel


def materialise(store: BlobStore, root: str | os.PathLike[str], manifest: Manifest) -> Path:
    """The tree of ``manifest`` under ``root/workspaces``, made if it is not there.

    Args:
        store: holds every blob of ``manifest``.
        root: the trees go under ``root/workspaces``.
        manifest: what the tree holds.

    Returns:
        ``root/workspaces/<manifest digest>``.

    Raises:
        LookupError: blobs of it are not in ``store`` (nothing is made).
        ValueError: a path of it is not inside the tree.
    """
    trees = Path(root) / "workspaces"
    final = trees / manifest.digest()
    if final.exists():
        return final
    blobs = {d: str(store.path(d)) for d in manifest.blobs()}
    lacking = sorted(
        rel for rel, e in manifest.files.items() if not os.path.exists(blobs[e.digest])
    )
    if lacking:
        raise LookupError(
            f"{len(lacking)} file(s) of the workspace were never sent here: "
            + ", ".join(lacking[:5])
            + (", ..." if len(lacking) > 5 else "")
        )
    trees.mkdir(mode=0o700, parents=True, exist_ok=True)
    _remove_dead_trees(trees)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:16]}-{os.getpid()}-", dir=trees))
    try:
        made: set[str] = set()
        # (strings, not Paths, and each directory made once: ~0.1 s for 5,000 files)
        for rel, entry in manifest.files.items():
            dest = os.path.join(tmp, _safe(rel))
            parent = os.path.dirname(dest)
            if parent not in made:
                os.makedirs(parent, exist_ok=True)
                made.add(parent)
            _place(blobs[entry.digest], dest, entry.mode)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            shutil.rmtree(tmp)  # another made it meanwhile: the same tree
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _place(blob: str, dest: str, mode: int) -> None:
    """``dest``, a hard link to ``blob`` (read only), or a copy: across file systems,
    or for an executable (a blob's mode is 0444 for every link to it)."""
    if not mode & 0o100:
        with contextlib.suppress(OSError):
            os.link(blob, dest)
            return
    shutil.copyfile(blob, dest)
    os.chmod(dest, mode)


def _remove_dead_trees(trees: Path) -> None:
    """Remove the half-made trees of makers that are gone (killed)."""
    for tmp in trees.glob(".*-*-*"):
        pid = tmp.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
