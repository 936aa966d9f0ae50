"""What users see: actors and their endpoints, actor meshes and the adverbs that call
them, value meshes of results, and restart policies; and the actor every process runs
for its controller (:class:`ProcAgent`).

This is the package's front door: other packages import only what is exported here.
The main entry points are :class:`Actor` and :func:`endpoint` (an actor's class and its
endpoints), :class:`ActorMesh` and :class:`MeshEndpoint` (an actor mesh and the
adverbs of an endpoint: ``call``, ``call_one``, ``choose``, ``stream``,
``broadcast``), :class:`ValueMesh`, and :class:`RestartPolicy` with the
``supervise=`` callables (:data:`Supervisor`).
"""

from __future__ import annotations

from ._actor import (
    Actor,
    EndpointDescriptor,
    cancelled,
    current_actor,
    current_rank,
    current_size,
    endpoint,
    handlers_of,
)
from ._actor_mesh import ActorMesh
from ._endpoint import MeshEndpoint, ranks_text, unpicklable
from ._policy import (
    RestartPolicy,
    RestartWindow,
    Supervisor,
    call_hook,
    call_supervisor,
    restart_policy,
)
from ._process_actor import AGENT_KEY, CONTROLLER_KEY, ControllerAgent, ProcAgent, serve_controller
from ._value_mesh import MeshView, ValueMesh

__all__ = [
    "AGENT_KEY",
    "CONTROLLER_KEY",
    "Actor",
    "ActorMesh",
    "ControllerAgent",
    "EndpointDescriptor",
    "MeshEndpoint",
    "MeshView",
    "ProcAgent",
    "RestartPolicy",
    "RestartWindow",
    "Supervisor",
    "ValueMesh",
    "call_hook",
    "call_supervisor",
    "cancelled",
    "current_actor",
    "current_rank",
    "current_size",
    "endpoint",
    "handlers_of",
    "ranks_text",
    "restart_policy",
    "serve_controller",
    "unpicklable",
]
