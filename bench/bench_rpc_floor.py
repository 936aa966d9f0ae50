"""What a round trip costs in plain Python on this machine: the smallest RPC that does
what amesh's does per message, and nothing more.

Two processes over a unix socket pair, uvloop on both sides, one ``asyncio.Protocol``
each. A call is a msgspec envelope (call id, actor, method, pickled arguments) behind
a 4-byte length; the worker decodes it, unpickles the arguments, calls the method,
pickles the result and writes the reply; the caller resolves a future per call. No
authentication, flow control, supervision, cancellation, output capture or
debugging, which amesh has.

It prints the sequential round trip (one call at a time) and the pipelined rate (64
calls in flight) with both sides' CPU per call, for a 64-byte ``bytes`` argument, so
that amesh's ``call_one`` can be read against it (``compare.py``'s uvloop floor is a
bare echo, with no envelope, pickling or future).

Run: ``taskset -c 0 .venv/bin/python bench/bench_rpc_floor.py [--seconds 2]`` (pinned,
as compare.py's runs are; unpinned the two processes run on different CPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import socket
import struct
import time
from typing import Any

import msgspec
import uvloop


class Request(msgspec.Struct, array_like=True, tag=1):
    call: int
    actor: str
    method: str
    payload: bytes


class Reply(msgspec.Struct, array_like=True, tag=2):
    call: int
    ok: bool
    payload: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Request | Reply)
_LEN = struct.Struct("<I")


class Echo:
    def echo(self, x: bytes) -> bytes:
        return x


class Side(asyncio.Protocol):
    """Either side: the worker answers requests, the caller resolves futures."""

    def __init__(self, worker: bool) -> None:
        self.worker = worker
        self.buf = bytearray()
        self.pending: dict[int, asyncio.Future[Reply]] = {}
        self.actors = {"echo": Echo()}
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 4:
            (n,) = _LEN.unpack_from(buf)
            if len(buf) < 4 + n:
                break
            msg = _decoder.decode(memoryview(buf)[4 : 4 + n])
            del buf[: 4 + n]
            if isinstance(msg, Request):
                args, kwargs = pickle.loads(msg.payload)
                result = getattr(self.actors[msg.actor], msg.method)(*args, **kwargs)
                self.send(Reply(msg.call, True, pickle.dumps(result, 5)))
            else:
                self.pending.pop(msg.call).set_result(msg)

    def send(self, msg: Request | Reply) -> None:
        body = _encoder.encode(msg)
        assert self.transport is not None
        self.transport.write(_LEN.pack(len(body)) + body)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


async def _worker(fd: int) -> None:
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(lambda: Side(True), socket.socket(fileno=fd))
    await asyncio.Event().wait()


async def _caller(fd: int, worker: int, seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    _, side = await loop.connect_accepted_socket(lambda: Side(False), socket.socket(fileno=fd))
    ids = iter(range(1, 1 << 62))

    async def call(x: bytes) -> bytes:
        cid = next(ids)
        fut: asyncio.Future[Reply] = loop.create_future()
        side.pending[cid] = fut
        side.send(Request(cid, "echo", "echo", pickle.dumps(((x,), {}), 5)))
        reply = await fut
        result: bytes = pickle.loads(reply.payload)
        return result

    payload = b"x" * 64
    for _ in range(2000):
        await call(payload)
    out: dict[str, Any] = {}
    for name, width in (("sequential", 1), ("pipelined", 64)):
        done = 0
        end = time.monotonic() + seconds
        c0, w0, t0 = _cpu_s(os.getpid()), _cpu_s(worker), time.perf_counter()

        async def loop_calls(end: float = end) -> None:
            nonlocal done
            while time.monotonic() < end:
                assert await call(payload) == payload
                done += 1

        await asyncio.gather(*[loop_calls() for _ in range(width)])
        c1, w1, t1 = _cpu_s(os.getpid()), _cpu_s(worker), time.perf_counter()
        out[name] = {
            "calls_per_s": done / (t1 - t0),
            "round_trip_us": (t1 - t0) / done * 1e6,
            "caller_cpu_us": (c1 - c0) / done * 1e6,
            "worker_cpu_us": (w1 - w0) / done * 1e6,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the worker
        a.close()
        uvloop.run(_worker(b.detach()))
        os._exit(0)
    b.close()
    try:
        result = uvloop.run(_caller(a.detach(), pid, args.seconds))
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    for name, r in result.items():
        print(
            f"{name}: {r['calls_per_s']:,.0f} calls/s, {r['round_trip_us']:.1f} us a call; "
            f"CPU per call: caller {r['caller_cpu_us']:.1f} us, worker {r['worker_cpu_us']:.1f} us"
        )


if __name__ == "__main__":
    main()
