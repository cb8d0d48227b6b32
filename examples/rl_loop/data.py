"""Prompts from the user's files: read them, render them, and sample them epoch by epoch.

`data.train_files` and `data.eval_files` are local JSONL, JSON or Parquet files, or
directories written by `datasets`' `save_to_disk`; nothing is fetched. Every row needs the
`data.prompt_key` column: text, or chat messages (a list of `{role, content}`) rendered
with the tokenizer's chat template (`add_generation_prompt=True`). The row's other columns
go to the reward functions as keyword arguments. Prompts longer than
`data.max_prompt_length` tokens are dropped and counted, or refused (`data.too_long`).

`DataSampler` walks the training rows in an order shuffled by the run's seed, a new order
each epoch; its position (epoch, index) is its whole state, saved in each checkpoint's
loop.json like the digit task's `state.PromptSampler`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from examples.rl_loop.state import ResumeError

TOO_LONG = ("drop", "error")
FORMATS = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class DataConfig:
    """The user's prompts. Empty `train_files`: the built-in digit task."""

    train_files: list[str] = field(default_factory=list)  # JSONL, JSON, Parquet or datasets dirs
    eval_files: list[str] = field(default_factory=list)  # scored greedy, for eval_reward
    prompt_key: str = "prompt"  # the column with the prompt: text or chat messages
    max_prompt_length: int | None = None  # in tokens, the chat template's included
    too_long: str = "drop"  # longer prompts: "drop" (counted in the log) or "error"

    def __post_init__(self) -> None:
        if self.too_long not in TOO_LONG:
            raise ValueError(f"data.too_long={self.too_long!r}: use one of {TOO_LONG}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length}: must be >= 1")
        if not self.prompt_key:
            raise ValueError("data.prompt_key='': name the column that holds the prompts")
        if self.eval_files and not self.train_files:
            raise ValueError("data.eval_files without data.train_files: give the training "
                             "prompts too (without data.*, the digit task runs)")
        if self.train_files and not self.eval_files:
            raise ValueError("data.train_files needs data.eval_files: the held-out prompts "
                             "the run's eval_reward is measured on (a few dozen rows split "
                             "off your training file will do)")

    @property
    def used(self) -> bool:
        """Whether the run trains on the user's files (else on the digit task)."""
        return bool(self.train_files)


@dataclass(frozen=True)
class Row:
    """One prompt: as the file holds it, as the model reads it, and the row's other
    columns."""

    prompt: str | list[dict[str, Any]]  # text, or chat messages
    text: str  # the prompt as rendered (the chat template applied)
    tokens: list[int]
    columns: dict[str, Any]

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)


def read_rows(files: list[str], setting: str, prompt_key: str) -> list[dict[str, Any]]:
    """Every row of `files`, in order, each a dict of columns; refused in one line naming
    the file (and `setting`, the config field that named it) when a file is missing, of an
    unknown kind, empty, or lacks the prompt column."""
    rows: list[dict[str, Any]] = []
    for name in files:
        path = Path(name).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{setting}: {name}: no such file or directory "
                                    "(local files only: JSONL, JSON, Parquet, or a "
                                    "save_to_disk directory)")
        found = list(_read(path, setting))
        if not found:
            raise ValueError(f"{setting}: {name} has no rows")
        for index, row in enumerate(found):
            if not isinstance(row, dict):
                raise ValueError(f"{setting}: {name}, row {index}: expected an object of "
                                 f"columns, got {type(row).__name__}")
            if row.get(prompt_key) is None:
                raise ValueError(f"{setting}: {name}, row {index} has no prompt in column "
                                 f"{prompt_key!r} (data.prompt_key); its columns: "
                                 f"{sorted(row)}")
        rows += found
    return rows


def _read(path: Path, setting: str) -> list[Any]:
    """The rows of one file or save_to_disk directory, read by `datasets` (local files
    only). What it cannot read is refused naming the file (a JSON Lines file: the line)."""
    if not path.is_dir() and path.suffix not in FORMATS:
        raise ValueError(f"{setting}: {path}: not a data file this loop reads (use "
                         f"{', '.join(FORMATS)}, or a save_to_disk directory)")
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{setting}: {path} holds several splits ({', '.join(splits)}): "
                         f"give one split's directory, e.g. {path / (splits or ['train'])[0]}")
    if path.suffix in (".json", ".jsonl") and not path.read_text().strip():
        return []  # datasets says only "corresponds to no data"
    import datasets

    kind = "parquet" if path.suffix == ".parquet" else "json"
    try:
        if path.is_dir():
            return datasets.load_from_disk(str(path)).to_list()
        return datasets.load_dataset(kind, data_files=str(path), split="train").to_list()
    except Exception as err:
        if path.suffix == ".jsonl":
            _check_lines(path, setting)  # names the first line that is not JSON
        cause = err.__cause__ or err
        first = str(cause).splitlines()[0] if str(cause) else ""
        raise ValueError(f"{setting}: {path}: datasets cannot read it as "
                         f"{'a save_to_disk directory' if path.is_dir() else kind} "
                         f"({type(cause).__name__}: {first})") from err


