"""Actor classes for tests/test_torch.py (importable by workers, so pickled by reference)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from amesh import Actor, endpoint

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class DistWorker(Actor):
    """Reports its environment and runs collectives on the default group."""

    @endpoint
    def env(self) -> dict[str, str | None]:
        names = (*ENV_NAMES, "CUDA_VISIBLE_DEVICES")
        return {name: os.environ.get(name) for name in names}

    @endpoint
    def group(self) -> tuple[int, int, str, int]:
        return dist.get_rank(), dist.get_world_size(), dist.get_backend(), os.getpid()

    @endpoint
    def all_reduce(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())

    @endpoint
    def all_gather_pids(self) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(out, torch.tensor([os.getpid()]))
        return [int(t.item()) for t in out]

    @endpoint
    def initialized(self) -> bool:
        return dist.is_initialized()

    @endpoint
    def echo(self, x: Any) -> Any:
        return x

    @endpoint
    def double(self, t: torch.Tensor) -> torch.Tensor:
        return t * 2

    def __cleanup__(self) -> None:
        """With AMESH_TEST_TORCH_CLEANUP_DIR set, run one more collective and record it."""
        path = os.environ.get("AMESH_TEST_TORCH_CLEANUP_DIR")
        if path and dist.is_initialized():
            t = torch.ones(1)
            dist.all_reduce(t)
            with open(os.path.join(path, f"rank{dist.get_rank()}"), "w") as f:
                f.write(str(float(t.item())))
