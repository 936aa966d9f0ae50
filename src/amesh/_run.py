"""``amesh.run``: the convenient entry point for a controller script."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from ._config import default_transport, loop_options, settings
from ._runtime import open_runtime
from ._tracebacks import hide_amesh_frames
from ._transport import open_transport

__all__ = ["run"]

T = TypeVar("T")


def run(main: Callable[..., Awaitable[T]], *args: Any, backend: str | None = None) -> T:
    """Run ``main(*args)`` on an event loop with an amesh runtime, and return its result.

    Args:
        main: the controller's async main function.
        backend: ``"asyncio"`` (uvloop when installed; the default) or ``"trio"``;
            ``AMESH_BACKEND`` sets the default.
    """
    backend = backend or settings().backend
    if not settings().debug:
        hide_amesh_frames()

    async def root() -> T:
        scheme, host = default_transport()
        async with open_runtime(lambda: open_transport(scheme, host=host)):
            return await main(*args)

    try:
        return anyio.run(root, backend=backend, backend_options=loop_options(backend))
    except KeyboardInterrupt:
        # Ctrl-C: the meshes are stopped. Where the signal landed (trio) and the
        # body's cancellation it caused (asyncio) say nothing to who pressed it.
        raise KeyboardInterrupt from None
