"""vLLM as one replica per model copy (`generator.replicas=per_copy`): the loop on 2 CPU
slots runs two independent vLLM engines on slots of their own, a step's sync gives both the
trainer's weights, and an episode's turns kept on one copy find its earlier tokens in that
copy's prefix cache, where turns dealt round robin compute them again."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import transformers  # noqa: E402

from bench.agentic import VLLM_BLOCK as BLOCK  # noqa: E402
from bench.agentic import long_session_share  # noqa: E402
from colocate import phase  # noqa: E402
from colocate.engines.generator import kv_cache_bytes  # noqa: E402
from examples.rl_loop.budget import slot_sizes  # noqa: E402
from examples.rl_loop.config import load_config  # noqa: E402
from examples.rl_loop.hooks import Hooks  # noqa: E402
from examples.rl_loop.loop import Loop  # noqa: E402
from examples.rl_loop.runtime import model_dir  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("vllm_preloaded")]

PER_COPY = ["run.engine=vllm", "generator.replicas=per_copy", "run.slots=2",
            "run.colocate=false"]


class Checks(Hooks):
    """After the first step (its sync done): the replicas' weights against the trainer's,
    then the same turns sticky and round robin."""

    def __init__(self) -> None:
        self.found: dict = {}

    async def started(self) -> None:
        async with phase(self.loop.generator):
            self.found["initial"] = await self.sums()

    async def step_ended(self, index: int, row: dict) -> None:
        if index:
            return
        gen = self.loop.generator
        async with phase(gen):
            self.found["synced"] = await self.sums()
        async with phase(self.loop.trainer):
            self.found["trainer"] = await self.loop.trainer.checksum.route()
        async with phase(gen):
            self.found["sticky"] = await long_session_share(self.loop, True, seed=1)
            self.found["round_robin"] = await long_session_share(self.loop, False, seed=2)

    async def sums(self) -> list[str]:
        return [await r.actors.checksum.call_one() for r in self.loop.generator.replicas]


async def test_per_copy_vllm_replicas_each_get_the_weights_and_keep_their_sessions_prefix(
        tmp_path: Path):
    cfg = load_config(overrides=[*PER_COPY, f"generator.block_size={BLOCK}",
                                 "generator.max_batch=8", "model.max_positions=512",
                                 "run.steps=1", "run.eval_every=1", "run.save_every=0",
                                 f"run.out={tmp_path}"])
    loop = Loop(cfg, hooks=Checks())
    await loop.run()
    found = loop.hooks.found
    replicas = loop.generator.replicas
    assert len(replicas) == 2
    pids = [set(r.allocation.pids) for r in replicas]
    assert len(pids[0] | pids[1]) == 2  # a proc each
    assert not (pids[0] | pids[1]) & set(loop.trainer.replicas[0].allocation.pids)
    # both replicas hold the trained weights, which the step changed
    assert found["synced"] == [found["trainer"]] * 2
    assert found["initial"][0] == found["initial"][1] != found["trainer"]
    assert found["sticky"] <= 0.1 < found["round_robin"], found


@pytest.mark.parametrize("shape", [["run.slots=2"],
                                   ["run.slots=1", "run.hosts=2", "run.scheduler=processes"]])
def test_per_copy_beside_the_trainer_is_refused_in_one_line(shape: list[str]) -> None:
    with pytest.raises(ValueError, match=r"^generator\.replicas=per_copy with "
                                         r"run\.colocate=true: its 2 vLLM replicas"):
        load_config(overrides=["run.engine=vllm", "generator.replicas=per_copy", *shape])


def test_generator_replicas_names_the_values_it_takes() -> None:
    with pytest.raises(ValueError, match=r"generator\.replicas='each'.*'spmd', 'per_copy'"):
        load_config(overrides=["generator.replicas=each"])
    with pytest.raises(ValueError, match=r"generator\.block_size=-1: must be >= 0"):
        load_config(overrides=["generator.block_size=-1"])
    # one copy over all slots is the spmd replica, beside the trainer as before; the torch
    # engine is one replica per slot either way
    load_config(overrides=["run.engine=vllm", "generator.replicas=per_copy", "run.slots=2",
                           "generator.tensor_parallel_size=2"])
    load_config(overrides=["generator.replicas=per_copy", "run.slots=2"])


def test_the_budget_holds_a_whole_model_and_its_kv_cache_on_each_copys_slot(tmp_path: Path):
    cfg = load_config(overrides=[*PER_COPY, f"generator.block_size={BLOCK}"])
    path = model_dir(cfg, tmp_path)
    config = transformers.AutoConfig.from_pretrained(path)
    sizes = slot_sizes(cfg, path)
    copies = [s["generator"] for s in sizes if "generator" in s]
    assert len(copies) == 2 and len(sizes) == 4  # the trainer's 2 slots, then the copies'
    kv = kv_cache_bytes(config.to_dict(), 64, config.max_position_embeddings, BLOCK)
    whole = sizes[0]["trainer"].stages["weights"][0]  # DDP: the whole model
    assert all(c.stages == {"weights": (whole, False), "kv_cache": (kv, False)} for c in copies)
