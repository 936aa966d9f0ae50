"""``amesh list``, ``amesh stacks`` and ``amesh logs`` for the live meshes of the
controllers on this machine, found in the registry (:mod:`amesh._mesh._registry`).

The workers are asked directly, with each controller's key (the registry holds it),
one controller after another: a runtime of its own for each mesh.
"""

from __future__ import annotations

import os
from typing import Any

import anyio

from .._errors import SupervisionError
from .._identity import adopt_key
from .._mesh import registry_read_all
from .._model import AGENT_KEY, CONTROLLER_KEY, ActorMesh, ControllerAgent, ProcAgent
from .._runtime import DUMP_TIMEOUT, LOOP_TIMEOUT, open_runtime, rank_of
from .._shape import Shape
from .._transport import open_transport

__all__ = [
    "ASK_TIMEOUT",
    "FOLLOW_PERIOD",
    "ask",
    "describe_live",
    "find",
    "live_meshes",
    "recent_logs",
    "stacks",
]

#: Seconds between two looks for new lines (``amesh logs -f``).
FOLLOW_PERIOD = 0.5
#: Seconds a worker has to answer ``amesh list`` or ``amesh stacks``: a rank whose
#: event loop does not answer by then is busy (``amesh stacks`` takes its stacks by a
#: signal then).
ASK_TIMEOUT = LOOP_TIMEOUT


def _transport_for(mesh: dict[str, Any]) -> Any:
    """A transport that reaches the workers of ``mesh`` (the way its controller does)."""
    scheme, rest = mesh["controller"].split("://", 1)
    host = "127.0.0.1"
    if scheme.removeprefix("stream+") in ("tcp", "tls+tcp"):
        host = rest.rsplit(":", 1)[0].strip("[]")
    return open_transport(scheme, host=host, reach=mesh["addrs"][0])


async def ask(
    key: str, mesh: dict[str, Any], method: str, ranks: list[int] | None = None, *args: Any
) -> list[Any]:
    """Call ``method`` (with ``args``) of the system actor of each of ``ranks``
    (default: all) of ``mesh`` (a registry entry), with the controller's ``key`` (hex).

    Returns:
        Per rank asked, the answer, or ``{"error": why, "busy": bool}`` if there was
        none (``busy``: its event loop did not answer within :data:`ASK_TIMEOUT`).
    """
    adopt_key(bytes.fromhex(key))
    addrs: list[str] = mesh["addrs"]
    ranks = list(range(len(addrs))) if ranks is None else ranks
    answers: list[Any] = [None] * len(ranks)

    async def one(i: int, rank: int) -> None:
        agent = ActorMesh(AGENT_KEY, AGENT_KEY, ProcAgent, Shape(["procs"], [1], [rank]), addrs)
        try:
            ep = getattr(agent, method).options(timeout=ASK_TIMEOUT)
            answers[i] = await ep.call_one(*args)
        except TimeoutError:
            why = f"busy: its event loop did not answer within {ASK_TIMEOUT:g} s"
            answers[i] = {"error": why, "busy": True}
        except Exception as exc:  # a dead worker: say so, go on with the others
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            answers[i] = {"error": why, "busy": False}

    async with open_runtime(lambda: _transport_for(mesh)), anyio.create_task_group() as tg:
        for i, rank in enumerate(ranks):
            tg.start_soon(one, i, rank)
    return answers


async def stacks(key: str, mesh: dict[str, Any], ranks: list[int], full: bool) -> list[str]:
    """The stacks of ``ranks`` of ``mesh`` (a registry entry): each worker's answer,
    else (its event loop is busy) taken by a signal by its controller."""
    texts = await ask(key, mesh, "stacks", ranks, full)
    busy = [i for i, t in enumerate(texts) if isinstance(t, dict) and t["busy"]]
    if busy:
        controller = ActorMesh(
            CONTROLLER_KEY,
            CONTROLLER_KEY,
            ControllerAgent,
            Shape(["procs"], [1]),
            [mesh["controller"]],
        )

        async def one(i: int) -> None:
            try:
                texts[i] = await controller.stacks.options(
                    timeout=DUMP_TIMEOUT + ASK_TIMEOUT
                ).call_one(mesh["name"], ranks[i], full)
            except Exception as exc:  # the controller is busy or gone too
                why = f"{type(exc).__name__}: {exc}".splitlines()[0]
                texts[i] = f"({texts[i]['error']}; and its controller did not take them: {why})\n"

        async with open_runtime(lambda: _transport_for(mesh)), anyio.create_task_group() as tg:
            for i in busy:
                tg.start_soon(one, i)
    return [t["error"] if isinstance(t, dict) else t for t in texts]


