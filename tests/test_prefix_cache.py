"""The torch generator's per-session KV prefix cache: a trajectory's later turns prefill only
their new tokens and sample what a generator without the cache samples (tokens equal,
log-probabilities within float tolerance), rows with different cached lengths share a
batch, the cache goes at a sleep and at a weight load (the next turn recomputes, and says
so), it stays within its bounds, and its bytes are declared working memory. Then the same
through `GeneratorActor` on a Monarch proc, with a real switch between turns."""

from __future__ import annotations

import pytest
import torch

from colocate import phase
from colocate.engines.actors import GeneratorActor, TrainerActor
from colocate.engines.generator import TorchGenerator, working_bytes
from colocate.engines.models import load_model
from colocate.engines.sampling import Completion, PrefixCounts, SamplingParams
from colocate.engines.sessions import computed_tokens
from services import ServiceConfig, spawn_service

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
# char ids of the tiny models: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14, 9, 9], [1, 5, 6]]
TOOL = [[13, 4], [15], [8, 8, 14], [3]]  # what each trajectory appends after a turn
CACHE = 1 << 20

_tags = iter(range(10**6))


def generator(path: str, **options) -> TorchGenerator:
    """A generator of the directory's model, under tags of its own."""
    return TorchGenerator(load_model(path), max_batch=8, prefix=f"gen{next(_tags)}", **options)


def next_turn(prompts: list[list[int]], outs: list[Completion], turn: int) -> list[list[int]]:
    """Each trajectory's next prompt: its prompt, its completion, then a tool's answer."""
    return [p + c.tokens + TOOL[(i + turn) % len(TOOL)]
            for i, (p, c) in enumerate(zip(prompts, outs, strict=True))]


