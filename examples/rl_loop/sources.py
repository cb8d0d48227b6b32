"""Where a run's prompts come from and how their completions are scored: the built-in digit
task (`task`), or the user's files (`data`) scored by the user's reward functions
(`rewards`). The loop sees one interface, `Source`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from colocate.engines.sampling import Completion
from examples.rl_loop import task
from examples.rl_loop.data import DataSampler, Row, characters, read_rows, render
from examples.rl_loop.rewards import RESERVED, RewardFunctions
from examples.rl_loop.state import PromptSampler
from examples.rl_loop.tool_calls import plain_alphabet
from examples.rl_loop.tools import tool_names, tool_schemas

logger = logging.getLogger(__name__)


@dataclass
class Scored:
    """A batch's rewards: one per sample, None where there is none (every function skipped
    the sample, or it was dropped), and what goes into the step's metrics row."""

    values: list[float | None]
    dropped: list[int] = field(default_factory=list)  # left out of the loss too
    metrics: dict[str, Any] = field(default_factory=dict)


class Source(Protocol):
    """Where prompts come from and how completions are scored: `sample(n)` and
    `eval_rows()` give `data.Row`s, `score(...)` gives `Scored`; `sampler` is the position a
    checkpoint keeps, `alphabet` the characters a tiny model is built over."""

    sampler: Any  # state_dict() / load_state_dict()
    alphabet: str
    max_new_tokens: int
    summary: dict[str, Any]  # the task's own figures, for the run's summary

    def prepare(self, tokenizer: Any) -> None: ...

    def longest_prompt(self) -> int: ...

    def sample(self, n: int) -> list[Row]: ...

    def eval_rows(self) -> list[Row]: ...

    async def score(self, where: str, rows: list[Row], texts: list[str],
                    completions: list[Completion],
                    conversations: list[list[dict[str, Any]] | None] | None = None
                    ) -> Scored: ...

    def close(self) -> None: ...


