"""Property tests: the stream transport's frame reader under arbitrary read boundaries.

A byte stream of frames (4-byte little-endian length, then the bytes) is fed to a
:class:`Reader` the way the event loop feeds a :class:`asyncio.BufferedProtocol`: copy
at most ``len(get_buffer())`` bytes into that buffer, then ``buffer_updated(n)``. Where
the reads end is up to the test: anywhere in the stream, on and around frame headers,
one byte at a time, or many frames at once.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable, Iterable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from amesh._native import _ext
from amesh._transport._stream_framing import (
    CHUNK,
    HEADER,
    HLEN,
    MAX_SIZE,
    SMALL,
    AnyReader,
    BadStream,
    Buf,
    Reader,
    c_reader,
    cut_frames_py,
)

pytestmark = pytest.mark.timeout(120)

KIB = 1024
#: Sizes where the reader changes strategy: frames cut out of its buffer or given one of
#: their own (SMALL), the buffer's end (CHUNK), and a header that straddles either.
EDGES = sorted(
    {SMALL - HLEN, SMALL, SMALL + HLEN, CHUNK - SMALL - HLEN, CHUNK - 2 * HLEN, CHUNK - HLEN}
    | {CHUNK, CHUNK + HLEN, 2 * CHUNK}
)

EXAMPLES = settings(
    max_examples=200,
    deadline=None,  # a loaded CI machine must not fail on timing; the pytest timeout bounds it
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def frame_size(most: int = 300 * KIB) -> st.SearchStrategy[int]:
    """Sizes up to ``most``: tiny ones, ones near the reader's thresholds, any."""
    edges = [n for n in EDGES if n <= most] or [most]
    near = st.sampled_from(edges).flatmap(lambda n: st.integers(max(0, n - 6), min(n + 6, most)))
    return st.one_of(st.integers(0, min(40, most)), near, st.integers(0, most))


