"""Where transports put socket files (``ipc`` schemes), whichever transport it is."""

from __future__ import annotations

import os
import stat
import tempfile

from .._config import settings

__all__ = ["ensure_ipc_dir", "ipc_dir"]


def ipc_dir() -> str:
    """Where ipc:// socket files go: ``AMESH_IPC_DIR``, else ``$TMPDIR/amesh-<uid>``."""
    return settings().ipc_dir or os.path.join(tempfile.gettempdir(), f"amesh-{os.getuid()}")


def ensure_ipc_dir() -> str:
    """:func:`ipc_dir`, created with mode 0700 if missing.

    A directory that already exists must be ours and closed to others: whoever else
    can write to it can rename or replace our sockets, and sit in the middle.

    Raises:
        PermissionError: it belongs to another user, or others may enter it.
        NotADirectoryError: the path is not a directory.
    """
    path = ipc_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"the ipc directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"the ipc directory {path} belongs to uid {st.st_uid}, not to us "
            f"(uid {os.getuid()}): remove it or set AMESH_IPC_DIR"
        )
    if st.st_mode & 0o077:
        raise PermissionError(
            f"the ipc directory {path} has mode {stat.S_IMODE(st.st_mode):o}; others may "
            "enter it: make it 0700 (chmod 700) or set AMESH_IPC_DIR"
        )
    return path
