"""Supervision of one ProcMesh: detect failures, restart, escalate to the owner.

A process is declared failed when its exit is seen (its exit status tells how), when
its link breaks and it does not exit (it is killed), or when it is silent past the
heartbeat timeout while this process was able to hear it (it is killed). Its calls
fail at once, every process that may be calling it is told, and then a restart policy
restarts it or the failure goes to the owner: the mesh's ``supervise=`` callable, the
owning actor's ``__supervise__``, or up the tree (cancelling the owner's scope).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from .. import _wire
from .._errors import Failure, SupervisionError
from .._model import Supervisor, call_hook, call_supervisor
from .._runtime import ActorInstance
from .._wire import FailureReport
from ._host import ProcHandle
from ._lifecycle import FAILED_STOP_TIMEOUT, Lifecycle, MeshState, failure_of

__all__ = ["LINK_LOSS_GRACE", "STALL_SLACK", "MeshSupervisor", "pid_alive", "unhandled_error"]

log = logging.getLogger("amesh.mesh")

#: A heartbeat monitor tick this much later than asked means this process's own loop
#: stalled (and could hear nobody): worker silence is counted from after the stall.
STALL_SLACK = 0.5
#: How long a worker whose link broke may take to exit before it is killed.
LINK_LOSS_GRACE = 1.0


def pid_alive(pid: int) -> bool:
    """False once ``pid`` has exited (gone, or a zombie not reaped yet); Linux /proc.

    Pids beyond any kernel's ``pid_max`` (in-process test workers) count as alive.
    """
    if pid >= 1 << 22:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # no /proc: assume alive, the watchers will tell
    return state not in ("Z", "X")


class MeshSupervisor:
    """Watches the processes of one running ProcMesh and acts on their failures.

    Args:
        label: the mesh, as failures name it.
        life: starts processes and actors again for restarts.
        handler: the mesh's ``supervise=`` callable, if any.
        owner: the actor that owns the mesh (None: the controller's runtime).
        scoped: the mesh is an ``async with`` scope (a failure cancels its body).
        period, timeout: heartbeat period and timeout, in seconds.
    """

    def __init__(
        self,
        label: str,
        life: Lifecycle,
        handler: Supervisor | None,
        owner: ActorInstance | None,
        scoped: bool,
        period: float,
        timeout: float,
    ) -> None:
        self.label = label
        self._life = life
        self._handler = handler
        self._owner = owner
        self._scoped = scoped
        self._period = period
        self._timeout = timeout
        self._state: MeshState | None = None

    def start(self, st: MeshState) -> None:
        """Supervise every process of ``st`` from now on."""
        self._state = st
        for slot, handle in enumerate(st.procs):
            self.supervise_proc(st, slot, handle)
        st.tg.start_soon(self.monitor_heartbeats, st)

    def supervise_proc(self, st: MeshState, slot: int, handle: ProcHandle) -> None:
        """Watch ``handle``'s exit, heartbeats and link from now on."""

        def link_lost(why: str) -> None:
            if not (st.closing or handle.expected_exit or handle.failed):
                st.tg.start_soon(self.confirm_lost, st, slot, handle, why)

        st.runtime.peers.watch(handle.addr, link_lost, anyio.current_time())
        st.tg.start_soon(self.watch, st, handle, slot)

    async def watch(self, st: MeshState, handle: ProcHandle, slot: int) -> None:
        await handle.process.wait()
        # shared-memory segments it sent that nobody took (a killed process never
        # cleans up after itself)
        _wire.remove_segments_of(handle.pid)
        if st.closing or handle.expected_exit or handle.failed:
            return
        handle.failed = True
        failure = failure_of(self.label, slot, handle, handle.exit_cause())
        self.proc_failed(st, slot, handle, failure)

    async def confirm_lost(self, st: MeshState, slot: int, handle: ProcHandle, why: str) -> None:
        """The link to a worker broke: it is dead if it exits (its exit status says
        how, through :meth:`_watch`), or is killed if it lingers without a link."""
        with anyio.move_on_after(LINK_LOSS_GRACE):
            await handle.process.wait()
            return
        if st.closing or handle.expected_exit or handle.failed:
            return
        handle.failed = True
        cause = f"its connection broke ({why}) and it did not exit; the process was killed"
        failure = failure_of(self.label, slot, handle, cause)
        handle.process.kill()
        self.proc_failed(st, slot, handle, failure)

    async def monitor_heartbeats(self, st: MeshState) -> None:
        """Declare lost a worker that was silent while this process could hear it.

        Heartbeats are read by this process's event loop, so a loop that stalls (a
        blocking call, a debugger stop, a notebook idle between cells) hears nobody
        and must not blame the workers for it. A worker's silence is counted only
        from the later of its last heartbeat and the end of the last stall of this
        monitor (a tick that came much later than asked), which gives every worker a
        full timeout after the loop runs again to be heard.
        """
        rt = st.runtime
        last_tick = hearing_since = anyio.current_time()
        while True:
            with anyio.move_on_after(self._period):
                await st.closed.wait()  # (ends this at once with the mesh, not a tick later)
            if st.closing:
                break
            now = anyio.current_time()
            if now - last_tick > self._period + STALL_SLACK:
                hearing_since = now
                log.debug(
                    "event loop stalled for %.1f s: heartbeats count from now", now - last_tick
                )
            last_tick = now
            for slot, handle in enumerate(list(st.procs)):
                last = rt.peers.last_heartbeat(handle.addr)
                if handle.failed or handle.expected_exit or last is None:
                    continue
                silent = now - max(last, hearing_since)
                if handle.returncode is None and silent > self._timeout:
                    handle.failed = True
                    cause = (
                        f"sent no heartbeat for {silent:.1f} s while this controller was "
                        f"listening (timeout {self._timeout:g} s); the worker was silent, "
                        "not its controller; the process was killed"
                    )
                    failure = failure_of(self.label, slot, handle, cause)
                    handle.process.kill()
                    self.proc_failed(st, slot, handle, failure)
            st.ticked()

    def proc_failed(self, st: MeshState, slot: int, handle: ProcHandle, failure: Failure) -> None:
        """A process is gone: fail its calls at once, then restart or escalate."""
        if st.closing:
            return
        slots = self.restart_slots(st, slot)
        if slots is not None:
            st.restarting += 1  # before the calls fail, so `ready()` sees it
        # every process that may be calling it hears of it (Died notices)
        st.runtime.peer_failed(handle.addr, failure, announce=True)
        st.runtime.peers.unwatch(handle.addr)
        if slots is not None:
            st.tg.start_soon(self.restart, st, slots, failure)
        else:
            st.tg.start_soon(self.escalate, st, failure)

    def on_actor_failure(self, report: FailureReport, peer: str) -> None:
        """An actor of this mesh failed, says the process at ``peer``: one of this
        mesh's own (or this one); a report from anywhere else is dropped."""
        st = self._state
        if st is None or st.closing:
            return
        if peer != st.runtime.address and peer not in st.addrs:
            log.warning("dropped a failure report for %s from %s", report.actor, peer)
            return
        spawned = st.spawned.get(report.actor)
        name = spawned.mesh.name if spawned is not None else report.actor
        failure = Failure(
            mesh=f"actor {name!r}", rank=report.rank, pid=report.pid, cause=report.cause
        )
        st.tg.start_soon(self.escalate, st, failure)

    async def escalate(self, st: MeshState, failure: Failure) -> None:
        try:
            await self.escalate_to_owner(st, failure)
        finally:
            st.escalated.add(failure.pid)
            if st.escalation is not None:
                st.escalation.set()

    async def escalate_to_owner(self, st: MeshState, failure: Failure) -> None:
        if self._handler is not None:
            handled = await call_supervisor(self._handler, failure)
        elif self._owner is not None:
            handled = await self._owner.supervise(failure)
        else:
            handled = False
        if handled:
            st.handled.append(failure)
            return
        st.unhandled.append(failure)
        # logged once, and only here: not when supervise= handled it, nor when the
        # session prints it (a mesh of no owner, outside any ``async with``)
        if self._scoped or self._owner is not None or st.runtime.on_root_failure is None:
            log.error("supervision failure: %s", failure)
        if self._scoped:
            st.tg.cancel_scope.cancel()
        elif self._owner is not None:
            self._owner.fail(f"unhandled failure of a mesh it owns: {failure}")
        else:
            st.runtime.fail_root(failure)

    def restart_slots(self, st: MeshState, slot: int) -> list[int] | None:
        """The process slots to restart for a failure at ``slot``, or None to escalate."""
        on_slot = [s for s in st.spawned.values() if slot in s.mesh.shape.slots]
        if not on_slot or any(s.policy is None for s in on_slot):
            return None
        policies = [s.policy for s in on_slot if s.policy is not None]
        slots = {slot}
        for s in on_slot:
            if s.policy is not None and s.policy.strategy == "one_for_all":
                slots.update(s.mesh.shape.slots)
        # every actor mesh on a restarted process must agree to be restarted
        for s in st.spawned.values():
            if slots & set(s.mesh.shape.slots) and s.policy is None:
                return None
        strictest = min(policies, key=lambda p: p.max_restarts)
        if not st.window.allow(strictest):
            log.error(
                "restart intensity exceeded (%d in %g s)", strictest.max_restarts, strictest.within
            )
            return None
        return sorted(slots)

    def _restart_done(self, st: MeshState) -> None:
        st.restarting -= 1
        st.restarted.set()
        st.restarted = anyio.Event()

    async def restart(self, st: MeshState, slots: list[int], failure: Failure) -> None:
        rt = st.runtime
        try:
            old = [st.procs[s] for s in slots]
            for h in old:
                h.expected_exit = True
                rt.peers.unwatch(h.addr)
                if h.addr not in rt.peers.dead:
                    rt.peer_failed(
                        h.addr,
                        Failure(
                            mesh=self.label,
                            rank=st.procs.index(h),
                            pid=h.pid,
                            cause=f"restarted with its mesh after: {failure}",
                        ),
                        announce=True,
                    )
            async with anyio.create_task_group() as tg:
                for h in old:
                    if h.returncode is None:
                        h.process.kill()
                    tg.start_soon(h.stop, 0)
            fresh = await self._life.start_procs(rt, slots)
            if st.closing:  # the mesh is being stopped: these are not wanted any more
                for h in fresh:
                    h.expected_exit = True
                    h.process.kill()
                    await h.stop(0)
                self._restart_done(st)
                return
            # Callers keep the old (dead) addresses, and fail at once, until every
            # actor is back: published earlier, a call would reach a process that
            # does not run its actor yet (a LookupError, not a SupervisionError).
            addrs = list(st.addrs)
            for s, h in zip(slots, fresh):
                st.procs[s] = h
                addrs[s] = h.addr
                self.supervise_proc(st, s, h)
            affected = [sp for sp in st.spawned.values() if set(slots) & set(sp.mesh.shape.slots)]
            for sp in affected:
                await self._life.spawn_ranks(st, sp, set(slots), addrs)
            for s in slots:
                st.addrs[s] = addrs[s]
            st.restarts += 1
            if st.publish is not None:
                await st.publish()
            log.warning("restarted process slot(s) %s after: %s", slots, failure)
        except Exception as exc:
            if st.closing:  # stopped by its owner meanwhile: nothing to escalate
                self._restart_done(st)
                return
            log.exception("restart failed")
            st.restarting -= 1
            st.restarted.set()
            st.restarted = anyio.Event()
            await self.escalate(
                st,
                Failure(
                    mesh=failure.mesh,
                    rank=failure.rank,
                    pid=failure.pid,
                    cause=f"{failure.cause}; the restart failed: {exc}",
                ),
            )
            return
        # The hooks re-send state before `ready()` returns, so the first call after
        # it finds the restarted actors as the owner wants them.
        for sp in affected:
            hook = sp.policy.on_restart if sp.policy is not None else None
            if hook is not None:
                ranks = [r for r, s in enumerate(sp.mesh.shape.slots) if s in slots]
                await call_hook(hook, sp.mesh, ranks)
        st.restarting -= 1
        st.restarted.set()
        st.restarted = anyio.Event()

    async def settle(self, st: MeshState) -> None:
        """Let the deaths that already happened be noticed and escalated (bounded).

        A remote error can beat the news of the death that caused it: a peer's
        collective fails as soon as the kernel closes the dead process's sockets.
        """
        gone = [
            p
            for p in st.procs
            if p.failed or p.returncode is not None or (p.local and not pid_alive(p.pid))
        ]
        with anyio.move_on_after(FAILED_STOP_TIMEOUT):
            while any(p.pid not in st.escalated for p in gone):
                st.escalation = anyio.Event()
                await st.escalation.wait()


def unhandled_error(failures: Sequence[Failure], where: str) -> SupervisionError:
    """What the owner of mesh ``where`` sees of the failures nobody handled: one
    error that names them all."""
    return SupervisionError(
        f"{len(failures)} supervision failure(s) in {where}: "
        + "; ".join(str(f).splitlines()[0] for f in failures),
        failures,
    )
