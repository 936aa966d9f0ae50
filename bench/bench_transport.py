"""Transport throughput and latency between two processes.

Compares raw pynng (``asend``/``arecv``), the NNG transport (:class:`ExtTransport`) with
pynng's own I/O (its fallback where the C extension is not built) and with the extension's,
and :class:`StreamTransport` (length-prefixed frames over unix sockets, I/O on the event
loop):

- one-way: frames of 64 bytes per second, sent as fast as the link takes them and
  counted at the receiver from the first frame to the last, and the CPU time (all
  threads of the process) per frame at the receiver and at the sender;
- ping-pong: round trip of a 64-byte frame, median and 99th percentile, the CPU time
  per round trip of the pinger, and the send call: its wall time (median) and the CPU
  time of the calling thread (mean). A send that wakes other threads is often
  preempted by them, so its wall time exceeds its CPU time without it blocking.

CPU time per frame is the figure that holds up on a busy machine, where the rates
depend on what else runs.

Each case runs twice: with both processes (and all their threads) on CPU 0, which shows
the software's own cost, and unpinned, which adds the cross-CPU wake-ups of the machine.

Usage::

    python bench/bench_transport.py [--quick] [--json] [--backend asyncio|trio]
        [--impl pynng|nng|ext|stream ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

IMPLS = ["pynng", "nng", "ext", "stream"]
LABELS = {
    "pynng": "raw pynng arecv",
    "nng": "Ext, pynng I/O",
    "ext": "ExtTransport",
    "stream": "StreamTransport",
}
FRAME = b"x" * 64


# -- worker side (one process per role) ------------------------------------------------


def _run(main: Callable[[], Any], backend: str) -> None:
    import anyio

    options = {"use_uvloop": True} if backend == "asyncio" else {}
    anyio.run(main, backend=backend, backend_options=options)


def _transport(impl: str) -> Any:
    if impl == "ext":
        from amesh._transport._ext import ExtTransport

        return ExtTransport("abstract")
    if impl == "stream":
        from amesh._transport import StreamTransport

        return StreamTransport("abstract")
    from amesh._transport._ext import ExtTransport

    class PynngTransport(ExtTransport):
        accelerated = False  # as where the extension is not built

    return PynngTransport("abstract")


def _fresh() -> str:
    from amesh._transport._nng_pipes import fresh_address

    return fresh_address("abstract", "")


def _cpu() -> float:
    """CPU seconds used so far by every thread of this process."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _say(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


async def _wait_stdin_closed() -> None:
    import anyio.to_thread

    await anyio.to_thread.run_sync(sys.stdin.read)


async def sink(impl: str, n: int) -> None:
    """Receive ``n`` frames; report the rate from the first to the last."""
    import anyio

    if impl == "pynng":
        import pynng

        addr = _fresh()
        with pynng.Pull0(listen=addr, recv_buffer_size=1024) as sock:
            _say({"addr": addr})
            await sock.arecv()
            t0, c0 = time.perf_counter(), _cpu()
            for _ in range(n - 1):
                await sock.arecv()
            t1, c1 = time.perf_counter(), _cpu()
    else:
        t = _transport(impl)
        _say({"addr": t.address})
        count = 0
        t0 = t1 = c0 = c1 = 0.0
        done = anyio.Event()

        def deliver(frame: bytes, peer: str) -> None:
            nonlocal count, t0, t1, c0, c1
            count += 1
            if count == 1:
                t0, c0 = time.perf_counter(), _cpu()
            elif count == n:
                t1, c1 = time.perf_counter(), _cpu()
                done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(t.serve, deliver)
            await done.wait()
            tg.cancel_scope.cancel()
        t.close()
    _say({"rate": (n - 1) / (t1 - t0), "rx_cpu_us": (c1 - c0) / (n - 1) * 1e6})


