"""The worlds the fault-injection rules run in: real processes, in-process workers, a
relay tree, faulty links, restart policies, silent workers."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from amesh import ActorError, ActorMesh, RestartPolicy, SupervisionError, _wire
from amesh._transport._stream_framing import HEADER, MAX_SIZE, is_stream_address, parse_address
from amesh.testing import FaultyTransport, InProcessHost, MemoryTransport

from ..actors import Ledger
from ._machine import STEP_DEADLINE, MeshMachine, N, plans, slices

#: what an attacker who can reach a worker's socket sends: bytes that are no handshake,
#: or none, or an answer to the challenge made without the job key, with a frame behind
ATTACKS = ["garbage", "oversize", "truncated", "bad_frame", "forged", "silent", "wrong_key"]
#: the stream handshake (see amesh._transport._auth): the listener's challenge is
#: "AMC1" and a 32-byte nonce; the answer "AMA1", the dialer's address (u16 LE length
#: first) and a 32-byte HMAC proof
CHALLENGE = b"AMC1"
CHALLENGE_LEN = 4 + 32
#: the address a forged frame claims to come from (nobody listens there)
ATTACKER = "stream+abstract://attacker"
#: request envelopes (a request to a relay is a Relay, to a rank a Call or Cast)
REQUESTS = {"Call", "Cast", "Relay"}


class RealProcesses(MeshMachine):
    """Real worker processes (asyncio + uvloop): SIGKILL, SIGSTOP, SIGCONT, and
    connections to a worker's socket from a process that has no business there."""

    backend = ("asyncio", {"use_uvloop": True})
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    @precondition(lambda self: len(self.killed | self.stopped) < N)
    @rule(data=st.data(), attack=st.sampled_from(ATTACKS), junk=st.binary(min_size=1, max_size=64))
    def attacker(self, data: st.DataObject, attack: str, junk: bytes) -> None:
        """Someone connects to a worker and sends what they like (same uid, so past
        the peer check, up to the challenge): the connection is refused and counted,
        the worker keeps serving, and nothing that was sent ran."""
        self.count("attacker")
        assert self.procs is not None
        rank = data.draw(st.sampled_from(self.live_ranks()))
        addr = self.procs._live().addrs[rank]
        if not is_stream_address(addr):
            return  # NNG transports (AMESH_TRANSPORT_IMPL): no raw socket to write to
        target = self.procs.slice(x=rank)
        before = self.run(target.statistics).values()[0]
        body = b"\xff" + junk  # not an amesh preamble ("AM")
        claim = None
        if attack == "garbage":
            sent = junk
        elif attack == "oversize":
            sent = HEADER.pack(MAX_SIZE) + junk
        elif attack == "truncated":
            sent = HEADER.pack(len(junk) + 100) + junk
        elif attack == "bad_frame":
            sent = HEADER.pack(len(body)) + body
        elif attack == "silent":
            sent = b""
        else:
            sent = self._forged(rank)
            if attack == "wrong_key":
                claim = self.rt.address  # and it claims to be the controller
        self._send_and_wait_close(addr, sent, claim)
        after = self.run(target.statistics).values()[0]
        self.check_counts(rank)  # still serving, and nothing ran
        if attack == "silent":
            # leaving without a word is what a route probe does (HybridTransport's
            # local_alias): closed, not counted as a refusal
            assert after["auth_refused"] == before["auth_refused"], (before, after)
        else:
            assert after["auth_refused"] > before["auth_refused"], (before, after)
        assert after["frames_dropped"] == before["frames_dropped"], "a frame got past the gate"

    def _forged(self, rank: int) -> bytes:
        """A well-formed Cast to the first actor mesh's ``bump`` at ``rank``."""
        key = next(iter(self.meshes_by_key))
        payload = _wire.dumps(((), {}))
        cast = _wire.Cast(ATTACKER, 1, rank, key, "bump", ["x"], [N], payload.data)
        frame = _wire.join(_wire.encode(cast))
        return HEADER.pack(len(frame)) + frame

    @staticmethod
    def _send_and_wait_close(addr: str, data: bytes, claim: str | None) -> None:
        """Send ``data`` on a fresh connection (first answering the challenge as
        ``claim`` with a proof made without the key, if ``claim``), close our side, and
        wait until the worker closes its side: by then it has judged all of it."""
        family, sockaddr = parse_address(addr)
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(STEP_DEADLINE)
            sock.connect(sockaddr)
            try:
                if claim is not None:
                    challenge = sock.recv(CHALLENGE_LEN, socket.MSG_WAITALL)
                    assert challenge.startswith(CHALLENGE), challenge
                    me = claim.encode()
                    proof = os.urandom(32)
                    data = b"AMA1" + struct.pack("<H", len(me)) + me + proof + data
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(4096):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass  # the worker dropped the connection first


