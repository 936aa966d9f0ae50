"""A mypy plugin that types the endpoints of actor meshes.

``ActorMesh`` finds endpoints by name at run time (``__getattr__``), which no type
annotation can express; with this plugin, mypy types ``mesh.step`` of an
``ActorMesh[Trainer]`` as ``MeshEndpoint[P, R]`` from ``Trainer.step``'s
``EndpointDescriptor[P, R]``, so its adverbs check their arguments and results, and a
name that is no endpoint of ``Trainer`` is an error. Each parameter of type ``T`` also
takes a ``ValueMesh[T]`` (scattered: each rank gets its own element), for
``mesh.step`` and ``mesh.endpoint(Trainer.step)`` alike. Enable it in mypy's
configuration::

    [tool.mypy]
    plugins = ["amesh.mypy"]

Other type checkers see such an attribute as an untyped endpoint;
``mesh.endpoint(Trainer.step)`` is typed without the plugin, but there a scattered
argument is a type error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mypy.errorcodes import ATTR_DEFINED
from mypy.plugin import AttributeContext, CheckerPluginInterface, MethodContext, Plugin
from mypy.subtypes import find_member
from mypy.types import (
    AnyType,
    Instance,
    Parameters,
    Type,
    TypeOfAny,
    UnionType,
    get_proper_type,
)

__all__ = ["plugin"]

_ACTOR_MESH = "amesh._model._actor_mesh.ActorMesh"
_DESCRIPTOR = "amesh._model._actor.EndpointDescriptor"
_MESH_ENDPOINT = "amesh._model._endpoint.MeshEndpoint"
#: looked up through the package, which re-exports it
_VALUE_MESH = "amesh.ValueMesh"


class _AmeshPlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner != _ACTOR_MESH:
            return None
        return functools.partial(_endpoint_attribute, name)

    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        if fullname != f"{_ACTOR_MESH}.endpoint":
            return None
        return _endpoint_method


def _endpoint_attribute(name: str, ctx: AttributeContext) -> Type:
    """The type of attribute ``name`` of an ``ActorMesh[A]``: its own attributes as
    declared, an endpoint of ``A`` as ``MeshEndpoint[P, R]``; anything else is an
    error."""
    mesh = get_proper_type(ctx.type)
    if not isinstance(mesh, Instance) or mesh.type.has_readable_member(name) or not mesh.args:
        return ctx.default_attr_type
    actor = get_proper_type(mesh.args[0])
    if not isinstance(actor, Instance):  # ActorMesh[Any], or a type variable's
        return ctx.default_attr_type
    member = find_member(name, actor, actor, class_obj=True)  # the descriptor itself
    desc = get_proper_type(member) if member is not None else None
    untyped = get_proper_type(ctx.default_attr_type)  # __getattr__'s MeshEndpoint[..., Any]
    if isinstance(desc, Instance) and desc.type.fullname == _DESCRIPTOR:
        if isinstance(untyped, Instance) and untyped.type.fullname == _MESH_ENDPOINT:
            return _scatterable(ctx.api, untyped.copy_modified(args=desc.args))
        return ctx.default_attr_type
    if isinstance(desc, AnyType):
        return ctx.default_attr_type
    ctx.api.fail(f'"{actor.type.name}" has no endpoint "{name}"', ctx.context, code=ATTR_DEFINED)
    return AnyType(TypeOfAny.from_error)


def _endpoint_method(ctx: MethodContext) -> Type:
    """The type of ``mesh.endpoint(Cls.step)``: its ``MeshEndpoint[P, R]``, with
    scattered arguments allowed."""
    endpoint = get_proper_type(ctx.default_return_type)
    if isinstance(endpoint, Instance) and endpoint.type.fullname == _MESH_ENDPOINT:
        return _scatterable(ctx.api, endpoint)
    return ctx.default_return_type


def _scatterable(api: CheckerPluginInterface, endpoint: Instance) -> Instance:
    """``endpoint`` (a ``MeshEndpoint[P, R]``) with each parameter type ``T`` of ``P``
    made ``T | ValueMesh[T]``."""
    params = get_proper_type(endpoint.args[0]) if endpoint.args else None
    if not isinstance(params, Parameters):
        return endpoint
    arg_types = [
        UnionType.make_union([t, api.named_generic_type(_VALUE_MESH, [t])])
        for t in params.arg_types
    ]
    return endpoint.copy_modified(
        args=[params.copy_modified(arg_types=arg_types), *endpoint.args[1:]]
    )


def plugin(version: str) -> type[Plugin]:
    """mypy's entry point: the plugin class (for any mypy version)."""
    return _AmeshPlugin
