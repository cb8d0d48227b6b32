"""The reference model, a third tenant: beside a trainer and a generator on the same procs
(DDP or FSDP, the torch or the vLLM generator), each woken in turn with its contents kept;
its log-probabilities equal the starting model's, gathered in row order from every rank;
and in the RL loop (`grpo.beta > 0`) it keeps the policy closer to where it started, with
each proc's peak within max(trainer, generator) + the reference's weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from colocate import phase
from colocate.engines.actors import GeneratorActor, ReferenceActor, TrainerActor
from colocate.engines.models import load_model
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.testing import start_runtime
from examples.rl_loop.batch import ReferenceLogprobs
from examples.rl_loop.config import load_config
from examples.rl_loop.grpo import pack_batch, token_logprobs
from examples.rl_loop.loop import Loop
from examples.rl_loop.memory import resident_per_proc
from services import ServiceConfig, spawn_service, sync_weights

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.usefixtures("vllm_preloaded", "procs_import_tests")]

ROOT = Path(__file__).resolve().parents[1]
# char ids of the tiny models: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(2,))
TEMPERATURE = 0.7


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch).logits[..., 5].mean(), {}


def scoring_batch() -> dict[str, torch.Tensor]:
    """Five rows (not a multiple of two ranks: the gather's padding is exercised)."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[0]]
    completions = [[4, 5, 2], [6], [7, 8, 9, 10, 2], [11, 2], [3, 3, 3, 3]]
    input_ids, targets, mask = pack_batch(prompts, completions, pad_id=0)
    valid = torch.zeros_like(mask, dtype=torch.bool)
    for row, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        valid[row, : len(p) + len(c) - 1] = True
    return {"input_ids": input_ids, "targets": targets, "mask": mask, "valid": valid}


def expected_logprobs(model_dir: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    model = load_model(model_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["valid"].long()).logits
    return token_logprobs(logits, batch["targets"], batch["mask"], TEMPERATURE)


@pytest.fixture
def model_dir(tmp_path):
    return str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                tie_embeddings=True, init_std=0.1))


