"""fault_tolerant_training: a rank dies mid-training, and training still completes.

The controller trains a small DDP model on a generated regression task (learn a fixed
"teacher" network). Every few steps rank 0 writes a checkpoint. At ``--kill-at`` the
controller SIGKILLs one worker, as a crashed node would die. The next ``step.call``
raises ``amesh.SupervisionError`` naming the rank, pid and signal, and the body of
``async with ProcMesh(...)`` is cancelled and its processes torn down. The controller
then starts a fresh mesh (new processes, a new torch process group), reloads the last
checkpoint and carries on from that step to the end.

Run it with ``python examples/fault_tolerant_training.py`` (``--procs``, ``--steps``,
``--kill-at``, ``--ckpt-every``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Any

import amesh
import amesh.torch
from amesh import Actor, ProcMesh, SupervisionError, endpoint

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 64


class Trainer(Actor):
    """One DDP rank: a small MLP that learns a fixed teacher network."""

    def __init__(self, lr: float) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        torch.set_num_threads(1)
        self.rank = dist.get_rank()
        torch.manual_seed(1234)  # the same initial weights on every rank
        self.teacher = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
        )
        model = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)
        )
        self.model = DistributedDataParallel(model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)

    def _batch(self, step: int, rank: int) -> tuple[Any, Any]:
        import torch

        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(BATCH, IN, generator=g)
        with torch.no_grad():
            y = self.teacher(x)
        return x, y

    @endpoint
    def step(self, step: int) -> float:
        import torch

        x, y = self._batch(step, self.rank)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients across ranks here
        self.opt.step()
        return float(loss.item())

    @endpoint
    def save(self, path: str, step: int) -> None:
        import torch

        if self.rank != 0:
            return
        state = {"model": self.model.module.state_dict(), "opt": self.opt.state_dict()}
        tmp = f"{path}.tmp"
        torch.save({"step": step, **state}, tmp)
        os.replace(tmp, path)  # a crash never leaves a half-written checkpoint

    @endpoint
    def load(self, path: str) -> int:
        """Load the checkpoint if there is one; return the step to continue from."""
        import torch

        if not os.path.exists(path):
            return 0
        state = torch.load(path, weights_only=True)
        self.model.module.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        return int(state["step"])

    @endpoint
    def evaluate(self) -> float:
        import torch

        x, y = self._batch(10**6, 0)  # held-out: a step no training run reaches
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(self.model.module(x), y).item())


async def train(args: argparse.Namespace, ckpt: str) -> dict[str, Any]:
    losses: dict[int, float] = {}
    restarts = 0
    killed = False
    killed_at = 0.0
    while True:
        try:
            async with ProcMesh(per_host={"gpus": args.procs}) as procs:
                await amesh.torch.init_process_group(procs)
                trainers = await procs.spawn("trainers", Trainer, args.lr)
                start = (await trainers.load.call(ckpt)).values()[0]
                print(f"[mesh {restarts}] pids {procs.pids}, starting at step {start}")
                for step in range(start, args.steps):
                    if step == args.kill_at and not killed:
                        victim = procs.pids[-1]
                        print(
                            f"[mesh {restarts}] step {step}: SIGKILL rank "
                            f"{args.procs - 1} (pid {victim})"
                        )
                        killed_at = time.perf_counter()
                        os.kill(victim, signal.SIGKILL)
                        killed = True
                    loss = (await trainers.step.call(step)).values()
                    losses[step] = sum(loss) / len(loss)
                    if (step + 1) % args.ckpt_every == 0:
                        await trainers.save.call(ckpt, step + 1)
                    if step % 10 == 0:
                        print(f"[mesh {restarts}] step {step:3d} loss {losses[step]:.4f}")
                evaluation = (await trainers.evaluate.call()).values()[0]
                return {"losses": losses, "restarts": restarts, "eval": evaluation}
        except SupervisionError as exc:
            restarts += 1
            print(
                f"the failed mesh was torn down {time.perf_counter() - killed_at:.2f} s "
                "after the kill"
            )
            for failure in exc.failures:
                print(f"supervision: {failure}")
            if restarts > 3:
                raise
            print(f"restarting the mesh from the last checkpoint (restart {restarts})")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=27)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amesh-ckpt-") as tmp:
        result = await train(args, os.path.join(tmp, "ckpt.pt"))
    losses = result["losses"]
    first, last = losses[min(losses)], losses[max(losses)]
    print(f"first loss {first:.4f}, last loss {last:.4f}, eval loss {result['eval']:.4f}")
    print(
        f"training completed after {result['restarts']} restart(s) "
        f"in {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    amesh.run(main, backend="trio" if "--trio" in sys.argv else None)
