"""Payload codec: pickle protocol 5 with out-of-band buffers.

Classes and functions from ``__main__`` (scripts, notebooks) travel by value
(cloudpickle). Buffers of at least :data:`OOB_THRESHOLD` bytes (numpy arrays, torch
tensors, bytearrays...) are not copied into the pickle: they travel as separate parts
of the frame, and the receiver's objects are views of the received frame.
"""

from __future__ import annotations

import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle

__all__ = ["OOB_THRESHOLD", "Payload", "dumps", "loads"]

#: Buffers smaller than this stay inside the pickle (a part costs more than a copy).
OOB_THRESHOLD = 64 * 1024


class Payload:
    """A pickled object: the pickle bytes and its out-of-band buffers."""

    __slots__ = ("buffers", "data")

    def __init__(self, data: bytes, buffers: Sequence[Any] = ()) -> None:
        self.data = data
        self.buffers: list[Any] = [memoryview(b) for b in buffers]

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(memoryview(b).nbytes for b in self.buffers)

    def __reduce__(self) -> tuple[Any, ...]:
        # Nested in another pickle (spawn arguments), the buffers stay out of band.
        return (Payload, (self.data, [pickle.PickleBuffer(b) for b in self.buffers]))


class _Pickler(cloudpickle.CloudPickler):  # type: ignore[misc]
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor:
            from .torch._tensor import reduce_tensor

            return reduce_tensor(obj)
        return super().reducer_override(obj)


def dumps(obj: Any) -> Payload:
    """Pickle ``obj``; large buffers are kept out of band.

    Raises:
        TypeError: ``obj`` cannot be pickled, with the reason.
    """
    buf = io.BytesIO()
    buffers: list[memoryview] = []

    def take(pb: pickle.PickleBuffer) -> bool:
        view = pb.raw()
        if view.nbytes < OOB_THRESHOLD:
            return True  # in band
        buffers.append(view)
        return False

    try:
        _Pickler(buf, protocol=5, buffer_callback=take).dump(obj)
    except Exception as exc:  # pickling raises anything from TypeError to PicklingError
        raise TypeError(f"cannot pickle {type(obj).__name__}: {exc}") from exc
    return Payload(buf.getvalue(), buffers)


def loads(data: bytes | memoryview, buffers: Sequence[memoryview] = ()) -> Any:
    """Unpickle what :func:`dumps` made; objects may be views of ``buffers``."""
    return pickle.loads(data, buffers=buffers)
