"""Trainer checkpoints (`colocate.engines.checkpoint`): a save and a load give the next step
of the run that saved, exactly; an async save stages a real copy and drops it once
written; DCP reshards between FSDP on 2 procs, DDP on 2 procs and one proc; a failed or
interrupted save leaves nothing under its path; every bad checkpoint is refused with a
`CheckpointError` naming the cause, the trainer left as it was; a sleeping trainer is
refused. Multi-proc trainers run in plain processes over gloo, as tests/test_fsdp.py."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

from colocate import memory
from colocate.engines.checkpoint_files import (
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ModelMismatchError,
    is_complete,
)
from colocate.engines.models import load_model
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer
from colocate.engines.weights import digest

WORLD = 2
STEPS = 2  # steps before the save
TOLERANCE = 1e-5  # 2 ranks' mean loss vs one proc's: the same sums in another order


def ce_loss(module, batch):
    logits = module(input_ids=batch).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             batch[:, 1:].flatten()), {}


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(3, 16, (4, 12), generator=torch.Generator().manual_seed(step))


def make_model(path: Path, **options) -> str:
    return str(write_tiny_model(path, "qwen2", alphabet="0123456789+=>#", tie_embeddings=True,
                                init_std=0.1, **options))


def weights_digest(trainer: PolicyTrainer) -> str:
    return digest(trainer.weights().tensors())


def optimizer_digest(trainer: PolicyTrainer) -> str:
    states = trainer.optimizer.state.values()
    return digest((f"{i}.{k}", v.reshape(-1)) for i, state in enumerate(states)
                  for k, v in state.items())


_prefixes = iter(range(10**6))


def trainer_of(model_dir: str, **options) -> PolicyTrainer:
    return PolicyTrainer(load_model(model_dir), lr=0.01, prefix=f"ck{next(_prefixes)}",
                         **options)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model(tmp_path_factory.mktemp("ckpt_model") / "model")


# -- one proc ---------------------------------------------------------------------------------

def test_save_then_load_gives_the_next_step_of_the_run_that_saved(model_dir, tmp_path):
    """Save after k steps, train one more; a fresh trainer that loads and trains one step
    gets the same loss and the same weights, bit for bit; steps and the RNG come back;
    the loaded AdamW state is under the trainer's tags (a sleep releases it)."""
    trainer = trainer_of(model_dir)
    for step in range(STEPS):
        trainer.step(ce_loss, global_batch(step))
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path, frame_dir=model_dir)
    assert trainer.wait_checkpoint() is None  # a waited save leaves nothing in flight
    expected = trainer.step(ce_loss, global_batch(STEPS))["loss"]
    expected_weights = weights_digest(trainer)

    # the layout: DCP's files, trainer.json, the model's frame
    assert is_complete(path)
    assert {".metadata", "__0_0.distcp", "trainer.json", "hf"} <= set(os.listdir(path))
    info = json.loads((path / "trainer.json").read_text())
    assert (info["format"], info["world_size"], info["parallel"], info["steps"]) == \
        (1, 1, "none", STEPS)
    shapes = {n: list(t.shape) for n, t in trainer.model.state_dict().items()}
    assert info["params"] == shapes and info["optimizer"] is True
    assert {"config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(path / "hf"))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]

    torch.manual_seed(999)
    fresh = trainer_of(model_dir)
    fresh.load_checkpoint(path)
    assert fresh.steps == STEPS
    assert torch.equal(torch.get_rng_state(), rng)
    weight_bytes = sum(p.numel() * 4 for p in fresh.model.parameters())
    info_after = fresh.tenancy.describe()
    assert info_after.tagged_bytes >= 3 * weight_bytes  # weights + AdamW's two moments
    released = fresh.tenancy.sleep()
    assert released >= 3 * weight_bytes
    fresh.tenancy.wake(list(fresh.tenancy.stages))
    assert fresh.step(ce_loss, global_batch(STEPS))["loss"] == expected
    assert weights_digest(fresh) == expected_weights


def test_async_save_stages_a_real_copy_and_drops_it_once_written(model_dir, tmp_path):
    """`wait=False` returns with the state copied into new host memory (no tensor shares
    a storage with the trainer's): weights and AdamW state changed right after it are not
    what is written. Once written, the staged copy is gone."""
    trainer = trainer_of(model_dir)
    for step in range(STEPS):
        trainer.step(ce_loss, global_batch(step))
    saved_weights, saved_optim = weights_digest(trainer), optimizer_digest(trainer)
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path, wait=False)
    live = {t.untyped_storage().data_ptr() for t in trainer.model.parameters()} | {
        v.untyped_storage().data_ptr() for s in trainer.optimizer.state.values()
        for v in s.values()}
    with torch.no_grad():  # change everything at once, while the write may be under way
        for p in trainer.model.parameters():
            p.add_(1.0)
        for state in trainer.optimizer.state.values():
            state["exp_avg"].mul_(0)
    stager = trainer.checkpoints.last_stager
    staged = [ref() for ref in stager.staged]
    staged = [t for t in staged if t is not None]
    assert staged, "the staged copy is alive until written"
    assert not {t.untyped_storage().data_ptr() for t in staged if t.numel()} & live
    assert stager.staged_bytes >= 3 * sum(p.numel() * 4 for p in trainer.model.parameters())
    del staged
    assert trainer.wait_checkpoint() == str(path)
    assert stager.staged_resident() == 0  # the staged copy was dropped

    loaded = trainer_of(model_dir)
    loaded.load_checkpoint(path)
    assert weights_digest(loaded) == saved_weights
    assert optimizer_digest(loaded) == saved_optim


