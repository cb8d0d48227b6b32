"""The trainer and the built-in generator taking turns on each GPU under torch_memory_saver,
with the staged weight handoff through the arbiter's logic, in a plain process per GPU, all
GPUs at once (Monarch is not on the GPU test machine). Memory is this process's share by
NVML (`read_gpu_process`)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from colocate import memory, telemetry
from colocate.arbiter import SlotArbiter
from colocate.arbiter.local import LocalTenantHandle
from colocate.engines.generator import TorchGenerator
from colocate.engines.sampling import SamplingParams
from colocate.engines.trainer import PolicyTrainer
from colocate.engines.weight_copy import copy_plan, copy_weights
from colocate.engines.weights import digest

PROMPTS = [[1, 5, 9, 12], [1, 7], [1, 30, 31, 32, 33, 34]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def _used() -> int:
    torch.cuda.synchronize()
    return telemetry.read_gpu_process(0).used_bytes


def _model(seed: int) -> torch.nn.Module:
    """A random Llama of about 100 M parameters (0.4 GB of weights, 1.2 GB with AdamW's
    moments, so NVML sees them), built with transformers' own config and initialisation."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _loss(module, batch):
    return module(input_ids=batch).logits[..., 5].mean(), {}


def _greedy_reference(net: torch.nn.Module, prompt: list[int]) -> list[int]:
    """Greedy decoding by full forward passes, no cache: what the generator must match."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(GREEDY.max_new_tokens):
            logits = net(input_ids=torch.tensor([tokens], device="cuda")).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt):]


def segment_bytes(prefix: str) -> int:
    """The bytes of the caching-allocator segments in torch_memory_saver's memory pools of
    the tags under `prefix`: what a pause unmaps (whole segments, not only the storages in
    them); the tags' live bytes where torch does not report its pools (preload mode)."""
    from torch_memory_saver import torch_memory_saver

    from colocate.memory.cuda import _pool_bytes

    total = 0
    for tag in memory.tags():
        if tag.startswith(prefix + "/"):
            pooled = _pool_bytes(torch_memory_saver, tag)
            total += memory.tagged_bytes(tag) if pooled is None else pooled
    return total


def turns_with_handoff(rounds: int, keep_weights: bool) -> dict:
    async def run():
        trainer = PolicyTrainer(_model(0), prefix="trainer", device="cuda")
        gen = TorchGenerator(_model(1), max_batch=8, prefix="generator", device="cuda",
                             keep_weights=keep_weights)
        arbiter = SlotArbiter([0])
        await arbiter.register(0, LocalTenantHandle("trainer", trainer.tenancy))
        # the generator is put to sleep
        await arbiter.register(0, LocalTenantHandle("generator", gen.tenancy, gen.receive))
        batch = torch.tensor([PROMPTS[0]], device="cuda")
        out = {"rounds": []}
        for _ in range(rounds):
            await arbiter.wake("trainer")
            trainer.step(_loss, batch)
            reference = [_greedy_reference(trainer.model.eval(), p) for p in PROMPTS]
            trainer.model.train()
            trained = digest(trainer.weights().tensors())
            # what the step and the reference freed (AdamW's temporaries, activations) is
            # not the trainer's to release: the handoff's release_cached() returns it too
            memory.release_cached()
            trainer_awake = _used()
            tagged = trainer.tenancy.describe().tagged_bytes
            segments = segment_bytes("trainer") - segment_bytes("generator")
            cached = torch.cuda.memory_reserved()
            await arbiter.handoff("trainer", "generator")
            generator_awake = _used()
            tokens = [c.tokens for c in gen.generate(PROMPTS, GREEDY)]
            out["rounds"].append({
                "status": arbiter.status()[0],
                "synced": digest(gen.weights().tensors()) == trained,
                "greedy_equal": tokens == reference,
                "released": trainer_awake - generator_awake,
                "expected": tagged - gen.tenancy.describe().tagged_bytes,
                "segments": segments,
                "cached_before": cached, "cached_after": torch.cuda.memory_reserved()})
        out["trainer_tagged"] = trainer.tenancy.describe().tagged_bytes
        out["trainer_segments"] = segment_bytes("trainer")
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("keep_weights", [True, False])
def test_trainer_and_generator_take_turns_with_weight_sync(on_each_gpu, keep_weights):
    for out in on_each_gpu(turns_with_handoff, 3, keep_weights):
        assert len(out["rounds"]) == 3
        for row in out["rounds"]:
            assert row["status"] == {"trainer": [], "generator": ["weights"]}
            assert row["synced"] and row["greedy_equal"], row
            # the trainer's stages left the GPU; the generator's came back (by NVML). A pause
            # unmaps whole allocator segments, so the bytes are the segments' (the first GPU
            # run released 86 MB, 6%, more than the storages held: `expected`)
            assert abs(row["released"] - row["segments"]) < 0.02 * out["trainer_segments"], row


def planned_sync_on_gpu() -> dict:
    """The in-place sync's planned copy on the GPU: fp32 into fp32 and into bf16 (the
    small tensors through `_foreach_copy_`, with a conversion for bf16), the plan kept
    across syncs; and its time against a device memcpy of the same tensors (the target
    is 0.7x: bench/engines.py measures it at 1.7 GB)."""
    import time

    source = _model(3).cuda()
    same, low = _model(4).cuda(), _model(5).cuda().to(torch.bfloat16)
    named = list(source.state_dict().items())
    out = {"copied": copy_weights(same, named), "plan_kept": None}
    plan = copy_plan(same)
    copy_weights(same, named)
    out["plan_kept"] = copy_plan(same) is plan
    copy_weights(low, named)
    out["same"] = digest(same.state_dict().items()) == digest(named)
    out["bf16"] = all(torch.equal(t, source.state_dict()[n].bfloat16())
                      for n, t in low.state_dict().items())
    plain = [torch.empty_like(t) for _, t in named]

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def raw() -> None:
        for dst, (_, src) in zip(plain, named, strict=True):
            dst.copy_(src)

    out["sync_vs_memcpy"] = timed(raw) / timed(lambda: copy_weights(same, named))
    out["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    return out


def test_the_planned_in_place_sync_copies_every_tensor_on_the_gpu(on_each_gpu):
    for out in on_each_gpu(planned_sync_on_gpu):
        assert out["copied"] == out["bytes"] and out["plan_kept"], out
        assert out["same"] and out["bf16"], out
        assert out["sync_vs_memcpy"] >= 0.5, out  # a guard; the target is 0.7x
