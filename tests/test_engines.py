"""The engines without Monarch: the Llama against transformers, the torch generator, the
trainer under tags, weight sync (in place and through shared memory), and the arbiter's
staged handoff between a real trainer and generator in one process."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from colocate import memory, telemetry
from colocate.arbiter import SlotArbiter, SwitchError
from colocate.arbiter.local import LocalTenantHandle
from colocate.engines.generator import TorchGenerator, WeightsDiscardedError
from colocate.engines.llama import KVCache, Llama, LlamaConfig, load_pretrained, save_pretrained
from colocate.engines.sampling import SamplingParams
from colocate.engines.tokenizer import CharTokenizer
from colocate.engines.trainer import PolicyTrainer
from colocate.engines.weights import (
    StaleWeightsError,
    digest,
    export_weights,
    read_exported,
)

TOKENIZER = CharTokenizer("0123456789+=>")
SMALL = LlamaConfig(vocab_size=TOKENIZER.vocab_size, dim=64, n_heads=2, n_kv_heads=1,
                    hidden_dim=128, max_seq_len=48)
PROMPTS = [TOKENIZER.encode(p) for p in ("12+34=", "7>", "905+1=", "3")]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(TOKENIZER.eos_id,))


def model(seed: int, config: LlamaConfig = SMALL) -> Llama:
    torch.manual_seed(seed)
    return Llama(config)


def greedy_reference(net: Llama, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding by full forward passes, no cache: what the generator must match."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_new_tokens):
            tokens.append(int(net(torch.tensor([tokens]))[0, -1].argmax()))
            if tokens[-1] in params.stop_token_ids:
                break
    return tokens[len(prompt):]


def sum_loss(module, batch):
    """A loss that pushes every logit of token 5 down: training visibly changes weights."""
    return module(batch)[..., 5].mean(), {}


# -- the model ---------------------------------------------------------------------------------

def test_llama_matches_transformers_and_padding_and_cache(tmp_path):
    transformers = pytest.importorskip("transformers")
    net = model(0).eval()
    save_pretrained(net, tmp_path, TOKENIZER)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.tensor([PROMPTS[0]])
    padded = torch.tensor([[0, 0, 0] + PROMPTS[0]])
    cache = KVCache.allocate(SMALL, 1, "cpu")
    with torch.no_grad():
        ours, theirs = net(x), hf(x).logits
        unpadded_rows = net(padded, padded != 0)[:, 3:]
        head = net(padded[:, :5], padded[:, :5] != 0, cache, 0)
        tail = net(padded[:, 5:], padded != 0, cache, 5)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert torch.allclose(ours, unpadded_rows, atol=1e-5)
    assert torch.allclose(ours, torch.cat([head, tail], 1)[:, 3:], atol=1e-5)
    assert digest(load_pretrained(tmp_path).state_dict().items()) == \
        digest(net.state_dict().items())
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("12+34=").input_ids == TOKENIZER.encode("12+34=", bos=False)


def test_config_and_tokenizer_reject_bad_input():
    with pytest.raises(ValueError, match="n_heads"):
        LlamaConfig(dim=64, n_heads=3)
    with pytest.raises(ValueError, match="not in the alphabet"):
        TOKENIZER.encode("12a")
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


# -- the generator ----------------------------------------------------------------------------

def test_generator_greedy_equals_full_forward_after_weight_sync():
    trainer = PolicyTrainer(model(1), prefix="t_sync")
    gen = TorchGenerator(model(2), max_batch=3, prefix="g_sync")  # 4 prompts: two batches
    assert digest(gen.named_weights()) != digest(trainer.named_weights())
    trainer.step(sum_loss, torch.tensor([PROMPTS[0]]))
    copied = gen.load_weights(trainer.named_weights())
    assert copied == sum(p.numel() * 4 for p in trainer.model.parameters())
    assert digest(gen.named_weights()) == digest(trainer.named_weights())
    out = gen.generate(PROMPTS, GREEDY)
    assert [c.tokens for c in out] == [greedy_reference(trainer.model, p, GREEDY)
                                       for p in PROMPTS]


def test_sampling_is_seeded_and_logprobs_are_the_policy():
    gen = TorchGenerator(model(3), prefix="g_sample")
    params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=11)
    first, again = gen.generate(PROMPTS, params), gen.generate(PROMPTS, params)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    other = gen.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.7, seed=12))
    assert [c.tokens for c in first] != [c.tokens for c in other]
    completion = first[0]
    with torch.no_grad():
        logits = gen.model(torch.tensor([PROMPTS[0] + completion.tokens[:-1]]))[0]
    expected = (logits[len(PROMPTS[0]) - 1:] / 0.7).log_softmax(-1)
    expected = expected.gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    nucleus = gen.generate(PROMPTS, SamplingParams(max_new_tokens=6, top_p=1e-6, seed=5))
    greedy = gen.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    assert [c.tokens for c in nucleus] == [c.tokens for c in greedy]


def test_generator_refuses_bad_calls_without_corruption():
    gen = TorchGenerator(model(4), prefix="g_bad")
    before = digest(gen.named_weights())
    with pytest.raises(ValueError, match="do not fit"):
        gen.generate([[1] * 45], GREEDY)
    wrong = dict(gen.named_weights())
    wrong["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="nothing was copied"):
        gen.load_weights(wrong.items())
    assert digest(gen.named_weights()) == before
    gen.sleep()
    with pytest.raises(memory.TagPausedError):
        gen.generate(PROMPTS, GREEDY)
    with pytest.raises(memory.TagPausedError):
        gen.load_weights(wrong.items())
    with pytest.raises(KeyError, match="unknown stage"):
        gen.wake(["weights", "optimizer"])
    gen.wake(["weights", "kv_cache"])
    assert digest(gen.named_weights()) == before


# -- the trainer ----------------------------------------------------------------------------

def trainer_sleep_scenario() -> dict:
    big = LlamaConfig(vocab_size=16, dim=256, n_heads=4, n_kv_heads=2, hidden_dim=1024,
                      n_layers=4, max_seq_len=32)
    batch = torch.randint(0, 16, (4, 16), generator=torch.Generator().manual_seed(0))
    slept, twin = PolicyTrainer(model(5, big), prefix="slept"), \
        PolicyTrainer(model(5, big), prefix="twin")
    losses = [slept.step(sum_loss, batch)["loss"] for _ in range(3)]
    twin_losses = [twin.step(sum_loss, batch)["loss"] for _ in range(3)]
    info = slept.describe()
    before = telemetry.process_rss()
    released = slept.sleep()
    after = telemetry.process_rss()
    slept.wake(list(slept.tenancy.stages))
    return {
        "losses": losses, "twin_losses": twin_losses, "stages": info.stages,
        "tagged": info.tagged_bytes, "released": released, "rss_drop": before - after,
        "next": slept.step(sum_loss, batch)["loss"],
        "twin_next": twin.step(sum_loss, batch)["loss"],
        "same_weights": digest(slept.named_weights()) == digest(twin.named_weights()),
    }


def test_trainer_sleeps_all_its_memory_and_trains_on_identically(isolated):
    out = isolated(trainer_sleep_scenario)
    assert out["losses"][-1] < out["losses"][0]
    assert out["losses"] == out["twin_losses"]
    params = 4 * (16 * 256 * 2 + 4 * (256 * 256 * 2 + 256 * 128 * 2 + 3 * 256 * 1024 + 512)
                  + 256)
    assert out["tagged"] >= 4 * params  # weights + grads + two AdamW moments
    assert out["released"] == out["tagged"]
    assert out["rss_drop"] >= 0.95 * out["released"]
    assert out["next"] == out["twin_next"] and out["same_weights"]


# -- weight sync across processes ---------------------------------------------------------------

def read_export(manifest) -> str:
    return read_exported(manifest, digest)


def test_shared_memory_export_reaches_another_process(isolated):
    net = model(6)
    manifest = export_weights(net.state_dict().items(), "test_engines/export", version=3)
    assert manifest.version == 3
    assert isolated(read_export, manifest) == digest(net.state_dict().items())
    inode = os.stat(manifest.path).st_ino
    net.apply(lambda m: [p.data.add_(1) for p in m.parameters(recurse=False)])
    again = export_weights(net.state_dict().items(), "test_engines/export", version=4)
    assert os.stat(again.path).st_ino == inode  # written in place, over the last export
    assert isolated(read_export, again) == digest(net.state_dict().items())


def export_and_exit(key: str) -> str:
    return export_weights(model(8).state_dict().items(), key).path


def test_an_export_goes_when_its_writer_exits(isolated):
    path = isolated(export_and_exit, "test_engines/exits")
    assert path.endswith("test_engines_exits.bin") and not os.path.exists(path)


def test_an_export_during_a_read_is_detected():
    net = model(7)
    key = "test_engines/overwritten"
    first = export_weights(net.state_dict().items(), key, version=1)

    def load_while_exporting(views):
        copied = [(name, t.clone()) for name, t in views]
        export_weights(net.state_dict().items(), key, version=2)  # a second writer
        return copied

    with pytest.raises(StaleWeightsError, match="version 2 after the read.*may be torn"):
        read_exported(first, load_while_exporting)
    with pytest.raises(StaleWeightsError, match="before the read.*nothing was loaded"):
        read_exported(first, digest)
    grown = dataclasses.replace(SMALL, dim=2 * SMALL.dim)
    export_weights(model(7, grown).state_dict().items(), key, version=3)
    with pytest.raises(StaleWeightsError, match="other tensors"):
        read_exported(first, digest)


# -- the staged handoff through the arbiter ---------------------------------------------------

class RecordingGenerator(TorchGenerator):
    """Records what was awake while it copied the trainer's weights; can be made to fail."""

    fail = False

    def receive(self, source: str) -> int:
        self.seen = {tag: memory.state(tag).value for tag in memory.tags()}
        if self.fail:
            raise RuntimeError("injected copy failure")
        return super().receive(source)