async def source(impl: str, addr: str, n: int) -> None:
    """Send ``n`` frames as fast as the link takes them, then wait to be told to stop."""
    if impl == "pynng":
        import pynng

        with pynng.Push0(dial=addr, send_buffer_size=1024) as sock:
            c0 = _cpu()
            for _ in range(n):
                await sock.asend(FRAME)
            c1 = _cpu()
            await _wait_stdin_closed()
    else:
        t = _transport(impl)
        c0 = _cpu()
        for _ in range(n):
            await t.send(addr, FRAME)
        c1 = _cpu()
        await _wait_stdin_closed()
        t.close()
    _say({"tx_cpu_us": (c1 - c0) / n * 1e6})


async def echo(impl: str) -> None:
    """Send every frame back to the address in the first one."""
    import anyio

    if impl == "pynng":
        import pynng

        addr = _fresh()
        with pynng.Pull0(listen=addr) as pull:
            _say({"addr": addr})
            back = (await pull.arecv()).decode()
            with pynng.Push0(dial=back) as push:
                while True:
                    await push.asend(await pull.arecv())
    t = _transport(impl)
    _say({"addr": t.address})
    peer: list[str] = []
    async with anyio.create_task_group() as tg:

        def deliver(frame: bytes, sender: str) -> None:
            if not peer:
                peer.append(bytes(frame).decode())
            elif not t.try_send(peer[0], bytes(frame)):
                tg.start_soon(t.send, peer[0], bytes(frame))

        await t.serve(deliver)


