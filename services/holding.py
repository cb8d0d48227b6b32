"""Whose restart hooks run in this context: a resource group's held calls go through from
inside its own `on_restart` hooks (set by services.restart, read by services.service)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_in_hooks: contextvars.ContextVar[str | None] = contextvars.ContextVar("in_restart_hooks",
                                                                       default=None)


def in_hooks(group: str) -> bool:
    """Whether this call runs inside `group`'s restart hooks (its calls go through)."""
    return _in_hooks.get() == group


@contextmanager
def running_hooks(group: str) -> Iterator[None]:
    """Run `group`'s restart hooks: calls made inside go through its hold."""
    token = _in_hooks.set(group)
    try:
        yield
    finally:
        _in_hooks.reset(token)
