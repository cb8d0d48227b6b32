"""The hybrid engine on every GPU present (1 to 8): a trainer over all GPUs (FSDP from 2
GPUs, else one proc) and one vLLM replica over the same procs (`external_launcher`,
tensor-parallel 2 where the count is even, data-parallel over the rest), taking turns
through the arbiters with vLLM's native sleep; each switch's release is checked by the
arbiter with NVML per process. After a sync in place, vLLM's greedy tokens equal the
built-in generator's synced from the same trainer. The CPU twin is tests/test_hybrid.py.

Needs Monarch and vLLM (CUDA build) installed beside torch: neither travels to the lent
GPU machine, so this file has not run yet (README, "What has run where")."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("monarch")

from colocate import phase  # noqa: E402
from colocate.engines.actors import GeneratorActor, TrainerActor  # noqa: E402
from colocate.engines.sampling import SamplingParams  # noqa: E402
from colocate.engines.tiny import write_tiny_model  # noqa: E402
from services import ServiceConfig, spawn_service, sync_weights  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("procs_import_tests")]

PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14], [1, 5, 5]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0)


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch.to(module.device)).logits[..., 5].mean(), {}


async def test_vllm_beside_the_trainer_on_every_gpu(colocate_runtime, tmp_path):
    rm = colocate_runtime
    slots = len((await rm.status())[0])
    tp = 2 if slots % 2 == 0 else 1
    model_dir = str(write_tiny_model(tmp_path / "model", "qwen2", alphabet="0123456789+=>",
                                     tie_embeddings=True, init_std=0.1, heads=2, kv_heads=2))
    group = ServiceConfig(procs_per_host=slots, resource_group="rl")
    trainer = await spawn_service(group, TrainerActor, model_dir, lr=0.05, name="trainer",
                                  parallel="fsdp" if slots > 1 else "ddp")
    vllm_gen = await spawn_service(group, GeneratorActor, model_dir, engine="vllm",
                                   name="vllm", tensor_parallel_size=tp,
                                   data_parallel_size=slots // tp)
    # one reference per proc: every FSDP rank takes part in a handoff's gathers
    reference = await spawn_service(ServiceConfig(num_replicas=slots, resource_group="rl"),
                                    GeneratorActor, model_dir, name="reference")
    async with phase(vllm_gen):
        before = await vllm_gen.generate.route(PROMPTS, GREEDY)
    for _ in range(2):  # two full turns: vLLM's native sleep and wake on each GPU
        async with phase(trainer):
            infos = await vllm_gen.replicas[0].actors.describe.call()
            assert all(info.resident_bytes == 0 for _, info in infos.items())
            await trainer.train_step.route(logit_loss, torch.tensor([PROMPTS[0]]))
        async with phase(vllm_gen):
            pass
    async with phase(trainer):
        pass
    await sync_weights(trainer, reference)
    expected = (await reference.generate.fanout(PROMPTS, GREEDY))[0]
    async with phase(trainer):
        pass
    await sync_weights(trainer, vllm_gen)
    status = await rm.status()
    for slot in range(slots):
        assert status[0][slot]["vllm_r0"] == ["weights", "kv_cache"]
    after = await vllm_gen.generate.route(PROMPTS, GREEDY)
    assert [c.tokens for c in after] == [c.tokens for c in expected]
    assert [c.tokens for c in after] != [c.tokens for c in before]
