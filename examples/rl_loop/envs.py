"""A stateful environment for multi-turn rollouts, as the user writes it: `env.cls=module:Class`
(or `path/to/file.py:Class`).

Where tools are stateless functions, an environment keeps the state of one trajectory: one
instance per trajectory, built with no arguments, then

    reset(row) -> messages                        the conversation's start, from a data row
    step(assistant_message) -> (messages, done)   the observations after a turn, and whether
                                                  the trajectory ends there

where messages are chat messages (`{"role": ..., "content": ...}`) and `assistant_message`
is the model's turn as one. Either method may be `async def`; a plain one runs on a thread
of its own, so that a slow environment does not hold the loop's event loop. `reset_env` and
`step_env` call them and check what they return, raising `EnvError` naming the class and
what was wrong.

An episode may outlive a checkpoint (partial rollouts carry it across steps), and then its
environment must come back with it. A class may say how, as torch modules do:

    state_dict() -> state                  what the instance holds, as JSON (dicts, lists,
                                           strings, numbers)
    load_state_dict(state)                 a new instance back to it (no reset first)

Without them the instance is rebuilt by replay: a new one reset on the same row, then
stepped on the same assistant messages, each step's observations checked against what the
episode saw (`Environments.restore`); an environment that answers otherwise (one with
randomness or outside state) is an `EnvError` telling it to define the two methods.

`Environments` is the run's side: the class loaded once (a bad spec, or a constructor that
fails, refused in one line before any proc starts), then an instance per episode
(`Environments.open`), each call bounded by `env.timeout_s`. A fault is handled by where it
happens:

- `reset` raising, returning no messages or the wrong shape, or running past the bound: an
  `EnvError` naming the class and the row, which fails the step (the episode has no prompt
  without its opening, and the same row would fail again).
- `step` raising or running past the bound: that episode ends there (`env_error`), logged
  naming the class and the row, counted in `env/errors` (`env/errors/raised`,
  `env/errors/timeout`); the other episodes go on. A hung call's thread is left behind (a
  thread cannot be stopped), a daemon one, so it never holds the run's exit.
- `step` returning the wrong shape: an `EnvError` naming what was expected (a bug of the
  class, which every step would hit).

In an episode (`episodes.AgentRollouts`): the opening is the prompt, rendered by the chat
template (the plain form of the tiny model: the messages' contents one after another, so
they must use the data's characters); a turn that ends at its stop token without a tool
call (tools, where given, run first) goes to `step` as `{"role": "assistant", "content":
...}` without the stop token; the observations are appended as a tool's results are
(plain: their contents), never trained on; `done` ends the episode, and so does
`rollout.max_turns`. The last turn's step runs too and its observations are kept (the
reward functions see what the environment said last); an observation that does not fit
the episode's room ends it as an overflow, unappended. The reward functions' prompt for a
group is its first episode's opening (every one's, when `reset` depends on the row alone).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from colocate.loading import load_function
from examples.rl_loop.data import Row

logger = logging.getLogger(__name__)
Message = dict[str, Any]
# a transcript's `opening`: messages as a `Row`'s prompt, its text and its tokens
Render = Callable[[list[Message]], tuple[Any, str, list[int]]]


class EnvError(ValueError):
    """An environment class that cannot be used, or a call of one that returned something
    else than the protocol says: the message names the class and the fault."""


@dataclass(frozen=True)
class EnvConfig:
    """A stateful environment for each trajectory (None: none)."""

    cls: str | None = None  # module:Class or path/to/file.py:Class (see examples.rl_loop.envs)
    timeout_s: float = 10.0  # one reset or step's limit; a step past it ends its episode

    def __post_init__(self) -> None:
        if self.cls is not None:
            module, _, name = self.cls.rpartition(":")
            if not module or not name:
                raise ValueError(f"env.cls: {self.cls!r}: write module:Class or "
                                 "path/to/file.py:Class")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"env.timeout_s={self.timeout_s}: must be a number > 0")

    @property
    def used(self) -> bool:
        return self.cls is not None


@runtime_checkable
class Environment(Protocol):
    """What `env.cls` instances do (see module)."""

    def reset(self, row: dict[str, Any]) -> list[Message]: ...

    def step(self, assistant_message: Message) -> tuple[list[Message], bool]: ...


def load_env(spec: str) -> type[Environment]:
    """The class `spec` names, checked to be a class with `reset` and `step` methods that
    can be built with no arguments, and built once here (a constructor that fails is
    refused now, not at the first episode); `EnvError` in one line otherwise."""
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
    try:
        cls()
    except Exception as err:
        raise EnvError(f"env.cls: {spec}: {cls.__name__}() raised {type(err).__name__}: "
                       f"{_first_line(err)}") from err
    return cls


async def reset_env(env: Environment, row: dict[str, Any]) -> list[Message]:
    """`env.reset(row)` (awaited if async, on a thread if not), its messages checked: at
    least one, the conversation's opening."""
    messages = _checked_messages(env, "reset", await _call(env.reset, row))
    if not messages:
        raise EnvError(f"{type(env).__name__}.reset returned no messages: expected the "
                       "conversation's opening, at least one message")
    return messages