async def ping(impl: str, addr: str, m: int) -> None:
    """Time ``m`` round trips through an echo process."""
    import math

    import anyio

    rtts: list[float] = []
    sends: list[float] = []
    send_cpu: list[float] = []
    warmup = max(m // 10, 10)
    c0 = 0.0
    if impl == "pynng":
        import pynng

        back = _fresh()
        with pynng.Pull0(listen=back) as pull, pynng.Push0(dial=addr) as push:
            await push.asend(back.encode())
            for i in range(warmup + m):
                if i == warmup:
                    c0 = _cpu()
                t0 = time.perf_counter()
                s0 = time.thread_time()
                await push.asend(FRAME)
                s1 = time.thread_time()
                t1 = time.perf_counter()
                await pull.arecv()
                if i >= warmup:
                    rtts.append(time.perf_counter() - t0)
                    sends.append(t1 - t0)
                    send_cpu.append(s1 - s0)
    else:
        t = _transport(impl)
        tx, rx = anyio.create_memory_object_stream[bytes](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.serve, lambda frame, peer: tx.send_nowait(frame))
            await t.send(addr, t.address.encode())
            for i in range(warmup + m):
                if i == warmup:
                    c0 = _cpu()
                t0 = time.perf_counter()
                s0 = time.thread_time()
                await t.send(addr, FRAME)
                s1 = time.thread_time()
                t1 = time.perf_counter()
                await rx.receive()
                if i >= warmup:
                    rtts.append(time.perf_counter() - t0)
                    sends.append(t1 - t0)
                    send_cpu.append(s1 - s0)
            tg.cancel_scope.cancel()
        t.close()
    c1 = _cpu()
    rtts.sort()
    _say(
        {
            "p50_us": statistics.median(rtts) * 1e6,
            "p99_us": rtts[int(len(rtts) * 0.99)] * 1e6,
            "rtt_cpu_us": (c1 - c0) / m * 1e6,
            "send_us": statistics.median(sends) * 1e6,
            "send_cpu_us": statistics.mean(send_cpu) * 1e6,
        }
    )


def worker(args: argparse.Namespace) -> None:
    from amesh._identity import adopt_key

    adopt_key(bytes.fromhex(sys.stdin.readline()))  # the driver's job key comes first
    if args.pin:
        os.sched_setaffinity(0, {0})  # before NNG starts its threads: they inherit it
    role = args.role
    if role == "sink":
        _run(lambda: sink(args.use, args.n), args.backend)
    elif role == "source":
        _run(lambda: source(args.use, args.addr, args.n), args.backend)
    elif role == "echo":
        _run(lambda: echo(args.use), args.backend)
    elif role == "ping":
        _run(lambda: ping(args.use, args.addr, args.n), args.backend)


# -- driver side -----------------------------------------------------------------------


def job_key() -> bytes:
    from amesh._identity import job_key

    return job_key()


def _spawn(role: str, impl: str, pin: bool, backend: str, **kw: Any) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", role, "--use", impl, "--backend", backend]
    if pin:
        cmd.append("--pin")
    for k, v in kw.items():
        cmd += [f"--{k}", str(v)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    # The roles are one job: they share the driver's key, sent down the stdin pipe.
    assert proc.stdin is not None
    proc.stdin.write(job_key().hex() + "\n")
    proc.stdin.flush()
    return proc


def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"worker {proc.args} exited with {proc.wait()}")
    return json.loads(line)  # type: ignore[no-any-return]


def _stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def one_way(impl: str, pin: bool, backend: str, n: int) -> dict[str, float]:
    rx = _spawn("sink", impl, pin, backend, n=n)
    tx = None
    try:
        addr = _read(rx)["addr"]
        tx = _spawn("source", impl, pin, backend, addr=addr, n=n)
        out = _read(rx)
        assert tx.stdin is not None
        tx.stdin.close()
        return {**out, **_read(tx)}
    finally:
        _stop(*(p for p in (tx, rx) if p is not None))


def ping_pong(impl: str, pin: bool, backend: str, m: int) -> dict[str, float]:
    ec = _spawn("echo", impl, pin, backend)
    pg = None
    try:
        addr = _read(ec)["addr"]
        pg = _spawn("ping", impl, pin, backend, addr=addr, n=m)
        return _read(pg)
    finally:
        if pg is not None:
            _stop(pg)
        ec.kill()
        ec.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short run")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--impl", choices=IMPLS, action="append", help="only these")
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--use", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        worker(args)
        return

    n, m = (20_000, 500) if args.quick else (200_000, 5_000)
    impls = args.impl or IMPLS
    results: list[dict[str, Any]] = []
    for pin in (True, False):
        for impl in impls:
            # arecv is two orders of magnitude slower: keep its run short.
            frames = n // 10 if impl == "pynng" else n
            flow = one_way(impl, pin, args.backend, frames)
            rtt = ping_pong(impl, pin, args.backend, m)
            results.append({"impl": impl, "pinned": pin, **flow, **rtt})

    if args.json:
        print(
            json.dumps({"backend": args.backend, "frames": n, "round_trips": m, "results": results})
        )
        return
    base = {r["pinned"]: r for r in results if r["impl"] == "nng"}
    print(f"backend {args.backend}, 64-byte frames; x: ratio against pynng's I/O (>1 is better)")
    cols = [
        ("one-way/s", "rate", "{:,.0f}", True),
        ("rx cpu us", "rx_cpu_us", "{:.1f}", False),
        ("tx cpu us", "tx_cpu_us", "{:.1f}", False),
        ("rtt p50 us", "p50_us", "{:.1f}", False),
        ("p99 us", "p99_us", "{:.1f}", None),
        ("rtt cpu us", "rtt_cpu_us", "{:.1f}", False),
        ("send us", "send_us", "{:.1f}", None),
        ("send cpu", "send_cpu_us", "{:.1f}", False),
    ]
    head = f"{'transport':<17}{'CPUs':<7}" + "".join(
        f"{name:>11}" + ("" if higher is None else f"{'x':>7}") for name, _, _, higher in cols
    )
    print(head)
    print("-" * len(head))
    for r in results:
        b = base.get(r["pinned"])
        line = f"{LABELS[r['impl']]:<17}{'CPU 0' if r['pinned'] else 'both':<7}"
        for _, key, fmt, higher in cols:
            line += f"{fmt.format(r[key]):>11}"
            if higher is not None and b is None:
                line += f"{'-':>7}"
            elif higher is not None:
                ratio = r[key] / b[key] if higher else b[key] / r[key]
                line += f"{ratio:>7.2f}"
        print(line)


if __name__ == "__main__":
    main()
