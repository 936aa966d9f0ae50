"""Frames as every transport takes them: one buffer, or parts sent back to back.

The wire schema (:mod:`amesh._wire`) builds frames; transports only carry them, so the
type and its helpers live here, below both.
"""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_FRAME", "Frame", "frame_size", "join"]

#: Frames above this size are refused at the sender with a clear error; NNG itself
#: would drop an oversize frame silently at the receiver.
DEFAULT_MAX_FRAME = 2**31 - 1

#: A frame as handed to a transport: one buffer, or parts to be sent back to back.
Frame = bytes | list[bytes | memoryview]


def join(frame: Frame | memoryview) -> bytes:
    """One bytes object for a frame (copies the parts of a multi-part frame)."""
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, list):
        return b"".join(frame)
    return bytes(frame)


def frame_size(frame: Frame) -> int:
    """The length of ``frame`` in bytes, without joining its parts."""
    if isinstance(frame, list):
        return sum(memoryview(p).nbytes for p in frame)
    return len(frame)
