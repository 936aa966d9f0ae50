"""Payload codec: pickle protocol 5, by value for ``__main__`` and notebook code."""

from __future__ import annotations

import io
import pickle
from typing import Any

import cloudpickle

__all__ = ["dumps", "loads"]


def dumps(obj: Any) -> bytes:
    """Pickle ``obj``; classes and functions from ``__main__`` travel by value.

    Raises:
        TypeError: ``obj`` cannot be pickled, with the reason.
    """
    buf = io.BytesIO()
    try:
        cloudpickle.CloudPickler(buf, protocol=5).dump(obj)
    except Exception as exc:  # pickling raises anything from TypeError to PicklingError
        raise TypeError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    return buf.getvalue()


def loads(data: bytes | memoryview) -> Any:
    """Unpickle a payload made by :func:`dumps`."""
    return pickle.loads(data)
