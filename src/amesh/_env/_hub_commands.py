"""``amesh env push``, ``pull`` and ``list``: environments to and from a hub.

Pushing never locks (it needs no network): the file's lock must be there and current.
Pulling checks that what the hub gave hashes to the version asked for, then writes the
file and its lock byte for byte as they were pushed.
"""

from __future__ import annotations

import argparse
import getpass
import os
import platform
import secrets
import socket
from datetime import UTC, datetime
from pathlib import Path

from .._config import settings
from ._base import EnvError
from ._file import EnvSpec, parse_spec
from ._hub import Hub, Meta, Stored, check_hash, check_name, open_hub, version_hash
from ._lock import Lock, amesh_version, env_hash, lock_path, this_platform
from ._open import stale_reason

__all__ = ["COMMANDS", "add_parsers", "run"]

#: the ``amesh env`` commands of this module
COMMANDS = ("push", "pull", "list")
#: the fewest hex digits of a hash that ``NAME@HASH`` may give
_MIN_PREFIX = 6


def add_parsers(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``push``, ``pull`` and ``list`` to ``amesh env``'s subparsers ``cmds``."""
    push = cmds.add_parser("push", help="put FILE and its lock on a hub, as a new version")
    push.add_argument(
        "file", nargs="?", default=None, metavar="FILE", help="a path or NAME (envs/NAME.toml)"
    )
    pull = cmds.add_parser(
        "pull", help="write envs/NAME.toml and its lock from a hub's version of NAME"
    )
    pull.add_argument("ref", metavar="NAME[@HASH]", help="the latest version, or this one")
    pull.add_argument(
        "--to", default=".", metavar="DIR", help="write DIR/envs/NAME.toml (default: here)"
    )
    pull.add_argument("--force", action="store_true", help="overwrite a different local copy")
    listing = cmds.add_parser("list", help="the environments of a hub and their versions")
    listing.add_argument("name", nargs="?", default=None, metavar="NAME", help="this one only")
    for cmd in (push, pull, listing):
        cmd.add_argument("--hub", default=None, metavar="DIR_OR_URL", help="default: AMESH_HUB")
        cmd.add_argument(
            "--token-file",
            default=None,
            metavar="FILE",
            help="an HTTP hub's token (default: AMESH_HUB_TOKEN_FILE)",
        )


def run(args: argparse.Namespace, path: Path | None) -> int:
    """Run ``amesh env push|pull|list``.

    Args:
        args: the parsed command line.
        path: push's environment file.

    Returns:
        The exit status.

    Raises:
        EnvError: what went wrong, in words.
    """
    hub = open_hub(
        args.hub if args.hub is not None else settings().hub,
        args.token_file if args.token_file is not None else settings().hub_token_file or None,
    )
    if args.env_command == "push":
        assert path is not None
        return _push(path, hub)
    if args.env_command == "pull":
        return _pull(args.ref, hub, Path(args.to), args.force)
    return _list(hub, args.name)


def _push(path: Path, hub: Hub) -> int:
    if not path.is_file():
        raise EnvError(f"{path}: no such environment file")
    lock_file = lock_path(path)
    try:
        env, lock_bytes = path.read_bytes(), lock_file.read_bytes()
    except FileNotFoundError:
        raise EnvError(f"{lock_file}: no lock: run `amesh env lock {path}` first") from None
    except OSError as exc:
        raise EnvError(f"{path}: cannot read it or its lock: {exc}") from None
    spec, lock = _parse(env, lock_bytes, str(path), str(lock_file))
    why = stale_reason(spec, lock)
    if why:
        raise EnvError(f"{lock_file}: {why}: run `amesh env lock {path}` first")
    digest = version_hash(env, lock_bytes)
    if hub.get(spec.name, digest) is not None:
        print(f"{hub}: {spec.name} {digest[:12]} is there already; nothing pushed")
        return 0
    parent = hub.latest(spec.name)
    meta = Meta(
        name=spec.name,
        hash=digest,
        environment=env_hash(spec, lock),
        pushed_by=f"{getpass.getuser()}@{socket.gethostname()}",
        time=datetime.now(UTC).isoformat(timespec="microseconds"),
        amesh=amesh_version(),
        python=platform.python_version(),
        platform=this_platform(),
        parent=parent if parent != digest else None,
    )
    created = hub.put(env, lock_bytes, meta)
    said = "pushed" if created else "is there already (pushed at the same time); nothing pushed"
    print(f"{hub}: {spec.name} {digest[:12]} {said}")
    return 0


def _parse(env: bytes, lock: bytes, env_file: str, lock_file: str) -> tuple[EnvSpec, Lock]:
    try:
        env_text, lock_text = env.decode("utf-8"), lock.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EnvError(f"{env_file}: not UTF-8 text: {exc}") from None
    return parse_spec(env_text, env_file), Lock.parse(lock_text, lock_file)


def _resolve(ref: str, hub: Hub) -> tuple[str, str]:
    """``(name, full hash)`` of ``NAME[@HASH]``, where HASH may be a prefix."""
    name, _, wanted = ref.partition("@")
    check_name(name)
    if not wanted:
        latest = hub.latest(name)
        if latest is None:
            raise EnvError(f"{hub}: no environment {name!r}")
        return name, latest
    if len(wanted) == 64:
        return name, check_hash(wanted)
    if len(wanted) < _MIN_PREFIX or not all(c in "0123456789abcdef" for c in wanted):
        raise EnvError(f"{ref}: a version is {_MIN_PREFIX} to 64 hex digits of its hash")
    found = [m.hash for m in hub.versions(name) if m.hash.startswith(wanted)]
    if len(found) != 1:
        many = "several versions" if found else "no version"
        raise EnvError(f"{hub}: {many} of {name} start with {wanted}")
    return name, found[0]


def _pull(ref: str, hub: Hub, to: Path, force: bool) -> int:
    name, digest = _resolve(ref, hub)
    stored = hub.get(name, digest)
    if stored is None:
        raise EnvError(f"{hub}: no version {digest[:12]} of {name}")
    _verify(stored, name, digest, str(hub))
    target = to / "envs" / f"{name}.toml"
    pairs = ((target, stored.env), (lock_path(target), stored.lock))
    if not force:
        for path, data in pairs:
            if path.exists() and path.read_bytes() != data:
                raise EnvError(f"{path} exists and differs (--force overwrites it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    for path, data in pairs:
        _write(path, data)
    print(f"wrote {target} and {lock_path(target)}: {name} {digest[:12]} from {hub}")
    return 0


def _verify(stored: Stored, name: str, digest: str, hub: str) -> None:
    """Refuse what does not hash to the version asked for (a hub that lies, or broke)."""
    where = f"{hub}: {name} {digest[:12]}"
    spec, _ = _parse(stored.env, stored.lock, f"{where}: env.toml", f"{where}: lock")
    if spec.name != name or version_hash(stored.env, stored.lock) != digest:
        raise EnvError(f"{where}: its file and lock do not hash to it: the hub broke or lies")


def _write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` atomically, as readable as the umask lets a new file be."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    try:
        with temp.open("xb") as out:
            out.write(data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _list(hub: Hub, only: str | None) -> int:
    names = [check_name(only)] if only else hub.names()
    if not names:
        print(f"{hub}: no environments")
        return 0
    for name in names:
        versions = hub.versions(name)
        latest = hub.latest(name)
        print(f"{name} ({len(versions)} version{'s' if len(versions) != 1 else ''})")
        for meta in reversed(versions):
            mark = "  latest" if meta.hash == latest else ""
            print(
                f"  {meta.hash[:12]}  {meta.time[:19]}Z  {meta.pushed_by}  Python {meta.python} "
                f"on {meta.platform}{mark}"
            )
    return 0