class DigitTask:
    """The built-in task (`examples.rl_loop.task`), exactly as before data files existed: the
    same prompts from the same generator state, the same rewards."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg.task
        self.sampler = PromptSampler(cfg.run.seed)
        self.alphabet = task.ALPHABET
        self.max_new_tokens = cfg.grpo.max_completion_length or cfg.task.max_new_tokens
        self.summary: dict[str, Any] = {}

    def prepare(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _row(self, prompt: str) -> Row:
        return Row(prompt=prompt, text=prompt, tokens=self.tokenizer(prompt).input_ids,
                   columns={})

    def longest_prompt(self) -> int:
        return len(self._row("0" * self.cfg.max_digits + task.SEPARATOR).tokens)

    def sample(self, n: int) -> list[Row]:
        return [self._row(p) for p in task.sample_prompts(self.cfg, n, self.sampler.rng)]

    def eval_rows(self) -> list[Row]:
        return [self._row(p) for p in task.eval_prompts(self.cfg)]

    async def score(self, where: str, rows: list[Row], texts: list[str],
                    completions: list[Completion],
                    conversations: list[list[dict[str, Any]] | None] | None = None
                    ) -> Scored:
        return Scored([task.reward(row.prompt, text)
                       for row, text in zip(rows, texts, strict=True)])

    def close(self) -> None:
        pass


class UserTask:
    """The user's prompt files and reward functions. Built from the config alone: the files
    are read and the functions loaded here, so a missing file, column or function is
    refused before any proc starts; `prepare` then renders the prompts with the model's
    tokenizer."""

    def __init__(self, cfg: Any) -> None:
        self.cfg, self.seed = cfg.data, cfg.run.seed
        key = self.cfg.prompt_key
        self.raw = {"train": read_rows(self.cfg.train_files, "data.train_files", key),
                    "eval": read_rows(self.cfg.eval_files, "data.eval_files", key)}
        clash = sorted({c for rows in self.raw.values() for row in rows for c in row}
                       & set(RESERVED))
        if clash:
            raise ValueError(f"data: the column(s) {clash} would clash with the arguments "
                             f"every reward function gets {RESERVED}: rename them")
        self.rewards = RewardFunctions(cfg.reward)
        # a tiny model's vocabulary: the data's characters, and those of plain tool calls
        self.alphabet = characters(self.raw["train"] + self.raw["eval"])
        self.tools = tool_schemas(cfg.tools) if cfg.tools.used else None
        if cfg.tools.used:
            self.alphabet = "".join(sorted(set(self.alphabet)
                                           | set(plain_alphabet(tool_names(cfg.tools)))))
        self.max_new_tokens = cfg.grpo.max_completion_length
        self.summary: dict[str, Any] = {}

    def prepare(self, tokenizer: Any) -> None:
        """Render both splits; count (and log) the prompts dropped as too long."""
        self.train, dropped = render(self.raw["train"], self.cfg, tokenizer,
                                     "data.train_files", self.tools)
        self.eval, eval_dropped = render(self.raw["eval"], self.cfg, tokenizer,
                                         "data.eval_files", self.tools)
        self.columns = list(dict.fromkeys(c for row in self.train + self.eval
                                          for c in row.columns))
        self.sampler = DataSampler(len(self.train), self.seed)
        self.summary = {"train_prompts": len(self.train), "eval_prompts": len(self.eval),
                        "prompts_too_long": {"train": dropped, "eval": eval_dropped}}
        if dropped or eval_dropped:
            logger.warning("dropped %d training and %d eval prompt(s) longer than "
                           "data.max_prompt_length=%d tokens", dropped, eval_dropped,
                           self.cfg.max_prompt_length)

    def longest_prompt(self) -> int:
        return max(len(row.tokens) for row in self.train + self.eval)

    def sample(self, n: int) -> list[Row]:
        return [self.train[i] for i in self.sampler.sample(n)]

    def eval_rows(self) -> list[Row]:
        return list(self.eval)

    async def score(self, where: str, rows: list[Row], texts: list[str],
                    completions: list[Completion],
                    conversations: list[list[dict[str, Any]] | None] | None = None
                    ) -> Scored:
        """The weighted sum of the reward functions, TRL's arguments: chat prompts get
        their completions as messages too (a multi-turn episode's: all its messages after
        the prompt, `conversations`)."""
        said = conversations or [None] * len(rows)
        shown = [(messages or [{"role": "assistant", "content": text}]) if row.chat else text
                 for row, text, messages in zip(rows, texts, said, strict=True)]
        scores = await self.rewards.score(
            where, [row.prompt for row in rows], shown, [c.tokens for c in completions],
            {c: [row.columns.get(c) for row in rows] for c in self.columns})
        if scores.skipped:
            logger.warning("%s: %d sample(s) scored None by every reward function: "
                           "advantage 0", where, len(scores.skipped))
        return Scored(scores.values, scores.dropped, scores.metrics())

    def close(self) -> None:
        self.rewards.close()


def check_fits(source: Source, model_dir: Path, served: int = 0) -> None:
    """The longest prompt and a whole completion must fit the model's positions, and the
    generator's when it serves fewer (`served`: `generator.max_model_len`): said here, not
    by the generator at the first step."""
    limit = max_positions(model_dir, served)
    need = source.longest_prompt() + source.max_new_tokens
    if need > limit:
        raise ValueError(
            f"the longest prompt ({source.longest_prompt()} tokens) and "
            f"grpo.max_completion_length={source.max_new_tokens} need {need} positions; "
            + (f"the generator serves {limit} (generator.max_model_len): raise it"
               if limit == served else f"the model has {limit}: raise model.max_positions "
               "(the tiny model)")
            + ", or lower data.max_prompt_length or grpo.max_completion_length")


def max_positions(model_dir: Path, served: int = 0) -> int:
    """The longest sequence a run takes, prompt and completion: the model's (its config's),
    or the generator's where it serves fewer (`served`; 0: no bound of its own)."""
    config = json.loads((model_dir / "config.json").read_text())
    return within_served(int(config.get("max_position_embeddings") or 1 << 30), served)


def within_served(positions: int, served: int) -> int:
    """The model's `positions`, or fewer where the generator serves fewer (`served`; 0:
    no bound of its own)."""
    return min(positions, served) if served else positions


def make_source(cfg: Any) -> Source:
    """The run's prompt source: the user's files with `data.train_files`, else the digits."""
    return UserTask(cfg) if cfg.data.used else DigitTask(cfg)
