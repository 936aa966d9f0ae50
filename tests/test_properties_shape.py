"""Property tests: named-dimension shapes and value meshes against a plain model.

The model is a dict from coordinate tuples to the underlying slot, built from a
nested list; its row-major order is the sorted order of its coordinate tuples. Every
view operation (``slice``, ``flatten``, ``rename``, ``split``) is applied to the model,
to a :class:`Shape` and to a :class:`ValueMesh` at once, and after every step the three
must agree: labels, sizes, slots, ranks, points, values, and the errors raised.
"""

from __future__ import annotations

import itertools
import math
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from amesh import Point, Shape, ValueMesh

pytestmark = pytest.mark.timeout(120)

#: Dimension names the operations draw from; renames and splits reuse them, so
#: collisions with existing dims (a ValueError) come up often. "dim" and "self" are
#: there because they are also the names of the methods' own parameters.
NAMES = ("a", "b", "c", "d", "gpus", "hosts", "dp", "tp", "dim", "self")
#: Names that are not identifiers, refused as dimension names.
BAD_NAMES = ("1x", "a-b", "")

EXAMPLES = settings(
    max_examples=200,
    deadline=None,  # a loaded CI machine must not fail on timing; the pytest timeout bounds it
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# -- the model ---------------------------------------------------------------------------


def nested(sizes: list[int], counter: Iterator[int]) -> Any:
    """A nested list of ``sizes`` whose leaves count up in row-major order."""
    if not sizes:
        return next(counter)
    return [nested(sizes[1:], counter) for _ in range(sizes[0])]


def walk(
    tree: Any, depth: int, path: tuple[int, ...] = ()
) -> Iterator[tuple[tuple[int, ...], int]]:
    if len(path) == depth:
        yield path, tree
        return
    for i, sub in enumerate(tree):
        yield from walk(sub, depth, (*path, i))


@dataclass
class Model:
    labels: list[str]
    sizes: list[int]
    cells: dict[tuple[int, ...], int]  # coordinates -> underlying slot

    @classmethod
    def dense(cls, labels: list[str], sizes: list[int]) -> Model:
        tree = nested(sizes, itertools.count())
        return cls(list(labels), list(sizes), dict(walk(tree, len(sizes))))

    def slots(self) -> list[int]:
        return [self.cells[c] for c in sorted(self.cells)]

    def slice(self, sel: dict[str, Any]) -> Model | type[Exception]:
        for name in sel:
            if name not in self.labels:
                return KeyError
        picks: list[Any] = []  # per dim: None (kept whole), an int index, or a range
        for name, size in zip(self.labels, self.sizes):
            s = sel.get(name)
            if s is None:
                picks.append(None)
            elif isinstance(s, bool) or not isinstance(s, int | slice):
                return TypeError
            elif isinstance(s, int):
                if not -size <= s < size:
                    return IndexError
                picks.append(s % size)
            else:
                if s.step == 0:
                    return ValueError
                picks.append(range(size)[s])
        labels = [n for n, p in zip(self.labels, picks) if not isinstance(p, int)]
        sizes = [
            size if p is None else len(p)
            for size, p in zip(self.sizes, picks)
            if not isinstance(p, int)
        ]
        cells = {}
        for coord, slot in self.cells.items():
            new: list[int] = []
            for c, p in zip(coord, picks):
                if p is None:
                    new.append(c)
                elif isinstance(p, int):
                    if c != p:
                        break
                elif c in p:
                    new.append(p.index(c))
                else:
                    break
            else:
                cells[tuple(new)] = slot
        return Model(labels, sizes, cells)

    def flatten(self, name: str) -> Model | type[Exception]:
        if not name.isidentifier():
            return ValueError
        return Model([name], [len(self.cells)], {(i,): s for i, s in enumerate(self.slots())})

    def rename(self, names: dict[str, str]) -> Model | type[Exception]:
        if any(old not in self.labels for old in names):
            return KeyError
        labels = [names.get(n, n) for n in self.labels]
        if len(set(labels)) != len(labels) or not all(n.isidentifier() for n in labels):
            return ValueError
        return Model(labels, list(self.sizes), dict(self.cells))

    def split(self, dim: str, into: dict[str, int]) -> Model | type[Exception]:
        if dim not in self.labels:
            return KeyError
        i = self.labels.index(dim)
        size = self.sizes[i]
        given_sizes = list(into.values())
        if not into or given_sizes.count(-1) > 1:
            return ValueError
        if any(s < 1 for s in given_sizes if s != -1):
            return ValueError
        known = math.prod(s for s in given_sizes if s != -1)
        if -1 in given_sizes:
            if size % known:
                return ValueError
            new_sizes = [size // known if s == -1 else s for s in given_sizes]
        elif known != size:
            return ValueError
        else:
            new_sizes = given_sizes
        labels = [*self.labels[:i], *into, *self.labels[i + 1 :]]
        if len(set(labels)) != len(labels) or not all(n.isidentifier() for n in labels):
            return ValueError
        digits = list(itertools.product(*(range(n) for n in new_sizes)))
        cells = {c[:i] + digits[c[i]] + c[i + 1 :]: s for c, s in self.cells.items()}
        return Model(labels, [*self.sizes[:i], *new_sizes, *self.sizes[i + 1 :]], cells)


def value_of(slot: int) -> str:
    return f"v{slot}"


def check(shape: Shape, vm: ValueMesh[str], model: Model) -> None:
    """``shape`` and ``vm`` are exactly ``model``."""
    sizes = dict(zip(model.labels, model.sizes))
    assert shape.labels == tuple(model.labels)
    assert shape.sizes == tuple(model.sizes)
    assert shape.size_dict() == sizes == vm.sizes
    assert list(vm.sizes) == model.labels  # outermost first
    assert len(shape) == len(vm) == len(model.cells) == math.prod(model.sizes)
    assert list(shape.slots) == model.slots()
    assert vm.shape == shape
    assert vm.values() == [value_of(s) for s in model.slots()]
    points = list(shape.points())
    assert [p.rank for p in points] == list(range(len(shape)))
    for rank, (coord, (point, value)) in enumerate(zip(sorted(model.cells), vm.items())):
        want = dict(zip(model.labels, coord))
        assert isinstance(point, Point)
        assert dict(point) == want and list(point) == model.labels
        assert point.rank == rank and point.sizes == sizes
        assert point == points[rank] == shape.point(rank)
        assert shape.coords(rank) == want
        assert shape.rank_of(want) == rank
        assert value == value_of(model.cells[coord]) == vm.item(**want)
    for bad in (-1, len(shape)):
        with pytest.raises(IndexError):
            shape.coords(bad)
    if len(shape) != 1:
        with pytest.raises(ValueError):
            vm.item()
    else:
        assert vm.item() == vm.values()[0]
    # Views travel by value: the same shape, the same values (a value mesh's slots
    # are renumbered, since only its own values travel).
    assert pickle.loads(pickle.dumps(shape)) == shape
    back = pickle.loads(pickle.dumps(vm))
    assert list(back.sizes.items()) == list(vm.sizes.items()) and back.values() == vm.values()
    assert back == vm and list(back.shape.slots) == list(range(len(vm)))


# -- strategies --------------------------------------------------------------------------

dims = st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True).flatmap(
    lambda labels: st.tuples(
        st.just(labels), st.lists(st.integers(1, 5), min_size=len(labels), max_size=len(labels))
    )
)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] or [1]


