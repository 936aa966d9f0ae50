"""Property tests: the payload codec's out-of-band buffers, alone and inside frames.

Random nested values mix ordinary Python objects with buffers (bytes, bytearrays,
memoryviews, numpy arrays and torch tensors, contiguous or not) of sizes around the
thresholds that matter: 16 KiB (a pickle travels beside the envelope), 64 KiB (a buffer
leaves the pickle; a frame is sent as parts). They must come back equal, with the same
types and the same sharing, through :func:`_wire.dumps`/:func:`_wire.loads` and
through a whole frame: encoded, then delivered joined or through the stream reader.
"""

from __future__ import annotations

import contextlib
import pickle
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from amesh import _wire, configure
from amesh._transport._stream_framing import HEADER, HLEN, Buf, Reader, byte_view

pytestmark = pytest.mark.timeout(120)

KIB = 1024
OOB = _wire.OOB_THRESHOLD
#: Frames of at most this many bytes are encoded as one bytes object (``_wire``).
JOIN_LIMIT = 64 * KIB

EXAMPLES = settings(
    max_examples=150,
    deadline=None,  # a loaded CI machine must not fail on timing; the pytest timeout bounds it
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- values ------------------------------------------------------------------------------

sizes = st.one_of(
    st.integers(0, 300),
    st.sampled_from([_wire.INLINE_LIMIT, OOB, JOIN_LIMIT]).flatmap(
        lambda n: st.integers(n - 8, n + 8)
    ),
    st.integers(OOB, 160 * KIB),
    st.integers(0, 160 * KIB),
)


def randbytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@st.composite
def blobs(draw: st.DrawFn) -> bytes | bytearray | memoryview:
    raw = randbytes(draw(sizes), draw(st.integers(0, 2**32)))
    kind = draw(st.sampled_from(["bytes", "bytearray", "view", "strided view", "int view"]))
    event(f"blob: {kind}")
    if kind == "bytes":
        return raw
    if kind == "bytearray":
        return bytearray(raw)
    if kind == "view":
        return memoryview(raw)
    if kind == "strided view":
        return memoryview(bytearray(raw))[::2]
    return memoryview(bytearray(raw[: len(raw) - len(raw) % 4])).cast("i")


NUMPY_DTYPES = ["u1", "?", "<i2", ">i4", "<i8", "<f4", "<f8", "<c8", "i4,f8"]


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    n = draw(sizes) // dtype.itemsize
    raw = randbytes(n * dtype.itemsize, draw(st.integers(0, 2**32)))
    if dtype == np.bool_:
        raw = bytes(b & 1 for b in raw)
    flat = np.frombuffer(raw, dtype).copy()
    rows = draw(st.integers(1, 8))
    grid = flat[: rows * (n // rows)].reshape(rows, n // rows)
    layout = draw(
        st.sampled_from(["flat", "grid", "fortran", "transposed", "strided", "columns", "0-d"])
    )
    event(f"array: {layout}")
    arr = {
        "flat": flat,
        "grid": grid,
        "fortran": np.asfortranarray(grid),
        "transposed": grid.T,
        "strided": flat[::2],
        "columns": grid[:, ::3],
        "0-d": flat[0] if n else flat,
    }[layout]
    arr = np.asarray(arr)
    if draw(st.booleans()):
        arr = arr.copy(order="K")
        arr.flags.writeable = False
    return arr


TORCH_DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.bool,
]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = draw(sizes) // itemsize
    raw = bytearray(randbytes(n * itemsize, draw(st.integers(0, 2**32))))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    flat = (
        torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if n else torch.empty(0, dtype=dtype)
    )
    rows = draw(st.integers(1, 8))
    grid = flat[: rows * (n // rows)].reshape(rows, n // rows)
    layouts = ["flat", "grid", "transposed", "strided", "0-d"]
    if dtype.is_floating_point:
        layouts.append("requires grad")
    if dtype.is_complex:
        layouts.append("conjugate")
    layout = draw(st.sampled_from(layouts))
    event(f"tensor: {layout}")
    if layout == "grid":
        return grid
    if layout == "transposed":
        return grid.t()
    if layout == "strided":
        return flat[::2]
    if layout == "0-d":
        return flat[0].clone() if n else flat
    if layout == "requires grad":
        return grid.clone().requires_grad_(True)
    if layout == "conjugate":
        return flat.conj()
    return flat


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.complex_numbers(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.frozensets(st.integers(), max_size=3),
)


@st.composite
def values(draw: st.DrawFn) -> Any:
    """A nested value over a pool of buffers, some of which appear more than once."""
    pool = draw(st.lists(st.one_of(blobs(), arrays(), tensors()), max_size=5))
    # (by index: hypothesis hashes what it samples, and a writable memoryview refuses)
    refs = st.sampled_from(range(len(pool))).map(pool.__getitem__) if pool else st.nothing()
    top = st.lists(refs, min_size=1, max_size=3) if pool else st.just([])
    tree = draw(
        st.recursive(
            st.one_of(scalars, refs, refs),
            lambda kids: st.one_of(
                st.lists(kids, max_size=4),
                st.tuples(kids, kids),
                st.dictionaries(st.text(max_size=4) | st.integers(), kids, max_size=4),
            ),
            max_leaves=8,
        )
    )
    # Some of the pool shows up for sure (the tree may pick none of it).
    return [tree, *draw(top)] if draw(st.booleans()) else (tree, *draw(top))


# -- what must come back -----------------------------------------------------------------

BUFFERS = (bytes, bytearray, memoryview, np.ndarray, torch.Tensor)


def tensor_bytes(t: torch.Tensor) -> bytes:
    # A fresh tensor: contiguous() keeps odd strides where they do not matter (one
    # element, or none), and view() refuses those.
    c = torch.empty(t.numel(), dtype=t.dtype)
    c.copy_(t.detach().resolve_conj().resolve_neg().reshape(-1))
    return c.view(torch.uint8).numpy().tobytes()


def walk(value: Any) -> Iterator[Any]:
    """Every buffer in ``value``, depth first (the same order for a value and its copy)."""
    if isinstance(value, BUFFERS):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from walk(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from walk(v)


def assert_same(want: Any, got: Any) -> None:
    """``got`` is ``want`` after a trip through the codec: equal, and of the same type."""
    if isinstance(want, np.ndarray):
        # As plain pickle has it: numpy sends a non-contiguous array by value, which
        # comes back in native byte order.
        ref = pickle.loads(pickle.dumps(want, protocol=5))
        assert type(got) is np.ndarray
        assert (got.dtype, got.shape) == (ref.dtype, ref.shape)
        assert got.tobytes() == ref.tobytes()
    elif isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert got.requires_grad == want.requires_grad and not got.is_conj()
        assert tensor_bytes(got) == tensor_bytes(want)
    elif isinstance(want, memoryview):
        assert type(got) is bytes and got == want.tobytes()  # cloudpickle sends its bytes
    elif isinstance(want, list | tuple | dict):
        assert type(got) is type(want) and len(got) == len(want)
        if isinstance(want, dict):
            assert list(got) == list(want)
            for k in want:
                assert_same(want[k], got[k])
        else:
            for w, g in zip(want, got):
                assert_same(w, g)
    else:
        assert type(got) is type(want) and got == want


def assert_same_sharing(want: Any, got: Any) -> None:
    """A buffer that appears twice in ``want`` is one object in ``got``, and only then."""
    w, g = list(walk(want)), list(walk(got))
    assert len(w) == len(g)
    # CPython has one b"" and one bytes object per single byte: those are shared anyway.
    keep = [i for i, b in enumerate(g) if type(b) is not bytes or len(b) > 1]
    w, g = [w[i] for i in keep], [g[i] for i in keep]
    for i in range(len(w)):
        for j in range(i):
            assert (w[i] is w[j]) == (g[i] is g[j]), (i, j, type(w[i]))


def nbytes(buf: Any) -> int:
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return memoryview(buf).nbytes if not isinstance(buf, np.ndarray) else buf.nbytes


def unique(value: Any) -> list[Any]:
    return list({id(b): b for b in walk(value)}.values())


def check_payload(value: Any, p: _wire.Payload) -> None:
    """Every buffer of 64 KiB or more left the pickle, as one part per object."""
    bufs = unique(value)
    assert sorted(b.nbytes for b in p.buffers) == sorted(
        nbytes(b) for b in bufs if nbytes(b) >= OOB
    )
    skeleton = pickle.dumps(strip(value), protocol=5)
    small = sum(nbytes(b) for b in bufs if nbytes(b) < OOB)
    assert len(p.data) <= len(skeleton) + small + 1000 * len(bufs)
    assert p.nbytes == len(p.data) + sum(b.nbytes for b in p.buffers)


def strip(value: Any) -> Any:
    """``value`` without its buffers (what its pickle costs besides them)."""
    if isinstance(value, BUFFERS):
        return None
    if isinstance(value, list | tuple):
        return type(value)(strip(v) for v in value)
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items()}
    return value


def in_memory_of(obj: Any, frame: Buf) -> bool:
    """Whether ``obj`` (an array or tensor) lies in ``frame``'s memory."""
    base = np.frombuffer(frame, np.uint8).ctypes.data
    addr = obj.data_ptr() if isinstance(obj, torch.Tensor) else obj.ctypes.data
    return base <= addr < base + len(frame)


# -- properties --------------------------------------------------------------------------


@EXAMPLES
@given(values())
def test_dumps_loads_round_trip(value: Any) -> None:
    p = _wire.dumps(value)
    check_payload(value, p)
    got = _wire.loads(p.data, p.buffers)
    assert_same(value, got)
    assert_same_sharing(value, got)
    # A payload inside another (spawn arguments) keeps its buffers out of band, and
    # its pickle too where that is large.
    outer = _wire.dumps(("args", p))
    sent = [b.nbytes for b in p.buffers] + ([len(p.data)] if len(p.data) >= OOB else [])
    assert sorted(b.nbytes for b in outer.buffers) == sorted(sent)
    inner = _wire.loads(outer.data, outer.buffers)[1]
    assert_same(value, _wire.loads(inner.data, inner.buffers))


def envelope(kind: str, data: bytes, lengths: list[int]) -> _wire.Envelope:
    if kind == "reply":
        return _wire.Reply(7, 3, data, lengths)
    return _wire.Call("stream+ipc:///x", 9, 2, "a#1", "run", ["x"], [4], data, ["c"], lengths)


@EXAMPLES
@given(values(), st.sampled_from(["call", "reply"]), st.data())
def test_frames_round_trip(value: Any, kind: str, data: st.DataObject) -> None:
    p = _wire.dumps(value)
    payload, lengths, parts = p.inline, p.lengths, p.parts
    # The pickle travels in the envelope, or (from 16 KiB) as the first part.
    if len(p.data) < _wire.INLINE_LIMIT:
        assert payload == p.data and parts == p.buffers
    else:
        assert payload == b"" and parts == [p.data, *p.buffers]
    assert lengths == [memoryview(b).nbytes for b in parts]
    env = envelope(kind, payload, lengths)
    frame = _wire.encode(env, parts)
    if sum(lengths) <= JOIN_LIMIT:
        assert isinstance(frame, bytes)
    else:
        assert isinstance(frame, list) and frame[1:] == parts
        assert all(a is b for a, b in zip(frame[1:], parts))  # never copied
    event("frame in parts" if isinstance(frame, list) else "frame in one piece")
    event("pickle beside the envelope" if not payload else "pickle in the envelope")
    event(f"out-of-band buffers: {min(len(p.buffers), 3)}{'+' if len(p.buffers) >= 3 else ''}")

    def unpacked(received: Buf) -> Any:
        got_env, bufs = _wire.decode(received)
        assert got_env == env
        assert [len(b) for b in bufs] == lengths
        assert [bytes(b) for b in bufs] == [bytes(b) for b in parts]
        return _wire.loads(got_env.payload, bufs)

    # Delivered joined, as one bytes object (the in-memory and NNG transports).
    joined = b"".join(frame) if isinstance(frame, list) else frame
    got = unpacked(joined)
    assert_same(value, got)
    assert_same_sharing(value, got)

    # Delivered as the stream transport does: its parts written back to back after a
    # length, read in arbitrary pieces, cut out again by the reader.
    wire = [HEADER.pack(len(joined))]
    wire += [frame] if isinstance(frame, bytes) else [byte_view(part) for part in frame]
    stream = b"".join(wire)
    ends = sorted(
        {len(stream), *data.draw(st.lists(st.integers(0, len(stream)), max_size=8), label="ends")}
    )
    received: list[Buf] = []
    reader = Reader(len(joined), received.append)
    pos = 0
    for end in ends:
        while pos < end:
            buf = reader.get_buffer()
            n = min(len(buf), end - pos)
            buf[:n] = stream[pos : pos + n]
            pos += n
            reader.buffer_updated(n)
    (one,) = received
    got = unpacked(one)
    assert_same(value, got)
    assert_same_sharing(value, got)
    # Out-of-band arrays and tensors are views of the received frame, not copies.
    for want, obj in zip(walk(value), walk(got)):
        contiguous = (
            want.is_contiguous()
            if isinstance(want, torch.Tensor)
            else isinstance(want, np.ndarray)
            and (want.flags.c_contiguous or want.flags.f_contiguous)
        )
        if isinstance(want, np.ndarray | torch.Tensor) and contiguous and nbytes(want) >= OOB:
            assert in_memory_of(obj, one)
    assert len(stream) - HLEN == len(joined)


@contextlib.contextmanager
def shm_threshold(n: int) -> Iterator[None]:
    configure(shm_threshold=n)
    try:
        yield
    finally:
        configure(shm_threshold=None)


@settings(EXAMPLES, max_examples=60)
@given(values(), st.sampled_from([OOB, 100 * KIB]))
def test_shared_memory_round_trip(value: Any, threshold: int) -> None:
    with shm_threshold(threshold):
        try:
            p = _wire.dumps(value, shm=True)
            # Only buffers under the threshold stay in the frame.
            assert all(b.nbytes < threshold for b in p.buffers)
            got = _wire.loads(p.data, p.buffers)
            assert _wire.release_segments() == 0  # loading consumed every segment
        finally:
            _wire.release_segments()
    assert_same(value, got)
    assert_same_sharing(value, got)