async def live_meshes() -> list[dict[str, Any]]:
    """Every live mesh of the controllers on this machine (but this process): its
    registry entry, with ``controller_pid`` and per rank the worker's ``status``."""
    found = []
    for record in registry_read_all():
        if record.get("pid") == os.getpid():
            continue
        for mesh in record.get("meshes", []):
            mesh["controller_pid"] = record["pid"]
            mesh["ranks"] = await ask(mesh.get("key") or record["key"], mesh, "status")
            found.append(mesh)
    return found


def find(name: str, pid: int | None) -> tuple[str, dict[str, Any]]:
    """``(key, entry)`` of the live mesh ``name`` (of the controller ``pid``).

    Raises:
        LookupError: there is none, or several (pid not given).
    """
    matches = [
        (m.get("key") or r["key"], m | {"controller_pid": r["pid"]})
        for r in registry_read_all()
        for m in r.get("meshes", [])
        if m["name"] == name and pid in (None, r["pid"])
    ]
    if not matches:
        raise LookupError(f"no live mesh named {name!r} on this machine")
    if len(matches) > 1:
        pids = ", ".join(str(m["controller_pid"]) for _, m in matches)
        raise LookupError(f"several meshes are named {name!r} (controller pids {pids}): use --pid")
    return matches[0]


def _shape(mesh: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in zip(mesh["labels"], mesh["sizes"]))


def describe_live(mesh: dict[str, Any]) -> str:
    """A live mesh, as ``amesh list`` shows it: one line per rank with the worker's
    pid, its actors' queued messages and running handlers, and the endpoints running
    (``now: trainers.step``)."""
    kind = "  persistent" if mesh.get("persistent") else ""
    lines = [f"{mesh['name']}  {{{_shape(mesh)}}}  controller pid {mesh['controller_pid']}{kind}"]
    lines.append("  actor meshes: " + (", ".join(mesh["actors"]) or "none"))
    for rank, (pid, status) in enumerate(zip(mesh["pids"], mesh["ranks"])):
        if "error" in status:
            if status.get("busy"):
                where = f"`amesh stacks {mesh['name']} {rank}` shows where"
                lines.append(f"  {rank}: pid {pid}  {status['error']}; {where}")
            else:
                lines.append(f"  {rank}: pid {pid}  no answer: {status['error']}")
            continue
        actors = status["actors"]
        queued = sum(a["queued"] for a in actors)
        running = sum(a["running"] for a in actors)
        now = [f"{a['name']}.{m}" for a in actors for m in a["now"]]
        failed = [f"{a['name']} failed: {a['failed']}" for a in actors if a["failed"]]
        line = f"  {rank}: pid {status['pid']}  queued={queued} running={running}"
        line += "  now: " + (", ".join(now) or "idle")
        lines.append(line + "".join(f"; {f}" for f in failed))
    return "\n".join(lines)


async def recent_logs(
    key: str, mesh: dict[str, Any], n: int, rank: int | None = None, follow: bool = False
) -> None:
    """Print the last ``n`` lines of output of ``mesh`` (a registry entry), which its
    controller keeps (asked with the controller's ``key``, hex), of rank ``rank``
    only when given; with ``follow``, then those that come, until the controller is
    gone."""
    adopt_key(bytes.fromhex(key))
    controller = ActorMesh(
        CONTROLLER_KEY, CONTROLLER_KEY, ControllerAgent, Shape(["procs"], [1]), [mesh["controller"]]
    )
    async with open_runtime(lambda: _transport_for(mesh)):
        logs = controller.logs.options(timeout=ASK_TIMEOUT)
        lines, seen = await logs.call_one(mesh["name"], n)
        printed = _print_lines(lines, rank)
        if not printed and not follow:
            print(f"no output from {mesh['name']!r} yet")
        while follow:
            await anyio.sleep(FOLLOW_PERIOD)
            try:
                lines, seen = await logs.call_one(mesh["name"], 0, seen)
            except (SupervisionError, TimeoutError) as exc:
                print(f"(its controller is gone: {exc})")
                return
            _print_lines(lines, rank)


def _print_lines(lines: list[str], rank: int | None) -> int:
    """Print ``lines`` (of rank ``rank`` only, when given); how many."""
    if rank is not None:
        lines = [line for line in lines if rank_of(line) == rank]
    for line in lines:
        print(line, flush=True)
    return len(lines)
