"""The trained model out: a Hugging Face directory (frame files + safetensors weights)
from a `WeightStream`, and from a trainer checkpoint without starting a run.

`write_hf_model` writes what transformers' `save_pretrained` writes: the frame
(config.json, generation_config.json, tokenizer files) and `model.safetensors`, or
`model-0000i-of-0000N.safetensors` + `model.safetensors.index.json` past
`max_shard_bytes`. The safetensors files are laid out up front from the stream's specs
(every name's shape and dtype) and each tensor is written at its offset as its bucket
arrives, so the writer holds one bucket at a time, never the whole model. A tied weight
(lm_head sharing the embeddings under `tie_word_embeddings`) is written once, as
`save_pretrained` does: safetensors refuses tensors that share storage, and
`from_pretrained` ties it again. The directory is written beside `out_dir` and swapped in
once complete.

    python -m colocate.engines.export CHECKPOINT_DIR OUT_DIR [--max-shard-bytes N]

turns a trainer checkpoint (`colocate.engines.checkpoint`) into that directory, as veRL's
model merger does: the model's names and shapes come from the checkpoint's `hf/config.json`
(transformers, on the meta device, local files only), and only the model's part of the
DCP checkpoint is read, a bucket at a time, without a process group, from whatever world
size saved it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from colocate.engines.checkpoint_files import (
    FRAME,
    READ_ERRORS,
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    check_same_model,
    is_complete,
    one_line,
    read_info,
    swap_into_place,
    write_frame,
)
from colocate.engines.weights import WeightStream

MAX_SHARD_BYTES = 5_000_000_000  # transformers' old default, "5GB"
BUCKET_BYTES = 256 << 20  # what the command reads from a checkpoint at once
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def _meta_model(config: Any) -> torch.nn.Module:
    """The config's causal LM on the meta device: names, shapes and ties, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tied_duplicates(config: Any) -> set[str]:
    """Names of the state dict that are the same parameter as an earlier name (lm_head
    under tie_word_embeddings): transformers saves the first one only."""
    seen: set[int] = set()
    duplicates = set()
    for name, tensor in _meta_model(config).state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            duplicates.add(name)
        seen.add(id(tensor))
    return duplicates


def _plan_shards(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], names: list[str],
                 max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards in order, each at most `max_shard_bytes` (or one tensor)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        shape, dtype = specs[name]
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


class _ShardFile:
    """One safetensors file, its header written first, its tensors at their offsets."""

    def __init__(self, path: Path, names: list[str],
                 specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            shape, dtype = specs[name]
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes
        self.start = 8 + len(raw)
        self.offsets = {name: header[name]["data_offsets"][0] for name in names}
        self.nbytes = offset
        self.file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.file.truncate(self.start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.file.seek(self.start + self.offsets[name])
        self.file.write(memoryview(data.numpy()))

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def write_hf_model(weights: WeightStream, frame_dir: str | os.PathLike,
                   out_dir: str | os.PathLike, max_shard_bytes: int = MAX_SHARD_BYTES,
                   progress: bool = False) -> Path:
    """Write the weights and `frame_dir`'s frame files as a Hugging Face model directory
    at `out_dir` (replaced only once the new one is complete); returns its path. One
    bucket of the stream is held at a time. `progress` shows a tqdm bar."""
    from tqdm import tqdm
    from transformers import AutoConfig

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be >= 1")
    out = Path(out_dir).absolute()
    config = AutoConfig.from_pretrained(frame_dir, local_files_only=True)
    dropped = tied_duplicates(config) & weights.specs.keys()
    names = [name for name in weights.specs if name not in dropped]
    shards = _plan_shards(weights.specs, names, max_shard_bytes)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir(parents=True)
    opened: list[_ShardFile] = []
    try:
        write_frame(frame_dir, config, tmp)
        opened = [_ShardFile(tmp / file, shard, weights.specs)
                  for file, shard in zip(files, shards, strict=True)]
        where = {name: shard for shard in opened for name in shard.offsets}
        written: set[str] = set()
        with tqdm(total=len(weights.specs), desc=f"writing {out.name}", unit="tensor",
                  disable=not progress) as bar:
            for name, tensor in weights.tensors():
                if (tuple(tensor.shape), tensor.dtype) != weights.specs[name]:
                    raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} is not "
                                     f"what its stream announced, {weights.specs[name]}")
                if name in where:
                    where[name].write(name, tensor)
                    written.add(name)
                bar.update(1)
        if missing := sorted(where.keys() - written):
            raise ValueError(f"the weight stream never gave {missing[:5]}")
        for shard in opened:
            shard.close()
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(s.nbytes for s in opened)},
                     "weight_map": {name: file for file, shard in zip(files, shards,
                                                                      strict=True)
                                    for name in shard}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        swap_into_place(tmp, out)
    except BaseException:
        for shard in opened:
            shard.file.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def checkpoint_weights(checkpoint_dir: str | os.PathLike,
                       bucket_bytes: int = BUCKET_BYTES) -> WeightStream:
    """The model's weights of a trainer checkpoint as a stream, read a bucket at a time
    with DCP's no-process-group load (any saving world size). Names and shapes come from
    the model built (on the meta device) from the checkpoint's hf/config.json, checked
    against the checkpoint's."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    path = Path(checkpoint_dir).absolute()
    info = read_info(path)
    if not (path / FRAME / "config.json").is_file():
        raise IncompleteCheckpointError(
            f"{path} has no {FRAME}/config.json: it cannot say which model to build; copy "
            f"the model's config.json (and tokenizer files) into {path / FRAME}")
    config = AutoConfig.from_pretrained(path / FRAME, local_files_only=True)
    own = {n: tuple(t.shape) for n, t in _meta_model(config).state_dict().items()}
    check_same_model(info, own, path)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    specs = {name: (shape, saved[f"model.{name}"].properties.dtype)
             for name, shape in own.items()}

    def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
        pending: list[str] = []
        size = 0
        for name, (shape, dtype) in specs.items():
            pending.append(name)
            size += math.prod(shape) * dtype.itemsize
            if size >= bucket_bytes:
                yield _read(path, pending, specs)
                pending, size = [], 0
        if pending:
            yield _read(path, pending, specs)

    return WeightStream(specs, buckets)


def _read(path: Path, names: list[str], specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
          ) -> list[tuple[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    state = {"model": {n: torch.empty(specs[n][0], dtype=specs[n][1]) for n in names}}
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except READ_ERRORS as err:
        raise CorruptCheckpointError(f"cannot read the model from checkpoint {path}: its "
                                     f"data files are truncated, corrupt or unreadable "
                                     f"({one_line(err)}); export an earlier checkpoint") from err
    return list(state["model"].items())


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike,
                      max_shard_bytes: int = MAX_SHARD_BYTES, progress: bool = False) -> Path:
    """A trainer checkpoint as a Hugging Face model directory at `out_dir`. A directory
    holding one as its `trainer/` part (a step of the RL loop's run) is taken for it."""
    checkpoint_dir = Path(checkpoint_dir)
    if not is_complete(checkpoint_dir) and is_complete(checkpoint_dir / "trainer"):
        checkpoint_dir = checkpoint_dir / "trainer"
    frame = checkpoint_dir / FRAME
    return write_hf_model(checkpoint_weights(checkpoint_dir), frame, out_dir,
                          max_shard_bytes, progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m colocate.engines.export",
        description="Turn a trainer checkpoint into a Hugging Face model directory.")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES,
                        help="split the safetensors weights past this size (default 5e9)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint_dir, args.out_dir, args.max_shard_bytes,
                                progress=True)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
