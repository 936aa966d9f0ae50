"""Where transports put socket files (``ipc`` schemes), whichever transport it is."""

from __future__ import annotations

import os
import tempfile

__all__ = ["ipc_dir"]


def ipc_dir() -> str:
    """Where ipc:// socket files go: ``AMESH_IPC_DIR``, else ``$TMPDIR/amesh-<uid>``."""
    return os.environ.get("AMESH_IPC_DIR") or os.path.join(
        tempfile.gettempdir(), f"amesh-{os.getuid()}"
    )
