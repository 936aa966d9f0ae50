"""Settings read from the environment (``AMESH_*``)."""

from __future__ import annotations

import os

__all__ = ["default_fanout", "default_transport", "env_float"]


def default_transport() -> tuple[str, str]:
    """``(scheme, host)`` from ``AMESH_TRANSPORT`` (auto, abstract, ipc, tcp) and
    ``AMESH_HOST`` (default 127.0.0.1)."""
    scheme = os.environ.get("AMESH_TRANSPORT", "auto")
    host = os.environ.get("AMESH_HOST", "127.0.0.1")
    return scheme, host


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