def handoff_scenario(fail: bool) -> dict:
    async def run():
        arbiter = SlotArbiter([0])
        trainer = PolicyTrainer(model(7), prefix="trainer")
        gen = RecordingGenerator(model(8), prefix="generator")
        gen.fail = fail
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, LocalTenantHandle("generator", gen))  # put to sleep
        trainer.step(sum_loss, torch.tensor([PROMPTS[0]]))
        trained, old = digest(trainer.named_weights()), None
        out = {}
        try:
            out["copied"] = await arbiter.handoff("trainer", "generator")
        except SwitchError as err:
            out["error"], out["after_error"] = str(err), arbiter.status()[0]
            await arbiter.wake("generator")
            old = digest(gen.named_weights())
        out.update(status=arbiter.status()[0], seen=gen.seen,
                   synced=digest(gen.named_weights()) == trained,
                   untouched=old == digest(model(8).state_dict().items()))
        return out

    return asyncio.run(run())


def test_handoff_is_staged_and_leaves_the_generator_with_the_trained_weights(isolated):
    out = isolated(handoff_scenario, False)
    assert out["seen"] == {  # during the copy: only the two weight stages held
        "trainer/weights": "active", "trainer/optimizer": "paused", "trainer/grads": "paused",
        "generator/weights": "active", "generator/kv_cache": "paused"}
    assert out["status"] == {"trainer": [], "generator": ["weights", "kv_cache"]}
    assert out["synced"] and out["copied"] > 0


