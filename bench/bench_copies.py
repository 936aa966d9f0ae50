"""What a large ``bytes`` costs to move through shared memory: the copies and pages.

A ``bytes`` payload between two processes of one host goes into a shared-memory
segment (a tmpfs file) and out of it, one copy each way. This measures the parts
such a copy can be made of, each the best of ``--rounds``, for ``--mib`` MiB:

- into fresh pages against into pages the process has: reading the file into a new
  ``bytes`` (whose pages the kernel faults in and zeroes one by one) or into a buffer
  that was used before;
- through the file against through a mapping that stays: ``pread``/``pwrite`` of the
  tmpfs file against a ``memcpy`` out of or into a mapping of it made once;
- amesh's own path (``amesh._wire``): loading a pooled segment the first time (a new
  mapping, a new object) and again (the mapping and the object it kept).

The ratios are what matter: on the 2-CPU VM of bench/README.md fresh pages cost 3
times the copy, and the tmpfs read or write 3 times a ``memcpy``.

Run: ``.venv/bin/python bench/bench_copies.py [--mib 16] [--rounds 10]``. Leaves no file
behind.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from collections.abc import Callable

MiB = 1 << 20


def best(fn: Callable[[], object], rounds: int) -> float:
    """The shortest of ``rounds`` runs of ``fn`` after a first one, in seconds."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    n = args.mib * MiB
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="amesh-bench-copies-", dir=where)
    rows: list[tuple[str, float]] = []
    try:
        os.write(fd, os.urandom(n))
        used = bytearray(n)  # pages this process has
        src = bytearray(os.urandom(n))
        mem = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mem)

        def into_used() -> None:
            view_of_used = memoryview(used)
            view_of_used[:] = view

        def into_mapping() -> None:
            view[:] = src

        r = args.rounds
        rows += [
            ("read the file into a new bytes (fresh pages)", best(lambda: os.pread(fd, n, 0), r)),
            ("read the file into a buffer used before", best(lambda: os.preadv(fd, [used], 0), r)),
            ("write the file from a buffer", best(lambda: os.pwrite(fd, src, 0), r)),
            ("memcpy out of a mapping that stays", best(into_used, r)),
            ("memcpy into a mapping that stays", best(into_mapping, r)),
        ]
        view.release()
        mem.close()
        rows += _wire_rows(n, args.rounds)
    finally:
        os.close(fd)
        os.unlink(path)
    print(f"{args.mib} MiB, best of {args.rounds}")
    print("| copy | ms | GB/s |\n|---|---:|---:|")
    for name, t in rows:
        print(f"| {name} | {t * 1e3:.2f} | {n / t / 1e9:.2f} |")


def _wire_rows(n: int, rounds: int) -> list[tuple[str, float]]:
    """amesh's load of a pooled segment: the first time, and with what it kept."""
    from amesh import _wire

    data = os.urandom(n)

    def first() -> None:  # nothing kept: a new mapping, a new bytes object
        _wire.release_segments()
        p = _wire.dumps(data, shm=True)
        t = time.perf_counter()
        _wire.loads(p.data, p.buffers)
        first_times.append(time.perf_counter() - t)

    def again() -> None:  # the segment, its mapping and the object come back
        p = _wire.dumps(data, shm=True)
        t = time.perf_counter()
        got = _wire.loads(p.data, p.buffers)
        again_times.append(time.perf_counter() - t)
        del got

    first_times: list[float] = []
    again_times: list[float] = []
    for _ in range(rounds + 1):
        first()
    _wire.release_segments()
    for _ in range(rounds + 1):
        again()
    _wire.release_segments()
    return [
        ("amesh: load a pooled segment, nothing kept", min(first_times[1:])),
        ("amesh: load it again (mapping and object kept)", min(again_times[1:])),
    ]


if __name__ == "__main__":
    main()
