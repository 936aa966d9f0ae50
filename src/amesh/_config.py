"""Settings read from the environment (``AMESH_*``)."""

from __future__ import annotations

import os

__all__ = ["debug", "default_fanout", "default_transport", "env_float", "loop_options"]


def default_transport() -> tuple[str, str]:
    """``(scheme, host)`` from ``AMESH_TRANSPORT`` and ``AMESH_HOST`` (default
    127.0.0.1).

    ``AMESH_TRANSPORT`` is ``auto`` (the default without ``AMESH_HOST``: abstract
    sockets on Linux, else ipc; one host only), ``abstract``, ``ipc``, ``tcp``
    (encrypted between hosts: NNG over TLS with certificates of the job, and event-loop
    streams within a host; ``tls+tcp`` is the same; the default when ``AMESH_HOST`` is
    set) or ``stream+tcp`` (plain event-loop streams over tcp: authenticated by the
    job key, not encrypted). See :func:`amesh._transport.open_transport`.
    """
    host = os.environ.get("AMESH_HOST", "")
    # an address given for other machines to reach: tcp (encrypted between hosts)
    scheme = os.environ.get("AMESH_TRANSPORT", "") or ("tcp" if host else "auto")
    return scheme, host or "127.0.0.1"


def default_fanout() -> int:
    """``AMESH_FANOUT`` (default 16; 0: no relay tree)."""
    raw = os.environ.get("AMESH_FANOUT", "16")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"AMESH_FANOUT must be an integer, not {raw!r}") from None


def env_float(name: str, default: float) -> float:
    """A float setting; ``default`` when unset or empty.

    Raises:
        ValueError: the variable is not a number.
    """
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {raw!r}") from None


def debug() -> bool:
    """``AMESH_DEBUG`` (set and not ``0``): remote tracebacks keep amesh's own frames,
    which they leave out by default. A worker reads its own environment: a local one
    inherits the controller's; set it for remote ones with ``ProcMesh(env=...)``."""
    return os.environ.get("AMESH_DEBUG", "0") not in ("", "0")


def loop_options(backend: str) -> dict[str, object]:
    """``backend_options`` for ``anyio.run``: uvloop for asyncio when it is installed."""
    if backend != "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}
