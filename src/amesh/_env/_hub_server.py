"""``amesh hub serve DIR``: a directory hub served over HTTP, with aiohttp.

Reading (``GET``) needs the read token or the write token; pushing (``PUT``) needs the
write token: ``Authorization: Bearer <token>``, compared in constant time. Without a
token, or with a wrong one, 401; the read token pushing, 403. Names and hashes are
checked against their patterns before they touch a path, and a push is checked before
it is kept: its file and lock parse, and hash to the version it names. A push is at
most :data:`~._hub.MAX_UPLOAD` bytes.

The log has one line per request (method, path, status): never a header, so never a
token, and never a file's contents. It binds 127.0.0.1 unless told otherwise: plain
HTTP carries the tokens in the clear, so a hub for other machines belongs behind a TLS
proxy.

The routes::

    GET /v1/envs                         the names (JSON list)
    GET /v1/envs/NAME/versions           their :class:`~._hub.Meta` (JSON list)
    GET /v1/envs/NAME/latest             the latest hash (text)
    GET /v1/envs/NAME/HASH/FILE          env.toml, NAME.lock, meta.json (bytes)
    PUT /v1/envs/NAME/HASH               {"env": str, "lock": str, "meta": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ._base import EnvError
from ._file import parse_spec
from ._hub import MAX_UPLOAD, DirHub, Meta, check_hash, check_name, lock_name, version_hash
from ._lock import Lock, env_hash

if TYPE_CHECKING:
    from aiohttp import web
    from aiohttp.typedefs import Handler, Middleware

__all__ = ["add_parser", "main", "serve"]

log = logging.getLogger("amesh.hub")

#: a token shorter than this is refused: the tokens are all that guards the hub
_MIN_TOKEN = 16
_DEFAULT_PORT = 8787


class _Push(msgspec.Struct, frozen=True):
    env: str
    lock: str
    meta: Meta


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hub`` and its command ``serve`` to the ``amesh`` command's subparsers."""
    hub = sub.add_parser("hub", help="serve a hub of environments over HTTP")
    cmds = hub.add_subparsers(dest="hub_command", metavar="COMMAND", required=True)
    serve = cmds.add_parser("serve", help="serve the directory hub DIR over HTTP")
    serve.add_argument("dir", metavar="DIR", help="the hub's directory (made if missing)")
    serve.add_argument(
        "--listen",
        default=f"127.0.0.1:{_DEFAULT_PORT}",
        metavar="ADDR:PORT",
        help=f"where to listen (default 127.0.0.1:{_DEFAULT_PORT}; port 0: any free one)",
    )
    for kind, may in (("read", "pull and list"), ("write", "push, pull and list")):
        serve.add_argument(
            f"--{kind}-token-file",
            required=True,
            metavar="FILE",
            help=f"the token that may {may} (one line, at least {_MIN_TOKEN} characters)",
        )


def _token(path: str) -> bytes:
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise EnvError(f"{path}: cannot read the token: {exc}") from None
    if len(token) < _MIN_TOKEN:
        raise EnvError(f"{path}: a token of at least {_MIN_TOKEN} characters, please")
    return token.encode()


def main(args: argparse.Namespace) -> int:
    """Run ``amesh hub serve`` with the parsed ``args`` until SIGINT or SIGTERM.

    Returns:
        The exit status.
    """
    try:
        host, _, port = args.listen.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise EnvError(f"--listen {args.listen}: expected ADDR:PORT")
        read, write = _token(args.read_token_file), _token(args.write_token_file)
        root = Path(args.dir)
        root.mkdir(parents=True, exist_ok=True)
    except (EnvError, OSError) as exc:
        print(f"amesh hub serve: {exc}", file=sys.stderr)
        return 2
    try:
        from aiohttp import web  # noqa: F401  (the `hub` extra)
    except ImportError:
        print("amesh hub serve: needs aiohttp: pip install 'amesh[hub]'", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_serve_until_signal(root, host.strip("[]"), int(port), read, write))
    return 0


async def _serve_until_signal(root: Path, host: str, port: int, read: bytes, write: bytes) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    def started(url: str) -> None:
        print(f"amesh hub: serving {root} at {url}", flush=True)

    await serve(root, host, port, read, write, stop, started)


