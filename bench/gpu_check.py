"""One short check of amesh.torch on this machine's GPUs (or its CPU, without CUDA).

1. The flagship, ``examples/train_ddp.py``, on every GPU (nccl), or on 2 CPU
   processes (gloo) where there is no CUDA: its loss, eval accuracy and wall time.
2. Host <-> device copies (pageable and pinned), GB/s (CUDA only).
3. Tensors through amesh endpoint calls between the controller and a worker process:
   controller -> worker (an argument), worker -> controller (a result), and, with
   CUDA, a worker's GPU tensor returned with ``.cpu()``; GB/s.
4. With CUDA: where a CUDA tensor returned as-is arrives (amesh.torch documents: on
   the CPU).

Sizes 1, 64 and 256 MiB; a few minutes at most. ``--json`` prints one JSON object.

    python bench/gpu_check.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import amesh
from amesh import Actor, ProcMesh, endpoint

MIB = 1 << 20
SIZES_MIB = (1, 64, 256)
ROOT = Path(__file__).resolve().parent.parent


def repeats(mib: int) -> int:
    return 5 if mib <= 1 else 2 if mib <= 64 else 1


def best_gbps(nbytes: int, runs: int, fn: Callable[[], object]) -> float:
    """GB/s of the fastest of ``runs`` calls of ``fn`` moving ``nbytes``."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def run_flagship(cuda: bool) -> dict[str, Any]:
    procs = torch.cuda.device_count() if cuda else 2
    cmd = [sys.executable, str(ROOT / "examples" / "train_ddp.py"), f"--procs={procs}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - start
    out = proc.stdout
    result: dict[str, Any] = {"procs": procs, "returncode": proc.returncode, "wall_s": wall}
    patterns = {
        "backend": r"backend (\w+)",
        "first_loss": r"^first loss: ([0-9.]+)",
        "last_loss": r"^last loss: ([0-9.]+)",
        "eval_accuracy": r"^eval accuracy: ([0-9.]+)",
        "samples_per_s": r"\(([0-9,]+) samples/s\)",
    }
    for key, pattern in patterns.items():
        match = re.search(pattern, out, re.MULTILINE)
        result[key] = match.group(1) if match else None
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-2000:]
    return result


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, runs: int) -> float:
    """GB/s of ``dst.copy_(src)`` across host and device, synchronised."""

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    copy()  # warm up
    return best_gbps(src.numel(), runs, copy)


def host_device_copies() -> list[dict[str, Any]]:
    rows = []
    for mib in SIZES_MIB:
        dev = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda")
        for pinned in (False, True):
            host = torch.empty(mib * MIB, dtype=torch.uint8, pin_memory=pinned)
            kind = "pinned" if pinned else "pageable"
            runs = repeats(mib) + 2
            rows.append(
                {"what": f"host->device {kind}", "mib": mib, "gbps": copy_gbps(dev, host, runs)}
            )
            rows.append(
                {"what": f"device->host {kind}", "mib": mib, "gbps": copy_gbps(host, dev, runs)}
            )
    return rows


class Transfer(Actor):
    """Receives and makes tensors for the endpoint measurements."""

    @endpoint
    def sink(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @endpoint
    def make(self, nbytes: int) -> torch.Tensor:
        return torch.ones(nbytes, dtype=torch.uint8)

    @endpoint
    def make_on_gpu(self, nbytes: int, as_is: bool) -> torch.Tensor:
        t = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        return t if as_is else t.cpu()


async def endpoint_transfers(cuda: bool) -> tuple[list[dict[str, Any]], str | None]:
    rows: list[dict[str, Any]] = []
    arrived_on: str | None = None
    async with ProcMesh(per_host={"gpus": 1}) as procs:
        worker = await procs.spawn("transfer", Transfer)
        await worker.sink.call_one(torch.zeros(1))  # torch imported in the worker
        for mib in SIZES_MIB:
            n = mib * MIB
            payload = torch.ones(n, dtype=torch.uint8)
            cases: list[tuple[str, amesh.MeshEndpoint[..., Any], tuple[Any, ...]]] = [
                ("controller->worker", worker.sink, (payload,)),
                ("worker->controller", worker.make, (n,)),
            ]
            if cuda:
                cases.append(("worker gpu .cpu()->controller", worker.make_on_gpu, (n, False)))
            for what, ep, call_args in cases:
                best = float("inf")
                for _ in range(repeats(mib)):
                    start = time.perf_counter()
                    await ep.call_one(*call_args)
                    best = min(best, time.perf_counter() - start)
                rows.append({"what": what, "mib": mib, "gbps": n / best / 1e9})
        if cuda:
            as_is = await worker.make_on_gpu.call_one(16, True)
            arrived_on = str(as_is.device)
    return rows, arrived_on


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    kinds = list(dict.fromkeys(r["what"] for r in rows))
    print(f"{'':<32}" + "".join(f"{f'{m} MiB':>12}" for m in SIZES_MIB))
    for kind in kinds:
        cells = {r["mib"]: r["gbps"] for r in rows if r["what"] == kind}
        print(f"{kind:<32}" + "".join(f"{cells[m]:>10.2f}  " for m in SIZES_MIB))
    print("(GB/s, best of a few runs)")


async def main(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    report: dict[str, Any] = {"torch": torch.__version__, "cuda": cuda}
    if cuda:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        report["gpus"] = names
        if not args.json:
            print(f"torch {torch.__version__}, {len(names)} GPU(s): {', '.join(names)}")
    elif not args.json:
        print(f"torch {torch.__version__}: no CUDA on this machine; running the CPU parts")

    flagship = run_flagship(cuda)
    report["flagship"] = flagship
    if not args.json:
        print(
            f"\nflagship train_ddp.py on {flagship['procs']} ranks ({flagship['backend']}): "
            f"exit {flagship['returncode']}, loss {flagship['first_loss']} -> "
            f"{flagship['last_loss']}, eval accuracy {flagship['eval_accuracy']}, "
            f"{flagship['samples_per_s']} samples/s, wall {flagship['wall_s']:.1f} s"
        )
        if flagship["returncode"] != 0:
            print(flagship["stderr_tail"])

    if cuda:
        report["host_device"] = host_device_copies()
        if not args.json:
            print_table("host <-> device copies", report["host_device"])

    rows, arrived_on = await endpoint_transfers(cuda)
    report["endpoint"] = rows
    report["cuda_tensor_as_is_arrives_on"] = arrived_on
    if args.json:
        print(json.dumps(report))
        return
    print_table("tensors through amesh endpoint calls (one way, incl. pickling)", rows)
    if cuda:
        print(f"a CUDA tensor returned as-is arrives on: {arrived_on}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args()


if __name__ == "__main__":
    amesh.run(main, parse_args())
