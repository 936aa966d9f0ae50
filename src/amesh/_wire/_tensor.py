"""Tensors on the wire: CPU memory travels out of band, never through ``torch.save``.

A tensor is sent as its raw bytes (a pickle-5 out-of-band buffer) plus dtype and
shape. The receiver's tensor is a view of the received frame when the frame is
writable, else one copy; a tensor that came through shared memory
(``amesh._wire.dumps(..., shm=True)``) is a view of the segment's mapping, which lives as
long as the tensor and its views. Non-contiguous tensors arrive contiguous, with the same
values. CUDA tensors are copied to the CPU by the sender and arrive on the CPU; move
them with ``.to(device)`` where you want them (amesh never guesses a device).

This is part of the wire, below everything that sends payloads, and imports torch only
where a tensor is at hand: the pickler (:mod:`._pickling`) calls :func:`reduce_tensor` when torch is
already imported and it meets a tensor, and unpickling a tensor imports torch (the
receiver needs it for the tensor anyway). ``amesh.torch`` is not needed for tensors to
travel this way.
"""

from __future__ import annotations

import ctypes
import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["rebuild_tensor", "reduce_tensor"]


def reduce_tensor(t: torch.Tensor) -> Any:
    """``__reduce__`` for a dense tensor, or NotImplemented to pickle it as torch does."""
    import torch  # already imported: ``t`` is a tensor

    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return NotImplemented
    requires_grad = t.requires_grad
    c = t.detach()
    if c.device.type != "cpu":
        c = c.cpu()
    c = c.resolve_conj().resolve_neg().contiguous()
    return (
        rebuild_tensor,
        (_raw_buffer(c), str(c.dtype).removeprefix("torch."), tuple(c.shape), requires_grad),
    )


def _raw_buffer(c: torch.Tensor) -> pickle.PickleBuffer:
    """The bytes of contiguous CPU tensor ``c`` as a buffer, without a copy.

    Torch tensors do not export the buffer protocol (and ``.numpy()`` needs numpy); a
    ctypes array over the data pointer does, and it keeps ``c`` alive for as long as
    the buffer is referenced.
    """
    nbytes = c.numel() * c.element_size()
    if not nbytes:
        return pickle.PickleBuffer(b"")
    arr = (ctypes.c_char * nbytes).from_address(c.data_ptr())
    arr._amesh_owner = c  # type: ignore[attr-defined]
    return pickle.PickleBuffer(arr)


def rebuild_tensor(
    buf: Any, dtype: str, shape: tuple[int, ...], requires_grad: bool
) -> torch.Tensor:
    """The receiving side of :func:`reduce_tensor`: a view of ``buf`` where it is writable."""
    import torch  # a tensor is being received: the receiver needs torch anyway

    view = memoryview(buf)
    if view.readonly:
        view = memoryview(bytearray(view))
    torch_dtype = getattr(torch, dtype)
    if view.nbytes == 0:
        t = torch.empty(shape, dtype=torch_dtype)
    else:
        t = torch.frombuffer(view, dtype=torch.uint8).view(torch_dtype).reshape(shape)
    if requires_grad:
        t.requires_grad_(True)
    return t
