"""Named-dimension shapes shared by process meshes, actor meshes and value meshes.

A :class:`Shape` is a row-major view over an underlying, flat list of positions
("slots"). Slicing never copies the mesh, it only narrows the list of slots, so a
view of a view still knows which underlying process each of its ranks is.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Point", "Shape"]


class Point(Mapping[str, int]):
    """A read-only mapping ``dim -> index`` with the flat row-major ``rank``.

    Attributes:
        rank: the flat row-major index of this point in its shape.
        sizes: the sizes of the shape this point lives in.
    """

    __slots__ = ("_coords", "rank", "sizes")

    def __init__(self, coords: Mapping[str, int], rank: int, sizes: Mapping[str, int]) -> None:
        self._coords = dict(coords)
        self.rank = rank
        self.sizes = dict(sizes)

    def __getitem__(self, key: str) -> int:
        return self._coords[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self._coords.items())
        return f"Point({inner}, rank={self.rank})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._coords == other._coords and self.rank == other.rank
        if isinstance(other, Mapping):
            return self._coords == dict(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((tuple(self._coords.items()), self.rank))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Point, (self._coords, self.rank, self.sizes))


def _check_label(name: str) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"dimension names must be identifiers, got {name!r}")


class Shape:
    """Named dimensions over a row-major list of underlying slots.

    Args:
        labels: the dimension names, outermost first.
        sizes: the size of each dimension.
        slots: the underlying position of every rank, in row-major order; defaults
            to ``range(prod(sizes))``.
    """

    __slots__ = ("labels", "sizes", "slots")

    def __init__(
        self,
        labels: Sequence[str],
        sizes: Sequence[int],
        slots: Sequence[int] | None = None,
    ) -> None:
        labels = tuple(labels)
        sizes = tuple(int(s) for s in sizes)
        if len(labels) != len(sizes):
            raise ValueError("labels and sizes differ in length")
        if len(set(labels)) != len(labels):
            raise ValueError(f"duplicate dimension names in {labels}")
        for name in labels:
            _check_label(name)
        for name, size in zip(labels, sizes):
            if size < 0:
                raise ValueError(f"dimension {name!r} has negative size {size}")
        n = math.prod(sizes)
        slots = tuple(range(n)) if slots is None else tuple(slots)
        if len(slots) != n:
            raise ValueError(f"{len(slots)} slots for a shape of {n} ranks")
        self.labels: tuple[str, ...] = labels
        self.sizes: tuple[int, ...] = sizes
        self.slots: tuple[int, ...] = slots

    @classmethod
    def from_sizes(cls, sizes: Mapping[str, int]) -> Shape:
        """A dense shape from ``{"dim": size, ...}``."""
        if not isinstance(sizes, Mapping) or not sizes:
            raise ValueError(f"expected a non-empty mapping of dim -> size, got {sizes!r}")
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"dimension {name!r} must be a positive int, got {size!r}")
        return cls(list(sizes), list(sizes.values()))

    # -- basic queries --------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.slots)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Shape):
            return NotImplemented
        return (self.labels, self.sizes, self.slots) == (other.labels, other.sizes, other.slots)

    def __hash__(self) -> int:
        return hash((self.labels, self.sizes, self.slots))

    def __repr__(self) -> str:
        return f"Shape({self.size_dict()})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Shape, (self.labels, self.sizes, self.slots))

    def size_dict(self) -> dict[str, int]:
        """The sizes as ``{"dim": size}``."""
        return dict(zip(self.labels, self.sizes))

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of flat ``rank`` in this shape."""
        if not 0 <= rank < len(self):
            raise IndexError(f"rank {rank} out of range for {self!r}")
        out: dict[str, int] = {}
        for name, size in zip(reversed(self.labels), reversed(self.sizes)):
            rank, out[name] = divmod(rank, size)
        return dict(reversed(list(out.items())))

    def point(self, rank: int) -> Point:
        """The :class:`Point` of flat ``rank``."""
        return Point(self.coords(rank), rank, self.size_dict())

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The flat rank of full coordinates ``coords``."""
        if set(coords) != set(self.labels):
            raise KeyError(f"expected coordinates for {self.labels}, got {tuple(coords)}")
        rank = 0
        for name, size in zip(self.labels, self.sizes):
            idx = coords[name]
            if not 0 <= idx < size:
                raise IndexError(f"{name}={idx} out of range(0, {size})")
            rank = rank * size + idx
        return rank

    def points(self) -> Iterator[Point]:
        """Every point, in rank order."""
        sizes = self.size_dict()
        for rank in range(len(self)):
            yield Point(self.coords(rank), rank, sizes)

    # -- views ----------------------------------------------------------------------

    def _ranks_where(self, keep: Mapping[str, range]) -> list[int]:
        out = []
        for rank in range(len(self)):
            c = self.coords(rank)
            if all(c[d] in r for d, r in keep.items()):
                out.append(rank)
        return out

    def slice(self, /, **dims: int | slice) -> Shape:
        """A view: ``dim=int`` drops the dimension, ``dim=slice`` keeps it narrowed."""
        keep: dict[str, range] = {}
        labels: list[str] = []
        sizes: list[int] = []
        for name in dims:
            if name not in self.labels:
                raise KeyError(f"no dimension {name!r} in {self!r}")
        for name, size in zip(self.labels, self.sizes):
            sel = dims.get(name)
            if sel is None:
                labels.append(name)
                sizes.append(size)
            elif isinstance(sel, slice):
                r = range(size)[sel]
                keep[name] = r
                labels.append(name)
                sizes.append(len(r))
            elif isinstance(sel, int) and not isinstance(sel, bool):
                idx = sel + size if sel < 0 else sel
                if not 0 <= idx < size:
                    raise IndexError(f"{name}={sel} out of range(0, {size})")
                keep[name] = range(idx, idx + 1)
            else:
                raise TypeError(f"{name}= takes an int or a slice, got {sel!r}")
        # Row-major order over the kept ranges, with the original order of dims.
        order = [self.slots[r] for r in self._ordered_ranks(keep)]
        return Shape(labels, sizes, order)

    def _ordered_ranks(self, keep: Mapping[str, range]) -> list[int]:
        ranges = [keep.get(name, range(size)) for name, size in zip(self.labels, self.sizes)]
        out = [0]
        for name_range, size in zip(ranges, self.sizes):
            out = [base * size + i for base in out for i in name_range]
        return out

    def flatten(self, name: str) -> Shape:
        """One dimension ``name`` over every rank, in rank order."""
        _check_label(name)
        return Shape([name], [len(self)], self.slots)

    def rename(self, /, **names: str) -> Shape:
        """Rename dimensions: ``rename(gpus="dp")``."""
        for old in names:
            if old not in self.labels:
                raise KeyError(f"no dimension {old!r} in {self!r}")
        labels = [names.get(n, n) for n in self.labels]
        return Shape(labels, self.sizes, self.slots)

    def split(self, dim: str, /, **into: int) -> Shape:
        """Split ``dim`` into several, outermost first: ``split("gpus", dp=2, tp=-1)``.

        One of the new sizes may be ``-1`` and is inferred.
        """
        if dim not in self.labels:
            raise KeyError(f"no dimension {dim!r} in {self!r}")
        if not into:
            raise ValueError("split needs at least one new dimension")
        i = self.labels.index(dim)
        size = self.sizes[i]
        known = [s for s in into.values() if s != -1]
        if sum(1 for s in into.values() if s == -1) > 1:
            raise ValueError("at most one size may be -1")
        if any(s < 1 for s in known):
            raise ValueError(f"sizes must be positive or -1, got {into}")
        prod = math.prod(known)
        if size % prod:
            raise ValueError(f"cannot split {dim}={size} into {into}")
        new_sizes = [s if s != -1 else size // prod for s in into.values()]
        if math.prod(new_sizes) != size:
            raise ValueError(f"cannot split {dim}={size} into {into}")
        labels = [*self.labels[:i], *into, *self.labels[i + 1 :]]
        sizes = [*self.sizes[:i], *new_sizes, *self.sizes[i + 1 :]]
        return Shape(labels, sizes, self.slots)
