"""Links between two hosts: NNG's TLS, Python's ``ssl`` and plain tcp streams, side by side.

The two "hosts" are network namespaces that this script makes (so it runs as root):
``amesh-bench-a`` (10.78.0.1/24) and ``amesh-bench-b`` (10.78.0.2/24), joined by a veth
pair (MTU 1500) made inside them, with a blackhole route for 10.78.0.0/24 in the root
namespace so that nothing leaves the machine. All three go at the end, also on an
error, Ctrl-C or SIGTERM (namespaces of these names left by a run that was killed are
removed first, unless a process still runs in them). Per transport, one server
process runs in B and one client process in A (``ip netns exec``, killed when the
driver dies); both get the driver's job key on their stdin pipe, never on the command
line or in the environment. Both run on uvloop, as amesh's processes do.

Transports (rows):

- ``NNG tls+tcp``: :class:`~amesh._transport._ext.ExtTransport` over ``tls+tcp``: NNG
  does the socket I/O and the TLS (Mbed TLS, TLS 1.3, both certificates checked:
  :mod:`amesh._transport._tls`) on its own threads; the job-key hello opens each pipe.
- ``asyncio ssl``: asyncio streams with an ``ssl.SSLContext`` (OpenSSL, TLS 1.3 only,
  both ends verified with certificates made as amesh makes them: the job's CA and a
  leaf of each process, :func:`amesh._transport._tls.job_material`), frames prefixed
  by a 4-byte length, the TLS done on the event loop. A frame above 1 MiB is written
  in 1 MiB pieces with a ``drain()`` after each (one ``write`` of 1 GiB would encrypt
  all of it before returning, holding the loop for seconds); the server reads a big
  frame in pieces of up to 1 MiB into an anonymous ``mmap`` of its size, as
  :class:`~amesh._transport.StreamTransport` does (a ``bytearray`` is zero-filled at
  once: most of a second per GiB on the loop).
- ``tcp, no TLS``: :class:`~amesh._transport.StreamTransport` over ``tcp``: length-
  prefixed frames with the I/O on the event loop, each connection authenticated by the
  job-key handshake (:mod:`amesh._transport._auth`), nothing encrypted.

Measured, from the client in A against the server in B (columns):

- round trip: a 64-byte frame to the server and echoed back, one at a time, median and
  99th percentile (after 200 that warm up);
- bulk: one 256 MiB frame A to B, from the send until the server's acknowledgement
  (sent once it holds the whole frame) is back; GB/s = 10**9 bytes/s, the best of
  ``--repeats`` transfers;
- under load: small round trips as above, back to back, while one 1 GiB frame goes A
  to B the same way: the median, 99th percentile and maximum of those that overlapped
  the transfer, and the transfer's GB/s. They take a second link between the same two
  processes (a second client transport, which the server answers on its link back to
  it, or a second TLS connection): frames on one link arrive in order, so a round trip
  on the bulk link would only wait for all of the big frame. What they share with the
  transfer is both processes, their event loops, NNG's threads and the wire: whether
  the transfer (its TLS, its copies) holds up the event loops shows here. The frame's
  bytes are made before the clock starts; how long the client's ``send`` held the
  caller is printed below the table (``ExtTransport`` copies the frame into an NNG
  message there, on the event loop: that copy is the row's maximum). The round trips
  run flat out and take CPU from the transfer (2 CPUs here), so its GB/s is lower than
  the bulk column, the more so for a transport whose round trips are cheap.

The figures of this 2-CPU VM move by tens of percent between runs, more so while
other work runs (the load average is printed): compare the rows of one run.
``--quick`` is a fast check (500 round trips, 16 MiB bulk, 64 MiB under load: a few
seconds); a full run takes about 30 s here.

Usage::

    sudo .venv/bin/python bench/bench_host_links.py [--quick] [--json] [--rounds N]
        [--big-mib N] [--load-mib N] [--repeats N] [--only ext-tls|ssl|stream-tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime
import json
import math
import mmap
import os
import platform
import select
import signal
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

NS_A, NS_B = "amesh-bench-a", "amesh-bench-b"
VETH_A, VETH_B = "amb-veth-a", "amb-veth-b"  # made inside the namespaces, never in the root
SUBNET = "10.78.0.0/24"
ADDR_A, ADDR_B = "10.78.0.1", "10.78.0.2"

KINDS = ("ext-tls", "ssl", "stream-tcp")
LABELS = {
    "ext-tls": "NNG tls+tcp (ExtTransport)",
    "ssl": "asyncio ssl streams (TLS 1.3)",
    "stream-tcp": "tcp, no TLS (StreamTransport)",
}
MIB = 1024 * 1024
SMALL = b"x" * 64
#: Frames up to this size are echoed; larger ones are acknowledged with ACK.
ECHO_MAX = 4096
ACK = b"ack"
WARMUP = 200
#: asyncio ssl: the pieces a big frame is written and read in, and the readers' limit.
PIECE = MIB
_HEAD = struct.Struct("<I")


# -- both roles ------------------------------------------------------------------------


def _say(obj: Any) -> None:
    print(json.dumps(obj), flush=True)


async def _stdin_closed() -> None:
    import anyio.to_thread

    await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


def _payload(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + b"x" * (size % 256)


def _ssl_context(server: bool) -> ssl.SSLContext:
    """TLS 1.3 only, the job CA the only one trusted, a certificate of the job shown
    and required at both ends (the listener's must name ``_tls.SERVER_NAME``)."""
    from amesh._identity import job_key
    from amesh._transport import _tls

    m = _tls.job_material(job_key())
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    ctx = ssl.create_default_context(purpose, cadata=m.ca)
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    # load_cert_chain reads files only: a private directory, gone right after.
    with tempfile.TemporaryDirectory() as tmp:
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, text in ((cert, m.cert), (key, m.key)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
        ctx.load_cert_chain(cert, key)
    return ctx


def _amesh_transport(kind: str, host: str) -> Any:
    if kind == "ext-tls":
        from amesh._transport._ext import ExtTransport

        return ExtTransport("tls+tcp", host=host)
    from amesh._transport import StreamTransport

    return StreamTransport("tcp", host=host)


# -- server (in B) ---------------------------------------------------------------------


async def amesh_server(kind: str) -> None:
    """Echo small frames to their sender, acknowledge big ones."""
    import anyio

    t = _amesh_transport(kind, ADDR_B)
    try:
        async with anyio.create_task_group() as tg:

            def deliver(frame: Any, peer: str) -> None:
                reply = bytes(frame) if len(frame) <= ECHO_MAX else ACK
                if not t.try_send(peer, reply):
                    tg.start_soon(t.send, peer, reply)

            tg.start_soon(t.serve, deliver)
            _say({"addr": t.address})
            await _stdin_closed()
            tg.cancel_scope.cancel()
    finally:
        t.close()


async def ssl_server() -> None:
    ctx = _ssl_context(server=True)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(_HEAD.size)
                (n,) = _HEAD.unpack(head)
                if n <= ECHO_MAX:
                    writer.write(head + await reader.readexactly(n))
                else:
                    # As StreamTransport does: a bytearray would be zero-filled at
                    # once (a gigabyte: most of a second on the loop), a mapping is
                    # filled page by page as the frame arrives.
                    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)
                    view = memoryview(buf)
                    pos = 0
                    while pos < n:
                        piece = await reader.read(min(n - pos, PIECE))
                        if not piece:
                            raise asyncio.IncompleteReadError(b"", n - pos)
                        view[pos : pos + len(piece)] = piece
                        pos += len(piece)
                    view.release()
                    buf.close()
                    writer.write(_HEAD.pack(len(ACK)) + ACK)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, ADDR_B, 0, ssl=ctx, limit=PIECE)
    try:
        port = server.sockets[0].getsockname()[1]
        _say({"addr": f"{ADDR_B}:{port}"})
        await _stdin_closed()
    finally:
        server.close()


