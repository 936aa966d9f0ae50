"""The ``amesh`` command (also ``python -m amesh``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys

from ._config import unknown_variables

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="amesh", description="amesh: one controller, many worker processes."
    )
    parser.add_argument(
        "--version", action="version", version=f"amesh {importlib.metadata.version('amesh')}"
    )
    # (not required: bare `amesh` prints this help)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    keygen = sub.add_parser("keygen", help="write a new job key file (readable by you only)")
    keygen.add_argument("path", help="where to write it (never overwritten)")

    agent = sub.add_parser(
        "agent", help="run a host agent: start workers for controllers that hold the key"
    )
    agent.add_argument(
        "--listen",
        required=True,
        metavar="tcp://ADDR:PORT",
        help="where controllers reach it, encrypted (TLS with certificates of the job made "
        "from its key) between hosts; stream+tcp://ADDR:PORT for plain streams",
    )
    agent.add_argument("--key-file", required=True, metavar="PATH", help="see `amesh keygen`")
    agent.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a controller may be unreachable before its workers are stopped (default 5)",
    )
    agent.add_argument(
        "--route-to",
        default="",
        metavar="IP",
        help="listen on this machine's address towards IP (the controller's), whatever "
        "--listen's ADDR says",
    )
    agent.add_argument(
        "--announce", default="", metavar="PATH", help="write the address to PATH once listening"
    )
    agent.add_argument(
        "--idle-exit",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="exit after SECONDS without workers or controllers (default: never)",
    )
    agent.add_argument(
        "--lock",
        default="",
        metavar="PATH",
        help="hold a lock on PATH while running, with the pid and address in it "
        "(this machine's own agent; exits if another holds it)",
    )

    for name, text in (
        (
            "list",
            "show the live meshes of this machine's controllers (per rank: pid, queued "
            "messages, running handlers, endpoints running now), then the persistent meshes",
        ),
        ("stop", "stop a persistent mesh: its processes and their actors"),
    ):
        cmd = sub.add_parser(name, help=text)
        if name == "stop":
            cmd.add_argument("name", help="the mesh's name")
        else:
            cmd.add_argument("--json", action="store_true", help="print JSON")
        cmd.add_argument(
            "--hosts",
            default="",
            metavar="ADDR,...",
            help="the host agents to ask (default: this machine's local agent)",
        )
        cmd.add_argument("--key-file", default=None, metavar="PATH", help="the agents' key")

    stacks = sub.add_parser(
        "stacks", help="print the Python stacks of a live mesh's workers (threads and tasks)"
    )
    stacks.add_argument("name", help="the mesh's name (`procs` unless named)")
    stacks.add_argument("rank", type=int, nargs="?", default=None, help="one rank only")
    stacks.add_argument(
        "--full",
        action="store_true",
        help="every frame: amesh's own and the standard library's too (also AMESH_DEBUG=1)",
    )
    logs = sub.add_parser(
        "logs",
        help="print the last lines of output of a mesh's workers: a live mesh's from its "
        "controller (it keeps 1000), a persistent one's without a controller from the log "
        "files its host agent keeps",
    )
    logs.add_argument("name", help="the mesh's name (`procs` unless named)")
    logs.add_argument(
        "-n", "--lines", type=int, default=100, help="how many of the last lines (default 100)"
    )
    logs.add_argument("--rank", type=int, default=None, help="the lines of this rank only")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="then print lines as they come (Ctrl-C ends)"
    )
    for cmd in (stacks, logs):
        cmd.add_argument(
            "--pid", type=int, default=None, help="its controller's pid (when several have one)"
        )
        cmd.add_argument(
            "--hosts",
            default="",
            metavar="ADDR,...",
            help="a persistent mesh on these host agents (default: this machine's meshes)",
        )
        cmd.add_argument("--key-file", default=None, metavar="PATH", help="the agents' key")

    debug = sub.add_parser(
        "debug", help="attach to a rank paused in breakpoint() by a controller on this machine"
    )
    debug.add_argument(
        "--pid", type=int, default=None, help="the controller's pid (when several have one)"
    )
    debug.add_argument(
        "--wait",
        type=float,
        nargs="?",
        const=math.inf,
        default=0.0,
        metavar="SECONDS",
        help="wait for a rank to pause (at most SECONDS; no value: as long as it takes)",
    )
    from ._env import add_hub_parser
    from ._env import add_parser as add_env_parser

    add_env_parser(sub)
    add_hub_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for text in unknown_variables():  # a misspelt AMESH_STATE_DIR, say
        print(f"amesh: warning: {text}", file=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "keygen":
        from ._identity import write_key_file

        try:
            write_key_file(args.path)
        except FileExistsError:
            print(
                f"amesh keygen: {args.path} exists, and a key file is never overwritten "
                "(remove it first, or choose another path)",
                file=sys.stderr,
            )
            return 1
        except OSError as exc:
            print(f"amesh keygen: cannot write {args.path}: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"wrote a new key to {args.path} (readable by you only)")
        return 0
    if args.command == "agent":
        from ._hosts import DEFAULT_GRACE, agent_main, parse_listen
        from ._identity import read_key_file

        try:
            parse_listen(args.listen)
            read_key_file(args.key_file)
        except (OSError, ValueError) as exc:
            print(f"amesh agent: {exc}", file=sys.stderr)
            return 2
        grace = DEFAULT_GRACE if args.grace is None else args.grace
        if not grace > 0:
            print("amesh agent: --grace must be more than 0 seconds", file=sys.stderr)
            return 2
        return agent_main(
            args.listen,
            args.key_file,
            grace,
            args.route_to,
            args.announce,
            args.idle_exit,
            args.lock,
        )
    if args.command in ("list", "stop", "stacks", "logs"):
        from ._hosts import admin_main

        hosts = [h for h in getattr(args, "hosts", "").split(",") if h] or None
        return admin_main(args.command, hosts, getattr(args, "key_file", None), args)
    if args.command == "env":
        from ._env import main as env_main

        return env_main(args)
    if args.command == "hub":
        from ._env import hub_main

        return hub_main(args)
    if args.command == "debug":
        from ._debug import cli as debug_main
        from ._hosts import state_dir

        if not args.wait >= 0:
            print("amesh debug: --wait must be 0 or more seconds", file=sys.stderr)
            return 2
        return debug_main(state_dir() / "debug", args.pid, args.wait)
    raise AssertionError(args.command)  # argparse allows no other
