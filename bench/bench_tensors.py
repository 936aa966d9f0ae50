"""Peak memory of sending a large tensor through an endpoint, relative to its size.

The controller sends a ``--mib`` MiB float32 tensor to a worker, which returns it
(``echo``). Before the round trip both processes reset their peak RSS (``VmHWM``, by
writing 5 to ``/proc/self/clear_refs``); afterwards each reports how far its peak rose
above the resident size it had before. A copy-free path would show about 1x the
payload on each side (the tensor received) and nothing more; every extra x is a
transient copy (pickling into bytes, the frame, unpickling). On one host a tensor of at
least ``AMESH_SHM_THRESHOLD`` bytes (1 MiB) travels through a shared-memory segment:
the sender copies it there once, and the receiver's tensor is a view of the mapping.

    python bench/bench_tensors.py             # 256 MiB, a table
    python bench/bench_tensors.py --mib 64 --json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import torch

import amesh
from amesh import Actor, ProcMesh, endpoint

MIB = 1 << 20


def memory() -> dict[str, int]:
    """This process's ``VmRSS`` and ``VmHWM`` (peak), in bytes."""
    with open("/proc/self/status") as f:
        status = f.read()
    out = {}
    for key in ("VmRSS", "VmHWM"):
        match = re.search(rf"^{key}:\s+(\d+) kB", status, re.MULTILINE)
        out[key] = int(match.group(1)) * 1024 if match else 0
    return out


def reset_peak() -> bool:
    """Reset this process's peak RSS to its current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class Echo(Actor):
    """Returns what it gets; reports its memory."""

    @endpoint
    def echo(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @endpoint
    def make(self, nbytes: int) -> torch.Tensor:
        return torch.ones(nbytes // 4, dtype=torch.float32)

    @endpoint
    def sink(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @endpoint
    def reset_peak(self) -> tuple[bool, dict[str, int]]:
        return reset_peak(), memory()

    @endpoint
    def memory(self) -> dict[str, int]:
        return memory()


async def measure(worker: amesh.ActorMesh[Echo], nbytes: int) -> dict[str, Any]:
    """One round trip of an ``nbytes`` tensor; peaks above the resident size before."""
    payload = torch.rand(nbytes // 4, dtype=torch.float32)
    worker_reset, worker_before = await worker.reset_peak.call_one()
    ctrl_reset = reset_peak()
    ctrl_before = memory()
    start = time.perf_counter()
    back = await worker.echo.call_one(payload)
    elapsed = time.perf_counter() - start
    # compared before the peak is read: a tensor received through shared memory is a
    # mapping whose pages count only once touched
    assert torch.equal(back, payload)
    ctrl_after = memory()
    worker_after = await worker.memory.call_one()
    del back
    return {
        "payload_mib": nbytes / MIB,
        "round_trip_s": elapsed,
        "gb_per_s": 2 * nbytes / elapsed / 1e9,
        "peak_reset": ctrl_reset and worker_reset,
        "controller_peak_extra_mib": (ctrl_after["VmHWM"] - ctrl_before["VmRSS"]) / MIB,
        "worker_peak_extra_mib": (worker_after["VmHWM"] - worker_before["VmRSS"]) / MIB,
    }


async def main(args: argparse.Namespace) -> None:
    async with ProcMesh(per_host={"procs": 1}) as procs:
        worker = await procs.spawn("echo", Echo)
        await worker.echo.call_one(torch.zeros(1))  # torch imported in the worker
        result = await measure(worker, args.mib * MIB)
    if args.json:
        print(json.dumps(result))
        return
    mib = result["payload_mib"]
    print(f"tensor round trip through an endpoint: {mib:.0f} MiB float32, controller <-> worker")
    if not result["peak_reset"]:
        print("(peak RSS could not be reset: peaks are since process start)")
    print(f"{'process':<12}{'peak above resident (MiB)':>28}{'x payload':>12}")
    for who in ("controller", "worker"):
        extra = result[f"{who}_peak_extra_mib"]
        print(f"{who:<12}{extra:>28.0f}{extra / mib:>12.2f}")
    print(f"round trip {result['round_trip_s'] * 1e3:.0f} ms, {result['gb_per_s']:.2f} GB/s")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="payload size in MiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args()


if __name__ == "__main__":
    amesh.run(main, parse_args())