async def step_env(env: Environment, assistant_message: Message) -> tuple[list[Message], bool]:
    """`env.step(assistant_message)` (awaited if async, on a thread if not), its
    (messages, done) checked."""
    got = await _call(env.step, assistant_message)
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], bool)):
        raise EnvError(f"{type(env).__name__}.step returned {_show(got)}: expected a tuple "
                       "(messages, done) with done a bool")
    return _checked_messages(env, "step", got[0]), got[1]


async def _call(method: Callable[..., Any], *args: Any) -> Any:
    """`method(*args)`: awaited when it is `async def`, else on a thread of its own (and
    what it returns awaited, if it returns an awaitable)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    got = await _on_thread(method, *args)
    return await got if inspect.isawaitable(got) else got


async def _on_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a daemon thread: not `asyncio.to_thread`, whose pool's threads the
    interpreter joins at exit, so that a call that never returns holds nothing up once its
    waiter has given up on it (its result, if it ever comes, is dropped)."""
    loop = asyncio.get_running_loop()
    settled = loop.create_future()

    def settle(result: Any, error: Exception | None) -> None:
        if settled.done():  # its waiter gave up (the call's bound)
            return
        if error is None:
            settled.set_result(result)
        else:
            settled.set_exception(error)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except Exception as err:
            result, error = None, err
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for it
            pass

    threading.Thread(target=run, daemon=True,
                     name=f"env-{getattr(fn, '__qualname__', 'call')}").start()
    return await settled


@dataclass
class EpisodeEnv:
    """One episode's environment instance, and what its steps came to: each step's
    assistant message and observations (None: it failed), which a replay repeats."""

    env: Environment | None  # None: an ended episode's, back from a checkpoint (figures only)
    row: str  # the row it was reset on, shown short: the log names it
    timeout_s: float
    steps: int = 0
    done: bool = False  # a step said the episode ends
    error: str | None = None  # the step that ended it: "raised" or "timeout"
    history: list[tuple[Message, list[Message] | None]] = field(default_factory=list)

    def saved(self) -> dict[str, Any]:
        """What a checkpoint keeps of it: its figures, its steps, and the instance's own
        `state_dict()` where its class has one (`Environments.restore` reads it)."""
        found: dict[str, Any] = {"steps": self.steps, "done": self.done, "error": self.error,
                                 "history": [list(h) for h in self.history]}
        if self.env is not None and callable(getattr(self.env, "state_dict", None)):
            found["state"] = self.env.state_dict()
        return found

    async def step(self, message: Message) -> list[Message] | None:
        """`step(message)` within the bound: its observations (`done` recorded), or None
        when it raised or ran past the bound (the episode ends there: logged, counted). A
        wrong return shape raises `EnvError`."""
        name = type(self.env).__name__
        self.steps += 1
        try:
            messages, self.done = await asyncio.wait_for(step_env(self.env, message),
                                                         self.timeout_s)
            self.history.append((message, messages))
            return messages
        except EnvError:
            raise
        except TimeoutError:
            self.error, what = "timeout", f"ran past env.timeout_s={self.timeout_s}"
        except Exception as err:
            self.error, what = "raised", f"raised {type(err).__name__}: {_first_line(err)}"
        logger.warning("env %s.step on row %s %s: its episode ends here", name, self.row, what)
        self.history.append((message, None))
        return None


