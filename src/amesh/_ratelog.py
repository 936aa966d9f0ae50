"""Rate-limited warnings: a flood of bad input costs one log line per interval."""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["RateLimitedLog"]


class RateLimitedLog:
    """Logs at most one line per ``interval`` seconds; the next line says how many
    were left out in between.

    Args:
        logger: where to log.
        interval: seconds between lines.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self._log = logger
        self._interval = interval
        self._next = 0.0
        self._suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        self._next = now + self._interval
        if self._suppressed:
            msg += f" (and {self._suppressed} more like it in the last {self._interval:g} s)"
            self._suppressed = 0
        self._log.warning(msg, *args)
