"""What TLS costs an NNG link: :class:`ExtTransport` over ``tcp`` against ``tls+tcp``.

Two transports in one process, over loopback (NNG does the socket I/O and the TLS on
its own threads; the event loop delivers):

- first frame: a new link's first frame, from the send to its delivery; for
  ``tls+tcp`` this includes the TCP connect and the TLS 1.3 handshake with both
  certificates checked (median of a few new pairs);
- round trip: a 64-byte frame there and back on an established link (median and 99th
  percentile);
- throughput: frames of 64 MiB sent back to back, counted at the receiver (MB/s).

Usage::

    python bench/bench_tls.py [--rounds N] [--big N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio

from amesh._transport import _tls
from amesh._transport._ext import ExtTransport

SMALL = b"x" * 64
BIG = 64 * 1024 * 1024


async def first_frame(scheme: str, pairs: int) -> float:
    """Median seconds from a new link's first send to its delivery."""
    took = []
    for _ in range(pairs):
        a, b = ExtTransport(scheme), ExtTransport(scheme)
        try:
            got = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.serve, lambda frame, peer, got=got: got.set())
                await anyio.wait_all_tasks_blocked()
                start = time.perf_counter()
                await a.send(b.address, SMALL)
                await got.wait()
                took.append(time.perf_counter() - start)
                tg.cancel_scope.cancel()
        finally:
            a.close()
            b.close()
    return statistics.median(took)


async def round_trips(a: ExtTransport, b: ExtTransport, rounds: int) -> list[float]:
    """Seconds per round trip of a small frame, a to b and back."""
    tx, rx = anyio.create_memory_object_stream[bytes](1)
    took = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.serve, lambda frame, peer: b.try_send(a.address, bytes(frame)))
        tg.start_soon(a.serve, lambda frame, peer: tx.send_nowait(bytes(frame)))
        for i in range(rounds + 100):  # the first 100 warm up (and connect)
            start = time.perf_counter()
            await a.send(b.address, SMALL)
            await rx.receive()
            if i >= 100:
                took.append(time.perf_counter() - start)
        tg.cancel_scope.cancel()
    return took


async def throughput(a: ExtTransport, b: ExtTransport, n: int) -> float:
    """MB/s of ``n`` frames of 64 MiB, a to b, from the first send to the last delivery."""
    frame = bytes(range(256)) * (BIG // 256)
    warm, done = anyio.Event(), anyio.Event()
    count = 0

    def deliver(view: Any, peer: str) -> None:
        nonlocal count
        assert len(view) == BIG
        count += 1
        if count == 1:
            warm.set()
        if count == n + 1:
            done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(b.serve, deliver)
        await a.send(b.address, frame)  # connects, and warms up
        await warm.wait()
        start = time.perf_counter()
        for _ in range(n):
            await a.send(b.address, frame)
        await done.wait()
        took = time.perf_counter() - start
        tg.cancel_scope.cancel()
    return n * BIG / took / 1e6


async def measure(scheme: str, rounds: int, big: int) -> dict[str, float]:
    first = await first_frame(scheme, 5)
    a, b = ExtTransport(scheme), ExtTransport(scheme)
    try:
        rtt = sorted(await round_trips(a, b, rounds))
        mbps = await throughput(a, b, big)
    finally:
        a.close()
        b.close()
    return {
        "first_frame_ms": first * 1e3,
        "rtt_median_us": statistics.median(rtt) * 1e6,
        "rtt_p99_us": rtt[int(len(rtt) * 0.99)] * 1e6,
        "throughput_MBps": mbps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5000, help="round trips (5000)")
    parser.add_argument("--big", type=int, default=8, help="64 MiB frames (8)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    start = time.perf_counter()
    _tls.material()  # made once per process: not part of any figure
    made_ms = (time.perf_counter() - start) * 1e3

    async def run() -> dict[str, dict[str, float]]:
        return {s: await measure(s, args.rounds, args.big) for s in ("tcp", "tls+tcp")}

    results = anyio.run(run, backend_options={"use_uvloop": True})
    if args.json:
        print(json.dumps({"certificates_ms": made_ms, **results}, indent=2))
        return
    print(f"certificates made in {made_ms:.1f} ms (once per process)")
    print(f"{'ExtTransport':<14}{'first frame':>14}{'RTT median':>14}{'RTT p99':>12}{'64 MiB':>14}")
    for scheme, r in results.items():
        print(
            f"{scheme:<14}{r['first_frame_ms']:>11.2f} ms{r['rtt_median_us']:>11.0f} µs"
            f"{r['rtt_p99_us']:>9.0f} µs{r['throughput_MBps']:>9.0f} MB/s"
        )


if __name__ == "__main__":
    main()
