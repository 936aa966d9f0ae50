"""Typed endpoints: mypy (with the ``amesh.mypy`` plugin) checks adverb arguments and
results; adverb options (``options(timeout=...)``) never collide with an endpoint's own
parameters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from amesh import Actor, ProcMesh, endpoint

#: A module of good uses (no error) and bad ones, each marked ``# E``: mypy reports
#: :data:`ERRORS` on them, in order.
USES = textwrap.dedent(
    """\
    from typing import assert_type

    from amesh import Actor, ActorMesh, Op, Point, Stream, ValueMesh, endpoint


    class Trainer(Actor):
        @endpoint
        async def step(self, lr: float, n: int = 1) -> int:
            return n

        @endpoint(concurrent=True)
        def label(self) -> str:
            return "t"

        @endpoint(thread=True)
        def wait(self, timeout: float) -> float:
            return timeout


    async def good(t: ActorMesh[Trainer], lrs: ValueMesh[float]) -> None:
        assert_type(await t.step.call(0.1), ValueMesh[int])
        assert_type(await t.step.call_one(0.1, n=2), int)
        assert_type(await t.step.choose(lr=0.1), int)
        assert_type(await t.label.call_one(), str)
        assert_type(t.step.broadcast(0.1), Op[None])
        assert_type(t.step.stream(0.1), Stream[tuple[Point, int]])
        async for point, value in t.step.stream(lrs):
            assert_type(point, Point)
            assert_type(value, int)
        assert_type(await t.wait.options(timeout=5).call_one(timeout=1.0), float)
        assert_type(await t.endpoint(Trainer.step).call(lrs, n=2), ValueMesh[int])


    def sync(t: ActorMesh[Trainer]) -> None:
        assert_type(t.step.call_one(0.1).get(), int)


    async def bad(t: ActorMesh[Trainer]) -> None:
        await t.step.call("fast")  # E
        await t.step.call_one()  # E
        await t.step.choose(0.1, m=2)  # E
        await t.step.call(0.1, timeout=2)  # E
        await t.wait.call_one()  # E
        s: str = await t.step.call_one(0.1)  # E
        (await t.step.call(0.1)).upper()  # E
        await t.stepp.call(0.1)  # E
        t.step.broadcast(0.1).get() + 1  # E
        await t.endpoint(Trainer.step).call_one("x")  # E


    def bad_sync(t: ActorMesh[Trainer]) -> None:
        x: str = t.step.call_one(0.1).get()  # E
    """
)

#: What mypy says on each line marked ``# E`` of :data:`USES`.
ERRORS = [
    (
        'Argument 1 to "call" of "MeshEndpoint" has incompatible type "str"; '
        'expected "float | ValueMesh[float]"  [arg-type]'
    ),
    'Missing positional argument "lr" in call to "call_one" of "MeshEndpoint"  [call-arg]',
    'Unexpected keyword argument "m" for "choose" of "MeshEndpoint"  [call-arg]',
    'Unexpected keyword argument "timeout" for "call" of "MeshEndpoint"  [call-arg]',
    'Missing positional argument "timeout" in call to "call_one" of "MeshEndpoint"  [call-arg]',
    (
        'Incompatible types in assignment (expression has type "int", '
        'variable has type "str")  [assignment]'
    ),
    '"ValueMesh[int]" has no attribute "upper"  [attr-defined]',
    '"Trainer" has no endpoint "stepp"  [attr-defined]',
    'Unsupported operand types for + ("None" and "int")  [operator]',
    (
        'Argument 1 to "call_one" of "MeshEndpoint" has incompatible type "str"; '
        'expected "float | ValueMesh[float]"  [arg-type]'
    ),
    (
        'Incompatible types in assignment (expression has type "int", '
        'variable has type "str")  [assignment]'
    ),
]

MYPY_CONFIG = """\
[mypy]
strict = True
plugins = amesh.mypy
"""


def test_mypy_catches_wrong_endpoint_uses(tmp_path: Path) -> None:
    (tmp_path / "uses.py").write_text(USES)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    mypy = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", ".cache"]
    out = subprocess.run(
        [*mypy, "--no-error-summary", "--hide-error-context", "uses.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    marked = [n for n, line in enumerate(USES.splitlines(), 1) if line.endswith("  # E")]
    assert len(marked) == len(ERRORS)
    expected = [f"uses.py:{n}: error: {message}" for n, message in zip(marked, ERRORS)]
    got = [line for line in out.stdout.splitlines() if ": error: " in line]
    assert got == expected, out.stdout + out.stderr
    assert out.returncode == 1


class Waiter(Actor):
    @endpoint
    async def wait(self, timeout: float) -> float:
        await anyio.sleep(timeout)
        return timeout

    @endpoint
    async def hang(self) -> None:
        await anyio.sleep_forever()


@pytest.mark.anyio
async def test_an_endpoint_may_have_a_timeout_parameter() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            w = await procs.spawn("w", Waiter)
            assert (await w.wait.call(0)).values() == [0, 0]
            assert await w.slice(procs=0).wait.options(timeout=30).call_one(timeout=0.01) == 0.01
            assert await w.wait.options(timeout=30).choose(timeout=0) == 0
            # the option is the adverb's, the keyword the endpoint's
            with pytest.raises(TimeoutError, match=r"w\.hang: no answer within 0\.2 s"):
                await w.hang.options(timeout=0.2).call()
            # an endpoint without such a parameter does not take it: no adverb option
            with pytest.raises(TypeError, match=r"hang\(\).*'timeout'"):
                await w.hang.call(timeout=0.2)  # type: ignore[call-arg]


@pytest.mark.anyio
async def test_options_and_typed_accessor() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}) as procs:
            w = await procs.spawn("w", Waiter)
            with pytest.raises(ValueError, match="timeout must be >= 0"):
                w.hang.options(timeout=-1)
            assert "timeout 0.5 s" in repr(w.hang.options(timeout=0.5))
            assert await w.endpoint(Waiter.wait).call_one(0) == 0
            with pytest.raises(AttributeError, match="is not an endpoint of Waiter"):
                w.endpoint(Other.ping)


class Other(Actor):
    @endpoint
    def ping(self) -> None:
        pass
