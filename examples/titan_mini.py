"""titan_mini: a tiny GPT trained with FSDP2, its learning rate steered by the controller.

A character-level GPT (a few transformer blocks, tiny dimensions) learns the text
embedded below. Its parameters are sharded across the ranks with FSDP2
(``torch.distributed.fsdp.fully_shard``, which trains on CPU with gloo in torch 2.13),
so each rank holds only a slice of every weight. The controller drives training step
by step, and between phases it lowers the learning rate through the ``set_lr``
endpoint: the same processes, the same optimizer state, a new rate. Each rank answers
with the rate its optimizer now uses, and the controller prints it per phase.

Run it with ``python examples/titan_mini.py`` (``--procs 2 --steps 180`` by default;
``--trio`` for the trio backend).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import amesh
import amesh.torch
from amesh import Actor, ProcMesh, endpoint

TEXT = """\
An actor is a small thing that owns its state and answers messages one at a time.
A mesh is many actors with named dimensions, one per process, all answering at once.
The controller sends a message to the mesh and awaits the answers; a failure anywhere
comes back as an exception, with the remote traceback, where the controller awaits.
The trainers shard the model, each rank holding a slice of every weight, and gather
the whole weight only for the moment it is needed. Step by step the loss falls, and
between the phases the controller lowers the learning rate without stopping anything.
"""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, and a linear head."""

    def __init__(self, vocab: int, block_size: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``(batch * time, vocab)`` for token ids ``(batch, time)``."""
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        # 2-D into the head, so the output is a fresh tensor rather than a view (FSDP2
        # warns about views coming out of a sharded module).
        logits: torch.Tensor = self.head(self.ln(x).flatten(0, 1))
        return logits


class Trainer(Actor):
    """One FSDP2 rank: a shard of the GPT and of its optimizer state."""

    def __init__(self, seed: int, batch_size: int, block_size: int, lr: float) -> None:
        torch.set_num_threads(1)  # several workers share few cores
        self.rank = dist.get_rank()
        self.chars = sorted(set(TEXT))
        self.data = torch.tensor([self.chars.index(c) for c in TEXT])
        self.batch_size, self.block_size = batch_size, block_size
        self.gen = torch.Generator().manual_seed(seed * 1000 + self.rank)
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = GPT(len(self.chars), block_size, dim=64, layers=2, heads=4)
        # on the CPUs, with gloo, also on a machine with GPUs (left to the other examples)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)  # each block's weights are gathered just for its use
        fully_shard(model, mesh=mesh)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` random windows of the text, and the same shifted by one."""
        n, data = self.block_size, self.data
        starts = torch.randint(0, len(data) - n - 1, (self.batch_size,), generator=self.gen)
        x = torch.stack([data[s : s + n] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + n] for s in starts.tolist()])
        return x, y

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y.reshape(-1))

    @endpoint
    def shard_sizes(self) -> tuple[int, int]:
        """``(parameters held by this rank, parameters of the whole model)``."""
        params = list(self.model.parameters())
        local = sum(p.to_local().numel() for p in params)  # FSDP2 params are DTensors
        return local, sum(p.numel() for p in params)

    @endpoint
    def set_lr(self, lr: float) -> float:
        """Use learning rate ``lr`` from the next step on; returns the rate now in use."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        return float(self.opt.param_groups[0]["lr"])

    @endpoint
    def step(self) -> float:
        """One training step on a batch drawn by this rank; returns the local loss."""
        loss = self._loss(*self._batch())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters each gradient to its shard
        self.opt.step()
        return float(loss.item())

    @endpoint
    def sample(self, prompt: str, length: int) -> str:
        """Greedy continuation of ``prompt``; every rank runs it (FSDP all-gathers)."""
        idx = torch.tensor([[self.chars.index(c) for c in prompt]])
        with torch.no_grad():
            for _ in range(length):
                logits = self.model(idx[:, -self.block_size :])
                idx = torch.cat([idx, logits[-1:].argmax(dim=-1, keepdim=True)], dim=1)
        return "".join(self.chars[i] for i in idx[0].tolist())


async def main(args: argparse.Namespace) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    lrs = [args.lr * 0.3**i for i in range(args.phases)]
    async with ProcMesh(per_host={"gpus": args.procs}, env=env) as procs:
        group = await amesh.torch.init_process_group(procs, backend="gloo")
        trainers = await procs.spawn(
            "trainers", Trainer, args.seed, args.batch_size, args.block_size, lrs[0]
        )
        local, total = (await trainers.shard_sizes.call()).values()[0]
        print(
            f"FSDP2 over {group.world_size} ranks ({group.backend}): "
            f"rank 0 holds {local:,} of {total:,} parameters"
        )
        first = last = math.nan
        step = 0
        start = time.perf_counter()
        bar = tqdm(total=args.steps, desc="train", unit="step", mininterval=0.5)
        for phase, lr in enumerate(lrs, 1):
            in_use = (await trainers.set_lr.call(lr)).values()
            phase_first = math.nan
            phase_steps = args.steps // args.phases + (phase <= args.steps % args.phases)
            for _ in range(phase_steps):
                losses = (await trainers.step.call()).values()
                last = sum(losses) / len(losses)
                step += 1
                if step == 1:
                    first = last
                if math.isnan(phase_first):
                    phase_first = last
                bar.update()
                bar.set_postfix(loss=f"{last:.3f}", lr=f"{lr:.1e}", refresh=False)
            bar.write(
                f"phase {phase}: lr {lr:.1e} (ranks use {[f'{x:.1e}' for x in in_use]}), "
                f"steps {step - phase_steps + 1}-{step}, loss {phase_first:.3f} -> {last:.3f}"
            )
        bar.close()
        elapsed = time.perf_counter() - start
        print(f"first loss: {first:.4f}")
        print(f"last loss: {last:.4f}")
        print(f"trained {step} steps in {elapsed:.1f} s")
        text = (await trainers.sample.call("The ", 60)).values()
        print(f"sample: {text[0]!r}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2, help="worker processes (ranks)")
    p.add_argument("--steps", type=int, default=180, help="training steps in all")
    p.add_argument("--phases", type=int, default=3, help="lr phases (lr x0.3 each)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate of phase 1")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=32, help="context length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trio", action="store_true", help="run the controller on trio")
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    amesh.run(main, arguments, backend="trio" if arguments.trio else None)
