"""The engines without Monarch, on Hugging Face models (tiny Llama, Qwen2 with tied
embeddings, Qwen3): model directories and their bad forms, the trainer against
transformers, the torch generator against `generate`, the trainer under tags, weight
streams and sync (in place and through shared memory), and the arbiter's staged handoff
between a real trainer and generator in one process."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from colocate import memory, shm_files, telemetry
from colocate.arbiter import SlotArbiter, SwitchError
from colocate.arbiter.local import LocalTenantHandle
from colocate.engines.generator import TorchGenerator, WeightsDiscardedError
from colocate.engines.models import ModelDirError, check_model_dir, load_model, load_tokenizer
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import NonFiniteGradientsError, PolicyTrainer
from colocate.engines.weight_copy import ALONE_BYTES, copy_plan, copy_weights
from colocate.engines.weights import (
    StaleWeightsError,
    WeightStream,
    digest,
    export_weights,
    read_exported,
)

TEXTS = ("12+34=", "7>", "905+1=", "3")
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(2,))  # 2: eos


def net(path: str, seed: int = 0) -> torch.nn.Module:
    """The directory's model; with a seed, every weight moved by a little seeded noise."""
    model = load_model(path)
    if seed:
        rng = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=rng))
    return model


def prompts(path: str) -> list[list[int]]:
    tokenizer = load_tokenizer(path)
    return [tokenizer(text).input_ids for text in TEXTS]


