"""A hub of environments: immutable versions, named by their hash, to push and pull.

A hub is a directory (a shared filesystem, a git checkout) or an HTTP server of one
(``amesh hub serve``, :mod:`._hub_server`). Its layout::

    <hub>/<name>/<hash>/env.toml       the environment file, as pushed (bytes)
    <hub>/<name>/<hash>/<name>.lock    its lock, as pushed (bytes)
    <hub>/<name>/<hash>/meta.json      who pushed it, when, from what (:class:`Meta`)
    <hub>/<name>/latest                the hash of the version pushed last

``<hash>`` is the version's content hash (:func:`version_hash`: of the file and lock
bytes, so a changed target is a new version too); ``meta.json`` also records the
environment's identity (:func:`amesh._env.env_hash`, what names its venvs on hosts). A version is
written into a directory of its own (``.push-*``) and renamed into place, so readers
never see half of one and a version directory, once there, is never written again.
Nothing of the pushing process's environment goes there: the environment file names
its secrets, and only their names.

:class:`DirHub` is a directory; :class:`HttpHub` talks to a server (with ``urllib``,
so pulling needs no extra package); :func:`open_hub` picks one for a URL or path.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Protocol

import msgspec

from ._base import EnvError

__all__ = [
    "MAX_UPLOAD",
    "DirHub",
    "Hub",
    "HttpHub",
    "Meta",
    "Stored",
    "check_hash",
    "version_hash",
    "check_name",
    "open_hub",
]

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")
HASH = re.compile(r"[0-9a-f]{64}")
#: the most bytes a push may carry (file, lock and meta together): a large lock (a
#: torch stack, every hash of every platform's wheel) is a few hundred KiB
MAX_UPLOAD = 4 << 20
#: seconds an HTTP hub has to answer one request
_HTTP_TIMEOUT = 30.0
_LATEST = "latest"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")

log = logging.getLogger("amesh.env")


class Meta(msgspec.Struct, frozen=True, kw_only=True, rename="kebab"):
    """What a hub records of a version besides its files (``meta.json``).

    Attributes:
        name: the environment's name.
        hash: its content hash (the version's name, :func:`version_hash`).
        environment: the environment's identity (:func:`amesh._env.env_hash`: what
            names its venv on a host; versions that differ only in targets share it).
        pushed_by: ``user@host`` of who pushed it.
        time: when, ISO 8601 in UTC.
        amesh: the pushing amesh's version.
        python: the pushing Python's version.
        platform: the pushing machine's platform.
        parent: the version that was the hub's latest of this name when it was
            pushed (None: the first).
    """

    name: str
    hash: str
    environment: str
    pushed_by: str
    time: str
    amesh: str
    python: str
    platform: str
    parent: str | None = None
    format: int = 1


class Stored(msgspec.Struct, frozen=True):
    """One version's files, as a hub holds them.

    Attributes:
        env: the environment file's bytes.
        lock: the lock's bytes.
        meta: its record.
    """

    env: bytes
    lock: bytes
    meta: Meta


def check_name(name: str) -> str:
    """``name`` if it is an environment's name (``[a-z0-9][a-z0-9._-]*``, at most 100
    characters: never a path).

    Raises:
        EnvError: it is not.
    """
    if not NAME.fullmatch(name):
        raise EnvError(f"{name!r} is not an environment's name ([a-z0-9][a-z0-9._-]*)")
    return name


def version_hash(env: bytes, lock: bytes) -> str:
    """The name of a hub's version of environment file ``env`` and its ``lock``: the
    sha256 of both, byte for byte (64 hex digits)."""
    digest = hashlib.sha256(b"amesh-env-version 1\0")
    for part in (env, lock):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def check_hash(value: str) -> str:
    """``value`` if it is a version's hash (64 lowercase hex digits).

    Raises:
        EnvError: it is not.
    """
    if not HASH.fullmatch(value):
        raise EnvError(f"{value!r} is not a version's hash (64 hex digits)")
    return value


def lock_name(name: str) -> str:
    """The lock's file name in a version of ``name``."""
    return f"{name}.lock"


