"""ActorMesh: a typed handle on one actor per rank of a process mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from .._runtime import Tree, bridged_always, grouped
from .._shape import Shape
from ._endpoint import MeshEndpoint
from ._value_mesh import MeshView

if TYPE_CHECKING:
    from ._actor import Actor, EndpointDescriptor

__all__ = ["ActorMesh"]

A = TypeVar("A", bound="Actor")
P = ParamSpec("P")
R = TypeVar("R")


class MeshOwner(Protocol):
    """What spawned an actor mesh and stops it: its ProcMesh, a layer above this one."""

    async def _stop_actor_mesh(self, mesh: ActorMesh[Any]) -> None: ...

    def _session_failure(self) -> Exception | None: ...

    #: why this controller no longer drives the mesh (another took it over), else None
    _taken_over: str | None


class ActorMesh(MeshView, Generic[A]):
    """One actor per rank; endpoints are attributes: ``mesh.step.call(...)``.

    Type checkers: with mypy's ``amesh.mypy`` plugin, ``mesh.step`` of an
    ``ActorMesh[Trainer]`` is the :class:`MeshEndpoint` typed by ``Trainer.step``'s
    signature. Without it (other checkers) it is untyped; ``mesh.endpoint(Trainer.step)``
    is the same endpoint, typed everywhere.

    Actor meshes can be passed in messages; a received mesh can be called but not
    stopped (its owner keeps supervision).

    Attributes:
        name: the name given at spawn.
        key: the unique routing key of this mesh.
        actor_class: the class of the actors.
    """

    def __init__(
        self,
        name: str,
        key: str,
        actor_class: type[A],
        shape: Shape,
        procs: Sequence[str],
        fanout: int = 0,
        group: int = 0,
    ) -> None:
        self.name = name
        self.key = key
        self.actor_class = actor_class
        self._shape = shape
        self._procs = procs
        #: the relay tree's fan-out (below 2: every rank is sent to directly)
        self._fanout = fanout
        #: processes per host when it spans hosts (the tree's first level is hosts)
        self._group = group
        #: the ProcMesh that spawned it, in the owner's process only
        self._owner: MeshOwner | None = None

    def _with_shape(self, shape: Shape) -> ActorMesh[A]:
        view = ActorMesh(
            self.name, self.key, self.actor_class, shape, self._procs, self._fanout, self._group
        )
        view._owner = self._owner
        return view

    @bridged_always
    async def stop(self) -> None:
        """Stop these actors (``__cleanup__`` runs); their processes live on.

        Raises:
            RuntimeError: this handle was received in a message; only the owner stops.
        """
        if self._owner is None:
            raise RuntimeError(f"{self!r} was not spawned here; only its owner can stop it")
        await self._owner._stop_actor_mesh(self)

    def _targets(self) -> dict[int, str]:
        """Rank -> the address of its process now (a restart changes it).

        Raises:
            RuntimeError: another controller took the mesh over.
        """
        owner = self._owner
        if owner is not None and owner._taken_over is not None:
            raise RuntimeError(owner._taken_over)
        procs, slots = self._procs, self._shape.slots
        if len(slots) == 1:  # (every call_one: no comprehension to run)
            return {0: procs[slots[0]]}
        return {rank: procs[slot] for rank, slot in enumerate(slots)}

    def _dense_shape(self) -> Shape:
        """This view's labels and sizes as a shape of its own, ranks from 0: what the
        ValueMesh of a call's results and its errors' coordinates use (made once)."""
        ds = self.__dict__.get("_ds")
        if ds is None:
            ds = self.__dict__["_ds"] = Shape(self._shape.labels, self._shape.sizes)
        return ds

    def _route(self) -> tuple[list[str], list[int], Tree | None]:
        """How calls to this view travel (made once): the ``labels`` and ``sizes``
        they carry, and the relay tree, when this mesh is big enough to use one or
        spans hosts (it holds the list of addresses that a restart changes in place)."""
        route: tuple[list[str], list[int], Tree | None] | None = self.__dict__.get("_routing")
        if route is None:
            tree: Tree | None = None
            if self._fanout >= 2 and (
                len(self._procs) > self._fanout or grouped(self._procs, self._group)
            ):
                slots = dict(enumerate(self._shape.slots))
                tree = Tree(self._procs, slots, self._fanout, self._group)
            shape = self._shape
            route = self.__dict__["_routing"] = (list(shape.labels), list(shape.sizes), tree)
        return route

    def endpoint(self, desc: EndpointDescriptor[P, R]) -> MeshEndpoint[P, R]:
        """The endpoint ``desc`` of these actors, typed by its signature:
        ``mesh.endpoint(Trainer.step)`` is ``mesh.step``.

        Raises:
            AttributeError: ``desc`` is not an endpoint of this mesh's actor class (as
                it dispatches it: not one a subclass overrode).
        """
        eps = self.actor_class._amesh_endpoints
        if eps.get(desc.name) is not desc:
            raise AttributeError(
                f"{getattr(desc.fn, '__qualname__', desc.name)} is not an endpoint of "
                f"{self.actor_class.__qualname__} "
                f"(endpoints: {', '.join(sorted(eps)) or 'none'})"
            )
        return MeshEndpoint(self, desc)

    def __getattr__(self, name: str) -> MeshEndpoint[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        eps = getattr(self.actor_class, "_amesh_endpoints", {})
        desc = eps.get(name)
        if desc is None:
            raise AttributeError(
                f"{self.actor_class.__qualname__} has no endpoint {name!r} "
                f"(endpoints: {', '.join(sorted(eps)) or 'none'})"
            )
        ep: MeshEndpoint[..., Any] = MeshEndpoint(self, desc)
        # kept: `mesh.name` finds it from now on without coming here (an actor class's
        # endpoints are fixed when it is defined)
        self.__dict__[name] = ep
        return ep

    def __repr__(self) -> str:
        return f"<ActorMesh {self.name!r} of {self.actor_class.__qualname__} {self.sizes}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            ActorMesh,
            (
                self.name,
                self.key,
                self.actor_class,
                self._shape,
                tuple(self._procs),
                self._fanout,
                self._group,
            ),
        )