class SilentWorkers(RealProcesses):
    """Real processes with a short heartbeat timeout, where every death is a SIGSTOP:
    the owner declares the silent worker lost (and kills it), once, and whoever waited
    on it (the owner, the Caller) learns of it."""

    heartbeat_period = 0.2
    heartbeat_timeout = 1.5
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    stop = None  # type: ignore[assignment]
    cont = None  # type: ignore[assignment]
    # covered by RealProcesses; left out so that deaths come up often
    attacker = None  # type: ignore[assignment]
    call_one = None  # type: ignore[assignment]
    caller_bump = None  # type: ignore[assignment]
    cancel_call = None  # type: ignore[assignment]
    choose = None  # type: ignore[assignment]
    raise_in_endpoint = None  # type: ignore[assignment]

    def kill_proc(self, pid: int) -> None:
        self.stop_proc(pid)

    def died(self, rank: int) -> None:
        super().died(rank)
        self.count("silent_death")
        self.wait_reported()
        (failure,) = [f for f in self.failures if f.rank == rank]
        assert "the worker was silent" in failure.cause, failure


class InProcessWorkers(MeshMachine):
    """In-process workers over the memory transport (trio): cheap, so many examples."""

    backend = ("trio", {})
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    def __init__(self) -> None:
        self._host = InProcessHost()
        super().__init__()

    def transport(self) -> Any:
        return MemoryTransport()

    def host(self) -> Any:
        return self._host

    def kill_proc(self, pid: int) -> None:
        self.portal.call(self._sync, self._host.worker(pid).kill)

    def stop_proc(self, pid: int) -> None:
        self.portal.call(self._sync, self._host.worker(pid).pause)

    def cont_proc(self, pid: int) -> None:
        self.portal.call(self._sync, self._host.worker(pid).resume)

    async def _sync(self, fn: Any) -> None:
        fn()


