"""Actors for tests/test_liveness.py (importable by workers, so pickled by reference)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import anyio

from amesh import Actor, endpoint


def _one_long_sum(at_least: float) -> tuple[int, int, float]:
    """``sum(range(n))``, one C call that holds the GIL throughout, with ``n`` grown
    until one such call lasted ``at_least`` seconds: (n, the sum, how long it took)."""
    n = 1_000_000
    while True:
        start = time.perf_counter()
        total = sum(range(n))
        took = time.perf_counter() - start
        if took >= at_least:
            return n, total, took
        # aim past the mark from what this call took (x2 at least, x64 at most)
        n = int(n * min(max(1.3 * at_least / max(took, 1e-6), 2.0), 64.0))


class Busy(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def hold_the_gil(self, at_least: float) -> tuple[int, int, float]:
        """Run the event loop's thread in one GIL-holding C call of ``at_least`` s."""
        return _one_long_sum(at_least)

    @endpoint
    async def idle(self, seconds: float) -> None:
        """Let time pass on this worker, its event loop free (work, not synchronisation)."""
        await anyio.sleep(seconds)

    @endpoint
    def hang_in_kernel(self, seconds: float) -> None:
        """Sleep uninterruptibly in the kernel (state D) on the event loop's thread."""
        from amesh._native import _ext

        _ext._wait_uninterruptibly(seconds)

    @endpoint
    def digest(self, data: Any) -> tuple[int, str]:
        """The length and sha256 of a (large) argument."""
        view = memoryview(data)
        return view.nbytes, hashlib.sha256(view).hexdigest()

    @endpoint
    def memory(self) -> tuple[int, int]:
        """This process's address space and resident memory, in bytes."""
        found = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmSize", "VmRSS"):
                    found[key] = int(value.split()[0]) * 1024
        return found["VmSize"], found["VmRSS"]