def test_a_save_before_any_step_and_into_an_existing_path(model_dir, tmp_path):
    """Before the first step there is no AdamW state: none is saved or made up (the
    trainer trains on as if never saved); a later save replaces the checkpoint whole."""
    trainer, twin = trainer_of(model_dir), trainer_of(model_dir)
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path)
    assert not trainer.optimizer.state
    assert json.loads((path / "trainer.json").read_text())["optimizer"] is False
    for step in range(STEPS):
        assert trainer.step(ce_loss, global_batch(step)) == twin.step(ce_loss,
                                                                      global_batch(step))
    loaded = trainer_of(model_dir)
    loaded.step(ce_loss, global_batch(0))
    loaded.load_checkpoint(path)  # back to no AdamW state, step 0
    assert loaded.steps == 0 and not loaded.optimizer.state
    assert loaded.step(ce_loss, global_batch(0)) == trainer_of(model_dir).step(
        ce_loss, global_batch(0))
    trainer.save_checkpoint(path)  # over the first one
    assert json.loads((path / "trainer.json").read_text())["steps"] == STEPS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- faults -----------------------------------------------------------------------------------

def _disk_full_after(monkeypatch, items: int) -> None:
    """DCP's file writer raises ENOSPC after `items` items (the one mock of these tests:
    a full disk cannot be made on a shared machine)."""
    original = dcp_fs._write_item
    written = []

    def write_item(*args, **kwargs):
        if len(written) >= items:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)


@pytest.mark.parametrize("wait", [False, True])
def test_a_disk_full_save_leaves_nothing_and_the_previous_checkpoint_loads(
        model_dir, tmp_path, monkeypatch, wait):
    trainer = trainer_of(model_dir)
    trainer.step(ce_loss, global_batch(0))
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path)
    first = weights_digest(trainer)
    trainer.step(ce_loss, global_batch(1))
    _disk_full_after(monkeypatch, items=3)  # mid-way: some tensors were written
    with pytest.raises(CheckpointWriteError) as failed:
        trainer.save_checkpoint(path, wait=wait)  # over the good one
        trainer.wait_checkpoint()
    message = str(failed.value)
    for named in (str(path), "disk is full", "nothing was written", "No space left"):
        assert named in message, named
    new_path = tmp_path / "new"
    with pytest.raises(CheckpointWriteError):
        trainer.save_checkpoint(new_path, wait=wait)
        trainer.wait_checkpoint()
    assert not new_path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left
    monkeypatch.undo()
    loaded = trainer_of(model_dir)
    loaded.load_checkpoint(path)
    assert loaded.steps == 1 and weights_digest(loaded) == first
    trainer.save_checkpoint(new_path)  # the trainer saves again once the disk has room
    assert is_complete(new_path)


def test_bad_checkpoints_are_refused_naming_the_cause_and_the_trainer_is_untouched(
        model_dir, tmp_path):
    trainer = trainer_of(model_dir)
    trainer.step(ce_loss, global_batch(0))
    good = tmp_path / "good"
    trainer.save_checkpoint(good)
    target = trainer_of(model_dir)
    target.step(ce_loss, global_batch(5))
    before = weights_digest(target), optimizer_digest(target), target.steps

    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        target.load_checkpoint(tmp_path / "nowhere")
    half = Path(shutil.copytree(good, tmp_path / "half"))
    (half / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"\.metadata missing.*never finished"):
        target.load_checkpoint(half)
    assert not is_complete(half)
    with pytest.raises(IncompleteCheckpointError, match="trainer.json missing"):
        target.load_checkpoint(model_dir)  # a model directory is not a checkpoint

    truncated = Path(shutil.copytree(good, tmp_path / "truncated"))
    data = truncated / "__0_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError,
                       match="truncated, corrupt or unreadable.*left as it was"):
        target.load_checkpoint(truncated)
    garbled = Path(shutil.copytree(good, tmp_path / "garbled"))
    (garbled / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        target.load_checkpoint(garbled)

    other_dir = make_model(tmp_path / "other_model", hidden_size=32, layers=3)
    other = trainer_of(other_dir)
    other.save_checkpoint(tmp_path / "other")
    with pytest.raises(ModelMismatchError) as mismatch:
        target.load_checkpoint(tmp_path / "other")
    message = str(mismatch.value)
    for named in ("another model", "unexpected: ['model.layers.2.", "mis-shaped:",
                  "model.embed_tokens.weight: [17, 32] in the checkpoint, [17, 64] here"):
        assert named in message, named
    assert (weights_digest(target), optimizer_digest(target), target.steps) == before
    target.load_checkpoint(good)  # and it still loads a good one
    assert weights_digest(target) == weights_digest(trainer)


def test_a_sleeping_trainer_refuses_to_save_or_load(model_dir, tmp_path):
    trainer = trainer_of(model_dir)
    trainer.step(ce_loss, global_batch(0))
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path)
    trainer.tenancy.sleep()
    for action, call in (("save", lambda: trainer.save_checkpoint(tmp_path / "asleep")),
                         ("load", lambda: trainer.load_checkpoint(path))):
        with pytest.raises(memory.TagPausedError,
                           match=f"cannot {action} a checkpoint: tenant .* is asleep.*wake it"):
            call()
    assert not (tmp_path / "asleep").exists()
    trainer.tenancy.wake(list(trainer.tenancy.stages))
    trainer.save_checkpoint(tmp_path / "awake")
    assert is_complete(tmp_path / "awake")


