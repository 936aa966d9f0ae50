"""Waiting for a new worker's Ready: how every host learns that a worker it started listens."""

from __future__ import annotations

import uuid

import anyio

from .. import _wire
from .._errors import SupervisionError
from .._mesh import ProcessLike, exit_cause
from .._runtime import Runtime

__all__ = ["STARTUP_TIMEOUT", "ReadyWaiter"]

#: How long a worker may take from exec (or fork) to listening.
STARTUP_TIMEOUT = 60.0


class ReadyWaiter:
    """Waits for the Ready of the worker that is started with :attr:`token`."""

    def __init__(self, rt: Runtime) -> None:
        self.token = uuid.uuid4().hex
        self.msg: _wire.Ready | None = None
        self._rt = rt
        self._ready = anyio.Event()
        rt.expect_ready(self.token, self._on_ready)

    def _on_ready(self, msg: _wire.Ready) -> None:
        self.msg = msg
        self._ready.set()

    async def wait(self) -> _wire.Ready:
        await self._ready.wait()
        assert self.msg is not None
        return self.msg

    def cancel(self) -> None:
        self._rt.expect_ready(self.token, None)

    async def started(self, process: ProcessLike, pid: int, where: str = "") -> _wire.Ready:
        """The Ready of ``process`` (pid ``pid``, on host ``where``: "" for this one).

        Raises:
            SupervisionError: it exited first, or did not report within
                :data:`STARTUP_TIMEOUT`; it is killed and reaped then.
        """
        try:
            with anyio.move_on_after(STARTUP_TIMEOUT):
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        await process.wait()
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    await self.wait()
                    tg.cancel_scope.cancel()
            if self.msg is None:
                if process.returncode is not None:
                    why = exit_cause(process)
                else:
                    why = f"did not report within {STARTUP_TIMEOUT:.0f} s"
                on = f" on {where}" if where else ""
                raise SupervisionError(f"worker process {pid}{on} {why} while starting")
            return self.msg
        except BaseException:
            self.cancel()
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()
                await process.aclose()
            raise