def hf_greedy(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """transformers' own greedy decoding: what the generator must match."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                           dtype=torch.long),
                         do_sample=False, max_new_tokens=params.max_new_tokens,
                         eos_token_id=list(params.stop_token_ids), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def sum_loss(module, batch):
    """A loss that pushes every logit of token 5 down: training visibly changes weights."""
    return module(input_ids=batch).logits[..., 5].mean(), {}


def ce_loss(module, batch):
    """Next-token cross-entropy, as transformers computes it from `labels`."""
    logits = module(input_ids=batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                             batch[:, 1:].flatten()), {}


# -- model directories ----------------------------------------------------------------------

def test_bad_model_directories_are_refused_naming_the_file_or_field(tmp_path, model_dirs):
    def copy(name: str) -> str:
        return str(shutil.copytree(model_dirs["llama"], tmp_path / name))

    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(tmp_path / "nowhere")
    no_config = copy("no_config")
    os.remove(f"{no_config}/config.json")
    with pytest.raises(ModelDirError, match="has no config.json"):
        load_model(no_config)
    unknown = copy("unknown")
    config = json.loads(open(f"{unknown}/config.json").read())
    open(f"{unknown}/config.json", "w").write(json.dumps({**config, "model_type": "nonesuch"}))
    with pytest.raises(ModelDirError, match="model_type 'nonesuch'"):
        load_model(unknown)
    no_eos = copy("no_eos")
    tokenizer_config = json.loads(open(f"{no_eos}/tokenizer_config.json").read())
    tokenizer_config.pop("eos_token")
    open(f"{no_eos}/tokenizer_config.json", "w").write(json.dumps(tokenizer_config))
    with pytest.raises(ModelDirError, match="no end-of-sequence token"):
        load_tokenizer(no_eos)
    small = copy("small_vocab")
    open(f"{small}/config.json", "w").write(json.dumps({**config, "vocab_size": 8}))
    with pytest.raises(ModelDirError, match="16 tokens but the model's embeddings only 8"):
        load_model(small)


# -- the trainer and the generator against transformers, per architecture ---------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_trainer_loss_equals_transformers_reference(model_dirs, arch):
    batch = torch.tensor([p[:2] for p in prompts(model_dirs[arch])])
    reference = net(model_dirs[arch])
    expected = reference(input_ids=batch, labels=batch).loss.item()
    trainer = PolicyTrainer(net(model_dirs[arch]), prefix=f"t_ref_{arch}")
    assert trainer.step(ce_loss, batch)["loss"] == pytest.approx(expected, rel=1e-6)


def test_gradients_that_are_not_finite_leave_the_weights_as_they_were(model_dirs):
    """A diverged step (inf or NaN in the loss) is refused before the optimizer step:
    weights, AdamW state and the step count stay, and the next good step trains."""
    trainer = PolicyTrainer(net(model_dirs["llama"]), prefix="t_nonfinite")
    batch = torch.tensor([p[:2] for p in prompts(model_dirs["llama"])])
    trainer.step(sum_loss, batch)  # AdamW state exists from here on
    before = digest(trainer.weights().tensors())
    moments = [t.clone() for s in trainer.optimizer.state.values() for t in s.values()]
    for bad in (float("inf"), float("nan")):
        with pytest.raises(NonFiniteGradientsError, match="not finite.*lower the learning"):
            trainer.step(lambda module, b, bad=bad: (sum_loss(module, b)[0] * bad, {}), batch)
        assert digest(trainer.weights().tensors()) == before
        after = [t for s in trainer.optimizer.state.values() for t in s.values()]
        assert all(torch.equal(a, b) for a, b in zip(moments, after, strict=True))
        assert trainer.steps == 1
    trainer.step(sum_loss, batch)
    assert trainer.steps == 2 and digest(trainer.weights().tensors()) != before


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_generator_greedy_equals_transformers_generate_after_a_sync(model_dirs, arch):
    path = model_dirs[arch]
    trainer = PolicyTrainer(net(path, seed=1), prefix=f"t_sync_{arch}")
    gen = TorchGenerator(net(path, seed=2), max_batch=3, prefix=f"g_sync_{arch}")  # 2 batches
    assert digest(gen.weights().tensors()) != digest(trainer.weights().tensors())
    trainer.step(sum_loss, torch.tensor([prompts(path)[0]]))
    copied = gen.load_weights(trainer.weights())
    assert copied == sum(t.numel() * 4 for t in trainer.model.state_dict().values())
    assert digest(gen.weights().tensors()) == digest(trainer.weights().tensors())
    out = gen.generate(prompts(path), GREEDY)
    assert [c.tokens for c in out] == [hf_greedy(trainer.model, p, GREEDY)
                                       for p in prompts(path)]


def test_sampling_is_seeded_and_logprobs_are_the_policy(model_dirs):
    path = model_dirs["qwen2"]
    gen = TorchGenerator(net(path, seed=3), prefix="g_sample")
    batch = prompts(path)
    params = SamplingParams(max_new_tokens=6, temperature=0.7, seed=11)
    first, again = gen.generate(batch, params), gen.generate(batch, params)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    other = gen.generate(batch, SamplingParams(max_new_tokens=6, temperature=0.7, seed=12))
    assert [c.tokens for c in first] != [c.tokens for c in other]
    completion = first[0]
    with torch.no_grad():
        logits = gen.model(input_ids=torch.tensor([batch[0] + completion.tokens[:-1]]))
    expected = (logits.logits[0, len(batch[0]) - 1:] / 0.7).log_softmax(-1)
    expected = expected.gather(-1, torch.tensor(completion.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    nucleus = gen.generate(batch, SamplingParams(max_new_tokens=6, top_p=1e-6, seed=5))
    greedy = gen.generate(batch, SamplingParams(max_new_tokens=6, temperature=0))
    assert [c.tokens for c in nucleus] == [c.tokens for c in greedy]


def test_generator_refuses_bad_calls_and_bad_weights_whole(model_dirs):
    gen = TorchGenerator(net(model_dirs["llama"], seed=4), prefix="g_bad")
    before = digest(gen.weights().tensors())
    with pytest.raises(ValueError, match="do not fit"):
        gen.generate([[1] * 45], GREEDY)
    good = dict(gen.weights().tensors())
    for name, bad, message in (
            ("wrong shape", {**good, "lm_head.weight": torch.zeros(3, 3)},
             r"wrong shapes \['lm_head.weight: \(3, 3\) != \(16, 64\)'\]"),
            ("missing", {n: t for n, t in good.items() if n != "model.norm.weight"},
             r"missing \['model.norm.weight'\]"),
            ("extra", {**good, "model.extra.weight": torch.zeros(2)},
             r"unknown \['model.extra.weight'\]")):
        with pytest.raises(ValueError, match=f"nothing was written.*{message}"):
            gen.load_weights({n: t.clone() + 1 for n, t in bad.items()}.items())
        assert digest(gen.weights().tensors()) == before, name
    gen.tenancy.sleep()
    with pytest.raises(memory.TagPausedError):
        gen.generate(prompts(model_dirs["llama"]), GREEDY)
    with pytest.raises(memory.TagPausedError):
        gen.load_weights(good.items())
    with pytest.raises(KeyError, match="unknown stage"):
        gen.tenancy.wake(["weights", "optimizer"])
    gen.tenancy.wake(["weights"])
    assert digest(gen.weights().tensors()) == before


# -- the trainer under tags, weight streams -----------------------------------------------------

def trainer_sleep_scenario(path: str) -> dict:
    batch = torch.randint(3, 16, (4, 16), generator=torch.Generator().manual_seed(0))
    slept = PolicyTrainer(load_model(path), prefix="slept")
    twin = PolicyTrainer(load_model(path), prefix="twin")
    losses = [slept.step(sum_loss, batch)["loss"] for _ in range(3)]
    twin_losses = [twin.step(sum_loss, batch)["loss"] for _ in range(3)]
    info = slept.tenancy.describe()
    before = telemetry.process_rss()
    released = slept.tenancy.sleep()
    after = telemetry.process_rss()
    slept.tenancy.wake(list(slept.tenancy.stages))
    params = sum(p.numel() * 4 for p in slept.model.parameters())
    return {
        "losses": losses, "twin_losses": twin_losses, "stages": info.stages,
        "tagged": info.tagged_bytes, "params": params, "released": released,
        "rss_drop": before - after,
        "next": slept.step(sum_loss, batch)["loss"],
        "twin_next": twin.step(sum_loss, batch)["loss"],
        "same_weights": digest(slept.weights().tensors()) == digest(twin.weights().tensors()),
    }


def test_trainer_sleeps_all_its_memory_and_trains_on_identically(isolated, tmp_path):
    path = str(write_tiny_model(tmp_path / "m", "qwen2", alphabet="0123456789+=>",
                                hidden_size=256, layers=4, heads=4, kv_heads=2,
                                intermediate_size=1024))
    out = isolated(trainer_sleep_scenario, path)
    assert out["losses"][-1] < out["losses"][0]
    assert out["losses"] == out["twin_losses"]
    assert out["tagged"] >= 4 * out["params"]  # weights + grads + two AdamW moments
    assert out["released"] == out["tagged"]
    assert out["rss_drop"] >= 0.95 * out["released"]
    assert out["next"] == out["twin_next"] and out["same_weights"]


def test_weights_come_in_buckets_of_bounded_size(tmp_path):
    path = write_tiny_model(tmp_path / "m", "llama", hidden_size=256, intermediate_size=1024)
    trainer = PolicyTrainer(load_model(path), prefix="t_buckets", bucket_mb=1)
    stream = trainer.weights()
    buckets = list(stream.buckets())
    sizes = [sum(t.numel() * t.element_size() for _, t in bucket) for bucket in buckets]
    largest = max(t.numel() * t.element_size() for _, t in stream.tensors())
    assert len(buckets) > 2 and max(sizes) <= max(1 << 20, largest)
    assert {n for b in buckets for n, _ in b} == set(stream.specs)
    gen = TorchGenerator(net(str(path), seed=5), prefix="g_buckets")
    gen.load_weights(stream)
    assert digest(gen.weights().tensors()) == digest(trainer.weights().tensors())
    manifest = export_weights(trainer.weights(), "test_engines/buckets")  # bucket by bucket
    assert read_exported(manifest, digest) == digest(trainer.weights().tensors())


# -- weight sync across processes ---------------------------------------------------------------

def mlp(seed: int, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 16))


def read_export(manifest) -> str:
    return read_exported(manifest, digest)


def test_shared_memory_export_reaches_another_process(isolated):
    model = mlp(6)
    manifest = export_weights(model.state_dict().items(), "test_engines/export", version=3)
    assert manifest.version == 3
    assert isolated(read_export, manifest) == digest(model.state_dict().items())
    inode = os.stat(manifest.path).st_ino
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    again = export_weights(model.state_dict().items(), "test_engines/export", version=4)
    assert os.stat(again.path).st_ino == inode  # written in place, over the last export
    assert isolated(read_export, again) == digest(model.state_dict().items())


def export_and_exit(key: str) -> str:
    return export_weights(mlp(8).state_dict().items(), key).path


def test_an_export_goes_when_its_writer_exits(isolated):
    path = isolated(export_and_exit, "test_engines/exits")
    assert path.endswith(".bin") and "test_engines_exits-" in path
    assert not os.path.exists(path)


def export_and_die(key: str, out) -> None:
    out.put(export_weights(mlp(8).state_dict().items(), key).path)
    out.close()
    out.join_thread()  # the path is sent before the kill
    os.kill(os.getpid(), signal.SIGKILL)  # no atexit


def test_a_killed_writers_export_is_its_own_and_goes_with_its_proc():
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    writer = context.Process(target=export_and_die, args=("test_engines/killed", out))
    writer.start()
    path = out.get(timeout=60)
    writer.join(60)
    assert path.endswith(f"test_engines_killed-{writer.pid}.bin") and os.path.exists(path)
    assert shm_files.remove_files_of([writer.pid]) == [Path(path)]  # as stop_procs does
    assert not os.path.exists(path)


def test_an_export_during_a_read_is_detected():
    model = mlp(7)
    key = "test_engines/overwritten"
    first = export_weights(model.state_dict().items(), key, version=1)

    def load_while_exporting(views):
        copied = [(name, t.clone()) for name, t in views]
        export_weights(model.state_dict().items(), key, version=2)  # a second writer
        return copied

    with pytest.raises(StaleWeightsError, match="version 2 after the read.*may be torn"):
        read_exported(first, load_while_exporting)
    with pytest.raises(StaleWeightsError, match="before the read.*nothing was loaded"):
        read_exported(first, digest)
    export_weights(mlp(7, width=128).state_dict().items(), key, version=3)
    with pytest.raises(StaleWeightsError, match="other tensors"):
        read_exported(first, digest)


def test_a_stream_of_existing_tensors_is_one_bucket():
    pairs = list(mlp(9).state_dict().items())
    stream = WeightStream.of(pairs)
    assert [len(b) for b in stream.buckets()] == [len(pairs)]
    assert stream.specs["0.weight"] == ((64, 64), torch.float32)


def test_a_sync_plans_its_copy_once_and_walks_the_model_again_when_a_tensor_changes():
    """The copy's plan (where each name is in the model) is made at the first sync and
    kept; a replaced tensor, a `.data` of another shape or a new module makes a new one,
    and every name and shape is still checked before anything is written."""
    model, source = mlp(10), mlp(11)
    assert copy_weights(model, source.state_dict().items()) == sum(
        t.numel() * 4 for t in source.state_dict().values())
    assert digest(model.state_dict().items()) == digest(source.state_dict().items())
    plan = copy_plan(model)
    copy_weights(model, mlp(12).state_dict().items())
    assert copy_plan(model) is plan  # kept across syncs
    assert digest(model.state_dict().items()) == digest(mlp(12).state_dict().items())

    replaced = torch.nn.Parameter(torch.zeros(64, 64))
    model[0].weight = replaced  # a new tensor object under the same name
    copy_weights(model, source.state_dict().items())
    assert copy_plan(model) is not plan
    assert model[0].weight is replaced and torch.equal(replaced, source[0].weight)

    before = digest(model.state_dict().items())
    model[1].weight.data = torch.zeros(8, 64)  # same object, another shape: 16 rows given
    with pytest.raises(ValueError, match=r"nothing was written.*1.weight: \(16, 64\) != "
                                         r"\(8, 64\)"):
        copy_weights(model, source.state_dict().items())
    assert digest((n, t) for n, t in model.state_dict().items() if n != "1.weight") == \
        digest((n, t) for n, t in source.state_dict().items() if n != "1.weight")
    model[1].weight.data = torch.zeros(16, 64)
    copy_weights(model, source.state_dict().items())

    plan = copy_plan(model)
    model.add_module("2", torch.nn.Linear(16, 4))  # a new name the sync must give
    with pytest.raises(ValueError, match=r"nothing was written\): missing \['2.bias', "
                                         r"'2.weight'\]"):
        copy_weights(model, source.state_dict().items())
    assert copy_plan(model) is not plan
    assert digest(model.state_dict().items()) != before  # the last good sync stayed


def test_a_bucket_copies_small_tensors_together_large_ones_alone_and_any_dtype(
        monkeypatch):
    """Small tensors of one dtype pair go through one `_foreach_copy_`, large ones and
    other dtypes or layouts through `copy_`: all arrive, converted where the model's
    dtype differs; a tied target fed from one source is written once."""
    big = ALONE_BYTES // 4 + 1  # fp32 elements over the bound

    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.small = torch.nn.Parameter(torch.zeros(3, 5))
            self.low = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
            self.bias = torch.nn.Parameter(torch.zeros(5))
            self.large = torch.nn.Parameter(torch.zeros(big))
            self.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
            self.head = torch.nn.Linear(5, 3, bias=False)
            self.head.weight = self.small  # tied: two names, one tensor

    model = Mixed()
    given = {"small": torch.randn(3, 5), "low": torch.randn(7), "bias": torch.randn(5),
             "large": torch.randn(big), "steps": torch.tensor([4, 5]),
             "head.weight": None}
    given["head.weight"] = given["small"]
    stream = WeightStream({n: (tuple(t.shape), t.dtype) for n, t in given.items()},
                          lambda: iter([list(given.items())[:3], list(given.items())[3:]]))
    together = []
    foreach_copy = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda targets, sources: (
        together.append(len(targets)), foreach_copy(targets, sources)))
    copy_weights(model, stream)
    assert together == [2]  # small and bias; the bf16 one, the int64 one, the large one alone
    assert torch.equal(model.small, given["small"]) and model.head.weight is model.small
    assert torch.equal(model.low, given["low"].bfloat16())
    assert torch.equal(model.large, given["large"]) and torch.equal(model.bias, given["bias"])
    assert model.steps.tolist() == [4, 5]
    other = {**given, "head.weight": torch.randn(3, 5)}  # the tie given two values
    copy_weights(model, other.items())
    assert torch.equal(model.small, other["head.weight"])  # the later name wins, as before


# -- the staged handoff through the arbiter ---------------------------------------------------

class RecordingGenerator(TorchGenerator):
    """Records what was awake while it copied the trainer's weights; can be made to fail."""

    fail = False

    def receive(self, source: str) -> int:
        self.seen = {tag: memory.state(tag).value for tag in memory.tags()}
        if self.fail:
            raise RuntimeError("injected copy failure")
        return super().receive(source)


def handoff_scenario(path: str, fail: bool) -> dict:
    async def run():
        arbiter = SlotArbiter([0])
        trainer = PolicyTrainer(net(path, seed=7), prefix="trainer")
        gen = RecordingGenerator(net(path, seed=8), prefix="generator")
        gen.fail = fail
        await arbiter.register(0, LocalTenantHandle("trainer", trainer.tenancy))
        # the generator is put to sleep
        await arbiter.register(0, LocalTenantHandle("generator", gen.tenancy, gen.receive))
        trainer.step(sum_loss, torch.tensor([[1, 4, 5]]))
        trained, old = digest(trainer.weights().tensors()), None
        out = {}
        try:
            out["copied"] = await arbiter.handoff("trainer", "generator")
        except SwitchError as err:
            out["error"], out["after_error"] = str(err), arbiter.status()[0]
            await arbiter.wake("generator")
            old = digest(gen.weights().tensors())
        out.update(status=arbiter.status()[0], seen=gen.seen,
                   synced=digest(gen.weights().tensors()) == trained,
                   untouched=old == digest(net(path, seed=8).state_dict().items()))
        return out

    return asyncio.run(run())


def test_handoff_is_staged_and_leaves_the_generator_with_the_trained_weights(isolated,
                                                                              model_dirs):
    out = isolated(handoff_scenario, model_dirs["llama"], False)
    assert out["seen"] == {  # during the copy: only the two weight stages held
        "trainer/weights": "active", "trainer/optimizer": "paused", "trainer/grads": "paused",
        "generator/weights": "active"}
    assert out["status"] == {"trainer": [], "generator": ["weights"]}
    assert out["synced"] and out["copied"] > 0


def test_failed_handoff_rolls_back_to_the_trainer(isolated, model_dirs):
    out = isolated(handoff_scenario, model_dirs["llama"], True)
    assert "injected copy failure" in out["error"] and "rolled back" in out["error"]
    assert out["seen"]["generator/weights"] == "active"
    assert out["after_error"] == {"trainer": ["weights", "optimizer", "grads"],
                                  "generator": []}
    # then the generator was woken by hand: its weights were not touched
    assert out["status"] == {"trainer": [], "generator": ["weights"]}
    assert out["untouched"] and not out["synced"]


def discarded_weights_scenario(path: str) -> dict:
    """A generator that keeps no weights across sleeps, taking turns with a trainer."""
    async def run():
        arbiter = SlotArbiter([0])
        trainer = PolicyTrainer(net(path, seed=7), prefix="trainer")
        gen = TorchGenerator(net(path, seed=8), prefix="generator", keep_weights=False)
        batch = prompts(path)
        before = [c.tokens for c in gen.generate(batch, GREEDY)]  # its own weights: fine
        await arbiter.register(0, LocalTenantHandle("trainer", trainer.tenancy))
        # the generator is put to sleep
        await arbiter.register(0, LocalTenantHandle("generator", gen.tenancy, gen.receive))
        await arbiter.wake("generator")  # woken with no weights loaded since
        reference = net(path, seed=8)
        out = {"before": before == [hf_greedy(reference, p, GREEDY) for p in batch]}
        for name, call in (("generate", lambda: gen.generate(batch, GREEDY)),
                           ("checksum", lambda: digest(gen.weights().tensors()))):
            try:
                call()
            except WeightsDiscardedError as err:
                out[name] = str(err)
        await arbiter.wake("trainer")
        trainer.step(sum_loss, torch.tensor([batch[0]]))
        trained = [hf_greedy(trainer.model, p, GREEDY) for p in batch]
        await arbiter.handoff("trainer", "generator")  # the trainer sleeps
        out["after"] = [c.tokens for c in gen.generate(batch, GREEDY)] == trained
        return out

    return asyncio.run(run())


def test_a_generator_that_keeps_no_weights_refuses_until_synced(isolated, model_dirs):
    out = isolated(discarded_weights_scenario, model_dirs["llama"])
    assert out["before"]
    assert "discarded" in out["generate"] and "sync weights" in out["generate"]
    assert "discarded" in out["checksum"]
    assert out["after"]  # the handoff's copy made it whole again


def test_a_batch_moves_to_the_engines_device_whole_and_the_rest_stays():
    from collections import namedtuple

    from colocate.engines.batches import to_device

    Pair = namedtuple("Pair", "ids mask")
    batch = {"pair": Pair(torch.ones(2), torch.zeros(2)), "rows": [torch.ones(1), 3],
             "shape": (torch.ones(3), "name"), "seed": 7}
    moved = to_device(batch, "meta")
    assert isinstance(moved["pair"], Pair) and isinstance(moved["shape"], tuple)
    tensors = [moved["pair"].ids, moved["pair"].mask, moved["rows"][0], moved["shape"][0]]
    assert all(t.device.type == "meta" for t in tensors)
    assert (moved["rows"][1], moved["shape"][1], moved["seed"]) == (3, "name", 7)
    assert batch["pair"].ids.device.type == "cpu"  # the caller's batch is left as it was