def test_failed_handoff_rolls_back_to_the_trainer(isolated):
    out = isolated(handoff_scenario, True)
    assert "injected copy failure" in out["error"] and "rolled back" in out["error"]
    assert out["seen"]["generator/weights"] == "active"
    assert out["after_error"] == {"trainer": ["weights", "optimizer", "grads"],
                                  "generator": []}
    # then the generator was woken by hand: its weights were not touched
    assert out["status"] == {"trainer": [], "generator": ["weights", "kv_cache"]}
    assert out["untouched"] and not out["synced"]


def discarded_weights_scenario() -> dict:
    """A generator that keeps no weights across sleeps, taking turns with a trainer."""
    async def run():
        arbiter = SlotArbiter([0])
        trainer = PolicyTrainer(model(7), prefix="trainer")
        gen = TorchGenerator(model(8), prefix="generator", keep_weights=False)
        before = [c.tokens for c in gen.generate(PROMPTS, GREEDY)]  # its own weights: fine
        await arbiter.register(0, LocalTenantHandle("trainer", trainer))
        await arbiter.register(0, LocalTenantHandle("generator", gen))  # put to sleep
        await arbiter.wake("generator")  # woken with no weights loaded since
        out = {"before": before == [greedy_reference(model(8), p, GREEDY) for p in PROMPTS]}
        for name, call in (("generate", lambda: gen.generate(PROMPTS, GREEDY)),
                           ("checksum", lambda: digest(gen.named_weights()))):
            try:
                call()
            except WeightsDiscardedError as err:
                out[name] = str(err)
        await arbiter.wake("trainer")
        trainer.step(sum_loss, torch.tensor([PROMPTS[0]]))
        trained = [greedy_reference(trainer.model, p, GREEDY) for p in PROMPTS]
        await arbiter.handoff("trainer", "generator")  # the trainer sleeps
        out["after"] = [c.tokens for c in gen.generate(PROMPTS, GREEDY)] == trained
        return out

    return asyncio.run(run())


def test_a_generator_that_keeps_no_weights_refuses_until_synced(isolated):
    out = isolated(discarded_weights_scenario)
    assert out["before"]
    assert "discarded" in out["generate"] and "sync weights" in out["generate"]
    assert "discarded" in out["checksum"]
    assert out["after"]  # the handoff's copy made it whole again