@pytest.fixture
def repo_on_procs_path(monkeypatch):
    """The procs unpickle `examples.rl_loop.rollouts.ReferenceLogprobs`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


@pytest.mark.parametrize(("engine", "parallel"),
                         [("torch", "ddp"), ("torch", "fsdp"), ("vllm", "fsdp")])
async def test_three_tenants_take_turns_on_each_proc_with_contents_kept(
        model_dir, repo_on_procs_path, engine, parallel):
    if engine == "vllm":
        pytest.importorskip("vllm")
    slots = 2
    async with start_runtime(gpus_per_host=slots) as rm:
        group = {"resource_group": "rl"}
        trainer = await spawn_service(ServiceConfig(procs_per_host=slots, **group),
                                      TrainerActor, model_dir, lr=0.05, name="trainer",
                                      parallel=parallel)
        if engine == "vllm":  # one replica over both procs, called SPMD
            generator = await spawn_service(ServiceConfig(procs_per_host=slots, **group),
                                            GeneratorActor, model_dir, engine="vllm",
                                            name="generator", tensor_parallel_size=1,
                                            data_parallel_size=slots)
        else:
            generator = await spawn_service(ServiceConfig(num_replicas=slots, **group),
                                            GeneratorActor, model_dir, name="generator")
        reference = await spawn_service(ServiceConfig(procs_per_host=slots, **group),
                                        ReferenceActor, model_dir, name="reference",
                                        parallel=parallel)
        batch = scoring_batch()
        expected = expected_logprobs(model_dir, batch)

        async def reference_turn() -> tuple[torch.Tensor, list[str]]:
            async with phase(reference):
                status = await rm.status()
                for slot in range(slots):  # the other two asleep on every proc
                    awake = {name: stages for name, stages in status[0][slot].items()
                             if stages}
                    assert list(awake) == ["reference_r0"], awake
                held = {name: await resident_per_proc(service) for name, service in
                        (("trainer", trainer), ("generator", generator))}
                assert all(b == 0 for per_proc in held.values() for b in per_proc.values())
                logprobs = await reference.forward.route(ReferenceLogprobs(TEMPERATURE), batch)
                sums = await reference.replicas[0].actors.checksum.call()
                return logprobs, [digest for _, digest in sums.items()]

        first, kept = await reference_turn()
        torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-5)
        if parallel == "fsdp":  # each rank keeps its own shard
            assert kept[0] != kept[1]
        for _ in range(2):  # the trainer changes its weights, the generator takes them
            async with phase(trainer):
                await trainer.train_step.route(logit_loss, torch.tensor([PROMPTS[0]]))
                trained = await trainer.checksum.route()
            await sync_weights(trainer, generator)
            async with phase(generator):
                assert (await generator.generate.route(PROMPTS, GREEDY))
            again, digests = await reference_turn()
            assert digests == kept  # the starting weights, kept across every sleep
            torch.testing.assert_close(again, first, rtol=0, atol=0)
            async with phase(trainer):
                assert await trainer.checksum.route() == trained  # its contents kept too


def test_the_reference_actor_sleeps_and_wakes_through_its_engines_tenancy():
    assert not {"sleep", "wake", "describe"} & set(vars(ReferenceActor))


def kl_to_start(run: Path, prompts: list[list[int]], samples: int = 8) -> float:
    """The exact KL(policy || starting model) per completion token, averaged over
    completions the trained policy samples (seeded) for `prompts`: how far training moved
    the policy from where it started, measured the same way for every run."""
    policy = load_model(run / "model").eval()
    start = load_model(run / "base_model").eval()
    torch.manual_seed(0)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt] * samples)
            out = policy.generate(ids, max_new_tokens=8, do_sample=True, top_k=0,
                                  pad_token_id=0, eos_token_id=2)
            logp = torch.log_softmax(policy(out).logits[:, len(prompt) - 1:-1], -1)
            logq = torch.log_softmax(start(out).logits[:, len(prompt) - 1:-1], -1)
            per_token = (logp.exp() * (logp - logq)).sum(-1)
            total += per_token.sum().item()
            tokens += per_token.numel()
    return total / tokens


async def run(out: Path, *overrides: str) -> tuple[Loop, dict]:
    loop = Loop(load_config(overrides=[f"run.out={out}", *overrides]))
    return loop, await loop.run()


async def test_beta_keeps_the_policy_near_the_reference_and_logs_the_kl(tmp_path):
    """Same seed, 8 steps: with grpo.beta=1 the trained policy stays far closer to the
    starting model than with beta=0 (measured: KL 0.05 against 0.80 after 10 steps); the
    KL is logged every step; the reference held memory in its turn, and each proc's peak
    stayed within max(trainer, generator) + the reference's weights."""
    steps = ["run.steps=8", "run.eval_every=8"]
    free, _ = await run(tmp_path / "beta0", *steps)
    held, summary = await run(tmp_path / "beta1", *steps, "grpo.beta=1.0")
    prompts = [row.tokens for row in held.source.eval_rows()][:16]
    near, far = kl_to_start(tmp_path / "beta1", prompts), kl_to_start(tmp_path / "beta0", prompts)
    assert near < 0.5 * far, (near, far)
    metrics = json.loads((tmp_path / "beta1" / "metrics.json").read_text())
    kls = [s["kl"] for s in metrics["steps"] if s["step"] >= 0]
    assert len(kls) == 8 and all(k > 0 for k in kls)
    assert {r["tenant"] for r in metrics["memory"] if r["bytes"] > 0} == \
        {"trainer", "generator", "reference"}
    memory = summary["memory_per_proc"]
    assert memory["within_bound"] and memory["reference_bytes"] > 0
    assert memory["peak_bytes"] <= memory["bound_bytes"]
    assert 0 < summary["reference_share"] < 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "beta1" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("rl/kl")] == pytest.approx(kls, rel=1e-5)
    free_metrics = json.loads((tmp_path / "beta0" / "metrics.json").read_text())
    assert "reference" not in {r["tenant"] for r in free_metrics["memory"]}
    assert free.runtime.reference is None


async def test_a_sharded_reference_beside_vllm_on_two_slots(tmp_path):
    """FSDP on 2 slots, one vLLM replica over both, the reference sharded like the trainer:
    each proc holds about half of it, and each proc's peak stays within its bound. vLLM
    serves fewer positions than the model has (`generator.max_model_len`), and its KV cache
    is the plan's: a peak slot off by more than 10% would say it sized the model's."""
    pytest.importorskip("vllm")
    loop, summary = await run(tmp_path, "run.engine=vllm", "run.slots=2",
                              "trainer.parallel=fsdp", "grpo.beta=0.1", "run.steps=2",
                              "run.eval_every=2", "model.max_positions=64",
                              "generator.max_model_len=32", "generator.block_size=32")
    assert summary["plan"]["peak_slot"]["within"]
    memory = summary["memory_per_proc"]
    assert memory["procs"] == 2 and memory["within_bound"]
    whole = sum(p.numel() * p.element_size() for p in load_model(loop.model_dir).parameters())
    assert 0 < memory["reference_bytes"] < 0.75 * whole  # a shard, not the whole model
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert all(s["kl"] >= 0 for s in metrics["steps"] if s["step"] >= 0)
