"""Type stubs for the C extension ``amesh._ext`` (ext/, a file per concern); written by hand."""

from collections.abc import Callable, Iterable
from typing import Any, Final, final

from typing_extensions import Buffer

#: The NNG functions that :func:`bind` needs, by their C names.
NNG_FUNCTIONS: Final[tuple[str, ...]]
NNG_EAGAIN: Final[int]
NNG_ECLOSED: Final[int]

def finalize() -> None:
    """Stop every Receiver and NNG :class:`Beat` and make no more NNG calls; run at
    exit, before the NNG sockets are closed."""

def exit_when_closed(fd: int, /) -> None:
    """Start a thread of its own (no Python, every signal blocked) that reads ``fd``
    until end of file or an error, then ends the process with ``_exit(1)``.

    Raises:
        ValueError: ``fd`` is negative.
        OSError: the thread could not be started.
    """

def set_parent_death_signal(sig: int, /) -> None:
    """Have the kernel send this process ``sig`` when the thread that forked it ends
    (``prctl(PR_SET_PDEATHSIG)``); 0 sends none.

    Raises:
        ValueError: ``sig`` is not a signal number.
        OSError: the system call failed, or this is not Linux.
    """

def line_buffer_stdout() -> None:
    """Make C's ``stdout`` line-buffered (before anything is written to it).

    Raises:
        OSError: ``setvbuf`` refused.
    """

def flush_stdio() -> None:
    """``fflush(NULL)``: write what C's stdio streams hold, the GIL released."""

#: Whether :func:`immortalize` does anything here (CPython 3.12 or 3.13, with the GIL).
CAN_IMMORTALIZE: bool

def immortalize(objects: list[object], /) -> int:
    """Make each object of ``objects`` immortal (PEP 683: its reference count is never
    written again), and what each refers to that the collector does not track
    (strings, numbers, code objects with their constants, untracked tuples and
    dicts), and give each type of the list a version tag (the key of its attribute
    cache, which a child's first look-up would otherwise write). Returns how many were
    not immortal before; 0 where :data:`CAN_IMMORTALIZE` is false. They are never
    freed: for a zygote's heap, made once before it forks, so that its children do not
    copy the pages of the reference counts of what they use.

    Raises:
        TypeError: ``objects`` is not a list.
    """

class NngError(OSError):
    """An NNG error; ``errno`` is NNG's error number, ``strerror`` its text."""

def bind(functions: dict[str, int], /) -> None:
    """Set the addresses of :data:`NNG_FUNCTIONS` in the loaded NNG; once per process.

    Raises:
        KeyError: a function is missing.
        RuntimeError: already bound to other addresses.
    """

def cut_frames(buffer: Buffer, start: int, end: int, limit: int, /) -> tuple[list[bytes], int, int]:
    """Cut the whole frames (a 4-byte little-endian length, then that many bytes) out
    of ``buffer[start:end]``, each into a ``bytes`` of its own.

    Stops at the first frame that is incomplete or announces more than ``limit``
    bytes.

    Returns:
        ``(frames, pos, size)``: the frames, where the rest starts (``end`` if nothing
        is left), and the length the next frame announces (-1 if fewer than 4 bytes
        are left).

    Raises:
        ValueError: ``start``/``end`` do not lie within the buffer.
    """

def pread_bytes(fd: int, size: int, spare: list[bytes], /) -> tuple[bytes, bool]:
    """The first ``size`` bytes of file ``fd`` (read from offset 0) as ``bytes``.

    A ``bytes`` of exactly ``size`` bytes in ``spare`` whose only reference is the
    list's is filled again and returned, its cached hash reset: its pages are in
    memory already, where a new object's are faulted in and zeroed as the read
    fills them. Nobody can see the change, since nobody else holds the object. What
    goes into ``spare`` is the caller's.

    Returns:
        ``(data, reused)``: the bytes, and whether they are an object of ``spare``.

    Raises:
        OSError: the read failed.
        RuntimeError: the file holds fewer than ``size`` bytes.
        ValueError: ``fd`` or ``size`` is negative.
    """

def copy_bytes(buffer: Buffer, size: int, spare: list[bytes], /) -> tuple[bytes, bool]:
    """:func:`pread_bytes` out of ``buffer`` (a mapping of the file): its first
    ``size`` bytes, in an object of ``spare`` that nothing else references if there is
    one, copied with the GIL released.

    Returns:
        ``(data, reused)``: the bytes, and whether they are an object of ``spare``.

    Raises:
        ValueError: ``size`` is negative or larger than ``buffer``.
    """

