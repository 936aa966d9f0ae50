"""``amesh list`` and ``amesh stop NAME``: the persistent meshes that host agents keep."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from .._config import default_transport
from .._errors import SupervisionError
from .._runtime._runtime import open_runtime
from .._transport import open_transport
from .._transport._auth import adopt_key_file
from ._agent import address_towards
from ._home import local_key
from ._remote import _agent_address, attach, held_meshes, local_hosts

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


async def _list(hosts: Sequence[str] | None, key_file: str | None, as_json: bool) -> int:
    held = await held_meshes(hosts, key_file)
    if as_json:
        print(
            json.dumps(
                {
                    n: {k: v for k, v in r.items() if k != "actors"}
                    | {"actors": [{"name": a["name"], "class": a["class"]} for a in r["actors"]]}
                    for n, r in held.items()
                },
                default=str,
            )
        )
        return 0
    if not held:
        print("no persistent meshes")
    for name in sorted(held):
        print(describe(name, held[name]))
    return 0


async def _stop(name: str, hosts: Sequence[str] | None, key_file: str | None) -> int:
    mesh = (
        await local_hosts(start=False) if hosts is None else await attach(hosts, key_file=key_file)
    )
    held = await held_meshes(mesh) if mesh is not None else {}
    record = held.get(name)
    if mesh is None or record is None:
        print(f"amesh stop: no persistent mesh named {name!r}", file=sys.stderr)
        return 1
    agents = list(record["agents"])
    if [i["addr"] for i in mesh.hosts] != agents:
        mesh = await attach(agents, key_file=key_file, _local=hosts is None)
    stopped = await mesh._agents.stop_mesh.call(name)
    print(f"stopped {name}: {sum(stopped.values())} process(es)")
    return 0


def main(
    command: str, hosts: Sequence[str] | None, key_file: str | None, args: argparse.Namespace
) -> int:
    """Run ``amesh list`` or ``amesh stop``."""

    async def run() -> int:
        if hosts is None:
            adopt_key_file(str(local_key()))
            scheme, host = default_transport()
        else:
            if key_file is not None:
                adopt_key_file(key_file)
            # the agents answer where they can reach us: on our side of the route to them
            first = _agent_address(hosts[0]).split("://", 1)[1].rsplit(":", 1)[0]
            scheme, host = "tcp", address_towards(first.strip("[]"))
        async with open_runtime(lambda: open_transport(scheme, host=host)):
            if command == "list":
                return await _list(hosts, key_file, args.json)
            return await _stop(args.name, hosts, key_file)

    try:
        return anyio.run(run)
    except (SupervisionError, TimeoutError, OSError, ValueError, RuntimeError) as exc:
        print(f"amesh {command}: {exc}", file=sys.stderr)
        return 1