class RelayTree(InProcessWorkers):
    """The same rules through a relay tree (fan-out 2 over 3 ranks: rank 2's messages
    go through rank 0). A stopped relay would hold its subtree's messages until it is
    declared dead, which the model does not follow, so this machine kills but does not
    stop; a broadcast is followed by a call to the same ranks, so that it has arrived
    (per-sender order, through the tree) before a relay may be killed."""

    backend = ("asyncio", {})
    fanout = 2
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    stop = None  # type: ignore[assignment]
    cont = None  # type: ignore[assignment]

    @rule(
        mesh=MeshMachine.meshes, s=slices, adverb=st.sampled_from(["call", "stream", "broadcast"])
    )
    def bump(self, mesh: ActorMesh[Ledger], s: slice, adverb: str) -> None:
        super().bump(mesh, s, adverb)
        ranks = list(range(N)[s])
        if adverb == "broadcast" and not set(ranks) & self.killed:
            counts = self.model[mesh.key]
            got = self.run(mesh.slice(x=s).peek.call).values()
            assert got == [(r, counts[r]) for r in ranks]

    @precondition(lambda self: not self.killed)
    @rule(mesh=MeshMachine.meshes, k=st.integers(1, 8))
    def relay_dies_holding_broadcasts(self, mesh: ActorMesh[Ledger], k: int) -> None:
        """Rank 0 relays rank 2's messages. It stops, broadcasts pile up in it, and it
        dies: the others still get each broadcast once, in order (resent around it)."""
        self.count("relay_dies_holding_broadcasts")
        resent = self.rt.statistics().casts_resent
        self.stop_proc(self.pids[0])

        async def broadcasts() -> None:
            for j in range(k):
                await mesh.note.broadcast(-2, j)

        self.run(broadcasts)
        self.kill(0)
        self.wait_reported()  # known dead: what follows goes around it
        notes = self.run(mesh.slice(x=slice(1, N)).take_notes.call).values()
        for r, got in zip(range(1, N), notes):
            assert [tuple(x) for x in got] == [(-2, j) for j in range(k)], r
            self.model[mesh.key][r] += k
        assert self.rt.statistics().casts_resent > resent

    @precondition(lambda self: not self.killed & {0, 2})
    @rule(mesh=MeshMachine.meshes, from_caller=st.booleans())
    def relay_dies_during_call(self, mesh: ActorMesh[Ledger], from_caller: bool) -> None:
        """Rank 0 relays a call to rank 2's serial ``block`` and dies while rank 2 runs
        it: the call fails, and rank 2 does not go on running what nobody waits for
        (its mailbox takes the next call)."""
        self.count("relay_dies_during_call")
        caller = self.caller if from_caller else None
        outcome = self.call_held(caller, mesh.slice(x=2), 2, "block")
        self.kill(0)
        kind, message = outcome.result(timeout=STEP_DEADLINE + 5)
        assert kind == "SupervisionError", (kind, message)
        self.wait_reported()
        try:
            got = self.run(lambda: mesh.slice(x=2).peek.options(timeout=5.0).call_one())
        except TimeoutError:
            raise AssertionError("rank 2 still runs the call its relay's death ended") from None
        assert got == (2, self.model[mesh.key][2])


