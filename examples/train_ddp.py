"""train_ddp: data-parallel training driven step by step from one controller.

The controller starts ``--procs`` worker processes, makes them one torch.distributed
job (``amesh.torch.init_process_group``: gloo on CPU, nccl on GPUs), spawns one trainer
per process, and then drives the loop itself: each ``await trainers.step.call()`` runs
one step of DistributedDataParallel on every rank (gradients are averaged by DDP's
all-reduce) and returns each rank's loss. Rank 0 writes checkpoints to a path the
controller chooses; a final evaluation on held-out points runs on all ranks, which add
up their counts with an all-reduce.

The task needs no download: classify points of a 3-armed spiral (generated with a
fixed seed) by arm. Each rank draws its batches from its own shard of the training set.

Run it with ``python examples/train_ddp.py`` (``--procs 4 --steps 300`` by default;
``--ckpt-dir DIR`` keeps the checkpoints, otherwise they go to a temporary directory
removed at exit; ``--trio`` for the trio backend).

Across machines, ``--procs`` processes on each: ``--hosts tcp://ADDR:PORT,... --key-file
KEY`` uses the ``amesh agent`` running on each machine, ``--slurm N`` submits a SLURM job
of N nodes that runs them; either way ``--listen ADDR`` is this machine's address on
their network (the checkpoint directory must be one every machine sees).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import amesh
import amesh.torch
from amesh import Actor, ProcMesh, current_rank, endpoint

CLASSES = 3


def spiral(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of a noisy spiral with ``CLASSES`` arms, and the arm of each point."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    radius = torch.rand(n, generator=g)
    angle = radius * 4.0 + labels * (2 * math.pi / CLASSES) + 0.15 * torch.randn(n, generator=g)
    points = torch.stack([radius * torch.sin(angle), radius * torch.cos(angle)], dim=1)
    return points, labels


class Trainer(Actor):
    """One data-parallel replica: a small MLP wrapped in DistributedDataParallel."""

    def __init__(self, seed: int, train_size: int, batch_size: int, lr: float) -> None:
        torch.set_num_threads(1)  # several workers share few cores
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        # the GPU under nccl (one per rank); under gloo (no GPU each) the CPU
        self.device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        # Every rank builds the same data set and keeps its own shard of it.
        points, labels = spiral(train_size, seed)
        self.x = points[self.rank :: world].to(self.device)
        self.y = labels[self.rank :: world].to(self.device)
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed * 1000 + self.rank)
        torch.manual_seed(seed)  # the same initial weights everywhere (DDP checks)
        model = nn.Sequential(
            nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
        ).to(self.device)
        self.model = DistributedDataParallel(model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.steps = 0

    @endpoint
    def step(self) -> float:
        """One training step on a batch of this rank's shard; returns the local loss."""
        idx = torch.randint(0, len(self.x), (self.batch_size,), generator=self.gen)
        loss = F.cross_entropy(self.model(self.x[idx]), self.y[idx])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients across ranks here
        self.opt.step()
        self.steps += 1
        return float(loss.item())

    @endpoint
    def save(self, path: str) -> int | None:
        """Rank 0 writes a checkpoint to ``path`` and returns its size in bytes."""
        if self.rank != 0:
            return None
        state = {
            "step": self.steps,
            "model": self.model.module.state_dict(),
            "optimizer": self.opt.state_dict(),
        }
        torch.save(state, path)
        return os.path.getsize(path)

    @endpoint
    def evaluate(self, seed: int, size: int) -> tuple[int, int]:
        """Accuracy on ``size`` held-out points, each rank scoring its share.

        Returns ``(correct, total)`` over all ranks (summed with an all-reduce).
        """
        world = dist.get_world_size()
        points, labels = spiral(size, seed)
        x = points[self.rank :: world].to(self.device)
        y = labels[self.rank :: world].to(self.device)
        with torch.no_grad():
            correct = (self.model(x).argmax(dim=1) == y).sum()
        counts = torch.stack([correct, torch.tensor(len(y), device=self.device)])
        dist.all_reduce(counts)
        return int(counts[0]), int(counts[1])

    @endpoint
    def where(self) -> str:
        return f"rank {self.rank} of {dist.get_world_size()} at {dict(current_rank())}"


