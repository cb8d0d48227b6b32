"""A small Llama-style causal LM in plain torch, with Hugging Face's parameter names.

The same module serves the trainer (full forward over padded batches) and the built-in
generator (incremental forward over a preallocated KV cache). Its parameters carry the
names of transformers' `LlamaForCausalLM` (`model.layers.0.self_attn.q_proj.weight`...), so
`save_pretrained` writes a directory that vLLM and transformers load as a Llama, and weight
sync passes tensors by those names to every engine.

Padding is on the left for prompts: `valid` marks real tokens, positions count real tokens
only, and padded keys are never attended, so a padded row computes what the unpadded one
would.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    """The model's shape. Validated here, once."""

    vocab_size: int = 32
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 256
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: dim ({self.dim}) must divide by n_heads "
                             f"({self.n_heads}), and n_heads by n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim {self.head_dim} must be even (RoPE)")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Rotary position embedding in Hugging Face's (GPT-NeoX) layout."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [B, heads, T, head_dim]; positions: [B, T]."""
        freqs = positions[:, None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (x * emb.cos() + _rotate_half(x) * emb.sin()).to(x.dtype)


@dataclass
class KVCache:
    """Keys and values of every layer for up to `batch` rows of `max_seq_len` tokens:
    [n_layers, batch, n_kv_heads, max_seq_len, head_dim] each. Allocate it inside the
    generator's cache stage so it sleeps apart from the weights."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, config: LlamaConfig, batch: int, device: str | torch.device,
                 dtype: torch.dtype = torch.float32) -> KVCache:
        shape = (config.n_layers, batch, config.n_kv_heads, config.max_seq_len, config.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype))


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.q_proj = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, rope: Rope,
                cache: tuple[torch.Tensor, torch.Tensor] | None, start: int) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, positions), rope(k, positions)
        if cache is not None:  # write this step's keys/values, attend over all so far
            cache_k, cache_v = cache
            cache_k[:b, :, start:start + t] = k
            cache_v[:b, :, start:start + t] = v
            k, v = cache_k[:b, :, :start + t], cache_v[:b, :, :start + t]
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.down_proj = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, positions, mask, rope, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, rope, cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.rotary_emb = Rope(config.head_dim, config.rope_theta)


class Llama(nn.Module):
    """A causal LM: `model(tokens, valid)` -> logits [B, T, vocab]."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor | None = None,
                cache: KVCache | None = None, start: int = 0,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for `tokens` [B, T].

        `valid` [B, start + T] marks real tokens among everything attended (all True by
        default). With `cache`, this call's keys/values go to cache positions
        [start, start + T) and attention covers [0, start + T). `positions` default to the
        count of real tokens before each one.
        """
        b, t = tokens.shape
        total = start + t
        if valid is None:
            valid = torch.ones(b, total, dtype=torch.bool, device=tokens.device)
        if positions is None:
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
        query = torch.arange(start, total, device=tokens.device)[:, None]
        key = torch.arange(total, device=tokens.device)[None, :]
        # causal, real keys only; a padded query attends itself so its row stays finite
        mask = (key <= query) & (valid[:, None, :] | (key == query))
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i])
            x = layer(x, positions, mask, self.model.rotary_emb, layer_cache, start)
        return self.lm_head(self.model.norm(x))


def hf_config(config: LlamaConfig, bos: int, eos: int, pad: int) -> dict:
    """The `config.json` that transformers and vLLM read as this model."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "colocate": asdict(config),  # read back by `load_pretrained`
    }


def save_pretrained(model: Llama, path: str | os.PathLike, tokenizer) -> Path:
    """Write `model` and `tokenizer` (a `CharTokenizer`) as a Hugging Face Llama directory:
    config.json, model.safetensors, tokenizer files. Returns the directory."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(model.config, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    state = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(path)
    return path


def load_pretrained(path: str | os.PathLike, device: str | torch.device = "cpu") -> Llama:
    """A `Llama` with the weights of a directory written by `save_pretrained`."""
    from safetensors.torch import load_file

    path = Path(path)
    saved = json.loads((path / "config.json").read_text())
    if "colocate" not in saved:
        raise ValueError(f"{path}/config.json was not written by save_pretrained: "
                         "its 'colocate' entry (the LlamaConfig) is missing")
    model = Llama(LlamaConfig(**saved["colocate"]))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.to(device)
