"""A trainer checkpoint's directory: its layout, how it is checked, and its errors.

    path/.metadata, path/__<rank>_0.distcp   DCP's files (each saving rank its part)
    path/trainer.json                        format, world size, parallel, steps, whether
                                             AdamW state is in it, every parameter's name
                                             and full shape
    path/hf/                                 the model's frame: config.json,
                                             generation_config.json, tokenizer files

Saving and loading are `colocate.engines.checkpoint`'s; `colocate.engines.export` reads
the same directories. Every error is a `CheckpointError` that names the cause and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

# DCP gathers every rank's failure into a CheckpointException, a BaseException
READ_ERRORS = (Exception, CheckpointException)
FORMAT = 1
INFO = "trainer.json"
FRAME = "hf"
METADATA = ".metadata"
# top-level files of a model directory that are weights, not its frame
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5",
                   ".msgpack")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: the message names the cause and what
    to do."""


class CheckpointNotFoundError(CheckpointError):
    """No directory at the path."""


class IncompleteCheckpointError(CheckpointError):
    """A directory that is not a finished trainer checkpoint (no .metadata or trainer.json)."""


class CorruptCheckpointError(CheckpointError):
    """Files of the checkpoint could not be read (truncated, corrupt, unreadable)."""


class ModelMismatchError(CheckpointError):
    """A checkpoint of another model: tensor names or shapes differ."""


class CheckpointWriteError(CheckpointError):
    """A save failed while writing (a full disk...): nothing was left under its path."""


def is_complete(path: str | os.PathLike) -> bool:
    """Whether `path` is a finished trainer checkpoint (`.metadata` and `trainer.json`
    present); a loop uses it to skip half-written or foreign directories."""
    path = Path(path)
    return (path / METADATA).is_file() and (path / INFO).is_file()


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's `trainer.json`, after checking `path` is a finished checkpoint of a
    format this code reads. Raises a `CheckpointError`."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: the directory does not exist"
            + (" (it is a file)" if path.exists() else "")
            + "; give a directory written by save_checkpoint")
    if not is_complete(path):
        missing = [name for name in (METADATA, INFO) if not (path / name).is_file()]
        raise IncompleteCheckpointError(
            f"{path} is not a complete trainer checkpoint: {' and '.join(missing)} missing "
            "(a save that never finished, or another kind of directory); use an earlier "
            "checkpoint (checkpoint_files.is_complete tells them apart)")
    try:
        info = json.loads((path / INFO).read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(f"{path / INFO} is unreadable ({err}); the "
                                     "checkpoint is damaged: use an earlier one") from err
    if info.get("format") != FORMAT:
        raise IncompleteCheckpointError(
            f"{path / INFO} has format {info.get('format')!r}; this code reads format "
            f"{FORMAT}: load it with the version that wrote it")
    return info


def check_same_model(info: dict[str, Any], own: dict[str, tuple[int, ...]],
                     path: str | os.PathLike) -> None:
    """Raise `ModelMismatchError` naming the first few missing, unexpected and mis-shaped
    tensors when the checkpoint's parameters are not `own` (name -> full shape)."""
    saved = {name: tuple(shape) for name, shape in info["params"].items()}
    missing = sorted(own.keys() - saved.keys())
    unexpected = sorted(saved.keys() - own.keys())
    shapes = [f"{name}: {list(saved[name])} in the checkpoint, {list(own[name])} here"
              for name in sorted(own.keys() & saved.keys()) if saved[name] != own[name]]
    if missing or unexpected or shapes:
        parts = [f"{label} {items[:5]}" + (f" (+{len(items) - 5} more)" if len(items) > 5
                                           else "")
                 for label, items in (("missing from the checkpoint:", missing),
                                      ("unexpected:", unexpected), ("mis-shaped:", shapes))
                 if items]
        raise ModelMismatchError(
            f"{path} is a checkpoint of another model ({'; '.join(parts)}); nothing was "
            "loaded: load it into the model it was saved from")


def write_frame(frame_dir: str | os.PathLike | None, config: Any, dest: Path) -> None:
    """The model's frame into `dest`: every top-level non-weight file of `frame_dir`
    (config.json, tokenizer files...), and a generation_config.json made from the config
    when the model has none. Without `frame_dir`, config.json from the model's `config`."""
    from transformers import GenerationConfig

    dest.mkdir(parents=True, exist_ok=True)
    if frame_dir is not None:
        for file in sorted(Path(frame_dir).iterdir()):
            if file.is_file() and not file.name.endswith(WEIGHT_SUFFIXES) \
                    and not file.name.endswith(".index.json"):
                shutil.copy2(file, dest / file.name)
    if not (dest / "config.json").is_file():
        config.save_pretrained(dest)
    if not (dest / "generation_config.json").is_file():
        GenerationConfig.from_model_config(config).save_pretrained(dest)


def swap_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished `tmp` to `path`; an existing `path` is moved aside first and
    removed after, so `path` is at every moment absent, the old or the new checkpoint."""
    old = None
    if path.exists():
        old = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:12]}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def one_line(err: BaseException, limit: int = 400) -> str:
    """`err` in one line: for DCP's CheckpointException (every rank's traceback), each
    failed rank's own exception."""
    if isinstance(err, CheckpointException):
        failures = getattr(err, "failures", {}) or {}
        text = "; ".join(f"rank {rank}: {one_line(failure[0], limit)}"
                         for rank, failure in sorted(failures.items())) or str(err)
    else:
        text = f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
