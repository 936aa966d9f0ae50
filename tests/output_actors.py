"""Actors that write output in every way a worker can (tests/test_output.py)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from amesh import Actor, current_rank, endpoint


class Printer(Actor):
    def __init__(self, greet: str = "") -> None:
        if greet:
            print(greet)

    @endpoint
    def say(self, text: str) -> None:
        """Print ``text``, the same on every rank."""
        print(text)

    @endpoint
    def say_mine(self, text: str) -> int:
        """Print ``text`` and this rank; the rank."""
        rank = current_rank().rank
        print(f"{text} {rank}")
        return rank

    @endpoint
    def complain(self, text: str) -> None:
        print(text, file=sys.stderr)

    @endpoint
    def log(self, name: str, text: str, level: int = logging.WARNING) -> None:
        logging.getLogger(name).log(level, text)

    @endpoint
    def warn(self, text: str) -> None:
        warnings.warn(text, UserWarning, stacklevel=1)

    @endpoint
    def raw_fd(self, data: bytes) -> None:
        os.write(1, data)

    @endpoint
    def c_write(self, text: str) -> int:
        """Write through C's stdout; returns how many bytes C's buffer still holds."""
        import ctypes

        libc = ctypes.CDLL(None)
        stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.fputs(text.encode(), stdout)
        fpending = getattr(libc, "__fpending")  # (a name that a class would mangle)
        fpending.restype = ctypes.c_size_t
        return int(fpending(stdout))

    @endpoint(thread=True)
    def say_in_thread(self, text: str) -> None:
        print(text)

    @endpoint
    def flood(self, n: int) -> None:
        for i in range(n):
            print(f"line {i}")

    @endpoint
    def say_and_stay(self, text: str) -> None:
        """Print without a newline: the line ends at exit."""
        print(text, end="")


class Goodbye(Actor):
    """Prints from ``__cleanup__``, right before its process exits."""

    def __init__(self, text: str) -> None:
        self.text = text

    @endpoint
    def ping(self) -> int:
        return os.getpid()

    def __cleanup__(self) -> None:
        print(self.text)
