"""What every module of the package shares: its error, and where its files go."""

from __future__ import annotations

from pathlib import Path

from .._config import settings

__all__ = ["EnvError", "cache_dir"]


class EnvError(ValueError):
    """An environment cannot be read, locked or fetched: a bad environment file (the
    message names the file, the line and the key), a lock that is missing or stale
    where one is required, a dependency that does not resolve, a wheel that fails to
    download, build or verify."""


def cache_dir() -> Path:
    """The controller's cache of environments (``AMESH_CACHE_DIR``, default
    ``~/.cache/amesh``): the wheels and the uv cache live under it."""
    configured = settings().cache_dir
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "amesh"