class Environments:
    """`env.cls` for a run: loaded and checked here, then an instance per episode, reset
    on its data row (`open`), each call bounded by `env.timeout_s` (see module)."""

    def __init__(self, cfg: EnvConfig, prompt_key: str = "prompt") -> None:
        if cfg.cls is None:
            raise ValueError("Environments: env.cls is not set")
        self.cls, self.timeout_s, self.prompt_key = load_env(cfg.cls), cfg.timeout_s, prompt_key

    async def open(self, row: Row, render: Render, max_positions: int
                   ) -> tuple[EpisodeEnv, Row]:
        """A new instance, reset on `row`'s columns (its prompt under `data.prompt_key`
        among them), and the episode's row: `row` with the opening messages `reset`
        returned as its prompt (`render`: a transcript's `opening`). `EnvError` naming the
        class and the row when the constructor or `reset` raises, runs past the bound or
        returns something else than messages, or when the opening leaves the model
        (`max_positions`) no room to write."""
        columns = self._columns(row)
        shown, name = _show(columns), self.cls.__name__

        async def opened() -> tuple[Environment, list[Message]]:
            env = await _on_thread(self.cls)
            return env, await reset_env(env, columns)

        try:
            env, messages = await asyncio.wait_for(opened(), self.timeout_s)
        except EnvError as err:
            raise EnvError(f"env.cls: {err} (row {shown})") from None
        except TimeoutError:
            raise EnvError(f"env.cls: {name}() and reset on row {shown} ran past "
                           f"env.timeout_s={self.timeout_s}") from None
        except Exception as err:
            raise EnvError(f"env.cls: {name}() or reset on row {shown} raised "
                           f"{type(err).__name__}: {_first_line(err)}") from err
        prompt, text, tokens = render(messages)
        if len(tokens) >= max_positions:
            raise EnvError(f"env.cls: {name}.reset on row {shown}: its opening is "
                           f"{len(tokens)} tokens, the model has {max_positions} positions")
        return EpisodeEnv(env, shown, self.timeout_s), replace(row, prompt=prompt, text=text,
                                                               tokens=tokens)

    async def restore(self, row: Row, saved: dict[str, Any], ended: bool) -> EpisodeEnv:
        """The environment `EpisodeEnv.saved` kept of an episode opened on data row `row`:
        its figures, and (unless the episode `ended`: it steps no more) an instance back at
        the same point, by its class's `load_state_dict`, else by replay (see module).
        `EnvError` naming the class, the row and the step when a replayed step answers
        otherwise than the episode saw."""
        columns = self._columns(row)
        back = EpisodeEnv(None, _show(columns), self.timeout_s, saved["steps"], saved["done"],
                          saved["error"], [(m, seen) for m, seen in saved["history"]])
        if ended:
            return back
        name = self.cls.__name__
        back.env = await _on_thread(self.cls)
        if "state" in saved and callable(getattr(back.env, "load_state_dict", None)):
            await _call(back.env.load_state_dict, saved["state"])
            return back
        await asyncio.wait_for(reset_env(back.env, columns), self.timeout_s)
        for index, (message, seen) in enumerate(back.history):
            messages, _ = await asyncio.wait_for(step_env(back.env, message), self.timeout_s)
            if messages != seen:
                raise EnvError(
                    f"env.cls: {name} on row {back.row}: replayed after a checkpoint, its step "
                    f"{index + 1} answered {_show(messages)}, not {_show(seen)} as before: an "
                    "environment that does not answer the same messages the same way must "
                    "define state_dict() and load_state_dict(state)")
        return back

    def _columns(self, row: Row) -> dict[str, Any]:
        """What `reset` gets: a data row's columns, its prompt under `data.prompt_key`."""
        return {self.prompt_key: row.prompt, **row.columns}


def contents(messages: list[Message]) -> str:
    """The messages' contents one after another: the plain form of an environment's
    messages, for a model without a chat template."""
    return "".join("" if m["content"] is None else str(m["content"]) for m in messages)


def env_metrics(envs: list[EpisodeEnv]) -> dict[str, Any]:
    """A step's episodes' environments in figures: `env/steps` (all its episodes'),
    `env/errors` and one `env/errors/<kind>` each (raised, timeout), `env/done_share` (the
    share of episodes a step ended with done)."""
    errors = Counter(e.error for e in envs if e.error is not None)
    row: dict[str, Any] = {"env/steps": sum(e.steps for e in envs),
                           "env/errors": sum(errors.values()),
                           "env/done_share": sum(e.done for e in envs) / max(1, len(envs))}
    row.update({f"env/errors/{kind}": n for kind, n in sorted(errors.items())})
    return row


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


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else ""