@st.composite
def fresh(draw: st.DrawFn, taken: list[str]) -> str:
    """Mostly a name not in ``taken``; now and then one that is, or no identifier."""
    free = [n for n in NAMES if n not in taken] + [n.upper() for n in NAMES]
    return draw(
        st.one_of(
            st.sampled_from(free),
            st.sampled_from(free),
            st.sampled_from(free),
            st.sampled_from([*NAMES, *BAD_NAMES]),
        )
    )


def selection(size: int) -> st.SearchStrategy[Any]:
    """Mostly an int or a slice within a dim of ``size``; sometimes outside, or no index."""
    step = st.sampled_from([None, 1, 2, 3, -1, -1, -2])
    inside = st.one_of(st.none(), st.none(), st.integers(0, size))
    wild = st.one_of(st.none(), st.integers(-size - 2, size + 2))
    return st.one_of(
        st.integers(-size, size - 1) if size else st.just(slice(None)),
        st.builds(slice, inside, st.none(), step),
        st.builds(slice, inside, inside, step),
        st.builds(slice, wild, wild, step),
        st.integers(-size - 2, size + 1),
        st.sampled_from([True, "0", 1.0, slice(0, 1, 0)]),
    )


@st.composite
def split_sizes(draw: st.DrawFn, size: int, count: int) -> list[int]:
    """``count`` sizes whose product is ``size`` (one maybe -1); sometimes not."""
    out = []
    left = size
    for _ in range(count - 1):
        d = draw(st.sampled_from(divisors(left)))
        out.append(d)
        left //= d
    out.append(left)
    if draw(st.booleans()):
        out[draw(st.integers(0, count - 1))] = -1
    if draw(st.integers(0, 4)) == 0:
        out[draw(st.integers(0, count - 1))] = draw(st.sampled_from([-1, 0, 2, 3, 7]))
    return out


