"""Monarch's private API, in one place. Written against torchmonarch 0.7.0.

The rest of the project imports Monarch's public `monarch.actor` only; what it needs
beyond that is here, so a Monarch upgrade is checked in one file:
- `BootstrapCommand`: a proc's bootstrap program and environment, set before it starts
  (`spawn_procs(bootstrap_command=...)` takes a function returning one).
- `EndpointProperty`: what `@endpoint` makes of a method; used to list a class's endpoints.
- `endpoint_function(prop)` / `set_endpoint_function(prop, fn)`: the plain function an
  endpoint runs (`EndpointProperty._method`), read to call it in-process and replaced to
  wrap it.
- `mesh_name(actors)`: the full name Monarch gave a spawned actor mesh (`ActorMesh._name`),
  the name its faults carry (`MeshFailure.mesh_name`).
- `SupervisionError`: what a call raises when the called actor or its proc failed.
"""

from __future__ import annotations

import importlib.metadata
import warnings
from typing import Any

from monarch._rust_bindings.monarch_hyperactor.host_mesh import BootstrapCommand
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch._src.actor.endpoint import EndpointProperty

MONARCH_VERSION = "0.7.0"

__all__ = ["MONARCH_VERSION", "BootstrapCommand", "EndpointProperty", "endpoint_function",
           "endpoint_names", "mesh_name", "set_endpoint_function", "SupervisionError"]

_installed = importlib.metadata.version("torchmonarch")
if _installed != MONARCH_VERSION:
    warnings.warn(f"colocate was written against torchmonarch {MONARCH_VERSION}; "
                  f"{_installed} is installed. If spawning procs or listing endpoints "
                  f"fails, check colocate/monarch_compat.py against it.", stacklevel=2)


def endpoint_names(cls: type) -> set[str]:
    """The names of `cls`'s `@endpoint` methods."""
    return {name for name in dir(cls) if isinstance(getattr(cls, name, None), EndpointProperty)}


async def mesh_name(actors: Any) -> str:
    """The full name of a spawned actor mesh (the spawn's name and an id Monarch adds), as
    its faults carry it in `MeshFailure.mesh_name`. Waits until the mesh is created."""
    return await actors._name  # noqa: SLF001 (Monarch's, see the docstring at the top)


def endpoint_function(prop: EndpointProperty) -> Any:
    """The function the endpoint `prop` runs (the decorated method itself)."""
    return prop._method  # noqa: SLF001 (Monarch's, see the docstring at the top)


def set_endpoint_function(prop: EndpointProperty, function: Any) -> None:
    """Have the endpoint `prop` run `function` instead (a wrapper of its method)."""
    prop._method = function  # noqa: SLF001 (Monarch's, see the docstring at the top)
