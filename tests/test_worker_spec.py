"""Every host starts a worker from one WorkerSpec: what its mesh asks of it, per mesh."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

import amesh
from amesh import ProcMesh, this_host
from amesh._bootstrap import Bootstrap, WorkerSpec, this_worker
from amesh._runtime import open_runtime
from amesh._transport import open_transport
from amesh.testing import InProcessHost

pytestmark = pytest.mark.anyio


@pytest.mark.timeout(60)
async def test_two_meshes_of_one_controller_start_their_workers_with_their_own_settings() -> None:
    """Heartbeats, event loop, output and environment are each mesh's own, and each
    worker knows its slot: two meshes in one controller, started side by side."""
    with anyio.fail_after(50):
        async with (
            ProcMesh(
                {"procs": 2},
                heartbeat_period=0.2,
                heartbeat_timeout=3.0,
                output="raw",
                backend="asyncio",
                env={"AMESH_TEST_MESH": "a"},
                name="first",
            ) as a,
            ProcMesh(
                {"procs": 3},
                heartbeat_period=1.0,
                heartbeat_timeout=9.0,
                backend="trio",
                env={"AMESH_TEST_MESH": "b"},
                name="second",
            ) as b,
        ):
            specs_a = (await a._agents(a._live()).spec.call()).values()
            specs_b = (await b._agents(b._live()).spec.call()).values()
    assert [s.slot for s in specs_a] == [0, 1] and [s.slot for s in specs_b] == [0, 1, 2]
    for s in specs_a:
        assert (s.heartbeat_period, s.heartbeat_timeout) == (0.2, 3.0)
        assert (s.backend, s.output, s.env["AMESH_TEST_MESH"]) == ("asyncio", "raw", "a")
        assert s.output_label == "first"
    for s in specs_b:
        assert (s.heartbeat_period, s.heartbeat_timeout) == (1.0, 9.0)
        assert (s.backend, s.output, s.env["AMESH_TEST_MESH"]) == ("trio", "folded", "b")
        assert s.output_label == "second"


@pytest.mark.timeout(30)
async def test_a_rank_in_the_controllers_process_has_no_spec_of_its_own() -> None:
    """In-process ranks share the controller's process, which no spec started."""
    with anyio.fail_after(20):
        async with ProcMesh({"procs": 1}, host=InProcessHost()) as procs:
            (spec,) = (await procs._agents(procs._live()).spec.call()).values()
    assert spec is None and this_worker() is None


def test_a_bootstrap_carries_its_spec_whole() -> None:
    spec = WorkerSpec(slot=7, scheme="tls+tcp", host="127.0.0.1", env={"X": "1"}, backend="trio")
    boot = Bootstrap(
        spec=spec, parent="p", parent_pid=1, token="t", sys_path=["/x"], pdeathsig=True, key=b"k"
    )
    assert Bootstrap.from_bytes(boot.to_bytes()) == boot


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "exec"])
async def test_a_worker_runs_in_the_interpreter_and_directory_of_its_spec(
    tmp_path: Path, zygote: bool
) -> None:
    """A spec's working directory is honoured whether the worker is forked or exec'd;
    its interpreter (here a wrapper that notes its pid, then runs this Python) runs it:
    exec'd, or forked by a zygote of that interpreter's own (never by the zygote of
    this one, whose import path is not its own)."""
    amesh.configure(zygote=zygote)
    ran = tmp_path / "ran"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho $$ > {ran}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    pids, parents = [], []
    with anyio.fail_after(50):
        async with open_runtime(lambda: open_transport("auto")) as rt:
            scheme = rt.address.split("://", 1)[0]
            for spec in (
                WorkerSpec(scheme=scheme, cwd=str(tmp_path)),
                WorkerSpec(scheme=scheme, cwd=str(tmp_path), python=str(python)),
            ):
                handle = await this_host().start_proc(rt, spec)
                try:
                    pids.append(handle.pid)
                    parents.append(int(Path(f"/proc/{handle.pid}/stat").read_text().split()[3]))
                    assert os.readlink(f"/proc/{handle.pid}/cwd") == str(tmp_path)
                    assert ran.exists() == (spec.python != "")
                finally:
                    handle.process.kill()
                    await handle.stop(0)
    wrapper = int(ran.read_text())  # (an exec keeps the wrapper's pid)
    if zygote:  # forked by the wrapper's zygote, not by this interpreter's
        assert parents[1] == wrapper and parents[0] not in (wrapper, os.getpid())
    else:
        assert pids[1] == wrapper and parents == [os.getpid(), os.getpid()]
