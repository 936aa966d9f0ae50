"""A content-addressed store of files: each is kept once, named by its SHA-256.

``root/blobs/aa/<digest>`` holds the blob whose SHA-256 (hex) is ``<digest>``
(``aa``: its first two characters, so that no directory grows to every blob). A blob
arrives through a :class:`BlobWriter`, in chunks, into a part file of its own under
``root/blobs/parts/``; only once the digest of what arrived is the one announced is it
renamed into place, in one step. A reader therefore sees a whole, verified blob or
none, whatever happens to the writer (killed, or sent the wrong bytes). Blobs are read
only (mode 0444): the trees and venvs made from them are hard links to them, and an
edit through one of those would change every other.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["BlobStore", "BlobWriter", "DigestError", "check_digest", "file_digest", "pid_alive"]

#: what a SHA-256 digest in hex looks like (anything else is no blob's name)
_DIGEST = re.compile(r"[0-9a-f]{64}")
#: bytes read at a time when hashing a file
_READ = 1 << 20

_parts = itertools.count()


class DigestError(ValueError):
    """What arrived for a blob is not what its digest says."""


def check_digest(digest: str) -> str:
    """``digest`` if it is a SHA-256 in lower-case hex.

    Raises:
        ValueError: it is not (it would name a path outside the store).
    """
    if not _DIGEST.fullmatch(digest):
        raise ValueError(f"not a SHA-256 digest in hex: {digest!r}")
    return digest


def file_digest(path: str | os.PathLike[str]) -> str:
    """The SHA-256 (hex) of the file at ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


class BlobStore:
    """The blobs under ``root/blobs`` (made on first use).

    Args:
        root: the directory the store lives in (an agent's: ``<state dir>/depot``).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._blobs = self.root / "blobs"
        self._parts = self._blobs / "parts"
        self._parts.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._remove_dead_parts()

    def __repr__(self) -> str:
        return f"<BlobStore {self.root}>"

    def path(self, digest: str) -> Path:
        """Where blob ``digest`` is (or would be)."""
        check_digest(digest)
        return self._blobs / digest[:2] / digest

    def has(self, digest: str) -> bool:
        """Whether blob ``digest`` is here."""
        return self.path(digest).exists()

    def missing(self, digests: Iterable[str]) -> list[str]:
        """Those of ``digests`` not here, each once, in the order given."""
        return [d for d in dict.fromkeys(digests) if not self.has(d)]

    def writer(self, digest: str) -> BlobWriter:
        """A writer of blob ``digest`` (see :class:`BlobWriter`)."""
        return BlobWriter(self, digest)

    def put(self, digest: str, chunks: Iterable[bytes]) -> Path:
        """Store the blob made of ``chunks``; its path.

        Raises:
            DigestError: they are not blob ``digest`` (nothing is stored).
        """
        with self.writer(digest) as w:
            for chunk in chunks:
                w.write(chunk)
            return w.commit()

    def put_file(self, path: str | os.PathLike[str]) -> str:
        """Store a copy of the file at ``path``; its digest."""
        digest = file_digest(path)
        if not self.has(digest):
            with open(path, "rb") as f:
                self.put(digest, iter(lambda: f.read(_READ), b""))
        return digest

    def _part_path(self, digest: str) -> Path:
        return self._parts / f"{digest}.{os.getpid()}.{next(_parts)}"

    def _remove_dead_parts(self) -> None:
        """Remove the part files of writers whose process is gone (killed mid-blob)."""
        for part in self._parts.iterdir():
            pid = part.name.split(".")[1] if part.name.count(".") == 2 else ""
            if pid.isdigit() and not pid_alive(int(pid)):
                with contextlib.suppress(OSError):
                    part.unlink()


class BlobWriter:
    """One blob arriving in chunks, in order; a context manager that removes what it
    wrote unless :meth:`commit` stored it.

    Args:
        store: where the blob goes.
        digest: its SHA-256 (hex), as announced by the sender.
    """

    def __init__(self, store: BlobStore, digest: str) -> None:
        self.digest = check_digest(digest)
        self._store = store
        self._part = store._part_path(digest)
        self._file = open(self._part, "xb")
        self._hash = hashlib.sha256()
        #: bytes written so far (where the next chunk starts)
        self.offset = 0

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()

    def write(self, chunk: bytes | memoryview, offset: int | None = None) -> None:
        """Append ``chunk``; ``offset``, when given, is where the sender says it starts.

        Raises:
            ValueError: ``offset`` is not where the blob ends now (a chunk lost or sent
                twice).
        """
        if offset is not None and offset != self.offset:
            raise ValueError(
                f"blob {self.digest[:12]}: a chunk at offset {offset}, expected {self.offset}"
            )
        self._file.write(chunk)
        self._hash.update(chunk)
        self.offset += len(chunk)

    def commit(self) -> Path:
        """Check the digest and rename the blob into place; its path.

        Raises:
            DigestError: what arrived has another digest (it is removed).
        """
        self._file.close()
        got = self._hash.hexdigest()
        if got != self.digest:
            self.abort()
            raise DigestError(
                f"blob {self.digest[:12]}: {self.offset} bytes arrived with digest "
                f"{got[:12]}; refused"
            )
        os.chmod(self._part, 0o444)
        final = self._store.path(self.digest)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        # (another writer of the same blob may have won: the same bytes either way)
        os.replace(self._part, final)
        return final

    def abort(self) -> None:
        """Drop what was written (nothing, after a commit)."""
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            self._part.unlink()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
