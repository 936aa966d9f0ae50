"""The actor that :func:`amesh.torch.init_process_group` spawns on every worker.

A worker's default process group belongs to the process, not to this actor: once
``init`` has run, every actor spawned later in the same process can run collectives.
Blocking torch calls run in a worker thread, so the worker's event loop keeps serving
messages (to its other actors, say) while a rank waits for its peers.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from .._model import Actor, current_rank, endpoint
from .._runtime import current_runtime

__all__ = ["RankEnv", "TorchSetup", "why_not_nccl"]

#: What one rank is told: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
#: ``MASTER_ADDR`` and ``MASTER_PORT``, set in its ``os.environ``.
RankEnv = dict[str, str]

#: ``CUDA_VISIBLE_DEVICES`` as the worker started with it (None: unset). Kept so that a
#: second group in the same process indexes the same devices as the first.
_inherited_cuda_devices: list[str | None] = []


def _timedelta(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def _visible_device(gpu: int, cuda: bool) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for the ``gpus`` coordinate ``gpu``.

    It indexes the devices the worker inherited, if ``CUDA_VISIBLE_DEVICES`` was set;
    with ``cuda`` (the group runs on CUDA) the device must exist.
    """
    if not _inherited_cuda_devices:
        _inherited_cuda_devices.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return device_for(gpu, _inherited_cuda_devices[0], _device_count() if cuda else 0)


def _device_count() -> int:
    # (counts the devices without initialising CUDA, so CUDA_VISIBLE_DEVICES still works)
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_for(gpu: int, inherited: str | None, count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for the ``gpus`` coordinate ``gpu`` of a worker that
    inherited ``inherited`` (None: unset) and must find a CUDA device among ``count``
    (0: the group does not run on CUDA, any coordinate will do).

    Raises:
        ValueError: the coordinate names a device this worker does not have: past the
            inherited list, or past the host's ``count`` devices.
    """
    if inherited is None:
        if count and gpu >= count:
            raise ValueError(
                f"gpus coordinate {gpu} is out of range: this host has {count} CUDA "
                "device(s); make the gpus dimension at most that, or pass "
                "cuda_visible_devices=False"
            )
        return str(gpu)
    devices = [d.strip() for d in inherited.split(",") if d.strip()]
    if gpu >= len(devices):
        raise ValueError(
            f"gpus coordinate {gpu} is out of range: the worker inherited "
            f"CUDA_VISIBLE_DEVICES={inherited!r}"
        )
    return devices[gpu]


def why_not_nccl(device_counts: list[int], gpus: list[int] | None = None) -> str | None:
    """Why a group whose ranks see these numbers of CUDA devices (and, with a ``gpus``
    dimension, have these ``gpus`` coordinates) cannot use nccl; None if it can:
    every rank needs a device of its own, and a group's ranks must agree on the
    backend, else they hang."""
    if not device_counts:
        return "the group has no ranks"
    without = [rank for rank, count in enumerate(device_counts) if not count]
    if without:
        return f"no CUDA device at {_ranks(without)}"
    if gpus is not None:
        over = [r for r, (g, n) in enumerate(zip(gpus, device_counts, strict=True)) if g >= n]
        if over:
            return (
                f"more ranks per host than GPUs: the gpus coordinate of {_ranks(over)} is "
                "past its host's CUDA devices"
            )
    return None


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


class TorchSetup(Actor):
    """Sets a worker up for ``torch.distributed`` and tears its group down."""

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._store: TCPStore | None = None
        self._initialized = False

    @endpoint
    def describe(self) -> tuple[str, bool, int, int]:
        """``(this host, whether this process already has a default group, the CUDA
        devices it sees, its gpus coordinate or -1)``: the host is the address this
        process listens on when that is tcp (the one other machines reach it at), else
        the hostname."""
        scheme, _, rest = current_runtime().address.partition("://")
        host = rest.rsplit(":", 1)[0].strip("[]") if scheme.endswith("tcp") else ""
        initialized = dist.is_available() and dist.is_initialized()
        point = current_rank()
        gpu = point["gpus"] if "gpus" in point.sizes else -1
        return host or socket.gethostname(), initialized, _device_count(), gpu

    @endpoint
    def open_store(self, bind_addr: str) -> int:
        """Listen for the group's TCPStore on ``bind_addr``; returns the port.

        The socket is bound here, on rank 0, and handed to the store, so the port is
        free by construction and the listener stays on ``bind_addr`` (loopback on one
        host) rather than on every interface.
        """
        family = socket.AF_INET6 if ":" in bind_addr else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((bind_addr, 0))
            listener.listen(socket.SOMAXCONN)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        port: int = listener.getsockname()[1]
        return port

    @endpoint
    async def init(
        self,
        envs: list[RankEnv],
        gpus_dim: bool,
        backend: str,
        timeout: float | None,
    ) -> str:
        """Set this rank's environment and join the default process group.

        Args:
            envs: one environment per rank, indexed by the flat rank.
            gpus_dim: set ``CUDA_VISIBLE_DEVICES`` from this rank's ``gpus`` coordinate.
            backend: the torch.distributed backend, the same for every rank.
            timeout: seconds for the store and the group's operations (None: torch's).

        Returns:
            The backend in use.

        Raises:
            ValueError: the ``gpus`` coordinate is outside the inherited
                ``CUDA_VISIBLE_DEVICES``.
            RuntimeError: CUDA was already initialised here, so ``CUDA_VISIBLE_DEVICES``
                could not take effect.
        """
        point = current_rank()
        env = envs[point.rank]
        if gpus_dim:
            device = _visible_device(point["gpus"], "nccl" in backend)
            cuda_started: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            if os.environ.get("CUDA_VISIBLE_DEVICES") != device and cuda_started:
                raise RuntimeError(
                    "CUDA is already initialised in this worker, so CUDA_VISIBLE_DEVICES "
                    "cannot take effect: call amesh.torch.init_process_group before any "
                    "actor touches CUDA, or pass cuda_visible_devices=False"
                )
            os.environ["CUDA_VISIBLE_DEVICES"] = device
        os.environ.update(env)
        return await anyio.to_thread.run_sync(
            self._join, env, backend, timeout, gpus_dim, abandon_on_cancel=True
        )

    def _join(self, env: RankEnv, backend: str, timeout: float | None, gpus_dim: bool) -> str:
        rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        store_timeout = datetime.timedelta(seconds=300 if timeout is None else timeout)
        # The store takes ownership of the listening socket (it closes the fd).
        listen_fd = self._listener.detach() if self._listener is not None else None
        self._listener = None
        self._store = TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            world_size,
            is_master=listen_fd is not None,
            timeout=store_timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        kwargs: dict[str, Any] = {}
        if "nccl" in backend:
            # One device per process: the rank's GPU is device 0 under its own
            # CUDA_VISIBLE_DEVICES, else the LOCAL_RANK-th visible one.
            index = 0 if gpus_dim else int(env["LOCAL_RANK"]) % torch.cuda.device_count()
            kwargs["device_id"] = torch.device("cuda", index)
        dist.init_process_group(
            backend,
            store=self._store,
            rank=rank,
            world_size=world_size,
            timeout=_timedelta(timeout),
            **kwargs,
        )
        self._initialized = True
        return str(dist.get_backend())

    async def __cleanup__(self) -> None:
        """Destroy the default process group this actor made (runs at ProcMesh exit)."""
        if self._initialized and dist.is_initialized():
            await anyio.to_thread.run_sync(dist.destroy_process_group, abandon_on_cancel=True)
        self._initialized = False
        self._store = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
