"""The hybrid engine on 2 CPU slots: a 2-proc trainer (DDP or FSDP) and one vLLM replica
over the same 2 procs (tensor- or data-parallel, `external_launcher`), taking turns
through the arbiters, synced in place, checked against the built-in generator."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

pytest.importorskip("vllm")

from colocate import phase  # noqa: E402
from colocate.engines.actors import GeneratorActor, TrainerActor  # noqa: E402
from colocate.engines.sampling import SamplingParams  # noqa: E402
from colocate.engines.tiny import write_tiny_model  # noqa: E402
from services import ServiceConfig, spawn_service, sync_weights  # noqa: E402
from services.errors import ServiceUnavailableError  # noqa: E402
from services.replica import ReplicaState  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.usefixtures("vllm_preloaded", "procs_import_tests")]

# char ids of the tiny model: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14], [1, 5, 5]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch).logits[..., 5].mean(), {}


@pytest.fixture
def model_dir(tmp_path):
    return str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                tie_embeddings=True, init_std=0.1, heads=2, kv_heads=2))


@pytest.mark.parametrize(("parallel", "tp", "dp"), [("ddp", 2, 1), ("fsdp", 1, 2)])
async def test_vllm_beside_the_trainer_takes_turns_and_generates_the_trained_policy(
        colocate_runtime, model_dir, parallel, tp, dp):
    rm = colocate_runtime
    trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                  TrainerActor, model_dir, lr=0.05, name="trainer",
                                  parallel=parallel)
    vllm_gen = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                   GeneratorActor, model_dir, engine="vllm", name="vllm",
                                   tensor_parallel_size=tp, data_parallel_size=dp)
    reference = await spawn_service(ServiceConfig(num_replicas=2, resource_group="rl"),
                                    GeneratorActor, model_dir, name="reference")
    async with phase(vllm_gen):  # one logical call, both ranks at once
        before = await vllm_gen.generate.route(PROMPTS, GREEDY)
        infos = await vllm_gen.replicas[0].actors.describe.call()
        assert all(info.resident_bytes == info.tagged_bytes > 0 for _, info in infos.items())
    assert len(before) == len(PROMPTS)
    async with phase(trainer):  # vLLM sleeps on both procs, release verified by the arbiter
        infos = await vllm_gen.replicas[0].actors.describe.call()
        assert all(info.resident_bytes == 0 and info.awake_stages == ()
                   for _, info in infos.items())
        for _ in range(2):
            await trainer.train_step.route(logit_loss, torch.tensor([PROMPTS[0]]))
    await sync_weights(trainer, reference)  # the reference ends awake
    expected = await reference.generate.fanout(PROMPTS, GREEDY)
    assert expected[0] == expected[1]
    async with phase(trainer):  # a handoff takes the weights from an awake trainer
        pass
    await sync_weights(trainer, vllm_gen)  # in place on each proc, a bucket at a time
    status = await rm.status()
    for slot in (0, 1):
        assert status[0][slot]["vllm_r0"] == ["weights", "kv_cache"]
        assert status[0][slot]["trainer_r0"] == []
    after = await vllm_gen.generate.route(PROMPTS, GREEDY)
    assert [c.tokens for c in after] == [c.tokens for c in expected[0]]
    assert [c.tokens for c in after] != [c.tokens for c in before]


async def test_a_killed_rank_fails_the_replica_with_a_clear_error_and_nothing_hangs(
        colocate_runtime, model_dir):
    """One proc of a 2-rank vLLM replica (DP=2) is killed while it generates: the call in
    flight and the next one end with an error that names the replica's failure, within a
    bound, instead of waiting on the dead rank."""
    vllm_gen = await spawn_service(
        ServiceConfig(procs_per_host=2, resource_group="rl", respawn=False, max_retries=0),
        GeneratorActor, model_dir, engine="vllm", name="vllm", data_parallel_size=2)
    many = PROMPTS * 64
    await vllm_gen.generate.route(many, GREEDY)  # warm
    infos = await vllm_gen.replicas[0].actors.describe.call()
    pid = [info.pid for _, info in infos.items()][1]
    in_flight = asyncio.ensure_future(vllm_gen.generate.route(many, SamplingParams(
        max_new_tokens=24, temperature=0)))
    await asyncio.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    try:  # it may have finished before the kill; if not, it must fail, not hang
        await asyncio.wait_for(in_flight, 90)
    except ServiceUnavailableError as err:
        assert "vllm" in str(err)
    with pytest.raises(ServiceUnavailableError, match=r"(?s)vllm.*failed.*spawn the service"):
        await asyncio.wait_for(vllm_gen.generate.route(PROMPTS, GREEDY), 90)
    assert vllm_gen.replicas[0].state is ReplicaState.FAILED


async def test_a_replica_that_lost_a_rank_is_respawned_whole_and_serves_again(
        colocate_runtime, model_dir):
    """With respawn (the default), the 2-rank replica comes back on new procs for the same
    slots, its ranks in a new torch.distributed world, and the call is retried there."""
    vllm_gen = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                   GeneratorActor, model_dir, engine="vllm", name="vllm",
                                   data_parallel_size=2)
    before = await vllm_gen.generate.route(PROMPTS, GREEDY)
    infos = await vllm_gen.replicas[0].actors.describe.call()
    os.kill([info.pid for _, info in infos.items()][1], signal.SIGKILL)
    after = await asyncio.wait_for(vllm_gen.generate.route(PROMPTS, GREEDY), 300)
    assert after == before
    replica = vllm_gen.replicas[0]
    assert replica.generation == 1 and replica.state is ReplicaState.HEALTHY