Op = tuple[str, Callable[[Any], Any], Callable[[Model], Model | type[Exception]]]


@st.composite
def operation(draw: st.DrawFn, model: Model) -> Op:
    """One view operation: its name, how to apply it to a shape or a mesh, and to the model."""
    kind = draw(st.sampled_from(["slice", "slice", "flatten", "rename", "split", "split"]))
    known = list(zip(model.labels, model.sizes))
    if kind == "slice":
        # (all dims may be gone already: a shape of one rank and no dims)
        chosen = draw(st.lists(st.sampled_from(known), unique=True)) if known else []
        sel = {name: draw(selection(size)) for name, size in chosen}
        if draw(st.integers(0, 9)) == 0:
            sel[draw(st.sampled_from(NAMES))] = 0  # maybe a dim that is not there
        return f"slice({sel})", lambda x: x.slice(**sel), lambda m: m.slice(sel)
    # Now and then a dim that is not there.
    dims = [*model.labels, "zz"] if draw(st.integers(0, 9)) == 0 or not known else model.labels
    if kind == "flatten":
        name = draw(fresh([]))
        return f"flatten({name!r})", lambda x: x.flatten(name), lambda m: m.flatten(name)
    if kind == "rename":
        olds = draw(st.lists(st.sampled_from(dims), unique=True, max_size=3))
        ren: dict[str, str] = {}
        for old in olds:
            ren[old] = draw(fresh([*model.labels, *ren.values()]))
        return f"rename({ren})", lambda x: x.rename(**ren), lambda m: m.rename(ren)
    dim = draw(st.sampled_from(dims))
    size = dict(known).get(dim, 4)
    new: list[str] = []
    for _ in range(draw(st.integers(0, 3) if draw(st.integers(0, 9)) == 0 else st.integers(1, 3))):
        new.append(draw(fresh([*model.labels, *new])))
    into = dict(zip(new, draw(split_sizes(size, len(new))) if new else []))
    return f"split({dim!r}, {into})", lambda x: x.split(dim, **into), lambda m: m.split(dim, into)


# -- properties --------------------------------------------------------------------------


@EXAMPLES
@given(dims, st.data())
def test_views_agree_with_the_model(
    shape_dims: tuple[list[str], list[int]], data: st.DataObject
) -> None:
    labels, sizes = shape_dims
    model = Model.dense(labels, sizes)
    shape = Shape.from_sizes(dict(zip(labels, sizes)))
    base = [value_of(s) for s in range(len(shape))]
    vm: ValueMesh[str] = ValueMesh(shape, base)
    check(shape, vm, model)
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        what, apply, expect = data.draw(operation(model), label="op")
        note(what)
        want = expect(model)
        event(what.partition("(")[0], "valid" if isinstance(want, Model) else want.__name__)
        if isinstance(want, type):
            with pytest.raises(want):
                apply(shape)
            with pytest.raises(want):
                apply(vm)
            continue
        shape, vm, model = apply(shape), apply(vm), want
        check(shape, vm, model)
    assert base == [value_of(s) for s in range(len(base))]  # views never copy nor write


