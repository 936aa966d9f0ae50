"""Soak of persistent meshes: do they live on, idle and whole, with no controller?

Two controllers (programs of their own, this script with ``--controller``) each make a
persistent mesh of ``--procs`` workers on this machine's local agent, give every rank
an actor with state of its own, hold the mesh for a few heartbeat periods, then go: one
returns (``return``), the other SIGKILLs itself (``kill``). Nobody holds the meshes for
``--hold`` seconds; meanwhile this script samples every worker's CPU time and RSS
(``/proc``) once a second. Then it takes each mesh over (``amesh.attach_mesh``), asks
every rank for its state and stops the mesh.

Reported per mesh: how it lost its controller, its workers alive at the end of the
hold, the ranks that answered with the state they were given, the heartbeat periods
held (hold / period: each is a period in which a worker found no controller to beat
to), and over the hold the workers' CPU (per worker: mean and the busiest, in % of one
core) and RSS (per worker, MiB: the largest at the start and at the end). The local
agent's CPU and RSS over the hold are the last row. The agent, the meshes and their
workers are gone at the end (``amesh stop`` and SIGKILL on an error or Ctrl-C).

Usage::

    python bench/bench_soak.py            # 3 minutes of hold
    python bench/bench_soak.py --quick    # 20 s
    python bench/bench_soak.py --hold 600 --procs 8 --json

``--json`` prints ``{"hold_s", "period_s", "procs", "meshes": [{"how", "alive",
"answered", "periods", "cpu_mean_pct", "cpu_max_pct", "rss_start_mib", "rss_end_mib"}],
"agent": {"cpu_pct", "rss_start_mib", "rss_end_mib"}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

import amesh
from amesh import Actor, endpoint

ROOT = Path(__file__).resolve().parent.parent
#: heartbeat periods a controller holds its mesh before it goes (the heartbeat bug of
#: issue 36 struck only connections up longer than a period)
LEAD_PERIODS = 5
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class Keeper(Actor):
    """State of its own per rank: what the controller gave it, and its pid."""

    def __init__(self) -> None:
        self.value = -1

    @endpoint
    def set(self, value: int) -> None:
        self.value = value

    @endpoint
    def state(self) -> tuple[int, int]:
        return os.getpid(), self.value


def _expected(rank: int) -> int:
    return 1000 + rank


async def _controller(name: str, how: str, procs: int, period: float) -> None:
    mesh = await amesh.ProcMesh(
        {"procs": procs}, name=name, persistent=True, heartbeat_period=period
    )
    keepers = await mesh.spawn("keepers", Keeper)
    for rank in range(procs):
        await keepers.slice(procs=rank).set.call_one(_expected(rank))
    print(" ".join(map(str, mesh.pids)), flush=True)
    await anyio.sleep(LEAD_PERIODS * period)  # holds the mesh (its heartbeats)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def _cpu_rss(pid: int) -> tuple[float, float] | None:
    """CPU seconds and RSS in MiB of ``pid``; None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] == "Z":
        return None
    cpu = (int(fields[11]) + int(fields[12])) / _TICK
    return cpu, int(fields[21]) * _PAGE / 2**20


