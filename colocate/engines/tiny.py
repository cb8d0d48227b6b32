"""Tiny random Hugging Face model directories, made offline: for tests, benchmarks and the
RL loop's default policy.

`write_tiny_model(dir, "qwen2", alphabet="0123456789>")` writes what a real model directory
holds (config.json, model.safetensors, tokenizer files) for a small, randomly initialised
Llama, Qwen2 or Qwen3 built with transformers' own config classes, and a character
tokenizer built with `tokenizers`: ids are the special tokens (pad, bos, eos), then one id
per character; encoding adds the bos token. vLLM and transformers load the directory as
they load any other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

SPECIALS = ("<pad>", "<bos>", "<eos>")
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def save_char_tokenizer(alphabet: str, path: str | os.PathLike) -> None:
    """A character tokenizer over `alphabet`, in Hugging Face format, into `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet {alphabet!r} must be non-empty, without repeats")
    vocab = {token: i for i, token in enumerate([*SPECIALS, *alphabet])}
    inner = Tokenizer(models.WordLevel(vocab, unk_token=SPECIALS[0]))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    inner.post_processor = processors.TemplateProcessing(
        single=f"{SPECIALS[1]} $A", special_tokens=[(SPECIALS[1], vocab[SPECIALS[1]])])
    inner.decoder = decoders.Fuse()
    pad, bos, eos = SPECIALS  # unknown characters read as pad (Qwen2's default is its own)
    fast = PreTrainedTokenizerFast(tokenizer_object=inner, pad_token=pad, unk_token=pad,
                                   bos_token=bos, eos_token=eos)
    fast.save_pretrained(str(path))


def write_tiny_model(path: str | os.PathLike, architecture: str = "llama",
                     alphabet: str = "0123456789>", hidden_size: int = 64, layers: int = 2,
                     heads: int = 2, kv_heads: int = 1, intermediate_size: int = 128,
                     max_positions: int = 32, tie_embeddings: bool = False,
                     init_std: float = 0.02, seed: int = 0) -> Path:
    """Write a random `architecture` causal LM and its character tokenizer into `path`;
    returns the directory. Weights are drawn with transformers' own initialisation (normal,
    std `init_std`); the same seed writes the same weights."""
    import transformers

    config = tiny_config(architecture, alphabet, hidden_size, layers, heads, kv_heads,
                         intermediate_size, max_positions, tie_embeddings, init_std)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path)
    save_char_tokenizer(alphabet, path)
    return path


def tiny_config(architecture: str = "llama", alphabet: str = "0123456789>",
                hidden_size: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                intermediate_size: int = 128, max_positions: int = 32,
                tie_embeddings: bool = False, init_std: float = 0.02) -> Any:
    """The transformers config `write_tiny_model` writes, without writing anything (a plan
    sizes the model from it)."""
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture={architecture!r}: use one of {ARCHITECTURES}")
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[architecture]
    return config_class(
        vocab_size=len(SPECIALS) + len(alphabet), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tie_embeddings, initializer_range=init_std, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
        dtype="float32")
