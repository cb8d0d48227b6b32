"""A mypy plugin that types `svc.<endpoint>` from the service's actor class.

    # pyproject.toml (or mypy.ini: plugins = services.mypy_plugin)
    [tool.mypy]
    plugins = ["services.mypy_plugin"]

`Service[A].__getattr__` exists only at run time; Python's types cannot say "the attribute
`name` of A, as a ServiceEndpoint". This plugin does: for `svc.generate` on a `Service[Gen]`
it reads `Gen.generate`'s own signature (its `@endpoint` method, `self` dropped, an `async`
method's result unwrapped) and gives `ServiceEndpoint[<those parameters>, <its result>]`, so
`svc.generate.route(...)` is checked like a call of the method (its own arguments only: a
session is a block, `Service.session`) and `fanout(...)` returns a list of its result.
`svc.<name>` where `Gen.name` is a method but not an `@endpoint`, or no attribute at all, is
an error saying which, as at run time. The method is read from its definition, so Monarch's
own typing (it ships no py.typed marker) is not needed.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from mypy.nodes import (
    CallExpr,
    Decorator,
    Expression,
    FuncDef,
    NameExpr,
    RefExpr,
)
from mypy.plugin import AttributeContext, Plugin
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    Parameters,
    Type,
    TypeOfAny,
    get_proper_type,
)

SERVICE = "services.service.Service"
ENDPOINT = "services.endpoint.ServiceEndpoint"


def _is_endpoint_decorator(expr: Expression) -> bool:
    """`@endpoint` or `@endpoint(...)`, however `endpoint` was imported."""
    if isinstance(expr, CallExpr):
        expr = expr.callee
    return isinstance(expr, RefExpr) and (expr.fullname or expr.name).split(".")[-1] == "endpoint"


def _ported(expr: Expression) -> bool:
    """`@endpoint(explicit_response_port=True)`: the result goes through a port argument."""
    return isinstance(expr, CallExpr) and any(
        arg == "explicit_response_port" and not (isinstance(value, NameExpr)
                                                 and value.name == "False")
        for arg, value in zip(expr.arg_names, expr.args, strict=True))


def _endpoints(actor: Instance) -> list[str]:
    """The names of the `@endpoint` methods of `actor`'s class and its bases."""
    return sorted({name for info in actor.type.mro for name, sym in info.names.items()
                   if isinstance(sym.node, Decorator)
                   and any(map(_is_endpoint_decorator, sym.node.original_decorators))})


def _endpoint_type(ctx: AttributeContext, name: str) -> Type:
    service = get_proper_type(ctx.type)
    if not isinstance(service, Instance) or not service.args:
        return ctx.default_attr_type
    actor = get_proper_type(service.args[0])
    if not isinstance(actor, Instance):  # Any, or not known yet
        return ctx.default_attr_type
    found = actor.type.get(name)
    node = found.node if found is not None else None
    if isinstance(node, Decorator) and any(map(_is_endpoint_decorator,
                                               node.original_decorators)):
        method = node.func.type
        if not isinstance(method, CallableType) or any(map(_ported, node.original_decorators)):
            return ctx.default_attr_type  # an unannotated method, or a ported one: untyped
        result = get_proper_type(method.ret_type)
        if node.func.is_coroutine and isinstance(result, Instance) and result.args:
            result = get_proper_type(result.args[-1])  # Coroutine[Any, Any, R] -> R
        params = Parameters(method.arg_types[1:], method.arg_kinds[1:], method.arg_names[1:])
        untyped = get_proper_type(ctx.default_attr_type)  # __getattr__'s ServiceEndpoint[...]
        if not isinstance(untyped, Instance) or untyped.type.fullname != ENDPOINT:
            return ctx.default_attr_type
        return Instance(untyped.type, [params, result])
    cls = actor.type.name
    if isinstance(node, (FuncDef, Decorator)):
        ctx.api.fail(f'"{cls}.{name}" is a method, not an @endpoint: a service reaches only '
                     "endpoints", ctx.context)
    else:
        close = difflib.get_close_matches(name, _endpoints(actor), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        ctx.api.fail(f'Service[{cls}] has no endpoint "{name}"{hint}', ctx.context)
    return AnyType(TypeOfAny.from_error)


def _attribute_hook(name: str) -> Callable[[AttributeContext], Type]:
    def hook(ctx: AttributeContext) -> Type:
        service = get_proper_type(ctx.type)
        if isinstance(service, Instance) and service.type.has_readable_member(name):
            return ctx.default_attr_type  # Service's own attribute
        return _endpoint_type(ctx, name)

    return hook


class ServicePlugin(Plugin):
    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        owner, _, name = fullname.rpartition(".")
        if owner == SERVICE and not name.startswith("_"):
            return _attribute_hook(name)
        return None


def plugin(version: str) -> type[Plugin]:
    return ServicePlugin
