"""The user's reward functions, called the TRL way, and checked.

`reward.funcs=[module:function, path/to/file.py:function, ...]`: each is called once per
batch as `fn(prompts=..., completions=..., completion_ids=..., **columns)`, with every other
column of the data as a keyword argument (one value per completion), and returns one
`float | None` per completion (None: the function does not apply to that sample). Plain and
`async def` functions are gathered together; with `reward.workers=N` they run in a pool of N
processes instead, each batch split across them, so a slow verifier runs in parallel.

A function that raises, returns the wrong number of values, a non-number or a NaN stops the
run with a `RewardError` naming the function, where (the step), and the sample's index and
prompt; with `reward.on_error=skip` that sample is dropped instead, and counted. To name the
sample when a call on the whole batch fails, the function is called again one sample at a
time.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import multiprocessing
import numbers
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from colocate import loading

ON_ERROR = ("stop", "skip")
RESERVED = ("prompts", "completions", "completion_ids")  # the arguments every call gets


@dataclass(frozen=True)
class RewardConfig:
    """The reward functions of a run on the user's data (`data.train_files`)."""

    funcs: list[str] = field(default_factory=list)  # module:function or file.py:function
    weights: list[float] = field(default_factory=list)  # one per function; empty: all 1.0
    workers: int = 0  # 0: called in the loop's process; N: in a pool of N processes
    on_error: str = "stop"  # a failing sample: "stop" the run, or "skip" it (dropped)

    def __post_init__(self) -> None:
        for spec in self.funcs:
            module, _, name = spec.rpartition(":")
            if not module or not name:
                raise ValueError(f"reward.funcs: {spec!r}: write module:function or "
                                 "path/to/file.py:function")
        if self.weights and len(self.weights) != len(self.funcs):
            raise ValueError(f"reward.weights: {len(self.weights)} weight(s) for "
                             f"{len(self.funcs)} function(s) in reward.funcs: give one each "
                             "(or none: 1.0 each)")
        if any(not math.isfinite(w) for w in self.weights):
            raise ValueError(f"reward.weights={list(self.weights)}: must be finite numbers")
        if self.workers < 0:
            raise ValueError(f"reward.workers={self.workers}: must be >= 0")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"reward.on_error={self.on_error!r}: use one of {ON_ERROR}")


