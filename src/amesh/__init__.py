"""amesh: drive meshes of worker processes and actors from one async controller.

The public API is re-exported here from private modules; the layers, lowest first:
``_transport`` (frames between processes), ``_wire`` (envelopes, payloads),
``_runtime`` (router, mailboxes, pending calls), ``_model`` (actors, endpoints, actor
and value meshes, restart policies), ``_mesh`` (ProcMesh, its lifecycle and
supervisor), ``_worker`` (a worker's main), ``_hosts`` (where processes come from)
and ``_env`` (environments: their files, locks, wheels and targets). Lower layers
never import higher ones, not even inside a function; ``lint-imports`` checks it
(``[tool.importlinter]`` in pyproject.toml).
"""

from __future__ import annotations

from . import _hosts
from ._config import ConfigError as ConfigError
from ._config import configure as configure
from ._debug import debug as debug
from ._env import EnvError as EnvError
from ._env import Environment as Environment
from ._errors import ActorError as ActorError
from ._errors import DeadlockError as DeadlockError
from ._errors import Failure as Failure
from ._errors import ProtocolError as ProtocolError
from ._errors import RemoteTraceback as RemoteTraceback
from ._errors import SupervisionError as SupervisionError
from ._hosts import HostMesh as HostMesh
from ._hosts import LocalHost as LocalHost
from ._hosts import SlurmJob as SlurmJob
from ._hosts import attach as attach
from ._hosts import attach_mesh as attach_mesh
from ._hosts import this_host as this_host
from ._mesh import ProcMesh as ProcMesh
from ._model import Actor as Actor
from ._model import ActorMesh as ActorMesh
from ._model import MeshEndpoint as MeshEndpoint
from ._model import RestartPolicy as RestartPolicy
from ._model import ValueMesh as ValueMesh
from ._model import cancelled as cancelled
from ._model import current_actor as current_actor
from ._model import current_rank as current_rank
from ._model import current_size as current_size
from ._model import endpoint as endpoint
from ._run import run as run
from ._runtime import Op as Op
from ._runtime import Stream as Stream
from ._shape import Point as Point
from ._shape import Shape as Shape

# The one place where the layers are wired: the hosts tell the layers below them (which
# cannot import them) where processes come from. Every amesh.* import runs this first.
_hosts.plug_in()

__version__ = "0.1.0"

__all__ = [
    "Actor",
    "ActorError",
    "ActorMesh",
    "ConfigError",
    "DeadlockError",
    "EnvError",
    "Environment",
    "Failure",
    "HostMesh",
    "LocalHost",
    "MeshEndpoint",
    "Op",
    "Point",
    "ProcMesh",
    "ProtocolError",
    "RestartPolicy",
    "RemoteTraceback",
    "Shape",
    "SlurmJob",
    "Stream",
    "SupervisionError",
    "ValueMesh",
    "attach",
    "attach_mesh",
    "cancelled",
    "configure",
    "current_actor",
    "current_rank",
    "current_size",
    "debug",
    "endpoint",
    "run",
    "this_host",
]
