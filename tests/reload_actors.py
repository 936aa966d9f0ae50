"""Actor classes for tests/test_reload.py (importable by workers)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from amesh import Actor, endpoint


class Successor(Actor):
    """Takes over the count of the actor it replaces (``__reload__``)."""

    def __init__(self, start: int = 0) -> None:
        self.n = start
        self.took_over_from: str | None = None

    def __reload__(self, old: Any) -> None:
        self.n += old.n
        self.took_over_from = type(old).__name__

    @endpoint
    def state(self) -> tuple[int, str | None]:
        return self.n, self.took_over_from

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Importer(Actor):
    """Imports modules in a worker and looks into them."""

    @endpoint
    def load_from(self, folder: str, module: str) -> str:
        """Import ``module`` from ``folder`` (first on the path); its file."""
        sys.path.insert(0, folder)
        try:
            return str(importlib.import_module(module).__file__)
        finally:
            sys.path.remove(folder)

    @endpoint
    def get(self, module: str, name: str) -> Any:
        return getattr(sys.modules[module], name, None)

    @endpoint
    def run(self, module: str, name: str) -> Any:
        return getattr(sys.modules[module], name)()
