"""Workers run the controller's event loop by default (``ProcMesh(backend=)`` picks
another): on trio, endpoints may use trio's own API."""

from __future__ import annotations

import anyio
import pytest
import sniffio

import amesh
from amesh import Actor, endpoint

pytestmark = pytest.mark.anyio


class Loops(Actor):
    @endpoint
    async def library(self) -> str:
        return sniffio.current_async_library()

    @endpoint
    async def trio_nap(self) -> str:
        import trio  # only on trio workers

        with trio.move_on_after(0.001):
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        return "slept on trio"


async def test_workers_run_the_controllers_loop(anyio_backend: object) -> None:
    ours = sniffio.current_async_library()
    with anyio.fail_after(60):
        async with amesh.ProcMesh({"procs": 2}) as procs:
            loops = await procs.spawn("loops", Loops)
            assert list((await loops.library.call()).values()) == [ours] * 2
            if ours == "trio":
                assert await loops.slice(procs=1).trio_nap.call_one() == "slept on trio"


@pytest.mark.parametrize("workers", ["asyncio", "trio"])
async def test_a_mesh_may_ask_for_the_other_loop(anyio_backend: object, workers: str) -> None:
    with anyio.fail_after(60):
        async with amesh.ProcMesh({"procs": 2}, backend=workers) as procs:
            loops = await procs.spawn("loops", Loops)
            assert list((await loops.library.call()).values()) == [workers] * 2
            if workers == "asyncio":
                with pytest.raises(amesh.ActorError, match="async context"):
                    await loops.slice(procs=0).trio_nap.call_one()


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backend must be 'asyncio' or 'trio'"):
        amesh.ProcMesh({"procs": 1}, backend="curio")