class RewardError(RuntimeError):
    """A reward function failed: the message names it, where, and the sample."""


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names (`colocate.loading.load_function`), refused with a
    `RewardError` naming reward.funcs."""
    return loading.load_function(spec, "reward.funcs", RewardError)


@dataclass
class Scores:
    """What the reward functions said about a batch."""

    values: list[float | None]  # the weighted sum per sample; None: no reward
    dropped: list[int]  # samples whose scoring failed (reward.on_error=skip)
    skipped: list[int]  # samples every function returned None for
    per_function: dict[str, list[float | None]]  # each function's own values

    def metrics(self) -> dict[str, Any]:
        """Each function's mean and std over the samples it scored, as TRL logs them
        (`rewards/<name>/mean`), and the samples dropped or skipped."""
        row: dict[str, Any] = {}
        for name, values in self.per_function.items():
            scored = [v for v in values if v is not None]
            mean = sum(scored) / len(scored) if scored else None
            std = None
            if len(scored) == 1:
                std = 0.0
            elif scored:  # unbiased, as TRL's nanstd
                std = math.sqrt(sum((v - mean) ** 2 for v in scored) / (len(scored) - 1))
            row[f"rewards/{name}/mean"], row[f"rewards/{name}/std"] = mean, std
        row["samples_dropped"] = len(self.dropped)
        row["samples_unscored"] = len(self.skipped)
        return row


class RewardFunctions:
    """The run's reward functions, loaded (and so checked) when built."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self.funcs = [load_function(spec) for spec in cfg.funcs]
        self.weights = list(cfg.weights) or [1.0] * len(self.funcs)
        short = [spec.rpartition(":")[2] for spec in cfg.funcs]
        # TRL's names: the function's own; the whole spec where two would share one
        self.names = [s if short.count(s) == 1 else spec for s, spec in zip(short, cfg.funcs,
                                                                            strict=True)]
        self.pool: ProcessPoolExecutor | None = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None

    async def score(self, where: str, prompts: list[Any], completions: list[Any],
                    completion_ids: list[list[int]], columns: dict[str, list[Any]]) -> Scores:
        """Every function on the batch (`where`: "step 3", for the errors), gathered."""
        kwargs = {"prompts": prompts, "completions": completions,
                  "completion_ids": completion_ids, **columns}
        n = len(completions)
        results = await asyncio.gather(*(self._function(f, kwargs, n, where)
                                         for f in range(len(self.funcs))))
        failures = sorted(fail for _, fails in results for fail in fails)
        if failures and self.cfg.on_error == "stop":
            index, f, what = failures[0]
            raise RewardError(f"reward function {self.cfg.funcs[f]} at {where}, sample "
                              f"{index} (prompt {_show(prompts[index])}): {what}")
        dropped = sorted({index for index, _, _ in failures})
        values: list[float | None] = []
        skipped = []
        for i in range(n):
            parts = [(w, vals[i]) for w, (vals, _) in zip(self.weights, results, strict=True)
                     if vals[i] is not None]
            if i in dropped or not parts:
                skipped += [] if i in dropped else [i]
                values.append(None)
            else:
                values.append(sum(w * v for w, v in parts))
        per_function = {name: [None if i in dropped else v for i, v in enumerate(vals)]
                        for name, (vals, _) in zip(self.names, results, strict=True)}
        return Scores(values=values, dropped=dropped, skipped=skipped,
                      per_function=per_function)

    async def _function(self, f: int, kwargs: dict[str, Any], n: int, where: str
                        ) -> tuple[list[float | None], list[tuple[int, int, str]]]:
        """Function `f` over the batch, split across the pool's workers (one part without a
        pool): its values, and the samples that failed (index, f, what went wrong)."""
        parts = max(1, min(self.cfg.workers, n))
        size = -(-n // parts)
        chunks = [list(range(start, min(start + size, n))) for start in range(0, n, size)]
        done = await asyncio.gather(*(self._checked(f, kwargs, rows) for rows in chunks))
        values: list[float | None] = [None] * n
        failures: list[tuple[int, int, str]] = []
        for got, failed in done:
            for index, value in got.items():
                values[index] = value
            failures += [(index, f, what) for index, what in failed]
        return values, failures

    async def _checked(self, f: int, kwargs: dict[str, Any], rows: list[int]
                       ) -> tuple[dict[int, float | None], list[tuple[int, str]]]:
        """Function `f` on the samples `rows`; a call that raises or returns the wrong
        number of values is made again one sample at a time, to find the samples at fault."""
        part = {key: [value[i] for i in rows] for key, value in kwargs.items()}
        try:
            result = await self._call(f, part)
            what = _count_problem(result, len(rows))
        except Exception as err:  # the user's code: whatever it raises is its failure
            result, what = None, f"raised {type(err).__name__}: {err}"
        if what is not None:
            if len(rows) == 1:
                return {}, [(rows[0], what)]
            singles = await asyncio.gather(*(self._checked(f, kwargs, [i]) for i in rows))
            got = {i: v for values, _ in singles for i, v in values.items()}
            failed = [fail for _, fails in singles for fail in fails]
            if not failed:  # each sample alone is fine: the batch's call is at fault
                failed = [(rows[0], f"{what} on the batch of {len(rows)} samples from "
                                    f"sample {rows[0]} on (each alone scored)")]
            return got, failed
        got, failed = {}, []
        for i, value in zip(rows, result, strict=True):
            problem = _value_problem(value)
            if problem is None:
                got[i] = None if value is None else float(value)
            else:
                failed.append((i, problem))
        return got, failed

    async def _call(self, f: int, kwargs: dict[str, Any]) -> Any:
        if self.cfg.workers:
            if self.pool is None:
                # spawn: the loop's process runs threads (Monarch's), which fork would copy
                self.pool = ProcessPoolExecutor(
                    self.cfg.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_load, initargs=(list(self.cfg.funcs),))
            return await asyncio.wrap_future(self.pool.submit(_worker_call, f, kwargs))
        result = self.funcs[f](**kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result


def _count_problem(result: Any, n: int) -> str | None:
    if isinstance(result, str | bytes | dict) or not hasattr(result, "__len__"):
        return f"returned {type(result).__name__}, not a list of {n} values"
    if len(result) != n:
        return f"returned {len(result)} values for {n} completion(s)"
    return None


def _value_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Real):
        return f"returned {value!r} ({type(value).__name__}), not a number or None"
    if not math.isfinite(float(value)):
        return f"returned {value!r}, not a finite number"
    return None


def _show(prompt: Any) -> str:
    text = repr(prompt)
    return text if len(text) <= 200 else text[:200] + "..."


_WORKER_FUNCS: list[Callable[..., Any]] = []


def _worker_load(specs: list[str]) -> None:
    """A pool worker's start: load the functions by their specs (a file's module is not
    importable by name, so functions are never pickled)."""
    _WORKER_FUNCS[:] = [load_function(spec) for spec in specs]


def _worker_call(f: int, kwargs: dict[str, Any]) -> Any:
    result = _WORKER_FUNCS[f](**kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(_awaited(result))
    return list(result) if not isinstance(result, str | bytes | dict) and hasattr(
        result, "__len__") else result


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