class FaultyLinks(InProcessWorkers):
    """The controller's transport drops, duplicates and delays frames.

    Duplicated requests run once (receivers drop them by sender and call id); a lost
    Credit costs a probe, never a stalled broadcaster (the send window is made small,
    ``AMESH_SEND_WINDOW=64``, by the test); delays keep each sender's order; a lost
    Call or Reply makes that call time out and nothing else. Duplicating every request
    may be on for a whole example ("ambient"), under all the other rules.
    """

    backend = ("asyncio", {})
    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    def __init__(self) -> None:
        self.dup_all = False
        super().__init__()

    def transport(self) -> Any:
        self.faulty = FaultyTransport(MemoryTransport())
        return self.faulty

    def faults(self) -> None:
        """Back to the example's ambient faults only."""
        self.faulty.clear()
        self.faults_after()

    def faults_after(self) -> None:
        """Add the ambient faults behind the rules already there (the first rule that
        matches a frame acts on it)."""
        if self.dup_all:
            self.faulty.duplicate(kinds=REQUESTS)

    @initialize(dup_all=st.booleans(), lost_credits=st.integers(0, 2))
    def ambient(self, dup_all: bool, lost_credits: int) -> None:
        self.dup_all = dup_all
        self.faults()
        if lost_credits:
            self.faulty.drop_inbound(kinds={"Credit"}, count=lost_credits)

    def usable(self, ranks: list[int]) -> bool:
        return not set(ranks) & (self.killed | self.stopped)

    def duplicates_dropped(self, ranks: list[int]) -> int:
        """Duplicated requests the workers at ``ranks`` dropped so far."""
        procs = self.procs
        assert procs is not None
        self.faulty.clear()  # the statistics calls themselves are not duplicated
        stats = [self.run(procs.slice(x=r).statistics).values()[0] for r in ranks]
        self.faults()
        return sum(s["duplicates_dropped"] for s in stats)

    @rule(
        mesh=MeshMachine.meshes,
        s=slices,
        adverb=st.sampled_from(["call", "stream", "broadcast"]),
        count=st.integers(1, 4),
    )
    def duplicate_requests(
        self, mesh: ActorMesh[Ledger], s: slice, adverb: str, count: int
    ) -> None:
        self.count("duplicate_requests")
        ranks = list(range(N)[s])
        if not self.usable(ranks):
            return
        before = self.duplicates_dropped(ranks)
        self.faulty.clear()
        self.faulty.duplicate(kinds=REQUESTS, count=count)
        duplicated = self.faulty.duplicated
        self.bump(mesh, s, adverb)
        assert self.faulty.duplicated - duplicated == min(count, len(ranks))
        self.faults()
        for r in ranks:
            self.check_counts(r)  # each ran once
        assert self.duplicates_dropped(ranks) - before >= min(count, len(ranks))

    @rule(mesh=MeshMachine.meshes, rank=st.integers(0, N - 1))
    def drop_request(self, mesh: ActorMesh[Ledger], rank: int) -> None:
        self.count("drop_request")
        if not self.usable([rank]):
            return
        self.faulty.clear()
        self.faulty.drop(kinds={"Call"}, count=1)
        dropped = self.faulty.dropped
        with pytest.raises(TimeoutError):
            self.run(lambda: mesh.slice(x=rank).bump.options(timeout=0.1).call_one())
        assert self.faulty.dropped == dropped + 1
        self.faults()
        self.check_counts(rank)  # it did not run, and later calls work

    @rule(mesh=MeshMachine.meshes, rank=st.integers(0, N - 1))
    def drop_reply(self, mesh: ActorMesh[Ledger], rank: int) -> None:
        self.count("drop_reply")
        if not self.usable([rank]):
            return
        self.faulty.clear()
        self.faulty.drop_inbound(kinds={"Reply"}, count=1)
        dropped = self.faulty.dropped
        with pytest.raises(TimeoutError):
            self.run(lambda: mesh.slice(x=rank).bump.options(timeout=0.1).call_one())
        assert self.faulty.dropped == dropped + 1
        self.model[mesh.key][rank] += 1  # it ran; only its answer was lost
        self.faults()
        self.check_counts(rank)

    @rule(mesh=MeshMachine.meshes, s=slices, extra=st.integers(1, 128), lost=st.integers(0, 2))
    def flood(self, mesh: ActorMesh[Ledger], s: slice, extra: int, lost: int) -> None:
        """More broadcasts than a window, with some Credit frames lost: all arrive,
        once each, in order."""
        self.count("flood")
        view = mesh.slice(x=s)
        ranks = list(range(N)[s])
        if set(ranks) & self.stopped:
            return
        if set(ranks) & self.killed:
            with pytest.raises(SupervisionError):
                self.run(view.note.broadcast, -1, 0)
            return
        window = self.rt.links.window
        n = window + extra
        self.faulty.clear()
        if lost:
            self.faulty.drop_inbound(kinds={"Credit"}, count=lost)
        self.faults_after()
        waits = self.rt.statistics().credit_waits
        dropped = self.faulty.dropped

        async def flood() -> None:
            for j in range(n):
                await view.note.broadcast(-1, j)

        self.run(flood)
        assert self.rt.statistics().credit_waits > waits, "the window was never full"
        assert self.faulty.dropped - dropped == lost  # each rank credits at least twice
        notes = self.run(view.take_notes.call).values()
        for r, got in zip(ranks, notes):
            assert [tuple(x) for x in got] == [(-1, j) for j in range(n)], r
            self.model[mesh.key][r] += n
        self.faults()

    @rule(
        mesh=MeshMachine.meshes,
        s=slices,
        tasks=plans,
        seconds=st.sampled_from([0.0, 0.002, 0.02]),
        count=st.integers(1, 10),
        kinds=st.sampled_from([None, frozenset({"Call"}), frozenset({"Cast"})]),
    )
    def delayed_concurrent(
        self,
        mesh: ActorMesh[Ledger],
        s: slice,
        tasks: list[list[str]],
        seconds: float,
        count: int,
        kinds: frozenset[str] | None,
    ) -> None:
        """Concurrent tasks while frames are held back: each task's order holds."""
        self.count("delayed_concurrent")
        self.faulty.clear()
        self.faulty.delay(seconds, kinds=set(kinds) if kinds else None, count=count)
        self.faults_after()
        self.concurrent(mesh, s, tasks)
        self.faults()


