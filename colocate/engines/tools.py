"""Tools as users write them, and `ToolActor`, the Monarch actor that calls them in a proc
of its own.

A tool is a plain or `async def` function with type hints and a docstring (TRL's `tools`
convention): its JSON schema, what a chat template shows the model, is
`transformers.utils.get_json_schema`'s. Tools are stateless; they are named by spec
(`module:function` or `path/to/file.py:function`, `colocate.loading`) and loaded in every
process that calls them, so only text crosses between processes.

`ToolActor.call(name, arguments)` never raises for what a tool does: an unknown name, bad
arguments, a tool that raises, runs past its time limit, or returns something that is not
text (or JSON-serialisable, then written as JSON) all end in a `ToolResult` whose `error`
says which and whose `content` is the observation the model reads. A sync tool runs on a
thread of its own, so the time limit holds for it too (a tool stuck past it leaves its
thread behind, counted in `stuck`); only a proc that dies or hangs as a whole ends a call
without an answer, which the caller bounds (`examples.rl_loop.tools.ToolClient`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from monarch.actor import Actor, endpoint

from colocate.loading import load_function

ERRORS = ("unknown_tool", "bad_arguments", "raised", "timeout", "not_text", "lost")


class ToolSpecError(ValueError):
    """A tool spec names no usable tool: the message names the spec and what to fix."""


@dataclass(frozen=True)
class Tool:
    """A loaded tool: its name (the function's), the function, and its JSON schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


@dataclass(frozen=True)
class ToolResult:
    """A tool call's outcome: `content` is the observation text; `error` None for a tool
    that answered, else one of ERRORS (and `content` says what went wrong)."""

    content: str
    error: str | None = None
    seconds: float = 0.0


def load_tools(specs: list[str], setting: str = "tools.funcs") -> dict[str, Tool]:
    """The tools `specs` name, by name, each with its JSON schema. A spec that names no
    function, a function without a docstring or type hints (no schema), or two tools of one
    name raise `ToolSpecError` in one line naming `setting`, the spec and what to fix."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import (
        DocstringParsingException,
        TypeHintParsingException,
    )

    tools: dict[str, Tool] = {}
    for spec in specs:
        fn = load_function(spec, setting, ToolSpecError)
        try:
            schema = get_json_schema(fn)
        except (DocstringParsingException, TypeHintParsingException) as err:
            raise ToolSpecError(f"{setting}: {spec}: no JSON schema for the model ({err}); a "
                                "tool needs a type hint on each argument and a Google-style "
                                "docstring with an Args: line for each") from None
        name = schema["function"]["name"]
        if name in tools:
            raise ToolSpecError(f"{setting}: {spec}: a second tool named {name!r}: the model "
                                "calls tools by name, so give each its own")
        tools[name] = Tool(name, fn, schema)
    return tools


def as_text(value: Any) -> str | None:
    """A tool's return value as the observation's text: text as it is, anything JSON can
    write as JSON; None for anything else."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def _arguments(tool: Tool, arguments: dict[str, Any] | str) -> dict[str, Any] | str:
    """The keyword arguments of a call, or what is wrong with them (a str)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return f"the arguments are not JSON ({err})"
    if not isinstance(arguments, dict):
        return f"the arguments are a {type(arguments).__name__}, not an object of names"
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as err:
        return f"{err}; its parameters: {tool.schema['function']['parameters']}"
    return arguments


async def call_tool(tool: Tool | None, name: str, arguments: dict[str, Any] | str,
                    timeout_s: float, threads: set[threading.Thread] | None = None
                    ) -> ToolResult:
    """Call `tool` (None: no tool of that `name`) with `arguments` (an object, or its JSON)
    within `timeout_s`; never raises for what the tool does (see module). A sync tool runs
    on a daemon thread of its own (in `threads` until the tool returns): one stuck past its
    limit holds no pool's worker, nor the process's exit."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    if tool is None:
        return ToolResult(f"error: no tool named {name!r}", "unknown_tool")
    kwargs = _arguments(tool, arguments)
    if isinstance(kwargs, str):
        return ToolResult(f"error: bad arguments for {name}: {kwargs}", "bad_arguments")
    try:
        if tool.is_async:
            work = tool.fn(**kwargs)
        else:
            work = _on_thread(tool.fn, kwargs, threads if threads is not None else set())
        value = await asyncio.wait_for(work, timeout_s)
    except TimeoutError:
        return ToolResult(f"error: {name} did not answer within {timeout_s} s", "timeout",
                          loop.time() - start)
    except asyncio.CancelledError:
        raise
    except BaseException as err:  # the user's tool: whatever it raises is an observation
        return ToolResult(f"error: {name} raised {type(err).__name__}: {err}", "raised",
                          loop.time() - start)
    text = as_text(value)
    if text is None:
        return ToolResult(f"error: {name} returned a {type(value).__name__}, not text or "
                          "JSON", "not_text", loop.time() - start)
    return ToolResult(text, None, loop.time() - start)


def _on_thread(fn: Callable[..., Any], kwargs: dict[str, Any],
               threads: set[threading.Thread]) -> asyncio.Future[Any]:
    """`fn(**kwargs)` on a daemon thread of its own, as a future of this loop; the thread is
    in `threads` while `fn` runs (not while the thread winds down, which a busy machine
    can make last)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            outcome = (True, fn(**kwargs))
        except BaseException as err:  # handed to the caller as the tool's failure
            outcome = (False, err)
        threads.discard(threading.current_thread())
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # its loop closed meanwhile: nobody waits for it
            pass

    thread = threading.Thread(target=run, name=f"tool-{getattr(fn, '__name__', 'fn')}",
                              daemon=True)
    threads.add(thread)
    thread.start()
    return future


class ToolActor(Actor):
    """The tools `specs` name, loaded in this proc, each call under `timeout_s`."""

    def __init__(self, specs: list[str], timeout_s: float) -> None:
        self.tools = load_tools(specs)
        self.timeout_s = timeout_s
        self.calls = 0
        self._running: set[threading.Thread] = set()

    @endpoint
    async def schemas(self) -> list[dict[str, Any]]:
        """Each tool's JSON schema, in the order of the specs."""
        return [tool.schema for tool in self.tools.values()]

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def stuck(self) -> int:
        """Sync tools still running past their time limit (their threads cannot be
        stopped; they end when the tool returns, or with the proc)."""
        return len(self._running)

    @endpoint
    async def call(self, name: str, arguments: dict[str, Any] | str) -> ToolResult:
        """Tool `name` with `arguments` (an object, or its JSON): see module."""
        self.calls += 1
        return await call_tool(self.tools.get(name), name, arguments, self.timeout_s,
                               self._running)