@EXAMPLES
@given(dims, st.data())
def test_slices_of_different_dims_commute(
    shape_dims: tuple[list[str], list[int]], data: st.DataObject
) -> None:
    labels, sizes = shape_dims
    shape = Shape(labels, sizes)
    known = dict(zip(labels, sizes))
    valid = {
        name: st.one_of(
            st.integers(-size, size - 1),
            st.builds(
                slice,
                st.none() | st.integers(-size, size),
                st.none() | st.integers(-size, size),
                st.none() | st.sampled_from([1, 2, -1]),
            ),
        )
        for name, size in known.items()
    }
    first = data.draw(st.fixed_dictionaries({}, optional=valid), label="first")
    rest = {n: s for n, s in valid.items() if n not in first}
    second = data.draw(st.fixed_dictionaries({}, optional=rest), label="second")
    both = shape.slice(**first, **second)
    assert shape.slice(**first).slice(**second) == both == shape.slice(**second).slice(**first)
    # Slicing nothing, or every dim whole, is the same view.
    assert shape.slice() == shape == shape.slice(**{n: slice(None) for n in labels})


@EXAMPLES
@given(dims, st.data())
def test_flatten_and_split_undo_each_other(
    shape_dims: tuple[list[str], list[int]], data: st.DataObject
) -> None:
    labels, sizes = shape_dims
    shape = Shape(labels, sizes, data.draw(st.permutations(range(math.prod(sizes)))))
    flat = shape.flatten("ranks")
    assert flat.labels == ("ranks",) and flat.slots == shape.slots
    assert flat.split("ranks", **shape.size_dict()) == shape
    # One size may be left to infer.
    infer = data.draw(st.sampled_from(labels))
    assert (
        flat.split("ranks", **{n: -1 if n == infer else s for n, s in zip(labels, sizes)}) == shape
    )
    assert shape.rename(**{n: n.upper() for n in labels}).slots == shape.slots


@settings(max_examples=100, deadline=None, database=None)
@given(
    st.one_of(
        st.just({}),
        st.dictionaries(st.sampled_from(NAMES), st.integers(-2, 0), min_size=1),
        st.dictionaries(st.sampled_from(BAD_NAMES), st.integers(1, 3), min_size=1),
        st.builds(lambda n: {n: True}, st.sampled_from(NAMES)),
        st.builds(lambda n: [(n, 2)], st.sampled_from(NAMES)),
    )
)
def test_bad_sizes_are_refused(sizes: Any) -> None:
    with pytest.raises(ValueError):
        Shape.from_sizes(sizes)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        Shape(["a", "b"], [1])
    with pytest.raises(ValueError, match="duplicate"):
        Shape(["a", "a"], [1, 2])
    with pytest.raises(ValueError, match="negative"):
        Shape(["a"], [-1])
    with pytest.raises(ValueError, match="slots"):
        Shape(["a"], [3], [0, 1])
    with pytest.raises(KeyError):
        Shape(["a", "b"], [2, 2]).rank_of({"a": 0})
    with pytest.raises(IndexError):
        Shape(["a", "b"], [2, 2]).rank_of({"a": 0, "b": 2})


def test_value_meshes_with_dims_in_another_order_differ() -> None:
    v1 = ValueMesh(Shape(["a", "b"], [2, 3]), list(range(6)))
    v2 = ValueMesh(Shape(["b", "a"], [3, 2]), list(range(6)))
    assert v1 != v2 and v1.item(a=0, b=1) != v2.item(a=0, b=1)
    assert v1 == ValueMesh(Shape(["a", "b"], [2, 3]), list(range(6)))