def send(socket: int, data: Buffer | Iterable[Buffer], /) -> bool:
    """Copy ``data`` into an NNG message and send it on ``socket`` without waiting.

    ``data`` is one buffer, or an iterable of buffers copied back to back.

    Returns:
        True if NNG took the message, False if the socket cannot take it now.

    Raises:
        NngError: any other NNG failure (``NNG_ECLOSED`` for a closed socket).
    """

@final
class Message(Buffer):
    """One received NNG message; ``memoryview(msg)`` is its body (read-only, no copy)."""

    @property
    def pipe(self) -> int:
        """The id of the NNG pipe (connection) the message came in on."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __len__(self) -> int: ...

@final
class Receiver:
    """A receive kept posted on an NNG socket, completing into a bounded queue.

    Completions are queued on NNG's threads without the GIL; :meth:`fileno` becomes
    readable when the queue turns non-empty or receiving stops. At most ``capacity``
    messages wait in the queue; beyond that NNG's own buffers apply back-pressure.
    """

    def __init__(self, socket: int, capacity: int) -> None: ...
    def start(self) -> None:
        """Post the first receive (once)."""

    def fileno(self) -> int:
        """The fd to wait on for readability (an eventfd on Linux, else a pipe)."""

    def drain(self, max: int, /) -> list[Message]:
        """Take up to ``max`` queued messages, oldest first.

        Raises:
            NngError: the queue is empty and receiving stopped (``NNG_ECLOSED`` after
                :meth:`close` or when the socket closed).
        """

    def close(self) -> None:
        """Stop receiving, wait for a running completion, free queued messages.

        Idempotent; leaves :meth:`fileno` readable so that a waiter wakes up.
        """

@final
class Beat:
    """Heartbeats from a thread of the extension that never takes the GIL.

    The thread writes ``frame`` (the bytes as they go on the wire) every ``period``
    seconds, the first at once: to a connected stream socket ``fd`` (which the Beat
    owns from the call on, and closes, even when the call fails), or to the NNG socket
    ``socket`` (non-blocking, needs :func:`bind`). Part of a frame that a full socket
    did not take is written before the next frame; a beat that finds the socket full
    is dropped. A send that fails otherwise ends the thread: :attr:`broken`.

    With ``watch_tid`` (a thread of this process, Linux) and ``hung_after`` > 0, each
    beat first reads that thread's state from ``/proc``; once it was in uninterruptible
    sleep (state D) in every look for more than ``hung_after`` seconds, beats are
    withheld until it is not.

    Raises:
        ValueError: neither or both of ``fd`` and ``socket``, an empty frame, or a
            period out of range.
        RuntimeError: ``socket`` before :func:`bind` or after :func:`finalize`.
        OSError: the thread cannot be started.
    """

    def __init__(
        self,
        frame: Buffer,
        period: float,
        *,
        fd: int = -1,
        socket: int = 0,
        watch_tid: int = 0,
        hung_after: float = 0.0,
    ) -> None: ...
    @property
    def sent(self) -> int:
        """Beats written (or begun: the rest goes before the next) so far."""

    @property
    def dropped(self) -> int:
        """Beats dropped because the socket could not take them at once."""

    @property
    def withheld(self) -> int:
        """Beats not sent because the watched thread was hung in the kernel."""

    @property
    def hung(self) -> bool:
        """Whether the last beat was withheld (the watched thread is hung)."""

    @property
    def error(self) -> int:
        """0, or the errno (the NNG error, for an NNG socket) of the send that broke."""

    @property
    def broken(self) -> bool:
        """Whether a send failed for good: the thread has ended; connect again."""

    @property
    def watching(self) -> bool:
        """Whether the state of ``watch_tid`` is looked at."""

    def close(self) -> None:
        """Stop the thread, wait until it has ended, close ``fd``; idempotent."""

def _wait_uninterruptibly(seconds: float, /) -> None:
    """For tests: the calling thread sleeps ``seconds`` in the kernel in state D (as
    the parent of a vfork child that sleeps; the child dies with this process), with
    the GIL released. Linux only."""

class FrameReader:
    """One inbound stream connection's length-prefixed frames, each handed to
    ``emit(frame)``: :class:`amesh._transport._stream_framing.Reader` in C, fed the way
    an event loop feeds an :class:`asyncio.BufferedProtocol` (a subclass that also
    inherits ``BufferedProtocol`` is one, and its reads run no Python code).

    Args:
        max_frame: the largest frame accepted.
        emit: gets each whole frame: ``bytes`` up to 16 KiB, else the memoryview that
            ``frame_memory(size)`` gave, which the socket read into.
        frame_memory: writable memory for a large frame (``bad_stream`` if none).
        bad_stream: raised (with a message) for a frame above ``max_frame``.
        fail: if given, called with the message instead of raising.
    """

    #: the connection is gone: emit no more frames
    stopped: bool

    def __init__(
        self,
        max_frame: int,
        emit: Callable[[bytes | memoryview], object],
        frame_memory: Callable[[int], memoryview],
        bad_stream: type[Exception],
        fail: Callable[[str], object] | None = None,
    ) -> None: ...
    def stop(self) -> None:
        """The connection is gone: emit no more frames, and let go of the memory of a
        large frame being read and of ``emit`` and ``fail`` (which lead back to the
        connection), now, not when this reader is collected."""

    def get_buffer(self, sizehint: int = -1, /) -> memoryview:
        """Where the next read goes."""

    def buffer_updated(self, nbytes: int, /) -> None:
        """Account ``nbytes`` read into :meth:`get_buffer`; emit the frames they
        complete.

        Raises:
            Exception: ``bad_stream`` (without ``fail``), or what ``emit`` raised.
        """

class FrameWriter:
    """The write side of one outbound stream connection on asyncio, for frames of up
    to ``small`` bytes: a protocol that inherits it sets :attr:`fd`,
    :attr:`transport`, :attr:`call_soon` and :attr:`end_turn` once connected.

    :meth:`send` puts a frame's 4-byte length in front of it and writes both at once
    (one ``writev``) when this process took in messages since this connection's last
    frame written at once (a :class:`FrameReader`'s read, a :class:`Receiver`'s
    drain); else the frame is copied into a
    batch, which goes in one write at the end of the loop's turn (the first frame
    batched calls ``call_soon(end_turn)``; ``end_turn`` calls :meth:`finish_turn`), or
    at once when it holds ``batch_bytes``. What the kernel does not take goes to
    ``transport.write()``.

    Args:
        small: the largest frame :meth:`send` takes.
        batch_bytes: a batch this large is written at once.
    """

    #: the socket's file descriptor; -1: none
    fd: int
    #: the connection's asyncio transport (None: none)
    transport: Any
    #: the loop's ``call_soon``
    call_soon: Callable[[Callable[[], object]], object] | None
    #: called by the loop at the end of a turn with a batch; calls :meth:`finish_turn`
    end_turn: Callable[[], object] | None
    #: the transport asked us to stop writing
    paused: bool
    #: whether frames may wait for the end of the turn (False: each goes at once)
    batching: bool

    def __init__(self, small: int, batch_bytes: int) -> None: ...
    def send(self, frame: object, /) -> int:
        """1: the frame is written or batched; 0: not taken, nothing done (not
        ``bytes``, larger than ``small``, or the connection paused, gone or closing);
        -1: taken, but the connection broke (the transport is aborted)."""

    def flush(self) -> bool:
        """Write what is batched now; False if the connection broke or is gone (what
        waited is lost)."""

    def finish_turn(self) -> bool:
        """The loop's turn is over (``end_turn`` runs): :meth:`flush`."""

    def drop(self) -> None:
        """The connection is gone: forget what is batched, and let go of the batch's
        memory, the transport and the loop's hooks; :meth:`send` takes nothing more."""

    @property
    def batched(self) -> int:
        """Bytes batched, waiting."""

