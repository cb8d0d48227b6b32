"""Continuous batching in the torch generator (`TorchGenerator.submit`, `decoding`): turns of
trajectories submitted as they come, with random (seeded) tool waits between turns, join
one running batch and leave it; each row's tokens and log-probabilities are bitwise those
of the same trajectory run alone, whatever its companions, its slot and the arrival order.
Preemption returns rows unfinished (continued later with `partial`), a sleep waits for the
rows in flight, and the generator's actor takes concurrent calls that merge."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from colocate.engines.generator import TorchGenerator
from colocate.engines.models import load_model
from colocate.engines.sampling import Completion, SamplingParams

pytestmark = pytest.mark.timeout(300)

SAMPLE = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(2,), seed=7)
# char ids of the tiny models: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
STARTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14, 9, 9], [1, 5, 6],
          [1, 3, 3, 13, 3], [1, 9, 8, 7, 6, 5, 4]]
TOOL = [13, 4, 15]  # what a tool appends after each turn
TURNS = 3


@pytest.fixture(scope="module")
def gen(model_dirs):
    return TorchGenerator(load_model(model_dirs["qwen2"]), max_batch=4, prefix="g_cb",
                          session_cache_bytes=1 << 22)


def trajectory(gen: TorchGenerator, index: int, delays: random.Random | None, name: str
               ) -> list[Completion]:
    """Trajectory `index`'s turns, each a call of its own (seeded by trajectory and turn),
    a tool's answer appended after each, `delays` (None: none) waiting before each turn."""
    tokens, out = list(STARTS[index]), []
    for turn in range(TURNS):
        if delays is not None:
            time.sleep(delays.uniform(0, 0.03))
        params = SamplingParams(**{**SAMPLE.__dict__, "seed": 1000 * turn + index})
        [completion] = gen.submit([tokens], params, sessions=[f"{name}-{index}"]).result()
        out.append(completion)
        tokens = tokens + completion.tokens + TOOL
    return out


