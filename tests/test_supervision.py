"""Failures are exceptions: detection, scopes, supervision trees, restarts, deadlocks."""

from __future__ import annotations

import logging
import os
import signal

import anyio
import pytest

import amesh
from amesh import DeadlockError, Failure, ProcMesh, RestartPolicy, SupervisionError
from amesh._runtime import current_runtime

from .actors import Counter, Cyclic, Mid, Mortal
from .test_lifecycle import wait_pid_gone

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("how", "exit_code", "signo"),
    [("sigkill", None, signal.SIGKILL), ("exit", 3, None), ("segv", None, signal.SIGSEGV)],
)
async def test_process_death_fails_calls_and_names_the_cause(
    how: str, exit_code: int | None, signo: int | None
) -> None:
    failures: list[Failure] = []

    def handle(failure: Failure) -> bool:
        failures.append(failure)
        return True

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"gpus": 2}, supervise=handle) as procs:
            m = await procs.spawn("m", Mortal)
            victim = procs.pids[1]
            errors: list[SupervisionError] = []

            async def call_dying_rank() -> None:
                try:
                    if how == "sigkill":
                        await m.slice(gpus=1).hang.call_one()
                    else:
                        await m.slice(gpus=1).die.call_one(how)
                except SupervisionError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(call_dying_rank)
                if how == "sigkill":
                    rt = current_runtime()
                    while not rt.calls.pending:  # the call is in flight
                        await anyio.lowlevel.checkpoint()
                    os.kill(victim, signal.SIGKILL)
            assert len(errors) == 1
            # a bystander rank is unaffected
            assert (await m.slice(gpus=0).bump.call_one())[1] == 1
        cause = "exited with code 3" if how == "exit" else f"killed by {signal.Signals(signo).name}"
        assert cause in str(errors[0])
        assert [f.rank for f in errors[0].failures] == [1]
        # the owner heard of it exactly once, with the details
        assert len(failures) == 1
        failure = failures[0]
        assert (failure.rank, failure.pid) == (1, victim)
        assert (failure.exit_code, failure.signal) == (exit_code, signo)
        assert "ProcMesh {'gpus': 2}" in str(failure) and cause in str(failure)


async def test_later_calls_to_a_dead_rank_fail_at_once_and_others_work() -> None:
    seen = anyio.Event()
    failures: list[Failure] = []

    def supervise(failure: Failure) -> bool:
        failures.append(failure)
        seen.set()
        return True  # handled: the scope lives on

    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 3}, supervise=supervise) as procs:
            m = await procs.spawn("m", Mortal)
            os.kill(procs.pids[1], signal.SIGKILL)
            await seen.wait()
            with pytest.raises(SupervisionError, match="SIGKILL") as info:
                await m.bump.call()
            assert info.value.failures[0].rank == 1
            with pytest.raises(SupervisionError):
                await m.slice(procs=slice(1, 3)).bump.call()
            with pytest.raises(SupervisionError):
                await m.bump.broadcast()
            ok = await m.slice(procs=slice(0, 3, 2)).bump.call()
            assert [c for _, c in ok.values()] == [1, 1]
            assert await m.bump.choose() != 1  # choose skips the dead rank
        assert [f.rank for f in failures] == [1]