class Restarts(InProcessWorkers):
    """Every actor mesh restarts its failed ranks (``restart="one_for_one"``): a killed
    rank answers again, with fresh state, once ``ready()``; the restart hook ran once
    per actor mesh, and no failure escalated."""

    examples = 0
    steps: dict[str, int] = {}  # noqa: RUF012

    def __init__(self) -> None:
        self.restarted: list[tuple[str, list[int]]] = []
        self._hooked: anyio.Event | None = None
        self._mark = (0, 0)
        super().__init__()

    def restart_policy(self) -> Any:
        return RestartPolicy(max_restarts=1_000_000, within=1.0, on_restart=self.on_restart)

    def on_restart(self, mesh: ActorMesh[Ledger], ranks: list[int]) -> None:
        self.restarted.append((mesh.key, list(ranks)))
        if self._hooked is not None:
            self._hooked.set()

    def kill(self, rank: int) -> None:
        self.mark()
        super().kill(rank)
        self.check_counts(rank)

    def mark(self) -> None:
        assert self.procs is not None
        self._mark = (self.procs.restarts, len(self.restarted))

    def died(self, rank: int) -> None:
        """Wait for the restart (each actor mesh's hook, then ``ready()``); the rank
        starts again from nothing."""
        procs = self.procs
        assert procs is not None
        restarts, hooks = self._mark
        wanted = hooks + len(self.model)

        async def restarted() -> None:
            while len(self.restarted) < wanted:
                self._hooked = anyio.Event()
                await self._hooked.wait()
            await procs.ready()

        old = self.pids[rank]
        self.run(restarted)
        assert procs.restarts == restarts + 1
        assert sorted(self.restarted[hooks:]) == sorted((k, [rank]) for k in self.model)
        self.pids = procs.pids
        assert self.pids[rank] != old
        for key, counts in self.model.items():
            counts[rank] = 0
            self.holds.pop((key, rank), None)
        self.stopped.discard(rank)

    @rule(mesh=MeshMachine.meshes, data=st.data())
    def call_while_restarting(self, mesh: ActorMesh[Ledger], data: st.DataObject) -> None:
        """Calls made while a rank restarts fail at once with a SupervisionError, until
        the restarted actor answers, fresh."""
        self.count("call_while_restarting")
        rank = data.draw(st.integers(0, N - 1))
        self.mark()
        self.kill_proc(self.pids[rank])
        answer, refused = self.run(self._call_until_answered, mesh.slice(x=rank))
        self.died(rank)
        assert answer == (rank, 1), (answer, refused)
        self.model[mesh.key][rank] = 1
        self.check_counts(rank)

    @staticmethod
    async def _call_until_answered(view: ActorMesh[Ledger]) -> tuple[Any, int]:
        refused = 0
        while True:
            try:
                return await view.bump.call_one(), refused
            except SupervisionError:
                refused += 1
            except ActorError as exc:
                raise AssertionError(
                    f"a call while the rank restarted (after {refused} refusals) failed with "
                    f"an error other than SupervisionError: {exc}"
                ) from exc
            await anyio.lowlevel.checkpoint()  # let the restart go on