def run_all(gen: TorchGenerator, delay_seed: int | None, name: str) -> list[list[Completion]]:
    """Every trajectory at once, on threads of their own (None: one after another)."""
    if delay_seed is None:
        return [trajectory(gen, i, None, name) for i in range(len(STARTS))]
    found: dict[int, list[Completion]] = {}
    order = list(range(len(STARTS)))
    random.Random(delay_seed).shuffle(order)
    threads = [threading.Thread(target=lambda i=i: found.__setitem__(
        i, trajectory(gen, i, random.Random(delay_seed * 31 + i), name))) for i in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [found[i] for i in range(len(STARTS))]


def bitwise(runs: list[list[Completion]]) -> list:
    return [[(c.tokens, c.logprobs, c.stopped, c.finished) for c in turns] for turns in runs]


def test_rows_are_the_same_whatever_joins_them(gen):
    """The test the design stands on: run alone (one trajectory at a time) and run at once
    with two different seeded tool timings and arrival orders, every turn's tokens and
    log-probabilities are bitwise equal; the runs at once did share decoding steps."""
    alone = run_all(gen, None, "alone")
    assert gen.batcher.most_live == 1
    reused = gen.prefix_counts(reset=True).reused
    assert reused > 0  # later turns started from their session's cached keys
    at_once = [run_all(gen, seed, f"at-once{seed}") for seed in (1, 2)]
    assert gen.batcher.most_live > 1  # rows did decode beside others
    assert gen.prefix_counts().reused == 2 * reused and gen.session_kv.evicted == 0
    assert bitwise(at_once[0]) == bitwise(alone)
    assert bitwise(at_once[1]) == bitwise(alone)
    lengths = {len(c.tokens) for turns in alone for c in turns}
    assert len(lengths) > 1  # rows left at different steps (stop token or budget)


def test_a_stopped_call_returns_its_rows_unfinished_and_continues(gen):
    """`stop` answers True after a few steps: the call's rows come back unfinished (a row
    that never joined with no tokens); continued with `partial`, they end, keeping what
    they had. A call beside it that is not stopped is not disturbed."""
    steps = gen.batcher.steps
    asked = lambda: gen.batcher.steps >= steps + 2  # noqa: E731
    prompts = [STARTS[i] for i in range(6)]  # 6 rows, 4 slots: two wait to join
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
    beside = gen.submit([STARTS[0]], params)
    got = gen.submit(prompts, params, stop=asked).result()
    assert not any(c.finished for c in got)
    assert [len(c.tokens) for c in got[4:]] == [0, 0]
    assert all(len(c.tokens) < 8 for c in got)
    later = gen.submit(prompts, params, partial=got).result()
    for before, after in zip(got, later, strict=True):
        assert after.finished and after.tokens[:len(before.tokens)] == before.tokens
    assert beside.result()[0].finished
    assert beside.result()[0] == gen.submit([STARTS[0]], params).result()[0]


def test_a_sleep_waits_for_the_rows_in_flight(gen, model_dirs):
    """A sleep asked while a call's rows decode happens after they ended; a call to a
    sleeping generator is refused, and so is one to a generator whose weights were
    discarded. The batch's cache is the KV cache its declared working memory counts."""
    from colocate.engines.decoding import SlotCache
    from colocate.engines.generator import WeightsDiscardedError, working_bytes
    from colocate.memory import TagPausedError

    config = gen.model.config
    cache = SlotCache(config, gen.max_batch, gen.max_len, torch.float32, gen.device)
    kv = sum(t.nbytes for t in (*cache.keys, *cache.values))
    logits = gen.max_batch * config.vocab_size * 4
    assert kv + logits == working_bytes(config.to_dict(), gen.max_batch, gen.max_len)

    future = gen.submit([STARTS[2]], SamplingParams(max_new_tokens=16, temperature=1.0,
                                                   seed=1))
    gen.tenancy.sleep()
    assert future.done() and len(future.result()[0].tokens) == 16
    with pytest.raises(TagPausedError):
        gen.submit([STARTS[0]], SAMPLE)
    gen.tenancy.wake(["weights"])
    assert gen.submit([STARTS[0]], SAMPLE).result()[0].finished
    dropped = TorchGenerator(load_model(model_dirs["qwen2"]), max_batch=2, prefix="g_cb_drop",
                             keep_weights=False)
    dropped.tenancy.sleep()
    dropped.tenancy.wake(["weights"])
    with pytest.raises(WeightsDiscardedError):
        dropped.submit([STARTS[0]], SAMPLE)


LONG = SamplingParams(max_new_tokens=100, temperature=1.0, seed=5)  # no stop token


@pytest.mark.parametrize("engine", ["torch", "vllm"])
async def test_the_actor_merges_concurrent_calls_and_a_switch_preempts_them(tmp_path, engine):
    """Through `GeneratorActor.generate_continuous` on a Monarch proc, with either engine: a
    one-token call sent after a long one is answered first (the actor took both: they share
    the batch); a preempting switch returns a running call's rows unfinished, and after it
    they are continued to their ends, keeping what they had. A refused call raises its own
    error."""
    import asyncio

    from colocate import phase
    from colocate.engines.actors import GeneratorActor
    from colocate.engines.tiny import write_tiny_model
    from colocate.testing import MemoryTenant, start_runtime
    from services import ServiceConfig, spawn_service

    path = write_tiny_model(tmp_path / "m", "qwen2", alphabet="0123456789+=>",
                            max_positions=128)
    async with start_runtime(gpus_per_host=1):
        if engine == "vllm":
            pytest.importorskip("vllm")
        gen = await spawn_service(ServiceConfig(resource_group="rl"), GeneratorActor,
                                  str(path), engine=engine, max_batch=4, name="generator")
        trainer = await spawn_service(ServiceConfig(resource_group="rl"), MemoryTenant, 1,
                                      name="trainer")
        async with phase(gen):
            long = asyncio.ensure_future(gen.generate_continuous.route([STARTS[0]], LONG))
            [short] = await gen.generate_continuous.route(
                [STARTS[1]], SamplingParams(max_new_tokens=1, seed=1))
            assert len(short.tokens) == 1 and not long.done()
            assert len((await long)[0].tokens) == LONG.max_new_tokens
            running = asyncio.ensure_future(gen.generate_continuous.route(STARTS, LONG))
            await asyncio.sleep(0.2)
        async with phase(trainer, preempt=True):
            assert running.done()
            partial = running.result()
        assert not all(c.finished for c in partial)
        async with phase(gen):
            done = await gen.generate_continuous.route(STARTS, LONG, partial)
            with pytest.raises(ValueError, match="do not fit"):  # the call's, not a fault
                await gen.generate_continuous.route([[1] * 100], LONG)
        assert all(c.finished and len(c.tokens) == LONG.max_new_tokens for c in done)
        assert [c.tokens[:len(p.tokens)] for c, p in zip(done, partial, strict=True)] \
            == [p.tokens for p in partial]


def test_continuous_rollouts_are_refused_where_they_cannot_run():
    from examples.rl_loop.config import load_config
    from examples.rl_loop.rollouts import RolloutConfig

    RolloutConfig(continuous=True)
    for bad in ({"cohorts": 2}, {"mode": "partial"}):
        with pytest.raises(ValueError, match="rollout.continuous=true runs each episode"):
            RolloutConfig(continuous=True, **bad)
    load_config(overrides=["run.engine=vllm", "rollout.continuous=true"])  # one rank
    with pytest.raises(ValueError, match="needs one-rank replicas, but each has 2 ranks"):
        load_config(overrides=["run.engine=vllm", "rollout.continuous=true", "run.slots=2"])
