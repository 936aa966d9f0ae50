"""Environments, the controller's side: what an environment *is*.

An environment file (TOML, :func:`load_spec`) names the packages, settings, secrets'
names, workspace and targets of a piece of work; its lock (:func:`lock_env`) pins the
packages with hashes for the controller's Python and platform; :func:`open_env` reads
both (locking again when the lock is missing or stale) into an :class:`Env` whose hash
is its identity; :func:`fetch_wheels` brings every locked package (and amesh itself)
into the controller's content-addressed wheel cache, once. :class:`Environment`
(``amesh.Environment``) spawns meshes on the file's targets: a :class:`Launcher` per
kind of target brings its hosts up (:func:`register_launcher`), and the host side
(:mod:`amesh._hosts`) builds each host's venv and workspace tree.

A hub (:func:`open_hub`: a directory, or an ``amesh hub serve`` over HTTP) keeps
immutable versions of environments, named by their hash, for ``amesh env push``,
``pull`` and ``list``; the server needs aiohttp (the ``hub`` extra).

This is the package's front door: other packages import only what is exported here.
``uv`` (the ``env`` extra) is imported only when something is locked.
"""

from __future__ import annotations

from ._base import EnvError, cache_dir
from ._check import probe_hosts
from ._commands import add_parser, main
from ._environment import Environment, find_env_file, read_secrets_file, secret_values
from ._file import (
    FORMAT,
    EnvSpec,
    HostsTarget,
    LocalTarget,
    SlurmTarget,
    SshTarget,
    Target,
    Workspace,
    load_spec,
    parse_spec,
)
from ._hub import DirHub, HttpHub, Meta, open_hub
from ._hub_server import add_parser as add_hub_parser
from ._hub_server import main as hub_main
from ._lock import LOCK_FORMAT, Lock, Locked, env_hash, lock_path, read_lock, resolve
from ._open import Env, lock_env, open_env
from ._targets import (
    HostsLauncher,
    Launcher,
    LocalLauncher,
    SlurmLauncher,
    SshLauncher,
    host_count,
    launcher_for,
    register_launcher,
)
from ._wheels import Wheel, amesh_wheel, fetch_wheels

__all__ = [
    "FORMAT",
    "LOCK_FORMAT",
    "Env",
    "EnvError",
    "EnvSpec",
    "DirHub",
    "Environment",
    "HostsLauncher",
    "HttpHub",
    "Meta",
    "HostsTarget",
    "Launcher",
    "LocalLauncher",
    "LocalTarget",
    "Lock",
    "Locked",
    "SlurmLauncher",
    "SlurmTarget",
    "SshLauncher",
    "SshTarget",
    "Target",
    "Wheel",
    "Workspace",
    "add_parser",
    "amesh_wheel",
    "cache_dir",
    "env_hash",
    "fetch_wheels",
    "add_hub_parser",
    "find_env_file",
    "host_count",
    "hub_main",
    "launcher_for",
    "open_hub",
    "load_spec",
    "lock_env",
    "lock_path",
    "main",
    "open_env",
    "parse_spec",
    "probe_hosts",
    "read_lock",
    "read_secrets_file",
    "register_launcher",
    "resolve",
    "secret_values",
]