# -- resharding between FSDP, DDP and one proc, in plain processes ------------------------------

def rank_main(rank: int, port: int, scenario: str, model_dir: str, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    rows = slice(rank, None, WORLD)
    out: dict = {}
    if scenario == "fsdp_saves":
        trainer = PolicyTrainer(load_model(model_dir), lr=0.01, prefix="fsdp",
                                parallel="fsdp")
        for step in range(STEPS):
            trainer.step(ce_loss, global_batch(step)[rows])
        out["saved_digest"] = weights_digest(trainer)
        trainer.save_checkpoint(Path(root, "from_fsdp"), wait=False, frame_dir=model_dir)
        # the next step runs while the write is in flight, on the default group
        out["next_loss"] = trainer.step(ce_loss, global_batch(STEPS)[rows])["loss"]
        out["waited"] = trainer.wait_checkpoint()
        out["inflight_group"] = trainer.checkpoints._group is not None
    else:  # "load": a DDP trainer loads FSDP's checkpoint, an FSDP one the 1-proc's
        for parallel, source in (("ddp", "from_fsdp"), ("fsdp", "from_one")):
            trainer = PolicyTrainer(load_model(model_dir), lr=0.01, prefix=parallel,
                                    parallel=parallel)
            trainer.load_checkpoint(Path(root, source))
            out[parallel] = {
                "steps": trainer.steps, "digest": weights_digest(trainer),
                "loss": trainer.step(ce_loss, global_batch(STEPS)[rows])["loss"]}
    Path(root, f"{scenario}-{rank}.json").write_text(json.dumps(out))


def run_ranks(scenario: str, model_dir: str, root: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=rank_main, args=(r, port, scenario, model_dir, str(root)))
             for r in range(WORLD)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
    assert [proc.exitcode for proc in procs] == [0] * WORLD, f"a rank of {scenario} failed"
    return [json.loads((root / f"{scenario}-{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(600)
def test_checkpoints_reshard_between_fsdp_ddp_and_one_proc(model_dir, tmp_path):
    """FSDP on 2 procs saves (async, a step running meanwhile); one proc and DDP on 2
    procs load it; FSDP on 2 procs loads what one proc saved. Each loader holds exactly
    the saved weights and its next loss is the saver's next loss."""
    one = trainer_of(model_dir)
    for step in range(STEPS):
        one.step(ce_loss, global_batch(step))
    one.save_checkpoint(tmp_path / "from_one")
    one_digest = weights_digest(one)
    one_next = one.step(ce_loss, global_batch(STEPS))["loss"]

    saver = run_ranks("fsdp_saves", model_dir, tmp_path)
    assert [r["waited"] for r in saver] == [str(tmp_path / "from_fsdp")] * WORLD
    assert all(r["inflight_group"] for r in saver)
    info = json.loads((tmp_path / "from_fsdp" / "trainer.json").read_text())
    assert (info["world_size"], info["parallel"], info["steps"]) == (WORLD, "fsdp", STEPS)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(tmp_path / "from_fsdp"))
    fsdp_next = sum(r["next_loss"] for r in saver) / WORLD

    loaded = trainer_of(model_dir)
    loaded.load_checkpoint(tmp_path / "from_fsdp")
    assert loaded.steps == STEPS
    assert weights_digest(loaded) == saver[0]["saved_digest"]
    assert loaded.step(ce_loss, global_batch(STEPS))["loss"] == pytest.approx(
        fsdp_next, rel=TOLERANCE)

    loaders = run_ranks("load", model_dir, tmp_path)
    for parallel, digest_, next_loss in (("ddp", saver[0]["saved_digest"], fsdp_next),
                                         ("fsdp", one_digest, one_next)):
        assert [r[parallel]["steps"] for r in loaders] == [STEPS] * WORLD
        assert [r[parallel]["digest"] for r in loaders] == [digest_] * WORLD, parallel
        mean = sum(r[parallel]["loss"] for r in loaders) / WORLD
        assert mean == pytest.approx(next_loss, rel=TOLERANCE), parallel