def assert_same(ours: list[Completion], theirs: list[Completion]) -> None:
    assert [c.tokens for c in ours] == [c.tokens for c in theirs]
    for mine, other in zip(ours, theirs, strict=True):
        assert mine.logprobs == pytest.approx(other.logprobs, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_later_turns_reuse_the_prefix_and_sample_what_a_recompute_samples(model_dirs, arch):
    cached = generator(model_dirs[arch], session_cache_bytes=CACHE)
    plain = generator(model_dirs[arch])
    # rows of every kind in one batch: two sessions kept, one new at turn 2, one with none
    sessions = [["a", "b", None, None], ["a", "b", "c", None], ["a", "b", "c", None]]
    prompts = [list(p) for p in PROMPTS]
    for turn, names in enumerate(sessions):
        had = {n: len(cached.ledger.known(n)) for n in names if n}
        ours, theirs = cached.generate(prompts, GREEDY, sessions=names), \
            plain.generate(prompts, GREEDY)
        assert_same(ours, theirs)
        for name, prompt, out in zip(names, prompts, ours, strict=True):
            # a session reuses all it computed before (the new prompt starts with it)
            assert out.prefix == PrefixCounts(len(prompt), had[name] if name else 0, 0)
            if name:
                assert cached.ledger.known(name) == computed_tokens(prompt, out.tokens)
        assert turn == 0 or sorted(set(had.values())) != [0]  # the later turns reused
        prompts = next_turn(prompts, ours, turn)
    totals = cached.prefix_counts()
    assert totals.reused > 0 and totals.recomputed == 0 and totals.recompute_share == 0.0
    assert len(cached.session_kv) == 3
    assert cached.session_kv.nbytes == sum(len(cached.ledger.known(n)) for n in "abc") \
        * cached.session_kv.token_bytes


def test_turns_continue_equally_in_batches_of_one_and_from_a_prompt_that_diverges(model_dirs):
    path = model_dirs["qwen2"]
    cached, plain = generator(path, session_cache_bytes=CACHE), generator(path)
    first = cached.generate(PROMPTS[:2], GREEDY, sessions=["a", "b"])
    # "a" comes back with its prompt's last three tokens changed: only what matches is reused
    changed = PROMPTS[0][:-3] + [9, 9, 9] + first[0].tokens
    for prompt, name in ((changed, "a"), (PROMPTS[1] + first[1].tokens + [4], "b")):
        out = cached.generate([prompt], GREEDY, sessions=[name])
        assert_same(out, plain.generate([prompt], GREEDY))
    assert cached.prefix_counts().reused == len(PROMPTS[0]) - 3 + len(PROMPTS[1]) + 5


def test_a_sleep_or_a_weight_load_drops_the_cache_and_the_next_turn_recomputes(model_dirs):
    path = model_dirs["llama"]
    cached, plain = generator(path, session_cache_bytes=CACHE), generator(path)
    info = cached.tenancy.describe()
    assert info.working_bytes == working_bytes(cached.model.config.to_dict(), 8,
                                               cached.max_len) + CACHE
    names = ["a", "b"]
    outs = cached.generate(PROMPTS[:2], GREEDY, sessions=names)
    prompts = next_turn(PROMPTS[:2], outs, 0)
    held = cached.session_kv.nbytes
    assert held > 0
    assert cached.tenancy.sleep() == info.tagged_bytes  # the weights' tag, as before
    assert cached.session_kv.nbytes == 0 and len(cached.session_kv) == 0
    cached.tenancy.wake(["weights"])
    known = [len(cached.ledger.known(n)) for n in names]
    before = cached.prefix_counts(reset=True)
    outs = cached.generate(prompts, GREEDY, sessions=names)
    assert_same(outs, plain.generate(prompts, GREEDY))
    assert [c.prefix for c in outs] == [PrefixCounts(len(p), 0, k)
                                        for p, k in zip(prompts, known, strict=True)]
    assert cached.prefix_counts().recompute_share == 1.0 and before.recomputed == 0

    prompts = next_turn(prompts, outs, 1)
    cached.load_weights(plain.weights())  # the same weights: the cache goes all the same
    assert len(cached.session_kv) == 0
    outs = cached.generate(prompts, GREEDY, sessions=names)
    assert all(c.prefix.reused == 0 and c.prefix.recomputed > 0 for c in outs)


def test_the_cache_keeps_within_its_bounds_least_recently_used_first(model_dirs):
    path = model_dirs["qwen3"]
    probe = generator(path, session_cache_bytes=CACHE)
    token = probe.session_kv.token_bytes
    first = probe.generate([PROMPTS[0]], GREEDY)[0].tokens
    one = computed_tokens(PROMPTS[0], first)  # a session's tokens after its first turn
    again = PROMPTS[0] + first + [5]  # its second turn's prompt
    by_count = generator(path, session_cache_bytes=CACHE, max_sessions=2)
    by_bytes = generator(path, session_cache_bytes=(2 * len(one) + 1) * token)
    too_small = generator(path, session_cache_bytes=len(one) * token - 1)
    for gen in (by_count, by_bytes, too_small):
        for name in ("a", "b", "c"):  # the same prompt: every session holds as much
            gen.generate([PROMPTS[0]], GREEDY, sessions=[name])
            assert gen.session_kv.nbytes <= gen.session_kv.max_bytes
    assert set(by_count.session_kv._entries) == set(by_bytes.session_kv._entries) == {"b", "c"}
    assert by_count.session_kv.evicted == by_bytes.session_kv.evicted == 1
    assert len(too_small.session_kv) == 0  # one session alone passes the bound: none kept
    out = too_small.generate([again], GREEDY, sessions=["a"])
    assert out[0].prefix == PrefixCounts(len(again), 0, len(one))

    # "b" used again is the most recent: "c" goes for "d"
    out = by_count.generate([again], GREEDY, sessions=["b"])
    assert out[0].prefix == PrefixCounts(len(again), len(one), 0)
    by_count.generate([PROMPTS[0]], GREEDY, sessions=["d"])
    assert set(by_count.session_kv._entries) == {"b", "d"}
    # an evicted session's next turn recomputes what it had, and says so
    out = by_count.generate([again], GREEDY, sessions=["c"])
    assert out[0].prefix == PrefixCounts(len(again), 0, len(one))
    # an ended session is forgotten: its next row is a new session's
    by_count.end_session("d")
    assert "d" not in by_count.session_kv and by_count.ledger.known("d") == []
    out = by_count.generate([again], GREEDY, sessions=["d"])
    assert out[0].prefix == PrefixCounts(len(again), 0, 0)


def test_a_preempted_turn_is_continued_from_the_cache_as_the_whole_turn_would_be(model_dirs):
    path = model_dirs["qwen2"]
    cached, plain = generator(path, session_cache_bytes=CACHE), generator(path)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    whole = plain.generate(PROMPTS, params)
    polls = iter(range(100))
    part = cached.generate(PROMPTS, params, stop=lambda: next(polls) >= 4,
                           sessions=["a", "b", "c", "d"])
    assert all(not c.finished and 0 < len(c.tokens) < 10 for c in part)
    done = cached.generate(PROMPTS, params, partial=part, sessions=["a", "b", "c", "d"])
    assert_same(done, whole)
    assert [c.prefix.reused for c in done] == [len(p) + len(c.tokens) - 1
                                               for p, c in zip(PROMPTS, part, strict=True)]
    # a call stopped before its batch began computed nothing: nothing counted or recorded
    skipped = cached.generate(PROMPTS[:1], params, stop=lambda: True, sessions=["e"])
    assert skipped[0].prefix == PrefixCounts() and cached.ledger.known("e") == []


def test_bad_sessions_are_refused_naming_the_row(model_dirs):
    gen = generator(model_dirs["llama"], session_cache_bytes=CACHE)
    with pytest.raises(ValueError, match="sessions has 1 entries for 2 prompts"):
        gen.generate(PROMPTS[:2], GREEDY, sessions=["a"])
    with pytest.raises(ValueError, match=r"session 'a' names rows 0 and 2"):
        gen.generate(PROMPTS[:3], GREEDY, sessions=["a", None, "a"])
    with pytest.raises(ValueError, match=r"sessions\[1\] = ''"):
        gen.generate(PROMPTS[:2], GREEDY, sessions=["a", ""])
    assert gen.prefix_counts() == PrefixCounts()  # nothing ran


def test_a_model_with_sliding_window_layers_is_refused_a_session_cache(tmp_path):
    import transformers

    config = transformers.Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, use_sliding_window=True,
                                      sliding_window=8, max_window_layers=0,
                                      max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="sliding-window layers"):
        TorchGenerator(model, prefix="sliding", session_cache_bytes=CACHE)
    plain = TorchGenerator(model, prefix="sliding2")  # without a session cache it serves
    with pytest.raises(ValueError, match="sliding-window layers"):  # but not continuously
        plain.submit([[1, 2]], GREEDY)


