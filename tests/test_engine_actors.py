"""Trainer and generator services on real Monarch procs: DDP or FSDP training over gloo on
a Hugging Face model, then `sync_weights` by staged handoff (one resource group), through
shared memory (two), or over Monarch RDMA buffers (two hosts); a handoff that would leave
FSDP ranks out is refused up front."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from colocate import ArbiterConfig, phase
from colocate.arbiter import ArbiterError
from colocate.engines.actors import GeneratorActor, TrainerActor
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.testing import start_runtime
from services import ServiceConfig, WeightSyncError, spawn_service, sync_weights

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("procs_import_tests")]

# char ids of the tiny models: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(2,))
BATCH = torch.tensor([PROMPTS[0], PROMPTS[2]])


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch).logits[..., 5].mean(), {"rows": float(batch.shape[0])}


@pytest.fixture
def model_dir(tmp_path):
    return str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                tie_embeddings=True, init_std=0.1))


# vLLM starts a one-rank torch.distributed group of its own, so it cannot share a proc with
# a trainer's group (refused with a clear error): with vLLM the trainer has one proc.
@pytest.mark.parametrize(("engine", "slots", "parallel"),
                         [("torch", 2, "ddp"), ("torch", 2, "fsdp"), ("vllm", 1, "ddp")])
async def test_colocated_trainer_hands_weights_to_generator_replicas(
        colocate_runtime, model_dir, engine, slots, parallel):
    if engine == "vllm":
        pytest.importorskip("vllm")
    rm = colocate_runtime
    trainer = await spawn_service(ServiceConfig(procs_per_host=slots, resource_group="rl"),
                                  TrainerActor, model_dir, lr=0.05, name="trainer",
                                  parallel=parallel)
    generator = await spawn_service(ServiceConfig(num_replicas=slots, resource_group="rl"),
                                    GeneratorActor, model_dir, engine=engine, name="generator")
    async with phase(generator):
        before = await generator.generate.fanout(PROMPTS, GREEDY)
    async with phase(trainer):
        first = await trainer.train_step.route(logit_loss, BATCH)
        second = await trainer.train_step.route(logit_loss, BATCH)
        trained = await trainer.checksum.route()
    assert second["loss"] < first["loss"]
    report = await sync_weights(trainer, generator)
    replicas = {f"generator_r{s}" for s in range(slots)}
    assert set(report.handoff) == replicas and not report.shared_memory
    assert all(b > 0 for b in report.handoff.values())
    status = await rm.status()
    stages = ["weights", "kv_cache"] if engine == "vllm" else ["weights"]
    for s in range(slots):
        assert status[0][s] == {"trainer_r0": [], f"generator_r{s}": stages}
    assert await generator.checksum.fanout() == [trained] * slots
    after = await generator.generate.fanout(PROMPTS, GREEDY)
    assert all(out == after[0] for out in after)  # every replica holds the trained weights
    assert [c.tokens for c in after[0]] != [c.tokens for c in before[0]]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
async def test_generators_in_another_group_load_through_shared_memory(model_dir, parallel):
    async with start_runtime(gpus_per_host=4):
        trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="train"),
                                      TrainerActor, model_dir, name="trainer",
                                      parallel=parallel)
        generator = await spawn_service(ServiceConfig(num_replicas=2, resource_group="generate"),
                                        GeneratorActor, model_dir, name="generator")
        for _ in range(2):  # the second sync writes over the first export, in place
            await trainer.train_step.route(logit_loss, BATCH)
            report = await sync_weights(trainer, generator)
            assert set(report.shared_memory) == {"generator_r0", "generator_r1"}
            assert not report.handoff
            trained = await trainer.checksum.route()
            assert await generator.checksum.fanout() == [trained, trained]


async def test_generator_on_another_host_reads_over_rdma(model_dir):
    """Two hosts (Monarch's ProcessJob): the trainer on one, the generator on the other;
    the weights cross over Monarch RDMA buffers (its TCP transport on this machine)."""
    async with start_runtime("processes", hosts=2, gpus_per_host=1):
        trainer = await spawn_service(ServiceConfig(resource_group="train"), TrainerActor,
                                      model_dir, lr=0.05, name="trainer")
        generator = await spawn_service(ServiceConfig(resource_group="generate"),
                                        GeneratorActor, model_dir, name="generator")
        hosts = {s.replicas[0].allocation.slots[0][0] for s in (trainer, generator)}
        assert hosts == {0, 1}
        before = await generator.generate.route(PROMPTS, GREEDY)
        await trainer.train_step.route(logit_loss, BATCH)
        await trainer.train_step.route(logit_loss, BATCH)
        trained = await trainer.checksum.route()
        assert await generator.checksum.route() != trained
        report = await sync_weights(trainer, generator)
        assert set(report.rdma) == {"generator_r0"} and not report.shared_memory
        assert report.rdma["generator_r0"] > 0 and not report.handoff
        assert await generator.checksum.route() == trained
        after = await generator.generate.route(PROMPTS, GREEDY)
        assert [c.tokens for c in after] != [c.tokens for c in before]


def test_engine_actors_sleep_wake_and_describe_through_their_engines_tenancy():
    """One path: `TenantActor`'s endpoints act on `self.tenancy`, which each engine actor
    takes from its engine; none writes the three endpoints again."""
    for cls in (TrainerActor, GeneratorActor):
        assert not {"sleep", "wake", "describe"} & set(vars(cls)), cls.__name__


@pytest.mark.parametrize("parallel", ["fsdp", "ddp"])
async def test_a_handoff_that_leaves_out_fsdp_ranks_is_refused_before_anything_switches(
        model_dir, parallel):
    """A 2-proc trainer, one generator replica on its first proc only. From FSDP (each
    bucket gathered by both ranks) the sync is refused at once, naming who and what to do,
    and nothing moved; from DDP (every rank holds the whole model) it goes through."""
    guard = ArbiterConfig(call_timeout_s=30)  # the hang this refuses would end here
    async with start_runtime(gpus_per_host=2, arbiter=guard) as rm:
        trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                      TrainerActor, model_dir, lr=0.05, name="trainer",
                                      parallel=parallel)
        generator = await spawn_service(ServiceConfig(resource_group="rl"), GeneratorActor,
                                        model_dir, name="generator")
        async with phase(trainer):
            await trainer.train_step.route(logit_loss, BATCH)
            trained = await trainer.checksum.route()
        if parallel == "ddp":
            report = await sync_weights(trainer, generator)
            assert set(report.handoff) == {"generator_r0"}
            assert await generator.checksum.route() == trained
            return
        status = await rm.status()
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as refused:
            await sync_weights(trainer, generator)
        assert time.monotonic() - start < 5
        message = str(refused.value)
        for named in ("'trainer'", "generator_r0", "(0, 1)", "rank 1", "nothing was switched",
                      "num_replicas=2", "procs_per_host=2", "parallel='ddp'"):
            assert named in message, named
        assert await rm.status() == status  # the trainer awake on both slots, as it was
        assert await trainer.checksum.route() == trained
        await trainer.train_step.route(logit_loss, BATCH)  # still trains, both ranks
        assert await trainer.checksum.route() != trained


async def test_a_generator_respawned_beside_the_trainer_syncs_through_shared_memory(model_dir):
    """A generator replica respawned on a new proc for the trainer's slot shares the slot,
    not the process: the sync goes through shared memory, and a direct handoff is refused
    naming why."""
    async with start_runtime(gpus_per_host=1) as rm:
        trainer = await spawn_service(ServiceConfig(resource_group="rl"), TrainerActor,
                                      model_dir, lr=0.05, name="trainer")
        generator = await spawn_service(ServiceConfig(resource_group="rl"), GeneratorActor,
                                        model_dir, name="generator")
        replica = generator.replicas[0]
        assert generator.lose(replica, RuntimeError("its proc is gone"))
        for _ in range(600):
            if replica.generation == 1 and replica.state.value == "healthy":
                break
            await asyncio.sleep(0.1)
        assert replica.tenant == "generator_r0_g1", replica.failure
        async with phase(trainer):
            await trainer.train_step.route(logit_loss, BATCH)
            trained = await trainer.checksum.route()
        with pytest.raises(ArbiterError, match=r"\(0, 0\).*different processes"):
            await rm.handoff("trainer_r0", "generator_r0_g1")
        report = await sync_weights(trainer, generator)
        assert set(report.shared_memory) == {"generator_r0_g1"} and not report.handoff
        async with phase(generator):
            assert await generator.checksum.route() == trained