@final
class EnvelopeDecoder:
    """A received frame's envelope and buffers, in one C call (``amesh._wire.try_decode``).

    ``preamble`` is the magic bytes and the protocol version (a little-endian u32 with
    the envelope's length follows them in a frame), ``decode`` msgspec's
    ``Decoder.decode``, ``checks`` what to run on an envelope of each type (``""`` or
    what is wrong). ``decode`` must not keep the view of the frame it is given.

    Raises:
        ValueError: the preamble is not 1 to 16 bytes.
    """

    def __init__(
        self,
        preamble: Buffer,
        decode: Callable[[memoryview], Any],
        checks: dict[type, Callable[[Any], str]],
    ) -> None: ...
    def __call__(self, frame: Buffer, /) -> tuple[Any, list[memoryview]] | None:
        """``(envelope, views of its out-of-band buffers)`` of a well-formed frame;
        None for anything else (the caller's Python decoder then says what is wrong).

        Raises:
            RuntimeError: ``decode`` kept the view of the frame (it is released).
        """

@final
class EnvelopeEncoder:
    """The frame of an envelope with no out-of-band buffers, in one C call
    (``amesh._wire.encode_envelope``): ``preamble``, the length of ``encode(env)`` as a
    little-endian u32, then ``encode(env)`` (msgspec's ``Encoder.encode``).

    Raises:
        ValueError: the preamble is not 1 to 16 bytes.
    """

    def __init__(self, preamble: Buffer, encode: Callable[[Any], bytes]) -> None: ...
    def __call__(self, env: object, /) -> bytes:
        """The frame of ``env``.

        Raises:
            TypeError: ``encode`` did not return bytes.
            Exception: what ``encode`` raised.
        """