@pytest.mark.timeout(300)
async def test_a_replicas_sessions_reuse_until_a_switch_and_recompute_after(colocate_runtime,
                                                                          model_dirs):
    path = model_dirs["qwen2"]
    config = ServiceConfig(resource_group="rl", procs_per_host=1)
    trainer = await spawn_service(config, TrainerActor, path, name="trainer")
    gen = await spawn_service(ServiceConfig(resource_group="rl"), GeneratorActor, path,
                              name="generator", session_cache_bytes=CACHE)
    prompts = [list(p) for p in PROMPTS[:2]]
    names = ["traj-0", "traj-1"]
    async with phase(gen):
        async with gen.session(id="rollout"):
            first = await gen.generate.route(prompts, GREEDY, sessions=names)
            prompts = next_turn(prompts, first, 0)
            second = await gen.generate.route(prompts, GREEDY, None, names)
        assert all(c.prefix.reused > 0 and c.prefix.recomputed == 0 for c in second)
        prompts = next_turn(prompts, second, 1)
    async with phase(trainer):  # the generator sleeps: its cache goes
        pass
    async with phase(gen):
        third = await gen.generate.route(prompts, GREEDY, None, names)
        assert all(c.prefix.reused == 0 and c.prefix.recomputed > 0 for c in third)
        await gen.end_session.route("traj-0")
        totals = await gen.prefix_counts.route()
    assert totals == PrefixCounts.total(c.prefix for c in first + second + third)
    assert 0 < totals.recompute_share < 1
    torch.testing.assert_close(totals.recompute_share,
                               sum(c.prefix.recomputed for c in third)
                               / (totals.reused + totals.recomputed))
