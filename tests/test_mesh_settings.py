"""Settings travel in the worker spec, not in the environment, and each mesh may have
its own (``ProcMesh(settings=)``): two meshes of one controller, different settings."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

import amesh
from amesh import Actor, ConfigError, ProcMesh, endpoint
from amesh._bootstrap import this_worker
from amesh._config import VARIABLES, settings

from .test_agent import agents, shared_key, tcp_runtime

pytestmark = pytest.mark.anyio

#: the variables of the settings these tests give in code
CONFIGURED = {"AMESH_SHM_THRESHOLD", "AMESH_SEND_WINDOW", "AMESH_LOG_LEVEL", "AMESH_ZYGOTE"}


class Reader(Actor):
    """What its worker process reads of its settings, spec and environment."""

    @endpoint
    def read(self) -> dict[str, Any]:
        s, spec = settings(), this_worker()
        assert spec is not None
        return {
            "shm_threshold": s.shm_threshold,
            "send_window": s.send_window,
            "log_level": s.log_level,
            "heartbeat_timeout": spec.heartbeat_timeout,
            "variables": sorted(var for var in os.environ if var in VARIABLES),
            "parent": os.getppid(),
        }


async def read_all(procs: ProcMesh) -> list[dict[str, Any]]:
    reader = await procs.spawn("reader", Reader)
    return list((await reader.read.call()).values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zygote", [True, False], ids=["forked", "execd"])
async def test_configured_settings_reach_workers_in_their_spec_not_their_environment(
    zygote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in CONFIGURED:
        monkeypatch.delenv(var, raising=False)
    amesh.configure(shm_threshold=65536, send_window=100, log_level="info", zygote=zygote)
    with anyio.fail_after(50):
        async with ProcMesh({"procs": 2}) as procs:
            seen = await read_all(procs)
    for s in seen:
        assert (s["shm_threshold"], s["send_window"], s["log_level"]) == (65536, 100, "INFO")
        assert CONFIGURED.isdisjoint(s["variables"])
        # forked by the zygote, or exec'd by this process, as configured
        assert (s["parent"] != os.getpid()) is zygote


@pytest.mark.timeout(120)
async def test_configured_settings_reach_a_host_agents_workers_in_their_spec(
    tmp_path: Path,
) -> None:
    key = shared_key(tmp_path)
    amesh.configure(shm_threshold=65536)
    with anyio.fail_after(100):
        async with agents(key, 1) as (agent,), tcp_runtime():
            hosts = await amesh.attach([agent.addr], key_file=str(key))
            async with hosts.spawn_procs({"procs": 1}, settings={"send_window": 128}) as procs:
                (seen,) = await read_all(procs)
    assert (seen["shm_threshold"], seen["send_window"]) == (65536, 128)
    assert CONFIGURED.isdisjoint(seen["variables"])


@pytest.mark.timeout(60)
async def test_two_meshes_of_one_controller_have_their_own_settings() -> None:
    amesh.configure(send_window=100)  # under both meshes' own
    with anyio.fail_after(50):
        async with (
            ProcMesh(
                {"procs": 2},
                settings={"shm_threshold": 65536, "send_window": 128, "heartbeat_timeout": 30},
            ) as a,
            ProcMesh({"procs": 2}, settings={"shm_threshold": 0, "log_level": "DEBUG"}) as b,
        ):
            seen_a, seen_b = await read_all(a), await read_all(b)
            assert (a._fanout, a._hb_timeout) == (16, 30.0)
    for s in seen_a:
        assert (s["shm_threshold"], s["send_window"], s["heartbeat_timeout"]) == (65536, 128, 30)
        assert s["log_level"] == ""
    for s in seen_b:
        assert (s["shm_threshold"], s["send_window"], s["heartbeat_timeout"]) == (0, 100, 5)
        assert s["log_level"] == "DEBUG"


@pytest.mark.timeout(90)
async def test_two_meshes_with_different_heartbeat_timeouts_fail_a_stopped_worker_apart() -> None:
    """A stopped worker of each mesh: the one of the mesh with a 1 s timeout is
    declared failed while the other mesh, with 60 s, has declared nothing yet."""
    failures: dict[str, list[amesh.Failure]] = {"short": [], "long": []}
    short_failed = anyio.Event()

    def supervise(which: str) -> Any:
        def record(f: amesh.Failure) -> bool:
            failures[which].append(f)
            if which == "short":
                short_failed.set()
            return True

        return record

    period = {"heartbeat_period": 0.1}
    with anyio.fail_after(80):
        async with (
            ProcMesh(
                {"procs": 2},
                settings={**period, "heartbeat_timeout": 1},
                supervise=supervise("short"),
            ) as short,
            ProcMesh(
                {"procs": 2},
                settings={**period, "heartbeat_timeout": 60},
                supervise=supervise("long"),
            ) as long,
        ):
            stopped = [short.pids[1], long.pids[1]]
            try:
                for pid in stopped:
                    os.kill(pid, signal.SIGSTOP)
                with anyio.fail_after(30):
                    await short_failed.wait()
                assert failures["long"] == []  # 60 s is far off
            finally:
                for pid in stopped:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
    (failure,) = failures["short"]
    assert failure.rank == 1 and failure.pid == stopped[0]
    assert "heartbeat" in failure.cause


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"heartbeat_timout": 1.0}, "no amesh setting heartbeat_timout"),
        ({"transport": "tcp"}, r"transport \(AMESH_TRANSPORT\) belongs to a whole process"),
        ({"send_window": 8}, r"send_window \(AMESH_SEND_WINDOW\) must be an integer >= 64"),
        ({"output": "loud"}, r"output \(AMESH_OUTPUT\) must be one of"),
    ],
)
def test_a_bad_mesh_setting_is_refused_where_the_mesh_is_made(
    values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        ProcMesh(settings=values)


def test_a_setting_given_twice_to_a_mesh_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^fanout is given twice"):
        ProcMesh(fanout=0, settings={"fanout": 4})
