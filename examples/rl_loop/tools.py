"""The user's tools in a service of their own, and the client a rollout calls them through.

`tools.funcs=[module:function, path/to/file.py:function]` names plain or `async def`
functions with type hints and a docstring (TRL's `tools`: their JSON schemas are what the
chat template shows the model). They are loaded here first, so a bad spec is refused before
any proc starts, then in each of `tools.workers` procs of a service without GPUs
(`colocate.engines.tools.ToolActor`): they never take turns with the slots' tenants, and a
slow or dying tool costs a call, never the run.

`ToolClient.call(name, arguments)` always returns a `ToolResult`, never raises: a tool that
raises, runs past `tools.timeout_s` or returns something that is not text (nor
JSON-serialisable) gives an error observation, counted by kind in `stats`. A call whose
worker dies under it is retried once on another worker (or on the same one respawned), and
ends as an error observation ("lost") when that fails too; every call ends within
`ToolClient.bound_s`. A worker calls one tool at a time, so the client sends each worker
one call at a time and keeps the others waiting here, where the bound does not run yet.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from colocate.engines.tools import ToolActor, ToolResult, load_tools
from colocate.resources.manager import ResourceManager
from services import Service, ServiceConfig, ServiceError, spawn_service

logger = logging.getLogger(__name__)
GRACE_S = 5.0  # past the tools' own limit: a message's way to a worker and back


@dataclass(frozen=True)
class ToolsConfig:
    """The tools a rollout's model may call."""

    funcs: list[str] = field(default_factory=list)  # module:function or file.py:function
    timeout_s: float = 10.0  # one call's limit; past it the call is an error observation
    workers: int = 1  # procs calling tools (each one call at a time), without GPUs

    def __post_init__(self) -> None:
        for spec in self.funcs:
            module, _, name = spec.rpartition(":")
            if not module or not name:
                raise ValueError(f"tools.funcs: {spec!r}: write module:function or "
                                 "path/to/file.py:function")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"tools.timeout_s={self.timeout_s}: must be a number > 0")
        if self.workers < 1:
            raise ValueError(f"tools.workers={self.workers}: must be >= 1")

    @property
    def used(self) -> bool:
        return bool(self.funcs)


@dataclass
class ToolStats:
    """What the calls came to: how many, and the errors by kind (ToolResult.error)."""

    calls: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        self.seconds += result.seconds
        if result.error is not None:
            self.errors[result.error] += 1

    def metrics(self) -> dict[str, Any]:
        """A step's row: `tools/calls`, `tools/errors` and one `tools/errors/<kind>` each."""
        row: dict[str, Any] = {"tools/calls": self.calls,
                               "tools/errors": sum(self.errors.values()),
                               "tools/seconds": round(self.seconds, 4)}
        row.update({f"tools/errors/{kind}": n for kind, n in sorted(self.errors.items())})
        return row


class ToolClient:
    """Calls the tools through `service` (ToolActor replicas); see module."""

    def __init__(self, service: Service[ToolActor], cfg: ToolsConfig,
                 schemas: list[dict[str, Any]], grace_s: float = GRACE_S) -> None:
        self.service, self.cfg, self.schemas = service, cfg, schemas
        self.names = [s["function"]["name"] for s in schemas]
        self.stats = ToolStats()
        self._slots = asyncio.Semaphore(cfg.workers)
        # a first try and a retry, each within the workers' bound (past it the service
        # kills a hung worker), and the kill's and the retry's way: the service ends a
        # call before this bound does, unless the call waits for a worker to come back
        self.bound_s = 2 * (cfg.timeout_s + grace_s) + grace_s

    @classmethod
    async def spawn(cls, cfg: ToolsConfig, resource_group: str = "tools",
                    rm: ResourceManager | None = None, grace_s: float = GRACE_S
                    ) -> ToolClient:
        """The tools loaded here (a bad spec is refused before any proc starts), then
        `cfg.workers` workers spawned in `resource_group`, a group of their own without
        GPUs (`colocate.engines.tools.ToolSpecError` names a bad spec). A worker that does
        not answer within `cfg.timeout_s + grace_s` (a tool that blocks its event loop)
        counts as hung: its proc is killed and respawned, and the call tried once more."""
        schemas = tool_schemas(cfg)
        config = ServiceConfig(
            num_replicas=cfg.workers, with_gpus=False, resource_group=resource_group,
            router="least_loaded", max_retries=1, wait_timeout_s=cfg.timeout_s + grace_s,
            call_timeout_s=cfg.timeout_s + grace_s)
        service = await spawn_service(config, ToolActor, list(cfg.funcs), cfg.timeout_s,
                                      name=f"{resource_group}-workers", rm=rm)
        return cls(service, cfg, schemas, grace_s)

    async def call(self, name: str, arguments: dict[str, Any] | str) -> ToolResult:
        """Tool `name` with `arguments` (an object, or its JSON) on a worker: its result,
        or an error observation (see module). Counted in `stats`."""
        async with self._slots:
            result = await self._call(name, arguments)
        self.stats.add(result)
        return result

    async def _call(self, name: str, arguments: dict[str, Any] | str) -> ToolResult:
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            return await asyncio.wait_for(self.service.call.route(name, arguments),
                                          self.bound_s)
        except TimeoutError:
            told = what = f"no worker answered within {self.bound_s} s"
        except ServiceError as err:  # its worker died or hung, and the retry's too
            told = "the worker calling it died or hung, and so did the retry's"
            what = f"{type(err).__name__}: {_first_line(err)}"
        except Exception as err:  # the worker's own failure, not the tool's (see module)
            told = "the worker calling it failed"
            what = f"{type(err).__name__}: {_first_line(err)}"
        logger.warning("tool %s: %s", name, what)
        return ToolResult(f"error: {name} was lost: {told}", "lost", loop.time() - start)

    def take_stats(self) -> ToolStats:
        """The calls' stats since the last take (a step's), and a new count."""
        stats, self.stats = self.stats, ToolStats()
        return stats

    async def shutdown(self, grace_s: float = 5.0) -> None:
        await self.service.shutdown(grace_s)


def tool_names(cfg: ToolsConfig) -> list[str]:
    """The tools' names (none without `tools.funcs`)."""
    return [s["function"]["name"] for s in tool_schemas(cfg)] if cfg.used else []


def tool_schemas(cfg: ToolsConfig) -> list[dict[str, Any]]:
    """The JSON schemas of `tools.funcs`, loaded here (a bad spec is refused in one line
    before any proc starts)."""
    return [tool.schema for tool in load_tools(cfg.funcs).values()]


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else ""
