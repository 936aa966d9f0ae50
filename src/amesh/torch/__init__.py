"""amesh.torch: torch.distributed on a :class:`~amesh.ProcMesh`, and tensors in messages.

``import amesh`` never imports torch; ``import amesh.torch`` does.

Process groups
--------------
``await init_process_group(procs)`` makes the processes of a running ProcMesh one
torch.distributed job of ``len(procs)`` ranks (rank = the flat row-major rank in
``procs``). In each worker it sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and ``CUDA_VISIBLE_DEVICES`` from
the ``gpus`` coordinate, if ``procs`` has a ``gpus`` dimension) and initialises the
default process group. The group belongs to the worker process, so actors spawned on
``procs`` afterwards run collectives directly::

    async with ProcMesh(per_host={"gpus": 4}) as procs:
        group = await amesh.torch.init_process_group(procs)
        trainers = await procs.spawn("trainers", Trainer)   # may use dist.all_reduce
        ...
    # leaving the block destroyed the group in every worker

An endpoint that runs a collective returns only once every rank has joined it: call
it on the whole mesh (``call``, ``broadcast``), not with ``choose`` or on a slice, or
it waits for the group's timeout.

The group lives until ``await group.destroy()`` or until the ProcMesh exits: it is
owned by an internal actor whose ``__cleanup__`` calls
``torch.distributed.destroy_process_group()``, and a ProcMesh stops every actor mesh
(running ``__cleanup__``) when it exits, the latest spawned first, so actors spawned
after the group may still use it in their own ``__cleanup__``. Several ProcMeshes may
each have a group at once (they are different processes); a process belongs to one
default group at a time. A process that is restarted (``restart=`` on spawn) starts
without the group: ``await group.destroy()``, then make a new one.

Call ``init_process_group`` before any actor on ``procs`` touches CUDA:
``CUDA_VISIBLE_DEVICES`` only takes effect in a process that has not initialised CUDA
yet (merely importing torch is fine).

Tensors in messages
-------------------
Tensors travel as endpoint arguments and results, nested anywhere in them. A CPU
tensor of any dtype and shape (0-d and empty included) arrives with the same dtype,
shape, values and ``requires_grad``; autograd history does not travel (the receiver
gets a leaf), and an ``nn.Parameter`` arrives as a Parameter. The bytes travel out of
band, not copied into the pickle. A non-contiguous tensor (a slice, a transpose, an
``expand``) travels as a contiguous copy of the elements it shows, so it arrives
contiguous, and a small view of a large tensor sends only the view.

A CUDA tensor is delivered on the CPU unless the receiver moves it: the sender copies
it to host memory, and the receiver calls ``.to(device)`` (or ``.cuda()``) where it
wants it. amesh never guesses a device. Calling ``.cpu()`` yourself before returning
makes the copy explicit and costs the same.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter

import anyio

from .._errors import ActorError, SupervisionError
from .._mesh import ProcMesh
from .._model import ActorMesh
from ._setup import RankEnv, TorchSetup, why_not_nccl

__all__ = ["DistGroup", "init_process_group"]

log = logging.getLogger("amesh.torch")

#: How long tearing down a half-made group may take after a failed init, in seconds.
_CLEANUP_TIMEOUT = 10.0


class DistGroup:
    """The default process group over a ProcMesh's processes (see :func:`init_process_group`).

    Attributes:
        procs: the ProcMesh whose processes are the ranks.
        backend: the torch.distributed backend (``"gloo"``, ``"nccl"``, ...).
        world_size: the number of ranks, ``len(procs)``.
        master_addr: ``MASTER_ADDR``, where rank 0's store listens.
        master_port: ``MASTER_PORT``.
        envs: the variables set in each rank's ``os.environ``, indexed by rank
            (``CUDA_VISIBLE_DEVICES`` aside).
    """

    def __init__(
        self,
        procs: ProcMesh,
        setup: ActorMesh[TorchSetup],
        backend: str,
        envs: list[RankEnv],
    ) -> None:
        self.procs = procs
        self.backend = backend
        self.envs = envs
        self.world_size = len(envs)
        self.master_addr = envs[0]["MASTER_ADDR"]
        self.master_port = int(envs[0]["MASTER_PORT"])
        self._setup: ActorMesh[TorchSetup] | None = setup

    def __repr__(self) -> str:
        state = "destroyed" if self._setup is None else "live"
        return (
            f"<DistGroup {self.backend} world_size={self.world_size} "
            f"{self.master_addr}:{self.master_port} {state}>"
        )

    async def destroy(self) -> None:
        """Destroy the group in every worker (``torch.distributed.destroy_process_group``).

        Not needed before the ProcMesh exits: its exit does the same. Calling it again
        does nothing. Afterwards ``init_process_group`` may be called on the processes
        again.

        Raises:
            RuntimeError: the ProcMesh is no longer running (its exit destroyed the group).
        """
        setup, self._setup = self._setup, None
        if setup is not None:
            await setup.stop()


def _rank_envs(hosts: list[str], master_addr: str, master_port: int) -> list[RankEnv]:
    """The torchrun-style variables of every rank; local ranks count per host."""
    per_host = Counter(hosts)
    seen: Counter[str] = Counter()
    envs: list[RankEnv] = []
    for rank, host in enumerate(hosts):
        envs.append(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(len(hosts)),
                "LOCAL_RANK": str(seen[host]),
                "LOCAL_WORLD_SIZE": str(per_host[host]),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
            }
        )
        seen[host] += 1
    return envs


async def init_process_group(
    procs: ProcMesh,
    backend: str | None = None,
    *,
    cuda_visible_devices: bool = True,
    timeout: float | None = None,
) -> DistGroup:
    """Make the processes of ``procs`` one torch.distributed job with a default group.

    Rank ``r`` of the group is the process at flat rank ``r`` of ``procs``. Rank 0 finds
    a free port for the group's store on its own host; on one host the store listens on
    127.0.0.1 only. Actors spawned on ``procs`` (or on the ProcMesh it views) afterwards
    see the group and the environment variables. See the module docstring for the
    variables set and for when the group is destroyed.

    Args:
        procs: a running ProcMesh (or a view of one).
        backend: the torch.distributed backend; None picks ``"nccl"`` where every
            worker has a CUDA device of its own (its ``gpus`` coordinate, if any, is
            below its host's device count), else ``"gloo"``: one backend for all.
            Where ranks that have GPUs get gloo this way, the ``amesh.torch`` logger
            warns and says why.
        cuda_visible_devices: if ``procs`` has a ``gpus`` dimension, set each worker's
            ``CUDA_VISIBLE_DEVICES`` to its ``gpus`` coordinate (indexing the devices
            the worker inherited, if it inherited ``CUDA_VISIBLE_DEVICES``), so its GPU
            is ``cuda:0``. False leaves it alone.
        timeout: seconds for connecting the ranks and for each collective afterwards;
            None keeps torch's defaults.

    Returns:
        A :class:`DistGroup` describing the group; ``await group.destroy()`` ends it.

    Raises:
        TypeError: ``procs`` is not a ProcMesh.
        ValueError: ``timeout`` is not a positive number of seconds.
        RuntimeError: ``procs`` is not running, or some of its processes already
            belong to a default process group.
        ActorError: a worker could not set up or join the group (the remote error says
            why, e.g. a ``gpus`` coordinate outside the inherited
            ``CUDA_VISIBLE_DEVICES``, or past the host's CUDA devices under nccl, or a
            timeout connecting to the store).
        SupervisionError: a worker process died meanwhile.
    """
    if not isinstance(procs, ProcMesh):
        raise TypeError(f"init_process_group needs a ProcMesh, got {type(procs).__name__}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    setup = await procs.spawn(f"_torch_setup_{uuid.uuid4().hex[:8]}", TorchSetup)
    try:
        described = (await setup.describe.call()).values()
        busy = [rank for rank, (_, initialized, _, _) in enumerate(described) if initialized]
        if busy:
            raise RuntimeError(
                f"ranks {busy} of {procs!r} already belong to a default process group; "
                "destroy it first (DistGroup.destroy)"
            )
        hosts = [host for host, _, _, _ in described]
        gpus_dim = cuda_visible_devices and "gpus" in procs.sizes
        if backend is None:
            counts = [count for _, _, count, _ in described]
            gpus = [gpu for _, _, _, gpu in described] if gpus_dim else None
            backend = _choose_backend(procs, counts, gpus)
        one_host = len(set(hosts)) == 1
        master_addr = "127.0.0.1" if one_host else hosts[0]
        rank0 = setup.flatten("rank").slice(rank=0)
        port = await rank0.open_store.call_one(master_addr)
        envs = _rank_envs(hosts, master_addr, port)
        backends = (await setup.init.call(envs, gpus_dim, backend, timeout)).values()
    except BaseException:
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLEANUP_TIMEOUT):
            try:
                await setup.stop()
            except (ActorError, SupervisionError, RuntimeError) as exc:
                log.warning("tearing down a failed process group: %s", exc)
        raise
    return DistGroup(procs, setup, backends[0], envs)


def _choose_backend(procs: ProcMesh, counts: list[int], gpus: list[int] | None) -> str:
    """The backend for a group whose ranks see ``counts`` CUDA devices (with ``gpus``
    coordinates): nccl where :func:`why_not_nccl` finds nothing against it, else gloo,
    with a warning saying why when some ranks have GPUs."""
    why = why_not_nccl(counts, gpus)
    if why is None:
        return "nccl"
    if any(counts):
        log.warning(
            "the process group of %r uses gloo on the CPU, not nccl: %s; pass backend= "
            "to choose, or give each rank a GPU of its own",
            procs,
            why,
        )
    return "gloo"
