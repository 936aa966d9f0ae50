"""Weights to many ranks: one state dict pushed to every rank of a mesh on one host.

An RL or parameter-server step sends one large set of tensors to every rank. amesh's
``call`` to several ranks of this host writes each large buffer once into shared memory
that every rank maps (copy-on-write); without shared memory each rank gets the bytes
in a frame of its own (16 sends of the same bytes). This measures, per system, the
time of one ``call`` of the whole state dict to every rank (each rank touches every page
of it and keeps it, as a model would), the aggregate GB/s (ranks x size / time) and the
peak memory the machine used for it (the largest drop of ``MemAvailable``, sampled every
5 ms, from before the first round), best of ``--rounds``.

Systems (``--systems``), each in a fresh process of its own:

- ``amesh``: the default (shared memory, written once);
- ``amesh-frames``: shared memory off (``amesh.configure(shm_threshold=...)`` above the
  payload): the bytes go in each rank's frame;
- ``monarch``: Monarch's ``call`` of the same state dict (``--monarch-python``: an
  interpreter with torchmonarch installed, e.g. ``.venv-bench/bin/python``; see
  bench/README.md). Shown as ``missing`` when there is none.

Run: ``.venv/bin/python bench/bench_weights.py [--mib 256] [--ranks 16] [--rounds 3]
[--systems amesh,amesh-frames,monarch] [--json]``. Leaves no process or segment behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

MiB = 1 << 20


def _state(mib: int, tensors: int) -> dict[str, Any]:
    import numpy as np

    each = mib * MiB // tensors // 4
    return {f"layer{i}": np.full(each, float(i + 1), dtype=np.float32) for i in range(tensors)}


def _touch(state: dict[str, Any]) -> float:
    """Read every page (4 KiB: 1,024 float32) of every tensor, as loading a model does."""
    return float(sum(float(a[::1024].sum()) for a in state.values()))


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class _Peak:
    """The largest drop of MemAvailable below ``base`` while it runs."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.lowest = base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.005):
            self.lowest = min(self.lowest, _available())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.base - self.lowest


async def _measure(call: Any, state: dict[str, Any], rounds: int, ranks: int) -> dict[str, Any]:
    want = _touch(state)
    base = _available()
    times = []
    peak = _Peak(base)
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = await call(state)
            times.append(time.perf_counter() - t0)
            if got != [want] * ranks:
                raise AssertionError(f"wrong checksums: {got[:3]}...")
    finally:
        used = peak.stop()
    size = sum(a.nbytes for a in state.values())
    best = min(times)
    return {
        "seconds": best,
        "gbps": ranks * size / best / 1e9,
        "peak_gib": used / (1 << 30),
        "size_gib": size / (1 << 30),
    }


def _run_amesh(args: argparse.Namespace, frames: bool) -> dict[str, Any]:
    import amesh

    if frames:
        amesh.configure(shm_threshold=1 << 62)

    class Receiver(amesh.Actor):
        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        @amesh.endpoint
        def load(self, state: dict[str, Any]) -> float:
            self.state = {}  # the previous round's weights go first, as in a model
            self.state = state
            return _touch(state)

    async def main() -> dict[str, Any]:
        state = _state(args.mib, args.tensors)
        async with amesh.ProcMesh(per_host={"procs": args.ranks}) as procs:
            m = await procs.spawn("receivers", Receiver)
            await m.load.call({"warm": state["layer0"][:1024]})

            async def call(s: dict[str, Any]) -> list[float]:
                return list((await m.load.call(s)).values())

            return await _measure(call, state, args.rounds, args.ranks)

    result: dict[str, Any] = amesh.run(main)
    return result


def _run_monarch(args: argparse.Namespace) -> dict[str, Any]:
    from monarch.actor import Actor, enable_transport, endpoint, this_host

    enable_transport("ipc")

    class Receiver(Actor):
        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        @endpoint
        async def load(self, state: dict[str, Any]) -> float:
            self.state = {}
            self.state = state
            return _touch(state)

    async def main() -> dict[str, Any]:
        state = _state(args.mib, args.tensors)
        procs = this_host().spawn_procs(per_host={"procs": args.ranks})
        try:
            await procs.initialized
            m = procs.spawn("receivers", Receiver)
            await m.load.call({"warm": state["layer0"][:1024]})

            async def call(s: dict[str, Any]) -> list[float]:
                return list((await m.load.call(s)).values())

            return await _measure(call, state, args.rounds, args.ranks)
        finally:
            await procs.stop()

    return asyncio.run(main())


def _one(args: argparse.Namespace) -> None:
    """In a system's own process: measure, print one JSON line."""
    if args.one == "monarch":
        result = _run_monarch(args)
    else:
        result = _run_amesh(args, frames=args.one == "amesh-frames")
    print("RESULT " + json.dumps(result), flush=True)


def _spawn(system: str, args: argparse.Namespace) -> dict[str, Any]:
    python = sys.executable
    if system == "monarch":
        python = args.monarch_python
        if not python or not os.path.exists(python):
            return {"status": "missing"}
    argv = [
        python, __file__, "--one", system, "--mib", str(args.mib), "--ranks", str(args.ranks),
        "--rounds", str(args.rounds), "--tensors", str(args.tensors),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src"))
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=args.timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return {"status": "ok", **json.loads(line[len("RESULT ") :])}
    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
    return {"status": "error", "why": " | ".join(tail)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="state dict size (MiB)")
    parser.add_argument("--tensors", type=int, default=16, help="tensors in it")
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--systems", default="amesh,amesh-frames,monarch")
    parser.add_argument("--monarch-python", default=".venv-bench/bin/python")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _one(args)
        return
    results = {s: _spawn(s, args) for s in args.systems.split(",")}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    base = results.get("amesh", {})
    print(f"{args.mib} MiB in {args.tensors} tensors to {args.ranks} ranks, best of {args.rounds}")
    print("| system | call (s) | aggregate GB/s | peak memory (GiB) | GB/s vs amesh |")
    print("|---|---:|---:|---:|---:|")
    for system, r in results.items():
        if r.get("status") != "ok":
            print(f"| {system} | {r.get('status')} {r.get('why', '')} | | | |")
            continue
        ratio = r["gbps"] / base["gbps"] if base.get("status") == "ok" else float("nan")
        print(
            f"| {system} | {r['seconds']:.3f} | {r['gbps']:.2f} | {r['peak_gib']:.2f} "
            f"| {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
