"""What a ProcMesh writes down about itself, for ``amesh list`` and for a persistent
mesh's host agents, and what a controller that takes a persistent mesh over makes of
that record again."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .. import _wire
from .._model import Actor, ActorMesh
from .._shape import Shape
from ._lifecycle import MeshState, Spawned

__all__ = [
    "Detacher",
    "Unknown",
    "listing_of",
    "named_actor_mesh",
    "record_of",
    "spawned_from",
]

log = logging.getLogger("amesh.mesh")


class Unknown(Actor):
    """Stands for an actor class that could not be loaded (see ``actor_mesh``)."""


class Detacher:
    """Stands for a persistent mesh among what its owner stops: lets go of it."""

    def __init__(self, detach: Callable[[], None]) -> None:
        self._detach = detach

    async def stop(self) -> None:
        self._detach()


def record_of(
    name: str | None,
    shape: Shape,
    fanout: int,
    heartbeat: tuple[float, float],
    settings: dict[str, Any],
    st: MeshState,
) -> dict[str, Any]:
    """What another controller needs to take a persistent mesh over: its shape,
    settings, processes and actor meshes (each class pickled by reference, when it
    pickles without buffers)."""
    actors = []
    for key, sp in st.spawned.items():
        cls = _wire.dumps(sp.mesh.actor_class)
        actors.append(
            {
                "name": sp.mesh.name,
                "key": key,
                "cls": bytes(cls.data) if not cls.buffers else b"",
                "class": sp.mesh.actor_class.__qualname__,
            }
        )
    return {
        "name": name,
        "labels": list(shape.labels),
        "sizes": list(shape.sizes),
        "fanout": fanout,
        "heartbeat": list(heartbeat),
        # (its restarted workers get them under the controller that took it over)
        "settings": settings,
        "procs": [[p.addr, p.pid] for p in st.procs],
        "actors": actors,
        "controller": st.runtime.address,
        "controller_pid": st.runtime.pid,
    }


def listing_of(
    name: str, shape: Shape, st: MeshState, persistent: bool, output: str
) -> dict[str, Any]:
    """A running mesh as ``amesh list`` finds it (see :mod:`amesh._mesh._registry`)."""
    return {
        "name": name,
        "labels": list(shape.labels),
        "sizes": list(shape.sizes),
        "addrs": list(st.addrs),
        "pids": [p.pid for p in st.procs],
        "actors": [sp.mesh.name for sp in st.spawned.values()],
        "controller": st.runtime.address,
        "persistent": persistent,
        "output": output,
    }


def spawned_from(
    actors: Sequence[dict[str, Any]],
    shape: Shape,
    addrs: list[str],
    fanout: int,
    group: int,
    owner: Any,
) -> dict[str, Spawned]:
    """The actor meshes of a persistent mesh's record (``actors``, as
    :func:`record_of` wrote them), by key, owned by ``owner``; a class this process
    cannot import stands as :class:`Unknown`."""
    spawned: dict[str, Spawned] = {}
    for a in actors:
        cls: type[Actor] = Unknown
        try:
            if a["cls"]:
                cls = _wire.loads(a["cls"])
        except Exception as exc:  # a module this process cannot import
            log.info("cannot load the class of actor mesh %r: %s", a["name"], exc)
        mesh = ActorMesh(a["name"], a["key"], cls, shape, addrs, fanout, group)
        mesh._owner = owner
        spawned[a["key"]] = Spawned(mesh, _wire.dumps((cls, (), {})), None)
    return spawned


def named_actor_mesh(
    st: MeshState,
    name: str,
    actor_class: type[Actor] | None,
    fanout: int,
    group: int,
    owner: Any,
    where: str,
) -> ActorMesh[Any]:
    """The live actor mesh named ``name`` of a mesh (``where``), as a new handle owned
    by ``owner``; ``actor_class``: its class, when the recorded one cannot be loaded
    here (see ``ProcMesh.actor_mesh``).

    Raises:
        LookupError: there is none, or its class cannot be loaded here and none is given.
    """
    for sp in st.spawned.values():
        mesh = sp.mesh
        if mesh.name == name:
            cls = actor_class or mesh.actor_class
            if cls is Unknown:
                raise LookupError(
                    f"the class of actor mesh {name!r} cannot be loaded here: pass it "
                    "as actor_mesh(name, actor_class=...)"
                )
            found = ActorMesh(mesh.name, mesh.key, cls, mesh.shape, st.addrs, fanout, group)
            found._owner = owner
            return found
    known = ", ".join(sorted(sp.mesh.name for sp in st.spawned.values())) or "none"
    raise LookupError(f"{where} has no actor mesh named {name!r} (there are: {known})")
