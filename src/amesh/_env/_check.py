"""``amesh env check``'s questions to a target's hosts: what each would need.

The agents of a ``hosts`` target, and this machine's agent for a ``local`` one (if one
runs: a check starts none), say their Python's version, whether the environment's venv
is built there already and which of the locked packages' files they lack; nothing is
sent or built. Targets whose launcher starts their agents (``ssh``, ``slurm``) have no
agents to ask before a spawn.
"""

from __future__ import annotations

from typing import Any

import anyio

from .._config import default_transport
from .._hosts import HostMesh, attach, local_hosts
from .._runtime import open_runtime
from .._transport import open_transport
from ._file import EnvSpec, HostsTarget, LocalTarget, Target
from ._lock import Lock, env_hash, lock_path, read_lock
from ._open import stale_reason

__all__ = ["HostLine", "probe_hosts"]

#: one line of a check's report, and whether it names a problem (a Python that does
#: not fit, an agent that cannot be reached): what is merely not there yet (a venv,
#: wheels) is built or sent by the first spawn
HostLine = tuple[str, bool]

#: seconds a check waits for a target's agents to answer
CHECK_TIMEOUT = 10.0


def probe_hosts(spec: EnvSpec, name: str, target: Target) -> list[HostLine] | None:
    """Ask the hosts of ``target`` (called ``name``) what they would need of
    ``spec``'s environment: a line per host; None for a target whose hosts cannot be
    asked before a spawn (their launcher starts their agents)."""
    if not isinstance(target, LocalTarget | HostsTarget):
        return None
    lock = read_lock(lock_path(spec.file))
    fresh = lock if lock is not None and not stale_reason(spec, lock) else None

    async def ask() -> list[HostLine]:
        scheme, host = default_transport()
        async with open_runtime(lambda: open_transport(scheme, host=host)):
            with anyio.fail_after(CHECK_TIMEOUT):
                return await _ask(spec, target, fresh)

    try:
        return anyio.run(ask)
    except Exception as exc:  # the report says it: an agent that cannot be asked
        return [(f"cannot ask: {type(exc).__name__}: {exc}", True)]


async def _ask(spec: EnvSpec, target: Target, lock: Lock | None) -> list[HostLine]:
    hosts: HostMesh | None
    if isinstance(target, LocalTarget):
        hosts = await local_hosts(start=False)
        if hosts is None:
            return [("no agent runs on this machine: the first spawn starts one", False)]
    else:
        assert isinstance(target, HostsTarget)
        key = str(spec.resolve(target.key_file)) if target.key_file else None
        hosts = await attach(list(target.agents), key_file=key)
    groups = [r.hashes for r in lock.requirements] if lock is not None else []
    digests = [h for hashes in groups for h in hashes]
    answers = await hosts.env_needs(env_hash(spec, lock) if lock else "", spec.python, digests)
    return [_line(spec, lock, groups, a) for a in answers]


def _line(
    spec: EnvSpec, lock: Lock | None, groups: list[tuple[str, ...]], answer: dict[str, Any]
) -> HostLine:
    fits = answer["python_fits"]
    python = f"Python {answer['python']}" + (
        f" does NOT satisfy python = {spec.python!r}" if fits else " fits"
    )
    if lock is None:
        return f"{answer['host']}: {python}; venv and packages: no fresh lock to ask", bool(fits)
    missing = set(answer["missing"])
    lacking = sum(1 for hashes in groups if hashes and all(h in missing for h in hashes))
    venv = "venv built" if answer["venv"] else "venv not built yet (the first spawn builds it)"
    packages = f"{lacking} of {len(groups)} locked packages to send"
    return f"{answer['host']}: {python}; {venv}; {packages}", bool(fits)