async def workers(args: argparse.Namespace) -> ProcMesh:
    """``--procs`` processes here, or on each of the machines of ``--hosts``/``--slurm``."""
    env = {"OMP_NUM_THREADS": "1"}  # one compute thread per worker process
    if args.hosts:
        hosts = await amesh.attach(args.hosts.split(","), key_file=args.key_file)
    elif args.slurm:
        hosts = await amesh.SlurmJob(nodes=args.slurm, name="train-ddp").host_mesh()
    else:
        return ProcMesh(per_host={"gpus": args.procs}, env=env)
    return hosts.spawn_procs(per_host={"gpus": args.procs}, env=env)


async def train(args: argparse.Namespace, ckpt_dir: str) -> None:
    async with await workers(args) as procs:
        group = await amesh.torch.init_process_group(procs)
        ranks = len(procs)
        print(f"{ranks} ranks, backend {group.backend}, store at {group.master_addr} {procs.sizes}")
        trainers = await procs.spawn(
            "trainers", Trainer, args.seed, args.train_size, args.batch_size, args.lr
        )
        samples_per_step = args.batch_size * ranks
        first_loss = last_loss = math.nan
        start = time.perf_counter()
        bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", mininterval=0.5)
        for step in bar:
            losses = (await trainers.step.call()).values()
            last_loss = sum(losses) / len(losses)
            if step == 1:
                first_loss = last_loss
            rate = step * samples_per_step / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{last_loss:.4f}", samples_per_s=f"{rate:,.0f}", refresh=False)
            if step % args.ckpt_every == 0 or step == args.steps:
                path = os.path.join(ckpt_dir, f"step{step:05d}.pt")
                size = (await trainers.save.call(path)).values()[0]
                bar.write(f"checkpoint: step {step} -> {path} ({size} bytes)")
        bar.close()
        elapsed = time.perf_counter() - start
        print(f"first loss: {first_loss:.4f}")
        print(f"last loss: {last_loss:.4f}")
        print(
            f"trained {args.steps} steps in {elapsed:.1f} s "
            f"({args.steps * samples_per_step / elapsed:,.0f} samples/s)"
        )
        correct, total = (await trainers.evaluate.call(args.seed + 1, args.eval_size)).values()[0]
        print(f"eval accuracy: {correct / total:.3f} ({correct}/{total} held-out points)")


async def main(args: argparse.Namespace) -> None:
    if args.ckpt_dir is not None:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        await train(args, args.ckpt_dir)
        return
    with tempfile.TemporaryDirectory(prefix="amesh-ckpt-") as tmp:
        await train(args, tmp)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=4, help="worker processes (ranks) per host")
    p.add_argument("--hosts", default="", help="amesh agents: tcp://ADDR:PORT,...")
    p.add_argument("--key-file", default=None, help="the agents' key (amesh keygen)")
    p.add_argument("--slurm", type=int, default=0, metavar="N", help="run on N SLURM nodes")
    p.add_argument("--listen", default="", help="this machine's address for --hosts/--slurm")
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    p.add_argument("--train-size", type=int, default=8192, help="training points")
    p.add_argument("--eval-size", type=int, default=4096, help="held-out points")
    p.add_argument("--ckpt-dir", default=None, help="keep checkpoints here")
    p.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trio", action="store_true", help="run the controller on trio")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.listen:  # the machines reach the controller over tcp at this address
        os.environ.setdefault("AMESH_TRANSPORT", "tcp")
        os.environ["AMESH_HOST"] = arguments.listen
    amesh.run(main, arguments, backend="trio" if arguments.trio else None)