class Hub(Protocol):
    """Where versions are kept; every method raises :class:`EnvError` on failure."""

    def names(self) -> list[str]:
        """The environments' names, sorted."""
        ...

    def versions(self, name: str) -> list[Meta]:
        """The versions of ``name``, oldest first (none: an empty list)."""
        ...

    def latest(self, name: str) -> str | None:
        """The hash of the version of ``name`` pushed last (None: none)."""
        ...

    def get(self, name: str, hash: str) -> Stored | None:
        """The version ``hash`` of ``name`` (None: no such version)."""
        ...

    def put(self, env: bytes, lock: bytes, meta: Meta) -> bool:
        """Add a version (``meta`` names it); False if it was there already."""
        ...


class DirHub:
    """A hub that is a directory.

    Args:
        root: the directory (made on the first push).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __str__(self) -> str:
        return str(self.root)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if NAME.fullmatch(p.name) and p.is_dir())

    def versions(self, name: str) -> list[Meta]:
        folder = self.root / check_name(name)
        if not folder.is_dir():
            return []
        out = []
        for path in folder.iterdir():
            if HASH.fullmatch(path.name):
                out.append(self._meta(path / "meta.json"))
        return sorted(out, key=lambda m: (m.time, m.hash))

    def latest(self, name: str) -> str | None:
        try:
            text = (self.root / check_name(name) / _LATEST).read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise EnvError(f"{self.root}/{name}/{_LATEST}: cannot read it: {exc}") from None
        return check_hash(text)

    def get(self, name: str, hash: str) -> Stored | None:
        folder = self.root / check_name(name) / check_hash(hash)
        if not folder.is_dir():
            return None
        try:
            env = (folder / "env.toml").read_bytes()
            lock = (folder / lock_name(name)).read_bytes()
        except OSError as exc:
            raise EnvError(f"{folder}: cannot read the version: {exc}") from None
        return Stored(env, lock, self._meta(folder / "meta.json"))

    def _meta(self, path: Path) -> Meta:
        try:
            return msgspec.json.decode(path.read_bytes(), type=Meta)
        except (OSError, msgspec.DecodeError) as exc:
            raise EnvError(f"{path}: not a version's record: {exc}") from None

    def put(self, env: bytes, lock: bytes, meta: Meta) -> bool:
        folder = self.root / check_name(meta.name)
        final = folder / check_hash(meta.hash)
        if final.is_dir():
            return False
        folder.mkdir(parents=True, exist_ok=True)
        # (os.mkdir, not mkdtemp: the version is as readable as the umask lets files be)
        temp = folder / f".push-{secrets.token_hex(8)}"
        temp.mkdir()
        try:
            for file, data in (
                ("env.toml", env),
                (lock_name(meta.name), lock),
                ("meta.json", json.dumps(msgspec.to_builtins(meta), indent=2).encode() + b"\n"),
            ):
                _write_read_only(temp / file, data)
            os.rename(temp, final)
        except OSError as exc:
            shutil.rmtree(temp, ignore_errors=True)
            # another push of the same version renamed its copy first: the same bytes
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and final.is_dir():
                return False
            raise EnvError(f"{final}: cannot write the version: {exc}") from None
        self._set_latest(folder, meta.hash)
        return True

    def _set_latest(self, folder: Path, hash: str) -> None:
        temp = folder / f".latest-{secrets.token_hex(8)}"
        try:
            temp.write_text(hash + "\n", encoding="ascii")
            os.replace(temp, folder / _LATEST)
        except OSError as exc:
            temp.unlink(missing_ok=True)
            raise EnvError(f"{folder}/{_LATEST}: cannot write it: {exc}") from None


def _write_read_only(path: Path, data: bytes) -> None:
    with path.open("xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    path.chmod(path.stat().st_mode & ~0o222)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuse redirects: urllib would send the token on to wherever one points."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


class HttpHub:
    """A hub served over HTTP (``amesh hub serve``).

    Args:
        url: its address, ``http(s)://HOST:PORT`` (a path after it is kept).
        token: sent as ``Authorization: Bearer``; the read token pulls and lists,
            the write token pushes too.
    """

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._opener = urllib.request.build_opener(_NoRedirect)

    def __str__(self) -> str:
        return self.url

    def _call(self, method: str, path: str, body: bytes | None = None) -> bytes | None:
        """The body of the answer to ``method path``; None for 404."""
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(self.url + path, data=body, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=_HTTP_TIMEOUT) as answer:
                data: bytes = answer.read(MAX_UPLOAD + 1)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            said = _said(exc)
            if exc.code in (401, 403):
                said += " (the token: --token-file or AMESH_HUB_TOKEN_FILE)"
            raise EnvError(f"{self.url}: {method} refused: {exc.code} {said}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise EnvError(f"{self.url}: cannot reach the hub: {exc}") from None
        if len(data) > MAX_UPLOAD:
            raise EnvError(f"{self.url}{path}: the answer is larger than {MAX_UPLOAD} bytes")
        return data

    def _json(self, path: str) -> object:
        data = self._call("GET", path)
        try:
            return None if data is None else json.loads(data)
        except ValueError:
            raise EnvError(f"{self.url}{path}: the hub answered what is not JSON") from None

    def names(self) -> list[str]:
        found = self._json("/v1/envs")
        if not isinstance(found, list) or not all(isinstance(n, str) for n in found):
            raise EnvError(f"{self.url}/v1/envs: not a list of names")
        return [check_name(n) for n in found]

    def versions(self, name: str) -> list[Meta]:
        found = self._call("GET", f"/v1/envs/{check_name(name)}/versions")
        if found is None:
            return []
        try:
            return msgspec.json.decode(found, type=list[Meta])
        except msgspec.DecodeError as exc:
            raise EnvError(f"{self.url}: {name}'s versions: {exc}") from None

    def latest(self, name: str) -> str | None:
        found = self._call("GET", f"/v1/envs/{check_name(name)}/latest")
        return None if found is None else check_hash(found.decode("ascii", "replace").strip())

    def get(self, name: str, hash: str) -> Stored | None:
        base = f"/v1/envs/{check_name(name)}/{check_hash(hash)}/"
        files = []
        for file in ("env.toml", lock_name(name), "meta.json"):
            data = self._call("GET", base + file)
            if data is None:
                return None
            files.append(data)
        try:
            meta = msgspec.json.decode(files[2], type=Meta)
        except msgspec.DecodeError as exc:
            raise EnvError(f"{self.url}{base}meta.json: {exc}") from None
        return Stored(files[0], files[1], meta)

    def put(self, env: bytes, lock: bytes, meta: Meta) -> bool:
        body = json.dumps(
            {
                "env": env.decode("utf-8"),
                "lock": lock.decode("utf-8"),
                "meta": msgspec.to_builtins(meta),
            }
        ).encode()
        path = f"/v1/envs/{check_name(meta.name)}/{check_hash(meta.hash)}"
        answer = self._call("PUT", path, body)
        if answer is None:
            raise EnvError(f"{self.url}{path}: the hub has no such place (404)")
        try:
            return bool(json.loads(answer)["created"])
        except (ValueError, KeyError, TypeError):
            raise EnvError(f"{self.url}{path}: the hub's answer is not a push's") from None


def _said(exc: urllib.error.HTTPError) -> str:
    """What the server said with its error (its own short text, not the whole body)."""
    try:
        text = exc.read(500).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or str(exc.reason)


def open_hub(where: str, token_file: str | None = None) -> DirHub | HttpHub:
    """The hub at ``where``: an ``http(s)://`` URL, else a directory.

    Args:
        where: the URL or directory ("": none given).
        token_file: a file holding the token for an HTTP hub (None: none sent).

    Raises:
        EnvError: no hub given, or the token file cannot be read.
    """
    if not where:
        raise EnvError("no hub: give --hub DIR_OR_URL, or set AMESH_HUB")
    url = urllib.parse.urlsplit(where)
    if url.scheme not in ("http", "https"):
        if "://" in where:
            raise EnvError(f"{where}: a hub is a directory, or an http:// or https:// URL")
        return DirHub(Path(where).expanduser())
    token = None
    if token_file:
        try:
            token = Path(token_file).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise EnvError(f"{token_file}: cannot read the hub's token: {exc}") from None
    if token and url.scheme == "http" and url.hostname not in _LOOPBACK:
        log.warning("%s: plain HTTP to another machine carries the token in the clear", where)
    return HttpHub(where, token)
