"""Type stubs for the C extension ``amesh._ext`` (ext/_amesh_ext.c); written by hand."""

from collections.abc import Iterable
from typing import Final, final

from typing_extensions import Buffer

#: The NNG functions that :func:`bind` needs, by their C names.
NNG_FUNCTIONS: Final[tuple[str, ...]]
NNG_EAGAIN: Final[int]
NNG_ECLOSED: Final[int]

def finalize() -> None:
    """Stop every Receiver and make no more NNG calls; run before pynng's nng_fini()."""

class NngError(OSError):
    """An NNG error; ``errno`` is NNG's error number, ``strerror`` its text."""

def bind(functions: dict[str, int], /) -> None:
    """Set the addresses of :data:`NNG_FUNCTIONS` in the loaded NNG; once per process.

    Raises:
        KeyError: a function is missing.
        RuntimeError: already bound to other addresses.
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
