"""A stateful environment for multi-turn rollouts, as the user writes it: `env.cls=module:Class`
(or `path/to/file.py:Class`).

Where tools are stateless functions, an environment keeps the state of one trajectory: one
instance per trajectory, built with no arguments, then

    reset(row) -> messages                        the conversation's start, from a data row
    step(assistant_message) -> (messages, done)   the observations after a turn, and whether
                                                  the trajectory ends there

where messages are chat messages (`{"role": ..., "content": ...}`) and `assistant_message`
is the model's turn as one. Either method may be `async def`. `reset_env` and `step_env` call
them and check what they return, raising `EnvError` naming the class and what was wrong.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from colocate.loading import load_function

Message = dict[str, Any]


class EnvError(ValueError):
    """An environment class that cannot be used, or a call of one that returned something
    else than the protocol says: the message names the class and the fault."""


@dataclass(frozen=True)
class EnvConfig:
    """A stateful environment for each trajectory (None: none)."""

    cls: str | None = None  # module:Class or path/to/file.py:Class (see examples.rl_loop.envs)

    def __post_init__(self) -> None:
        if self.cls is not None:
            module, _, name = self.cls.rpartition(":")
            if not module or not name:
                raise ValueError(f"env.cls: {self.cls!r}: write module:Class or "
                                 "path/to/file.py:Class")


@runtime_checkable
class Environment(Protocol):
    """What `env.cls` instances do (see module)."""

    def reset(self, row: dict[str, Any]) -> list[Message]: ...

    def step(self, assistant_message: Message) -> tuple[list[Message], bool]: ...


def load_env(spec: str) -> type[Environment]:
    """The class `spec` names, checked to be a class with `reset` and `step` methods that
    can be built with no arguments; `EnvError` in one line otherwise."""
    cls = load_function(spec, "env.cls", EnvError)
    if not inspect.isclass(cls):
        raise EnvError(f"env.cls: {spec}: a {type(cls).__name__}, not a class: give a class "
                       "with reset(row) and step(assistant_message) methods")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"env.cls: {spec}: {cls.__name__} has no {' or '.join(missing)} "
                       "method: an environment needs reset(row) -> messages and "
                       "step(assistant_message) -> (messages, done)")
    try:
        inspect.signature(cls).bind()
    except TypeError as err:
        raise EnvError(f"env.cls: {spec}: {cls.__name__}() must take no arguments, one "
                       f"instance per trajectory ({err})") from None
    return cls


async def reset_env(env: Environment, row: dict[str, Any]) -> list[Message]:
    """`env.reset(row)`, awaited if async, its messages checked."""
    messages = await _maybe_await(env.reset(row))
    return _checked_messages(env, "reset", messages)


async def step_env(env: Environment, assistant_message: Message) -> tuple[list[Message], bool]:
    """`env.step(assistant_message)`, awaited if async, its (messages, done) checked."""
    got = await _maybe_await(env.step(assistant_message))
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], bool)):
        raise EnvError(f"{type(env).__name__}.step returned {_show(got)}: expected a tuple "
                       "(messages, done) with done a bool")
    return _checked_messages(env, "step", got[0]), got[1]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _checked_messages(env: Environment, method: str, messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages):
        raise EnvError(f"{type(env).__name__}.{method} returned {_show(messages)}: expected "
                       "a list of chat messages ({'role': ..., 'content': ...})")
    return messages


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."
