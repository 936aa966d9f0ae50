"""``amesh list`` and ``amesh stop NAME``: the persistent meshes that host agents keep;
``amesh list`` shows the live meshes of this machine's controllers first, and
``amesh stacks`` and ``amesh logs`` look into those (see :mod:`amesh._hosts._live`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from .._config import default_transport, settings
from .._errors import SupervisionError
from .._identity import adopt_key_file
from .._mesh import registry_read_all
from .._runtime import open_runtime
from .._transport import open_transport
from ._agent import address_towards
from ._home import local_key
from ._inspect import held_logs, held_stacks
from ._live import describe_live, find, live_meshes, recent_logs, stacks
from ._remote import _agent_address, find_held, held_meshes

__all__ = ["describe", "main"]


def describe(name: str, record: dict[str, Any]) -> str:
    """A persistent mesh, as ``amesh list`` shows it."""
    shape = ", ".join(f"{k}: {v}" for k, v in zip(record["labels"], record["sizes"], strict=True))
    hosts = ", ".join(record["hosts"])
    lines = [f"{name}  {{{shape}}}  on {hosts}"]
    exits: dict[int, int] = record.get("exits", {})
    ranks = []
    for rank, (_, pid) in enumerate(record["procs"]):
        rc = exits.get(pid)
        state = (
            "running" if rc is None else (f"killed by signal {-rc}" if rc < 0 else f"exited {rc}")
        )
        ranks.append(f"{rank}: pid {pid} {state}")
    lines.append("  processes: " + "; ".join(ranks))
    actors = ", ".join(f"{a['name']} ({a['class']})" for a in record["actors"]) or "none"
    lines.append(f"  actor meshes: {actors}")
    lines.append(f"  last controller: pid {record['controller_pid']} at {record['controller']}")
    return "\n".join(lines)


def _print_list(held: dict[str, Any], live: list[dict[str, Any]] | None, as_json: bool) -> None:
    """Print the live meshes (None: not asked, ``--hosts``) above the persistent ones."""
    if as_json:
        persistent = {
            n: {k: v for k, v in r.items() if k != "actors"}
            | {"actors": [{"name": a["name"], "class": a["class"]} for a in r["actors"]]}
            for n, r in held.items()
        }
        print(json.dumps({"live": live or [], "persistent": persistent}, default=str))
        return
    if live is not None:
        print("live meshes:" if live else "no live meshes")
        for mesh in live:
            print(describe_live(mesh))
        print()
    print("persistent meshes:" if held else "no persistent meshes")
    for name in sorted(held):
        print(describe(name, held[name]))


def _transport(hosts: Sequence[str] | None, key_file: str | None) -> tuple[str, str]:
    """``(scheme, host)`` of a runtime that reaches the agents at ``hosts`` (this
    machine's local agent when None), whose key it adopts."""
    if hosts is None:
        adopt_key_file(str(local_key()))
        return default_transport()
    if key_file is not None:
        adopt_key_file(key_file)
    # the agents answer where they can reach us: on our side of the route to them
    first = _agent_address(hosts[0]).split("://", 1)[1].rsplit(":", 1)[0]
    return "tcp", address_towards(first.strip("[]"))


async def _held(
    name: str,
    missing: LookupError | None,
    work: Callable[[], Awaitable[None]],
    hosts: Sequence[str] | None,
    key_file: str | None,
) -> int:
    """Run ``work()`` on persistent mesh ``name``, which no controller on this machine
    holds (not live: ``missing``), through its agents (see :mod:`._inspect`)."""
    scheme, host = _transport(hosts, key_file)
    async with open_runtime(lambda: open_transport(scheme, host=host)):
        try:
            await work()
        except LookupError as exc:
            if missing is None:
                raise
            raise LookupError(
                f"no live mesh named {name!r} on this machine, nor a persistent one ({exc})"
            ) from None
    return 0


async def _stacks(
    name: str,
    rank: int | None,
    pid: int | None,
    full: bool,
    hosts: Sequence[str] | None,
    key_file: str | None,
) -> int:
    async def held() -> None:
        for r, worker, text in await held_stacks(name, rank, full, hosts, key_file):
            print(f"=== {name} rank {r} (pid {worker})")
            print(text)

    if hosts is not None:  # (the live meshes are this machine's)
        return await _held(name, None, held, hosts, key_file)
    try:
        key, mesh = find(name, pid)
    except LookupError as missing:
        if pid is not None:
            raise
        return await _held(name, missing, held, hosts, key_file)
    ranks = list(range(len(mesh["addrs"]))) if rank is None else [rank]
    if not all(0 <= r < len(mesh["addrs"]) for r in ranks):
        print(f"amesh stacks: mesh {name!r} has no rank {rank}", file=sys.stderr)
        return 1
    texts = await stacks(key, mesh, ranks, full)
    for r, text in zip(ranks, texts):
        print(f"=== {name} rank {r} (pid {mesh['pids'][r]})")
        print(text)
    return 0


async def _stop(name: str, hosts: Sequence[str] | None, key_file: str | None) -> int:
    try:
        mesh, _ = await find_held(name, hosts, key_file)
    except LookupError:
        owners = sorted(
            str(r["pid"])
            for r in registry_read_all()
            for m in r.get("meshes", [])
            if m["name"] == name
        )
        if hosts is not None or not owners:
            raise
        raise LookupError(
            f"{name!r} is not a persistent mesh but a live one, of controller pid "
            f"{', '.join(owners)}: it stops with its controller (procs.stop() there, or "
            "end that program)"
        ) from None
    stopped = await mesh._agents.stop_mesh.call(name)
    print(f"stopped {name}: {sum(stopped.values())} process(es)")
    return 0


async def _logs(args: argparse.Namespace, hosts: Sequence[str] | None, key_file: str | None) -> int:
    def held() -> Awaitable[None]:
        return held_logs(args.name, args.lines, args.rank, args.follow, hosts, key_file)

    if hosts is not None:  # (the live meshes are this machine's)
        return await _held(args.name, None, held, hosts, key_file)
    try:
        key, mesh = find(args.name, args.pid)
    except LookupError as missing:
        if args.pid is not None:
            raise
        return await _held(args.name, missing, held, hosts, key_file)
    await recent_logs(key, mesh, args.lines, args.rank, args.follow)
    return 0


def main(
    command: str, hosts: Sequence[str] | None, key_file: str | None, args: argparse.Namespace
) -> int:
    """Run ``amesh list``, ``amesh stop``, ``amesh stacks`` or ``amesh logs``."""

    async def run() -> int:
        if command == "stacks":
            full = args.full or settings().debug
            return await _stacks(args.name, args.rank, args.pid, full, hosts, key_file)
        if command == "logs":
            return await _logs(args, hosts, key_file)
        scheme, host = _transport(hosts, key_file)
        async with open_runtime(lambda: open_transport(scheme, host=host)):
            if command == "stop":
                return await _stop(args.name, hosts, key_file)
            held = await held_meshes(hosts, key_file)
        # after the agents: each controller's key replaces the local one
        _print_list(held, await live_meshes() if hosts is None else None, args.json)
        return 0

    try:
        return anyio.run(run)
    except KeyboardInterrupt:  # the way out of `amesh logs -f`
        return 130
    except (SupervisionError, TimeoutError, OSError, ValueError, RuntimeError, LookupError) as exc:
        print(f"amesh {command}: {exc}", file=sys.stderr)
        return 1
