"""Models and tokenizers from a local Hugging Face directory, through transformers.

Every engine takes the same directory (config.json, safetensors weights, tokenizer files):
the trainer and the built-in generator load it with `load_model`, vLLM loads it itself.
Nothing is fetched: transformers reads local files only. `check_model_dir` refuses a
directory that no engine could use, before anything is built, with an error naming the
file or field at fault (`ModelDirError`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class ModelDirError(ValueError):
    """A model directory that cannot be used as a causal LM: the message says which file or
    field, and what to do."""


def check_model_dir(path: str | os.PathLike) -> tuple[Any, Any]:
    """The directory's (transformers config, tokenizer), both checked: a config of a
    causal-LM architecture transformers knows, a tokenizer with an end-of-sequence token
    whose vocabulary fits in the model's embeddings. Raises `ModelDirError`."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(path)
    if not (path / "config.json").is_file():
        where = "does not exist" if not path.exists() else "has no config.json"
        raise ModelDirError(f"model directory {path} {where}: give a local Hugging Face "
                            "model directory (config.json, *.safetensors, tokenizer files)")
    model_type = json.loads((path / "config.json").read_text()).get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelDirError(f"{path}/config.json: model_type {model_type!r} is not a causal "
                            "LM architecture this transformers knows (e.g. llama, qwen2, "
                            "qwen3, mistral); upgrade transformers or convert the model")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
                            "save the tokenizer into the model directory")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ModelDirError(f"{path}: the tokenizer has no end-of-sequence token "
                            "(eos_token in tokenizer_config.json); generation could not stop")
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ModelDirError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's "
                            f"embeddings only {vocab} (config.json vocab_size): a token id "
                            "past the table would index out of range; resize the embeddings")
    return config, tokenizer


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The causal LM of a checked directory, on `device`, in `dtype` (default: float32)."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(Path(path), local_files_only=True,
                                                 dtype=dtype or torch.float32)
    return model.to(device)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The directory's tokenizer, checked with its model's config (see `check_model_dir`)."""
    return check_model_dir(path)[1]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules transformers never splits
    (`_no_split_modules`), in order. What FSDP shards one at a time."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); FSDP needs one to shard by")
    return layers