async def serve(
    root: Path,
    host: str,
    port: int,
    read_token: bytes,
    write_token: bytes,
    stop: asyncio.Event,
    started: Callable[[str], None] | None = None,
) -> None:
    """Serve the directory hub ``root`` at ``host:port`` until ``stop`` is set.

    Args:
        root: the hub's directory.
        host: the address to bind.
        port: the port (0: any free one).
        read_token: the token that may read.
        write_token: the token that may read and push.
        stop: set to stop serving.
        started: called with the URL once listening.
    """
    from aiohttp import web

    app = web.Application(client_max_size=MAX_UPLOAD, middlewares=[_guard(read_token, write_token)])
    app.router.add_routes(_routes(DirHub(root)))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        if started is not None:
            started(f"http://{shown}:{bound[1]}")
        await stop.wait()
    finally:
        await runner.cleanup()


def _guard(read_token: bytes, write_token: bytes) -> Middleware:
    from aiohttp import web

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            given = _bearer(request.headers.get("Authorization", ""))
            # (both compared, always: how long it takes says nothing of which matched)
            reads = hmac.compare_digest(given, read_token)
            writes = hmac.compare_digest(given, write_token)
            if not (reads or writes):
                status = 401
                return web.Response(
                    status=401,
                    text="a read or write token is needed (Authorization: Bearer)",
                    headers={"WWW-Authenticate": 'Bearer realm="amesh hub"'},
                )
            if request.method not in ("GET", "HEAD") and not writes:
                status = 403
                return web.Response(status=403, text="pushing needs the write token")
            answer = await handler(request)
            status = answer.status
            return answer
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            log.info("%s %s %d", request.method, request.path, status)

    return guard


def _bearer(header: str) -> bytes:
    scheme, _, token = header.partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


def _checked(name: str, hash: str | None = None) -> None:
    from aiohttp import web

    try:
        check_name(name)
        if hash is not None:
            check_hash(hash)
    except EnvError:
        raise web.HTTPBadRequest(text="not a name or a hash") from None


def _routes(hub: DirHub) -> web.RouteTableDef:
    from aiohttp import web

    routes = web.RouteTableDef()

    @routes.get("/v1/envs")
    async def names(request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(hub.names))

    @routes.get("/v1/envs/{name}/versions")
    async def versions(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        _checked(name)
        found = await asyncio.to_thread(hub.versions, name)
        if not found:
            raise web.HTTPNotFound(text="no such environment")
        return web.Response(body=msgspec.json.encode(found), content_type="application/json")

    @routes.get("/v1/envs/{name}/latest")
    async def latest(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        _checked(name)
        found = await asyncio.to_thread(hub.latest, name)
        if found is None:
            raise web.HTTPNotFound(text="no such environment")
        return web.Response(text=found + "\n")

    @routes.get("/v1/envs/{name}/{hash}/{file}")
    async def file(request: web.Request) -> web.Response:
        name, hash, file = (request.match_info[k] for k in ("name", "hash", "file"))
        _checked(name, hash)
        if file not in ("env.toml", lock_name(name), "meta.json"):
            raise web.HTTPNotFound(text="no such file")
        stored = await asyncio.to_thread(hub.get, name, hash)
        if stored is None:
            raise web.HTTPNotFound(text="no such version")
        if file == "meta.json":
            return web.Response(body=msgspec.json.encode(stored.meta))
        return web.Response(body=stored.env if file == "env.toml" else stored.lock)

    @routes.put("/v1/envs/{name}/{hash}")
    async def push(request: web.Request) -> web.Response:
        name, hash = request.match_info["name"], request.match_info["hash"]
        _checked(name, hash)
        try:
            pushed = msgspec.json.decode(await request.read(), type=_Push)
            _verify(name, hash, pushed)
        except (msgspec.DecodeError, EnvError) as exc:
            raise web.HTTPBadRequest(text=f"not a version of {name} {hash}: {exc}") from None
        created = await asyncio.to_thread(
            hub.put, pushed.env.encode(), pushed.lock.encode(), pushed.meta
        )
        return web.json_response({"created": created}, status=201 if created else 200)

    return routes


def _verify(name: str, hash: str, pushed: _Push) -> None:
    """Refuse a push whose files are not the version its path names."""
    if (pushed.meta.name, pushed.meta.hash) != (name, hash):
        raise EnvError("its record names another version")
    spec = parse_spec(pushed.env, "env.toml")
    if spec.name != name:
        raise EnvError(f"the file is environment {spec.name!r}'s")
    if version_hash(pushed.env.encode(), pushed.lock.encode()) != hash:
        raise EnvError("the file and lock do not hash to it")
    if env_hash(spec, Lock.parse(pushed.lock, lock_name(name))) != pushed.meta.environment:
        raise EnvError("its record names another environment")
