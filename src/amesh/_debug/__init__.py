"""Remote debugging: ``breakpoint()`` in an endpoint, on any rank, pauses that handler in
a pdb session that the controller's user attaches to (:func:`debug`, or ``amesh debug``
in another terminal).

Worker side: :func:`breakpointhook` is the worker's ``sys.breakpointhook``. It connects
to the controller's debug listener (the address in ``AMESH_DEBUG_LISTENER``, which the controller
gives the workers it starts on its machine), from the thread that hit the breakpoint and
without the event loop (which may be that thread), announces the paused rank, and runs
pdb on the caller's frame with the connection as its input and output. ``continue``,
``quit`` or the end of the connection (the user detached) ends the session: the
handler goes on.

Controller side: :class:`DebugListener`, one listening socket (a Linux abstract unix
socket) and a thread per connection, started when the controller starts its first
local worker. It keeps the paused sessions, and splices a client (:func:`debug`, ``amesh
debug``) to the one it chose. A host agent runs one too, for the workers it starts
(:mod:`amesh._hosts._agent`). Once a rank pauses, it writes
``<state dir>/debug/<pid>.json`` (mode 0600: the address and the job key, in hex, as
readable as the key file of the state directory) for ``amesh debug``, and removes it
when the controller exits.

Both ends prove that they hold the job key: the dialer answers the listener's stream
challenge (:mod:`amesh._transport._auth`), then the listener answers the dialer's nonce
(:func:`_listener_proof`), so that a squatter of the address gets no pdb session either.
A peer of another uid is refused before the challenge.

After the handshake each side sends JSON lines: the first says who it is (``role``
``worker`` with where it paused, or ``client``); a worker then sends its output
(``{"out": text}``) and asks for each line of input (``{"read": 1}``), which comes back
as one raw line; a client lists (``{"op": "list"}``) and attaches (``{"op": "attach"}``).

Ranks paused on other machines: :func:`debug` also lists those of the host agents this
controller attached to (the :class:`RemoteDebugger` s that the hosts layer registers
with :func:`set_remote_debuggers`), polling them while it waits, and relays a session
through its agent, over the amesh link to it.

Modules: :mod:`._conn` (connections and their handshake, both ends),
:mod:`._listener` (the controller's listener), :mod:`._pdb` (the worker's side),
:mod:`._client` (:func:`debug`, ``amesh debug``).
"""

from ._client import RemoteDebugger, cli, debug, set_remote_debuggers
from ._conn import DEBUG_ENV
from ._listener import DebugListener, current_listener, debug_env
from ._pdb import breakpointhook

__all__ = [
    "DEBUG_ENV",
    "DebugListener",
    "RemoteDebugger",
    "breakpointhook",
    "cli",
    "current_listener",
    "debug",
    "debug_env",
    "set_remote_debuggers",
]
