"""ValueMesh: one value per rank of the mesh that was called."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from .._shape import Point, Shape

__all__ = ["MeshView", "ValueMesh"]

T = TypeVar("T")
V = TypeVar("V", bound="MeshView")


class MeshView:
    """Shape operations shared by process, actor and value meshes."""

    _shape: Shape

    def _with_shape(self: V, shape: Shape) -> V:
        raise NotImplementedError

    @property
    def sizes(self) -> dict[str, int]:
        """``{dim: size}``, outermost first."""
        return self._shape.size_dict()

    @property
    def shape(self) -> Shape:
        """The :class:`Shape` of this view."""
        return self._shape

    def __len__(self) -> int:
        return len(self._shape)

    def slice(self: V, /, **dims: int | slice) -> V:
        """A view: ``dim=int`` drops the dimension, ``dim=slice(a, b)`` narrows it."""
        return self._with_shape(self._shape.slice(**dims))

    def flatten(self: V, name: str) -> V:
        """The same ranks as one dimension called ``name``."""
        return self._with_shape(self._shape.flatten(name))

    def rename(self: V, /, **names: str) -> V:
        """Rename dimensions: ``rename(gpus="dp")``."""
        return self._with_shape(self._shape.rename(**names))

    def split(self: V, dim: str, /, **into: int) -> V:
        """Split ``dim`` into new dimensions: ``split("gpus", dp=2, tp=-1)``."""
        return self._with_shape(self._shape.split(dim, **into))


class ValueMesh(MeshView, Generic[T]):
    """Results of a ``call``, shaped like the mesh that was called; or one argument per
    rank of a call.

    An argument of a call that is a ValueMesh is scattered: each rank of the called
    mesh gets only its own element, the one at its point (the ValueMesh must have the
    called mesh's shape). So the results of one mesh's call can feed another mesh of
    the same shape: ``await b.consume.call(await a.produce.call())``. To pass a
    ValueMesh itself to every rank, pass :meth:`whole`.

    Args:
        shape: the shape; its slots index ``values``.
        values: one value per slot.
    """

    #: scattered when passed as an argument (False for :meth:`whole`)
    _scatter = True

    def __init__(self, shape: Shape, values: Sequence[T]) -> None:
        self._shape = shape
        self._values = list(values)

    @classmethod
    def of(cls, mesh: MeshView | Shape, values: Sequence[T]) -> ValueMesh[T]:
        """One value per rank of ``mesh`` (a process, actor or value mesh, a slice of
        one, or a :class:`Shape`), in rank order: ``ValueMesh.of(trainers, shards)``.

        Raises:
            ValueError: ``values`` does not have one value per rank.
        """
        shape = mesh if isinstance(mesh, Shape) else mesh.shape
        if len(values) != len(shape):
            raise ValueError(
                f"{len(values)} values for a mesh of {len(shape)} ranks {shape.size_dict()}"
            )
        return cls(Shape(shape.labels, shape.sizes), values)

    def whole(self) -> ValueMesh[T]:
        """This ValueMesh as one argument that every rank gets whole, not scattered."""
        view = ValueMesh(self._shape, self._values)
        view._scatter = False
        return view

    def _with_shape(self, shape: Shape) -> ValueMesh[T]:
        return ValueMesh(shape, self._values)

    def items(self) -> Iterator[tuple[Point, T]]:
        """``(point, value)`` in rank order."""
        for point, slot in zip(self._shape.points(), self._shape.slots):
            yield point, self._values[slot]

    def values(self) -> list[T]:
        """The values in rank order."""
        return [self._values[s] for s in self._shape.slots]

    def __iter__(self) -> Iterator[tuple[Point, T]]:
        return self.items()

    def item(self, /, **coords: int) -> T:
        """The value at full coordinates ``coords`` (none needed on a single rank).

        Raises:
            ValueError: no coordinates given for a mesh of more than one rank.
        """
        if not coords:
            if len(self) != 1:
                raise ValueError(f"item() without coordinates needs one rank, not {len(self)}")
            return self._values[self._shape.slots[0]]
        return self._values[self._shape.slots[self._shape.rank_of(coords)]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ValueMesh):
            return NotImplemented
        # dict equality ignores order: (a=2, b=3) and (b=3, a=2) are different meshes
        same_dims = list(self.sizes.items()) == list(other.sizes.items())
        return same_dims and self.values() == other.values()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ValueMesh({self.sizes}, {self.values()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ValueMesh, (Shape(self._shape.labels, self._shape.sizes), self.values()))