def _check_lines(path: Path, setting: str) -> None:
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{setting}: {path}, line {number}: not JSON ({err})") from None


def characters(rows: list[dict[str, Any]]) -> str:
    """Every character in the rows' text, sorted: the alphabet of the tiny model built for a
    run without `model.path`."""
    seen: set[str] = set()

    def visit(value: Any) -> None:
        if isinstance(value, str):
            seen.update(value)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)

    visit(rows)
    return "".join(sorted(seen))


def render(rows: list[dict[str, Any]], cfg: DataConfig, tokenizer: Any, setting: str,
           tools: list[dict[str, Any]] | None = None) -> tuple[list[Row], int]:
    """The rows as prompts for the model, and how many were dropped as too long; chat
    prompts show the model `tools` (their JSON schemas) where given."""
    kept: list[Row] = []
    dropped = 0
    for index, row in enumerate(rows):
        prompt = row[cfg.prompt_key]
        text, tokens = _render(prompt, tokenizer, f"{setting}, row {index}", cfg.prompt_key,
                               tools)
        if cfg.max_prompt_length is not None and len(tokens) > cfg.max_prompt_length:
            if cfg.too_long == "error":
                raise ValueError(f"{setting}, row {index}: the prompt is {len(tokens)} tokens, "
                                 f"over data.max_prompt_length={cfg.max_prompt_length} "
                                 "(data.too_long=drop leaves such prompts out): "
                                 f"{text[:200]!r}")
            dropped += 1
            continue
        columns = {k: v for k, v in row.items() if k != cfg.prompt_key}
        kept.append(Row(prompt=prompt, text=text, tokens=tokens, columns=columns))
    if not kept:
        raise ValueError(f"{setting}: all {len(rows)} prompts are longer than "
                         f"data.max_prompt_length={cfg.max_prompt_length} tokens")
    return kept, dropped


def _render(prompt: Any, tokenizer: Any, where: str, key: str,
            tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    """A prompt's text and tokens: text as it is (with the special tokens the tokenizer
    adds), chat messages through the chat template (which places its own)."""
    if isinstance(prompt, str):
        tokens = tokenizer(prompt).input_ids
        text = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{where}: the prompt is chat messages, but the model's tokenizer "
                             "has no chat template to render them with: use a model whose "
                             "tokenizer has one (model.path), or text prompts")
        text = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
        tokens = tokenizer(text, add_special_tokens=False).input_ids
    else:
        raise ValueError(f"{where}: data.prompt_key={key!r} holds {type(prompt).__name__} "
                         f"{str(prompt)[:80]!r}: expected text or chat messages (a list of "
                         "{role, content})")
    if not tokens:
        raise ValueError(f"{where}: the prompt {text!r} has no tokens")
    return text, tokens


class DataSampler:
    """The training rows in a shuffled order, epoch after epoch: epoch e's order is a
    permutation drawn from run.seed and e, so (epoch, index) is the sampler's whole state."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError("DataSampler: no rows to sample")
        self.size, self.seed = size, seed
        self.epoch = self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def sample(self, n: int) -> list[int]:
        """The next `n` row indices, going on into the next epoch's order when this one
        ends (a step's prompts may span two epochs)."""
        picked: list[int] = []
        while len(picked) < n:
            if self.index == self.size:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            take = min(n - len(picked), self.size - self.index)
            picked += self._order[self.index:self.index + take]
            self.index += take
        return picked

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "data", "epoch": self.epoch, "index": self.index, "rows": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "data":
            raise ResumeError("the checkpoint's loop state is the digit task's, not a run on "
                              "data files: resume with its settings, or start anew "
                              "(run.resume=none)")
        if state["rows"] != self.size:
            raise ResumeError(f"the checkpoint's run trained on {state['rows']} rows, the "
                              f"data files now hold {self.size}: the files changed since; "
                              "resume with the same files, or start anew (run.resume=none)")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
