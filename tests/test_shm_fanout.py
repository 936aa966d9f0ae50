"""Large arguments to several ranks on one host: written once into shared memory that
every receiver maps (copy-on-write), not sent once per rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from amesh import Actor, ProcMesh, current_rank, endpoint
from amesh._runtime import current_runtime
from amesh._wire import _pickling

pytestmark = pytest.mark.anyio

MiB = 1 << 20


class Holder(Actor):
    def __init__(self) -> None:
        self.weights: dict[str, Any] = {}

    @endpoint
    def load(self, weights: dict[str, Any]) -> float:
        """Keep the weights, write this rank's number into the first of them."""
        self.weights = weights
        first = next(iter(weights.values()))
        total = float(sum(float(w.sum()) for w in weights.values()))
        first[:] = current_rank().rank
        return total

    @endpoint
    def first_values(self) -> list[float]:
        """What this rank's first tensor holds now."""
        return sorted({float(v) for v in next(iter(self.weights.values()))})

    @endpoint
    async def hang(self) -> None:
        await anyio.sleep_forever()


def _weights() -> dict[str, Any]:
    return {f"layer{i}": np.full(MiB, i + 1, dtype=np.float32) for i in range(3)}


async def test_a_call_to_several_ranks_writes_large_arguments_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path))
    made: list[str] = []
    create = _pickling.create_segment

    def counted(view: memoryview, poolable: bool = False) -> tuple[str | None, bool]:
        path, pooled = create(view, poolable)
        made.append(str(path))
        return path, pooled

    monkeypatch.setattr(_pickling, "create_segment", counted)
    weights = _weights()
    want = float(sum(float(w.sum()) for w in weights.values()))
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 4}) as procs:
            m = await procs.spawn("m", Holder)
            transport = current_runtime().transport
            before = transport.statistics().bytes_sent
            got = await m.load.call(weights)
            sent = transport.statistics().bytes_sent - before
            assert got.values() == [want] * 4
            assert len(made) == 3  # one segment per tensor, for all four ranks
            assert sent < MiB  # the frames carried names, not the 12 MiB
            assert os.listdir(tmp_path) == []  # each rank unlinked its own names
            # each rank's writes stayed its own (copy-on-write), the sender's too
            firsts = await m.first_values.call()
            assert firsts.values() == [[0.0], [1.0], [2.0], [3.0]]
            assert float(weights["layer0"][0]) == 1.0


async def test_an_abandoned_call_leaves_no_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AMESH_SHM_DIR", str(tmp_path))
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            m = await procs.spawn("m", Holder)
            async with anyio.create_task_group() as tg:
                tg.start_soon(m.hang.call)  # both ranks busy: the next call waits
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(TimeoutError):
                    await m.load.options(timeout=0.5).call(_weights())
                assert os.listdir(tmp_path) == []  # released by the caller, unread
                tg.cancel_scope.cancel()
            assert (await m.load.call(_weights())).values() == [6.0 * MiB] * 2