async def test_a_failure_is_logged_once_and_only_when_unhandled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 36, item 19: `supervision failure:` was logged when supervise= handled the
    failure too."""
    caplog.set_level(logging.ERROR, logger="amesh.mesh")

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "supervision failure" in r.getMessage()]

    handled = anyio.Event()
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}, supervise=lambda f: handled.set() or True) as p:
            os.kill(p.pids[1], signal.SIGKILL)
            await handled.wait()
        assert logged() == []
        with pytest.raises(SupervisionError):
            async with ProcMesh(per_host={"procs": 2}) as p:
                os.kill(p.pids[1], signal.SIGKILL)
                await anyio.sleep_forever()  # until the failure cancels the block
        (line,) = logged()
        assert line.startswith("supervision failure: ProcMesh {'procs': 2} rank 1 ")
        assert line.endswith("was killed by SIGKILL"), line


async def test_supervision_messages_name_the_mesh_rank() -> None:
    """A failure seen through a slice names the rank in the whole mesh, and the rank
    in the called slice where that differs: for a call in flight and a later one."""
    seen = anyio.Event()
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 4}, supervise=lambda f: seen.set() or True) as procs:
            m = await procs.spawn("m", Counter)
            tail = m.slice(procs=slice(2, 4))
            victim = procs.pids[3]
            async with anyio.create_task_group() as tg:

                async def kill_when_running() -> None:
                    await tail.slice(procs=1).wait_started.call_one()
                    os.kill(victim, signal.SIGKILL)

                tg.start_soon(kill_when_running)
                with pytest.raises(SupervisionError) as in_flight:
                    await tail.hang_concurrent.call()
            await seen.wait()
            with pytest.raises(SupervisionError) as later:
                await tail.incr.call()
    for info in (in_flight, later):
        err = info.value
        assert "at rank 3 (rank 1 of the called slice)" in str(err), str(err)
        assert [f.rank for f in err.failures] == [3]


async def test_broadcast_exception_fails_the_actor_and_the_scope() -> None:
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match="exploded under broadcast") as info:
            async with ProcMesh(per_host={"procs": 2}) as procs:
                m = await procs.spawn("m", Mortal)
                await m.slice(procs=0).explode.broadcast()
                await anyio.sleep_forever()
        assert info.value.failures[0].rank == 0
        assert info.value.failures[0].mesh == "actor 'm'"


async def test_failed_actor_refuses_calls_when_handled() -> None:
    handled = anyio.Event()
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 1}, supervise=lambda f: handled.set() or True) as p:
            m = await p.spawn("m", Mortal)
            await m.explode.broadcast()
            await handled.wait()
            with pytest.raises(SupervisionError, match="failed earlier"):
                await m.bump.call_one()


@pytest.mark.parametrize("leaf_handles", [True, False])
async def test_three_level_tree_handled_below(leaf_handles: bool) -> None:
    with anyio.fail_after(90):
        async with ProcMesh(per_host={"p": 1}) as procs:
            mid = await procs.spawn("mid", Mid, True, leaf_handles)
            _, grandchildren = await mid.start.call_one()
            await mid.leaf_bump_child.call_one()
            os.kill(grandchildren[0], signal.SIGKILL)
            if leaf_handles:
                seen_by_leaf = await mid.leaf_seen.call_one()
                assert "SIGKILL" in seen_by_leaf[0] and str(grandchildren[0]) in seen_by_leaf[0]
                # the leaf lives; its dead child fails at once
                with pytest.raises(SupervisionError, match="SIGKILL"):
                    await mid.leaf_bump_child.call_one()
                assert await mid.call_leaf.call_one() == "leaf"
            else:
                # the leaf failed; the mid handled that and lives on
                seen_by_mid = await mid.wait_supervised.call_one()
                assert "actor 'leaf'" in seen_by_mid[0] and "SIGKILL" in seen_by_mid[0]
                with pytest.raises(SupervisionError, match="failed earlier"):
                    await mid.call_leaf.call_one()
                # the dead leaf's own mesh was stopped with it
                assert wait_pid_gone(grandchildren[0], 10)
            assert await mid.ping.call_one() == "mid"


async def test_three_level_tree_escalates_to_the_controller() -> None:
    with anyio.fail_after(90):
        with pytest.raises(SupervisionError) as info:
            async with ProcMesh(per_host={"p": 1}) as procs:
                mid = await procs.spawn("mid", Mid, False, False)
                children, grandchildren = await mid.start.call_one()
                os.kill(grandchildren[0], signal.SIGKILL)
                await anyio.sleep_forever()
        text = str(info.value.failures[0])
        # the chain: controller's actor 'mid' <- actor 'leaf' <- the grandchild process
        assert "actor 'mid'" in text and "actor leaf[0]" in text
        assert f"pid {grandchildren[0]}" in text and "SIGKILL" in text
        for pid in children + grandchildren:
            assert wait_pid_gone(pid, 10)


async def test_unhandled_failure_cancels_amesh_run_body() -> None:
    # amesh.run's own runtime is the owner of awaited (not `async with`) meshes
    async def main() -> None:
        procs = await ProcMesh(per_host={"p": 1})
        m = await procs.spawn("m", Mortal)
        await m.die.broadcast("exit")
        await anyio.sleep_forever()

    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match="exited with code 3"):
            await anyio.to_thread.run_sync(amesh.run, main)


@pytest.mark.parametrize("strategy", ["one_for_one", "one_for_all"])
async def test_restart_policy(strategy: str) -> None:
    restarted: list[list[int]] = []
    event = anyio.Event()

    def on_restart(mesh: amesh.ActorMesh[Mortal], ranks: list[int]) -> None:
        restarted.append(ranks)
        event.set()

    policy = RestartPolicy(strategy, max_restarts=2, within=600, on_restart=on_restart)  # type: ignore[arg-type]
    with anyio.fail_after(90):
        async with ProcMesh(per_host={"procs": 3}) as procs:
            m = await procs.spawn("m", Mortal, restart=policy)
            before = procs.pids
            await m.bump.call()
            with pytest.raises(SupervisionError):
                await m.slice(procs=1).die.call_one("exit")
            await procs.ready()
            await event.wait()
            after = procs.pids
            bumped = await m.bump.call()
            if strategy == "one_for_one":
                assert restarted == [[1]]
                assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
                assert [c for _, c in bumped.values()] == [2, 1, 2]  # rank 1 is a new actor
            else:
                assert restarted == [[0, 1, 2]]
                assert set(after).isdisjoint(before)
                assert [c for _, c in bumped.values()] == [1, 1, 1]
            assert [pid for pid, _ in bumped.values()] == after
            assert procs.restarts == 1


async def test_restart_intensity_escalates() -> None:
    with anyio.fail_after(90):
        with pytest.raises(SupervisionError, match="exited with code 3"):
            async with ProcMesh(per_host={"procs": 1}) as procs:
                m = await procs.spawn("m", Mortal, restart=RestartPolicy(max_restarts=1))
                with pytest.raises(SupervisionError):
                    await m.die.call_one("exit")
                await procs.ready()
                assert procs.restarts == 1
                with pytest.raises(SupervisionError):
                    await m.die.call_one("exit")  # the second failure is one too many
                await anyio.sleep_forever()


async def test_restart_needs_every_mesh_on_the_process_to_agree() -> None:
    with anyio.fail_after(90):
        with pytest.raises(SupervisionError):
            async with ProcMesh(per_host={"procs": 1}) as procs:
                m = await procs.spawn("m", Mortal, restart="one_for_one")
                await procs.spawn("c", Counter)  # no policy: its actor cannot be restarted
                with pytest.raises(SupervisionError):
                    await m.die.call_one("exit")
                await anyio.sleep_forever()


async def test_deadlock_is_refused_with_the_cycle_named() -> None:
    with anyio.fail_after(60):
        async with ProcMesh(per_host={"procs": 2}) as procs:
            a = await procs.slice(procs=0).spawn("a", Cyclic)
            b = await procs.slice(procs=1).spawn("b", Cyclic)
            with pytest.raises(amesh.ActorError) as info:
                await a.call_other.call_one(b, a, "serial_ping")
            # A's call fails with B's error, which is the refused call back into A
            assert info.value.type_name == "amesh.DeadlockError"
            assert "a[0].call_other -> b[0].bounce -> a[0].serial_ping" in info.value.message
            assert await a.call_other.call_one(b, a, "concurrent_ping") == "concurrent pong"
            with pytest.raises(DeadlockError, match=r"a\[0\].call_self -> a\[0\].serial_ping"):
                await a.call_self.call_one(a)
            assert await a.serial_ping.call_one() == "serial pong"


async def test_stopped_process_is_declared_failed_by_heartbeat() -> None:
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError, match="no heartbeat") as info:
            async with ProcMesh(
                per_host={"procs": 2}, heartbeat_period=0.05, heartbeat_timeout=2.0
            ) as procs:
                m = await procs.spawn("m", Mortal)
                victim = procs.pids[0]
                os.kill(victim, signal.SIGSTOP)
                await m.slice(procs=0).bump.call_one()  # fails once declared dead
        failure = info.value.failures[0]
        assert failure.pid == victim and "timeout 2 s" in failure.cause
        assert wait_pid_gone(victim, 10)


async def test_remote_error_racing_a_death_is_reported_as_the_death() -> None:
    """A process dies and, before the owner has noticed, an endpoint error escapes the
    scope (as a peer's failed collective would): the scope raises the supervision
    failure, with the remote error as its cause when it came first."""
    with anyio.fail_after(60):
        with pytest.raises(SupervisionError) as info:
            async with ProcMesh(per_host={"procs": 2}) as procs:
                c = await procs.spawn("c", Counter)
                os.kill(procs.pids[1], signal.SIGKILL)
                await c.slice(procs=0).fail.call_one("a consequence")
    assert [f.rank for f in info.value.failures] == [1]
    assert info.value.__cause__ is None or "a consequence" in str(info.value.__cause__)