# -- client (in A) ---------------------------------------------------------------------


class AmeshLink:
    """Frames to the server over one client transport; what comes back, in order."""

    def __init__(self, transport: Any, addr: str) -> None:
        import anyio

        self.t = transport
        self.addr = addr
        self._tx, self._rx = anyio.create_memory_object_stream[bytes](math.inf)

    def deliver(self, frame: Any, peer: str) -> None:
        self._tx.send_nowait(bytes(frame))

    async def send(self, frame: bytes) -> None:
        await self.t.send(self.addr, frame)

    async def recv(self) -> bytes:
        return await self._rx.receive()


class SslLink:
    """Length-prefixed frames over one TLS connection (asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, frame: bytes) -> None:
        n = len(frame)
        if n <= PIECE:
            self.writer.write(_HEAD.pack(n) + frame)
        else:
            self.writer.write(_HEAD.pack(n))
            view = memoryview(frame)
            for at in range(0, n, PIECE):
                self.writer.write(view[at : at + PIECE])
                await self.writer.drain()
        await self.writer.drain()

    async def recv(self) -> bytes:
        (n,) = _HEAD.unpack(await self.reader.readexactly(_HEAD.size))
        return await self.reader.readexactly(n)


Link = AmeshLink | SslLink


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(int(len(s) * q), len(s) - 1)] * 1e6


async def round_trips(link: Link, rounds: int) -> dict[str, float]:
    took = []
    for i in range(WARMUP + rounds):
        start = time.perf_counter()
        await link.send(SMALL)
        await link.recv()
        if i >= WARMUP:
            took.append(time.perf_counter() - start)
    return {
        "rtt_p50_us": statistics.median(took) * 1e6,
        "rtt_p99_us": _pct(took, 0.99),
        "rtt_n": len(took),
    }


async def transfer(link: Link, frame: bytes) -> float:
    """Seconds from sending ``frame`` until the server acknowledged all of it."""
    start = time.perf_counter()
    await link.send(frame)
    reply = await link.recv()
    took = time.perf_counter() - start
    if reply != ACK:
        raise RuntimeError(f"expected an acknowledgement, got {reply[:16]!r}")
    return took


async def under_load(ping: Link, bulk: Link, frame: bytes) -> dict[str, float]:
    """Round trips on ``ping``, back to back, while ``frame`` goes over ``bulk``."""
    import anyio

    spans: list[tuple[float, float]] = []
    stop = False

    async def pinger() -> None:
        while not stop:
            start = time.perf_counter()
            await ping.send(SMALL)
            await ping.recv()
            spans.append((start, time.perf_counter()))

    async with anyio.create_task_group() as tg:
        tg.start_soon(pinger)
        await anyio.sleep(0.05)  # the pinger is going
        begin = time.perf_counter()
        await bulk.send(frame)
        sent = time.perf_counter()
        reply = await bulk.recv()
        end = time.perf_counter()
        stop = True
    if reply != ACK:
        raise RuntimeError(f"expected an acknowledgement, got {reply[:16]!r}")
    took = end - begin
    during = [e - s for s, e in spans if e > begin and s < end]
    return {
        "load_send_s": sent - begin,
        "load_s": took,
        "load_GBps": len(frame) / took / 1e9,
        "load_n": len(during),
        "load_p50_us": statistics.median(during) * 1e6,
        "load_p99_us": _pct(during, 0.99),
        "load_max_us": max(during) * 1e6,
    }


async def measure(ping: Link, bulk: Link, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = await round_trips(ping, args.rounds)
    await bulk.send(SMALL)  # connects the bulk link
    await bulk.recv()
    frame = _payload(args.big_mib * MIB)
    times = [await transfer(bulk, frame) for _ in range(args.repeats)]
    del frame
    out["big_s"] = times
    out["big_GBps"] = args.big_mib * MIB / min(times) / 1e9
    frame = _payload(args.load_mib * MIB)
    out.update(await under_load(ping, bulk, frame))
    return out


async def amesh_client(kind: str, server: str, args: argparse.Namespace) -> dict[str, Any]:
    import anyio

    ping_t = _amesh_transport(kind, ADDR_A)
    bulk_t = _amesh_transport(kind, ADDR_A)
    try:
        ping, bulk = AmeshLink(ping_t, server), AmeshLink(bulk_t, server)
        async with anyio.create_task_group() as tg:
            tg.start_soon(ping_t.serve, ping.deliver)
            tg.start_soon(bulk_t.serve, bulk.deliver)
            out = await measure(ping, bulk, args)
            tg.cancel_scope.cancel()
        return out
    finally:
        ping_t.close()
        bulk_t.close()


async def ssl_client(server: str, args: argparse.Namespace) -> dict[str, Any]:
    from amesh._transport import _tls

    ctx = _ssl_context(server=False)
    host, port = server.rsplit(":", 1)
    links = []
    try:
        for _ in range(2):
            r, w = await asyncio.open_connection(
                host, int(port), ssl=ctx, server_hostname=_tls.SERVER_NAME, limit=PIECE
            )
            links.append(SslLink(r, w))
        sslobj = links[0].writer.get_extra_info("ssl_object")
        out = await measure(links[0], links[1], args)
        out["cipher"] = sslobj.cipher()[0] if sslobj is not None else None
        out["tls_version"] = sslobj.version() if sslobj is not None else None
        return out
    finally:
        for link in links:
            link.writer.close()


def role(args: argparse.Namespace) -> None:
    import anyio

    from amesh._identity import adopt_key

    adopt_key(bytes.fromhex(sys.stdin.readline()))  # the driver's job key comes first
    main: Callable[[], Awaitable[Any]]
    if args.role == "server":
        main = ssl_server if args.kind == "ssl" else lambda: amesh_server(args.kind)
        anyio.run(main, backend_options={"use_uvloop": True})
        return
    if args.kind == "ssl":
        main = lambda: ssl_client(args.addr, args)  # noqa: E731
    else:
        main = lambda: amesh_client(args.kind, args.addr, args)  # noqa: E731
    _say(anyio.run(main, backend_options={"use_uvloop": True}))


# -- driver: the namespaces ------------------------------------------------------------


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {done.stderr.strip()}")
    return done


def _namespaces() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()}


class Hosts:
    """The two namespaces, their veth pair and the root namespace's blackhole route;
    :meth:`down` removes whatever :meth:`up` made (or found left over by a run that was
    killed), and is safe to call more than once."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.route = False

    def up(self) -> None:
        for ns in set((NS_A, NS_B)) & _namespaces():
            if _ip("netns", "pids", ns).stdout.strip():
                raise RuntimeError(f"network namespace {ns} is in use (another run?)")
            _ip("netns", "del", ns)  # left over by a run that was killed
        if "blackhole" in _ip("route", "show", SUBNET).stdout:
            self.route = True  # left over too: ours to remove
        for ns in (NS_A, NS_B):
            _ip("netns", "add", ns)
            self.made.append(ns)
        veth = ["type", "veth", "peer", "name", VETH_B, "netns", NS_B]
        _ip("link", "add", VETH_A, "netns", NS_A, *veth)
        for ns, dev, addr in ((NS_A, VETH_A, ADDR_A), (NS_B, VETH_B, ADDR_B)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        if not self.route:
            _ip("route", "add", "blackhole", SUBNET)
            self.route = True

    def down(self) -> None:
        while self.made:
            _ip("netns", "del", self.made.pop(), check=False)  # takes its veth end along
        if self.route:
            _ip("route", "del", "blackhole", SUBNET, check=False)
            self.route = False


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the driver dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class Proc:
    """A role in a namespace; the job key goes down its stdin first."""

    def __init__(self, ns: str, argv: list[str], key: bytes) -> None:
        cmd = ["ip", "netns", "exec", ns, sys.executable, os.path.abspath(__file__), *argv]
        self.name = f"{' '.join(argv[:4])} (in {ns})"
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        assert self.p.stdin is not None
        self.p.stdin.write(key.hex() + "\n")
        self.p.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        out = self.p.stdout
        assert out is not None
        if not select.select([out], [], [], timeout)[0]:
            raise TimeoutError(f"no answer from {self.name} within {timeout:g} s")
        line = out.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited with {self.p.wait()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def stop(self) -> None:
        """Close its stdin (a server ends then), wait a little, then kill it."""
        if self.p.stdin is not None and not self.p.stdin.closed:
            try:
                self.p.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        if self.p.stdout is not None:
            self.p.stdout.close()


def run_kind(kind: str, key: bytes, args: argparse.Namespace) -> dict[str, Any]:
    server = Proc(NS_B, ["--role", "server", "--kind", kind], key)
    client = None
    try:
        addr = server.read(30)["addr"]
        sizes = ["--rounds", str(args.rounds), "--big-mib", str(args.big_mib)]
        sizes += ["--load-mib", str(args.load_mib), "--repeats", str(args.repeats)]
        client = Proc(NS_A, ["--role", "client", "--kind", kind, "--addr", addr, *sizes], key)
        return client.read(300)
    finally:
        if client is not None:
            client.stop()
        server.stop()


# -- driver: the table -----------------------------------------------------------------


def _fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    under = f"under {args.load_mib} MiB"
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("RTT p50 µs", lambda r: _fmt(r["rtt_p50_us"])),
        ("RTT p99 µs", lambda r: _fmt(r["rtt_p99_us"])),
        (f"{args.big_mib} MiB GB/s", lambda r: _fmt(r["big_GBps"], 3)),
        (f"p99 µs {under}", lambda r: _fmt(r["load_p99_us"])),
        (f"p50 µs {under}", lambda r: _fmt(r["load_p50_us"])),
        (f"max µs {under}", lambda r: _fmt(r["load_max_us"])),
        (f"{args.load_mib} MiB GB/s under pings", lambda r: _fmt(r["load_GBps"], 3)),
    ]
    lines = [
        "| transport | " + " | ".join(name for name, _ in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for kind, r in results.items():
        lines.append(f"| {LABELS[kind]} | " + " | ".join(f(r) for _, f in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a fast check: smaller and fewer")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--rounds", type=int, help="small round trips (5000; --quick 500)")
    ap.add_argument("--big-mib", type=int, help="the bulk frame, MiB (256; --quick 16)")
    ap.add_argument("--load-mib", type=int, help="the frame under load, MiB (1024; --quick 64)")
    ap.add_argument("--repeats", type=int, help="bulk transfers, the best counts (2; --quick 1)")
    ap.add_argument("--only", choices=KINDS, action="append", help="only this transport")
    ap.add_argument("--role", choices=["server", "client"], help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=KINDS, help=argparse.SUPPRESS)
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for name, full, quick in (
        ("rounds", 5000, 500),
        ("big_mib", 256, 16),
        ("load_mib", 1024, 64),
        ("repeats", 2, 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.role:
        role(args)
        return
    if os.geteuid() != 0:
        sys.exit("bench_host_links.py makes network namespaces: run it as root")

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    from amesh._identity import job_key

    key = job_key()
    load_before = os.getloadavg()[0]
    started = datetime.datetime.now(datetime.UTC)
    hosts = Hosts()
    results: dict[str, dict[str, Any]] = {}
    try:
        hosts.up()
        for kind in args.only or KINDS:
            results[kind] = run_kind(kind, key, args)
            if not args.json:
                print(f"{LABELS[kind]}: done", file=sys.stderr, flush=True)
    finally:
        hosts.down()
    meta = {
        "started": started.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "took_s": (datetime.datetime.now(datetime.UTC) - started).total_seconds(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "rounds": args.rounds,
        "big_mib": args.big_mib,
        "load_mib": args.load_mib,
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=2))
        return
    print(
        f"{meta['started']}, {meta['cpus']} CPUs, Python {meta['python']}, Linux "
        f"{meta['kernel']}; load average {load_before:.2f} before, "
        f"{meta['load_after']:.2f} after; took {meta['took_s']:.0f} s"
    )
    print(
        f"{args.rounds} round trips of 64 B; best of {args.repeats} x {args.big_mib} MiB; "
        f"round trips on a second link while {args.load_mib} MiB go A to B"
    )
    print()
    print(table(results, args))
    print()
    for kind, r in results.items():
        print(
            f"- {LABELS[kind]}: {r['load_n']:,} round trips under load; the {args.load_mib} "
            f"MiB send returned after {r['load_send_s']:.3f} s"
        )
    ssl_row = results.get("ssl")
    if ssl_row and ssl_row.get("cipher"):
        print(f"- asyncio ssl negotiated {ssl_row['tls_version']} {ssl_row['cipher']}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # everything is cleaned up by then
        sys.exit(130)
