"""The per-process runtime: links and credit, pending calls, routing and relays, peer
liveness, dispatch into mailboxes; :mod:`._runtime` wires the parts together.

This is the package's front door: other packages import only what is exported here.
The main entry points are :func:`open_runtime` (a process's :class:`Runtime`, which
:func:`current_runtime` finds again), :data:`call_context` (the call a handler runs
in), :class:`ActorInstance` (an actor's mailbox), the session's :func:`bridged` (an
``async def`` made to return an :class:`Op`: awaited, or ``.get()`` from synchronous
code such as a notebook cell), and a worker's output capture (:func:`install_capture`)
and stack dumps (:func:`install_stack_dump`).
"""

from __future__ import annotations

from ._calls import Pending, rank_label
from ._capture import Capture, output_identity
from ._capture import active as active_capture
from ._capture import install as install_capture
from ._context import CallContext, call_context, is_local, runtime_var
from ._logfile import LogWriter, rank_of
from ._logfile import read as read_logs
from ._mailbox import ActorInstance, Handler, can_wait
from ._output import OutputPrinter, output_mode
from ._pausable import debugged_here, may_pause, paused_outside, wait_off_loop
from ._peers import LINK_LOST
from ._router import Payloads, Tree
from ._runtime import Runtime, current_runtime, is_supervision, open_runtime, pass_cancellation
from ._session import Op, Stream, bridged, bridged_always
from ._stackdump import DUMP_TIMEOUT, LOOP_TIMEOUT, stacks_by_signal
from ._stackdump import install as install_stack_dump
from ._stacks import format_stacks
from ._tree import grouped

__all__ = [
    "DUMP_TIMEOUT",
    "LINK_LOST",
    "LOOP_TIMEOUT",
    "ActorInstance",
    "CallContext",
    "Capture",
    "Handler",
    "LogWriter",
    "Op",
    "OutputPrinter",
    "Payloads",
    "Pending",
    "Runtime",
    "Stream",
    "Tree",
    "active_capture",
    "bridged",
    "bridged_always",
    "call_context",
    "can_wait",
    "current_runtime",
    "debugged_here",
    "format_stacks",
    "grouped",
    "install_capture",
    "install_stack_dump",
    "is_local",
    "is_supervision",
    "may_pause",
    "open_runtime",
    "output_identity",
    "output_mode",
    "pass_cancellation",
    "paused_outside",
    "rank_label",
    "rank_of",
    "read_logs",
    "runtime_var",
    "stacks_by_signal",
    "wait_off_loop",
]