def make_frames(sizes: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def encode(frames: Iterable[bytes]) -> bytes:
    return b"".join(HEADER.pack(len(f)) + f for f in frames)


@st.composite
def cuts(draw: st.DrawFn, frames: list[bytes]) -> list[int]:
    """Where reads end in the stream of ``frames``: sorted offsets, the end included."""
    total = sum(HLEN + len(f) for f in frames)
    starts = [0]
    for f in frames:
        starts.append(starts[-1] + HLEN + len(f))
    marks = starts + [s + HLEN for s in starts[:-1]]  # headers, and the bodies after them
    near = draw(st.lists(st.tuples(st.sampled_from(marks), st.integers(-HLEN, HLEN)), max_size=30))
    anywhere = draw(st.lists(st.integers(0, total), max_size=20))
    # A run of one-byte reads somewhere (through a header, most likely).
    first = max(0, draw(st.sampled_from(marks)) + draw(st.integers(-8, 0)))
    run = range(first, first + draw(st.integers(0, 24)))
    return sorted({total} | {min(max(a + b, 0), total) for a, b in near} | set(anywhere) | set(run))


def feed(reader: AnyReader, stream: bytes, ends: list[int]) -> None:
    """Feed ``stream`` with reads that end at each of ``ends``, never writing past the
    buffer the reader offers (so a read may end earlier, and the rest come next)."""
    pos = 0
    for end in ends:
        while pos < min(end, len(stream)):
            buf = reader.get_buffer()
            assert len(buf) > 0  # asyncio refuses an empty buffer
            n = min(len(buf), end - pos)
            buf[:n] = stream[pos : pos + n]
            pos += n
            reader.buffer_updated(n)


Cut = Callable[[bytearray, int, int, int], tuple[list[bytes], int, int]]
#: Every test runs with the C extension's reader (None here), the Python reader with
#: the extension's frame cutter, and the pure-Python fallback.
CUTTERS = pytest.mark.parametrize(
    "cut", [None, _ext.cut_frames, cut_frames_py], ids=["c-reader", "c-cut", "python"]
)


def new_reader(max_frame: int, emit: Callable[[Buf], None], cut: Cut | None) -> AnyReader:
    """The one place these tests make a reader (should its constructor change)."""
    if cut is None:
        reader = c_reader(max_frame, emit)
        assert reader is not None
        return reader
    return Reader(max_frame, emit, cut)


@CUTTERS
@EXAMPLES
@given(st.lists(frame_size(), max_size=12), st.integers(0, 2**32), st.data())
def test_frames_come_out_whole_and_in_order(
    cut: Cut | None, sizes: list[int], seed: int, data: st.DataObject
) -> None:
    frames = make_frames(sizes, seed)
    stream = encode(frames)
    ends = data.draw(cuts(frames), label="read ends")
    event("frames over SMALL" if any(n > SMALL for n in sizes) else "small frames only")
    got: list[tuple[Buf, bytes]] = []
    reader = new_reader(max(sizes, default=0), lambda f: got.append((f, bytes(f))), cut)
    feed(reader, stream, ends)
    # Each frame as it was delivered, and still now: no frame's memory is reused.
    assert [seen for _, seen in got] == frames
    assert [bytes(f) for f, _ in got] == frames
    # Nothing is left half-read: the reader offers its whole buffer again.
    assert len(reader.get_buffer()) == CHUNK


#: Offsets in the reader's buffer where a header that lands there (give or take a few
#: bytes) leaves just too little room, or just enough, for a frame of about SMALL.
TIGHT = [CHUNK - SMALL - HLEN, CHUNK - SMALL, CHUNK - HLEN, CHUNK, SMALL]


@CUTTERS
@EXAMPLES
@given(
    st.sampled_from(TIGHT),
    st.integers(-HLEN - 1, HLEN + 1),
    st.one_of(
        st.integers(SMALL - HLEN, SMALL + 1),
        st.integers(SMALL - 2 * HLEN, SMALL + 2 * HLEN),
        frame_size(),
    ),
    st.lists(frame_size(), max_size=3),
    st.data(),
)
def test_frames_that_straddle_the_buffer_end(
    cut: Cut | None, where: int, off: int, second: int, more: list[int], data: st.DataObject
) -> None:
    # The first read takes the first frame whole and stops inside the second, whose
    # header starts ``where + off`` bytes into the reader's buffer.
    head = where + off
    frames = make_frames([head - HLEN, second, *more], head)
    stream = encode(frames)
    ends = data.draw(st.lists(st.integers(head + 1, len(stream)), min_size=1), label="ends")
    got: list[bytes] = []
    reader = new_reader(max(len(f) for f in frames), lambda f: got.append(bytes(f)), cut)
    feed(reader, stream, sorted({*ends, len(stream)}))
    assert got == frames


@CUTTERS
def test_every_tight_spot_at_the_buffer_end(
    cut: Cut | None,
) -> None:
    """The cases above, all of them: a header at each offset near a TIGHT spot, a frame
    of about SMALL after it, the first read ending a little way into that frame."""
    for where in TIGHT:
        for head in range(where - HLEN - 1, where + HLEN + 2):
            for second in range(SMALL - HLEN - 1, SMALL + HLEN + 2):
                frames = make_frames([head - HLEN, second, 3], head + second)
                stream = encode(frames)
                for first_read in (head + 1, head + HLEN - 1, head + HLEN, head + HLEN + 1):
                    got: list[bytes] = []

                    def emit(f: Buf, got: list[bytes] = got) -> None:
                        got.append(bytes(f))

                    reader = new_reader(2 * CHUNK, emit, cut)
                    feed(reader, stream, [first_read, len(stream)])
                    assert got == frames, (head, second, first_read)


@CUTTERS
@EXAMPLES
@given(st.lists(frame_size(100 * KIB), min_size=1, max_size=10), st.data())
def test_no_frame_after_stopped(cut: Cut | None, sizes: list[int], data: st.DataObject) -> None:
    frames = make_frames(sizes, 7)
    stop_after = data.draw(st.integers(1, len(frames)), label="stop after")
    got: list[bytes] = []
    reader: AnyReader

    def emit(frame: Buf) -> None:
        got.append(bytes(frame))
        if len(got) == stop_after:
            reader.stopped = True  # as a protocol does once its connection is lost

    reader = new_reader(100 * KIB, emit, cut)
    stream = encode(frames)
    pos = 0
    for end in data.draw(cuts(frames), label="read ends"):
        while pos < end and not reader.stopped:
            buf = reader.get_buffer()
            n = min(len(buf), end - pos)
            buf[:n] = stream[pos : pos + n]
            pos += n
            reader.buffer_updated(n)
    assert got == frames[:stop_after]


@CUTTERS
@EXAMPLES
@given(
    st.integers(0, 200 * KIB).flatmap(
        lambda limit: st.tuples(
            st.just(limit),
            st.lists(frame_size(limit) | st.just(limit), max_size=6),
            st.one_of(
                st.integers(limit + 1, limit + 2 * CHUNK),
                st.sampled_from([2**31, MAX_SIZE]),
            ),
        )
    ),
    st.integers(0, 3 * CHUNK),
    st.data(),
)
def test_an_oversize_header_is_refused_before_its_frame_is_allocated(
    cut: Cut | None, good: tuple[int, list[int], int], after: int, data: st.DataObject
) -> None:
    limit, sizes, bad = good
    frames = make_frames(sizes, bad)
    # The bad header, then some of the frame it announces (or not), then more frames.
    stream = encode(frames) + HEADER.pack(bad) + bytes(min(after, bad)) + encode(frames)
    header_end = len(encode(frames)) + HLEN
    ends = data.draw(cuts(frames), label="read ends")
    ends += data.draw(st.lists(st.integers(header_end, len(stream)), max_size=4), label="after")
    got: list[bytes] = []
    reader = new_reader(limit, lambda f: got.append(bytes(f)), cut)
    pos = 0
    for end in sorted({*ends, len(stream)}):
        while pos < end:
            buf = reader.get_buffer()
            n = min(len(buf), end - pos)
            buf[:n] = stream[pos : pos + n]
            if pos + n < header_end:
                reader.buffer_updated(n)
                pos += n
                continue
            # This read completes the bad header (whole or in pieces, with whatever
            # else it carries): it raises, and allocates nothing like ``bad`` bytes.
            tracemalloc.start()
            try:
                with pytest.raises(BadStream, match=f"{bad} bytes"):
                    reader.buffer_updated(n)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert got == frames
            # (what the frames delivered in this read, and their copies here, take)
            bound = 4 * CHUNK + max(sizes, default=0)
            if bad > bound:
                assert peak < bound
            return
    raise AssertionError("the stream ended before the bad header")