class Sampler:
    """CPU and RSS of some processes over a span: their first and last samples (a
    process that is gone has no last one)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.first: dict[int, tuple[float, float]] = {}
        self.last: dict[int, tuple[float, float]] = {}
        self.t0 = self.t1 = time.monotonic()

    def sample(self) -> None:
        self.t1 = time.monotonic()
        for pid in self.pids:
            got = _cpu_rss(pid)
            if got is None:
                self.last.pop(pid, None)
                continue
            self.first.setdefault(pid, got)
            self.last[pid] = got

    def alive(self) -> int:
        return sum(_cpu_rss(p) is not None for p in self.pids)

    def cpu_pcts(self) -> list[float]:
        span = max(self.t1 - self.t0, 1e-9)
        return [
            100 * (self.last[p][0] - self.first[p][0]) / span for p in self.pids if p in self.last
        ]

    def rss(self, which: dict[int, tuple[float, float]]) -> float:
        return max((which[p][1] for p in self.pids if p in which), default=float("nan"))


def _agent_pid(home: Path) -> int | None:
    """The local agent of ``home`` (its key file is on its command line)."""
    key = str(home / "key").encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"agent" in cmd and key in cmd:
                return int(entry.name)
    return None


@contextlib.contextmanager
def _state_dir() -> Iterator[Path]:
    """A state directory of this run's own: its local agent, and its key, which this
    process and the controllers it starts use from the start (so that this one may
    take their meshes over). Set in the environment before amesh reads it; the agent
    is gone at the end."""
    with tempfile.TemporaryDirectory(prefix="amesh-soak-") as tmp:
        home = Path(tmp) / "state"
        home.mkdir(mode=0o700)
        key = home / "key"
        subprocess.run(
            [sys.executable, "-m", "amesh", "keygen", str(key)], check=True, capture_output=True
        )
        os.environ["AMESH_STATE_DIR"] = str(home)
        os.environ["AMESH_KEY_FILE"] = str(key)
        os.environ["AMESH_LOCAL_AGENT_IDLE"] = "1"
        try:
            yield home
        finally:
            agent = _agent_pid(home)
            if agent is not None:
                os.kill(agent, signal.SIGTERM)


async def _start_controller(name: str, how: str, procs: int, period: float) -> list[int]:
    """Run a controller (this script) until it has gone; the pids of its mesh."""
    cmd = [sys.executable, __file__, "--controller", name, how, str(procs), str(period)]
    out = await anyio.run_process(cmd, cwd=ROOT, check=False)
    want = -signal.SIGKILL if how == "kill" else 0
    if out.returncode != want:
        raise RuntimeError(f"controller {how} exited {out.returncode}: {out.stderr.decode()}")
    return [int(p) for p in out.stdout.split()]


async def _take_over(name: str) -> int:
    """Take mesh ``name`` over, ask each rank its state, stop it: the ranks that
    answered with the state they were given (by their own pid)."""
    mesh = await amesh.attach_mesh(name)
    try:
        keepers = await mesh.actor_mesh("keepers")
        with anyio.fail_after(30):
            states = await keepers.state.call()
        return sum(
            state == (pid, _expected(rank))
            for rank, (pid, state) in enumerate(zip(mesh.pids, states.values()))
        )
    finally:
        await mesh.stop()


async def soak(home: Path, hold: float, procs: int, period: float) -> dict[str, Any]:
    names = {"return": "soak-return", "kill": "soak-kill"}
    pids: dict[str, list[int]] = {}
    stopped: set[str] = set()
    try:
        async with anyio.create_task_group() as tg:
            for how, name in names.items():

                async def start(how: str = how, name: str = name) -> None:
                    pids[how] = await _start_controller(name, how, procs, period)

                tg.start_soon(start)
        agent = _agent_pid(home)
        samplers = {how: Sampler(pids[how]) for how in names}
        agent_sampler = Sampler([agent] if agent is not None else [])
        every = [*samplers.values(), agent_sampler]
        for s in every:
            s.sample()
        end = time.monotonic() + hold
        while (left := end - time.monotonic()) > 0:
            await anyio.sleep(min(1.0, left))
            for s in every:
                s.sample()
        meshes = []
        for how, s in samplers.items():
            alive = s.alive()
            answered = await _take_over(names[how]) if alive else 0
            stopped.add(how)
            cpu = s.cpu_pcts()
            meshes.append(
                {
                    "how": how,
                    "alive": alive,
                    "answered": answered,
                    "periods": int(hold / period),
                    "cpu_mean_pct": sum(cpu) / len(cpu) if cpu else float("nan"),
                    "cpu_max_pct": max(cpu, default=float("nan")),
                    "rss_start_mib": s.rss(s.first),
                    "rss_end_mib": s.rss(s.last),
                }
            )
    finally:  # (an error, Ctrl-C): what was not taken over and stopped
        with anyio.CancelScope(shield=True):
            for how, name in names.items():
                if how not in stopped:
                    await anyio.run_process(
                        [sys.executable, "-m", "amesh", "stop", name], check=False
                    )
                    for pid in pids.get(how, []):
                        if _cpu_rss(pid) is not None:
                            os.kill(pid, signal.SIGKILL)
    agent_cpu = agent_sampler.cpu_pcts()
    return {
        "hold_s": hold,
        "period_s": period,
        "procs": procs,
        "meshes": meshes,
        "agent": {
            "cpu_pct": agent_cpu[0] if agent_cpu else float("nan"),
            "rss_start_mib": agent_sampler.rss(agent_sampler.first),
            "rss_end_mib": agent_sampler.rss(agent_sampler.last),
        },
    }


def _table(r: dict[str, Any]) -> str:
    lines = [
        f"persistent meshes of {r['procs']} workers, held {r['hold_s']:g} s with no "
        f"controller (heartbeat period {r['period_s']:g} s)",
        "",
        "| controller | alive | answered with its state | periods held | worker CPU % "
        "mean / max | worker RSS MiB start / end |",
        "|---|---|---|---|---|---|",
    ]
    for m in r["meshes"]:
        lines.append(
            f"| {m['how']} | {m['alive']}/{r['procs']} | {m['answered']}/{r['procs']} | "
            f"{m['periods']} | {m['cpu_mean_pct']:.2f} / {m['cpu_max_pct']:.2f} | "
            f"{m['rss_start_mib']:.1f} / {m['rss_end_mib']:.1f} |"
        )
    a = r["agent"]
    lines.append(
        f"| (local agent) | | | | {a['cpu_pct']:.2f} | "
        f"{a['rss_start_mib']:.1f} / {a['rss_end_mib']:.1f} |"
    )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--controller"]:
        name, how, procs, period = sys.argv[2:6]
        amesh.run(_controller, name, how, int(procs), float(period))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hold", type=float, default=180.0, help="seconds without a controller")
    p.add_argument("--quick", action="store_true", help="hold 20 s")
    p.add_argument("--procs", type=int, default=4, help="workers per mesh")
    p.add_argument("--period", type=float, default=0.5, help="heartbeat period, s")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    hold = 20.0 if args.quick else args.hold
    with _state_dir() as home:
        result = amesh.run(soak, home, hold, args.procs, args.period)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    if any(m["answered"] != args.procs for m in result["meshes"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
