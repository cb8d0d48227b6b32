"""A run's plan (colocate.planning, examples/rl_loop/plan.py): its stage sizes are the real
tenants', `--plan` starts nothing and writes its JSON, a plan that does not fit says why,
and a short run's summary holds its figures against the plan."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from colocate.engines.generator import TorchGenerator
from colocate.engines.models import load_model
from colocate.engines.tiny import write_tiny_model
from colocate.engines.trainer import PolicyTrainer
from colocate.planning import Rates, Sync, TenantSpec, Wake, forecast_slot, plan_run
from examples.rl_loop import task
from examples.rl_loop.config import load_config
from examples.rl_loop.plan import model_config, tenants

pytestmark = pytest.mark.timeout(300)

# fixed rates, so that a test's plan does not depend on this machine's
RATES = Rates(device="cpu", backup_out=1e9, backup_in=1e9, drop=1e11, refill=1e10,
              in_slot=5e9, fixed_s={"wake": 0.01, "sync": 0.01, "in_place": 0.002},
              process_bytes=500 << 20)


@pytest.fixture
def rates_file(tmp_path):
    path = tmp_path / "rates.json"
    RATES.save(path)
    return path


def test_the_plans_stage_sizes_are_the_real_tenants(tmp_path):
    cfg = load_config()
    m = cfg.model
    path = write_tiny_model(tmp_path / "m", m.architecture, alphabet=task.ALPHABET,
                            hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
                            kv_heads=m.kv_heads, intermediate_size=m.intermediate_size,
                            max_positions=m.max_positions)
    planned = {t.name: t for t in tenants(cfg, model_config(cfg, task.ALPHABET))[0]}
    trainer = PolicyTrainer(load_model(path), prefix="plan_trainer")
    batch = torch.randint(3, 10, (2, 8), generator=torch.Generator().manual_seed(0))
    trainer.step(lambda module, b: (module(input_ids=b).logits.mean(), {}), batch)
    generator = TorchGenerator(load_model(path), max_batch=cfg.generator.max_batch,
                               prefix="plan_generator", keep_weights=False)  # as the loop
    for name, real in (("trainer", trainer.tenancy.describe()),
                       ("generator", generator.tenancy.describe())):
        spec = planned[name]
        assert list(spec.stages) == list(real.stages)
        for stage, (nbytes, kept) in spec.stages.items():
            # the estimate leaves out the model's buffers (a rotary table: 128 bytes here)
            assert abs(real.size(stage) - nbytes) <= 0.001 * nbytes, (name, stage)
            assert kept == (stage in real.kept)
        assert spec.working_bytes == real.working_bytes
    params = list(trainer.model.parameters())
    real_tensors = {"weights": len(params), "grads": sum(p.grad is not None for p in params),
                    "optimizer": sum(len(state) for state in trainer.optimizer.state.values())}
    assert dict(planned["trainer"].tensors) == real_tensors
    assert dict(planned["generator"].tensors) == {"weights": len(params)}


def test_plan_starts_nothing_and_writes_its_json(tmp_path, rates_file, monkeypatch, capsys):
    import examples.rl_loop.loop as loop
    from examples.rl_loop.__main__ import main

    def no_loop(*args, **kwargs):
        raise AssertionError("--plan built the loop")

    monkeypatch.setattr(loop, "Loop", no_loop)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as done:
        main(["--plan", "--rates", str(rates_file), f"run.out={out}"])
    assert done.value.code == 0
    assert not (out / "metrics.json").exists()
    plan = json.loads((out / "plan.json").read_text())
    printed = capsys.readouterr().out
    assert plan["fits"] and "fits: yes" in printed
    slot = plan["slots"][0]
    assert set(slot["tenants"]) == {"trainer", "generator"}
    assert set(slot["tenants"]["trainer"]["stages"]) == {"weights", "optimizer", "grads"}
    # auto's capacity: the trainer's weights go to host memory and back once a step
    weights = slot["tenants"]["trainer"]["stages"]["weights"]["bytes"]
    assert plan["predicted"]["bytes_moved_per_step"] == 2 * weights
    assert [s["turn"] for s in slot["step"]] == [
        "wake generator", "wake trainer", "sync trainer -> generator"]
    assert plan["predicted"]["switch_time_per_step_s"] == pytest.approx(
        sum(s["seconds"] for s in slot["step"]))
    with pytest.raises(SystemExit) as done:  # a slot below the trainer alone: exit status 3
        main(["--plan", "--rates", str(rates_file), f"run.out={out}",
              "run.slot_memory=500KiB"])
    assert done.value.code == 3
    printed = capsys.readouterr().out
    assert "fits: no: slot 0: " in printed and "cannot wake" in printed


def test_a_plan_that_does_not_fit_names_why():
    trainer = TenantSpec("trainer", {"weights": (100, True), "optimizer": (200, True),
                                     "grads": (100, False)})
    generator = TenantSpec("generator", {"weights": (100, False)}, working_bytes=50)
    step = [Wake("generator"), Wake("trainer"), Sync("trainer", "generator")]
    start = [Sync("trainer", "generator")]
    fits = forecast_slot([trainer, generator], step, 400, start=start)
    # the generator's turn (150 with its working memory) beside the trainer's 300 kept:
    # its weights (the smaller kept stage) go out and come back once a step
    assert fits.fits and fits.moved_per_step() == 200 and fits.peak_bytes() == 400
    small = forecast_slot([trainer, generator], step, 300, start=start)
    assert not small.fits and "needs" in small.why and "300" not in small.why.split(":")[0]
    host = plan_run([[trainer, generator]], step, 400, RATES, start=start,
                    host_capacity_bytes=150, host_other_bytes=100)  # + 100 of backups
    assert not host.fits and host.why.startswith("the host:") and "capacity" in host.why
    roomy = forecast_slot([trainer, generator], step, 10_000, start=start)
    assert roomy.moved_per_step() == 0
    assert [s.way for s in roomy.step] == ["none", "none", "in_place"]


def test_a_switch_counts_the_tensors_it_handles_and_the_plan_prices_them():
    trainer = TenantSpec("trainer", {"weights": (100, True), "optimizer": (200, True),
                                     "grads": (100, False)},
                         tensors={"weights": 10, "optimizer": 30, "grads": 10})
    generator = TenantSpec("generator", {"weights": (100, False)}, working_bytes=50,
                           tensors={"weights": 10})
    step = [Wake("generator"), Wake("trainer"), Sync("trainer", "generator")]
    start = [Sync("trainer", "generator")]
    tight = forecast_slot([trainer, generator], step, 400, start=start)
    # the trainer's wake: the generator's weights dropped, the trainer's weights and grads
    # back; the sync: the trainer's grads and weights out, the generator's weights in and
    # written by the copy (its 10 tensors once more)
    assert [s.tensors for s in tight.step] == [0, 30, 40]
    roomy = forecast_slot([trainer, generator], step, 10_000, start=start)
    assert [s.tensors for s in roomy.step] == [0, 0, 10]  # the in-place copy's
    rates = dataclasses.replace(RATES, per_tensor_s={"in_place": 1e-3})
    plan = plan_run([[trainer, generator]], step, 10_000, rates, start=start)
    assert plan.figures()["sync_s_per_step"] == pytest.approx(
        RATES.seconds("in_place", in_slot=100) + 10 * 1e-3)


def test_a_plan_for_a_bigger_machine_is_not_bound_by_this_ones_memory():
    """The slot's moves for stages far beyond this machine's memory (a node's, planned on a
    laptop) are the same as for small ones: every kept stage goes to host memory, and the
    host's capacity is the plan's to judge (`plan_run`'s host_capacity_bytes)."""
    tib = 1 << 40
    trainer = TenantSpec("trainer", {"weights": (tib, True), "optimizer": (2 * tib, True),
                                     "grads": (tib, False)})
    generator = TenantSpec("generator", {"weights": (tib, False)}, working_bytes=tib // 2)
    step = [Wake("generator"), Wake("trainer"), Sync("trainer", "generator")]
    start = [Sync("trainer", "generator")]
    big = forecast_slot([trainer, generator], step, 4 * tib, start=start)
    assert big.fits, big.why
    assert big.moved_per_step() == 2 * tib and big.peak_bytes() == 4 * tib  # as at 400 B
    planned = plan_run([[trainer, generator]], step, 4 * tib, RATES, start=start,
                       host_capacity_bytes=2 * tib)
    assert planned.fits and planned.figures()["host_backup_bytes"] == tib


def test_a_plan_for_a_gpu_node_is_made_here_from_that_gpus_rates():
    """Rates measured on a GPU make the plan that GPU's, on a machine without one: `auto`
    slots hold the GPU's memory (as its rates file says it) and backups are pinned; a file
    that does not say it is refused, naming the field to give."""
    from examples.rl_loop.plan import make_plan

    gpu = dataclasses.replace(RATES, device="NVIDIA H100 80GB HBM3", slot_bytes=80 << 30)
    cfg = load_config(overrides=["run.slots=2"])  # run.slot_memory=auto
    model = model_config(cfg, task.ALPHABET)
    there = make_plan(cfg, model, gpu).as_dict()
    assert there["pinned"] and [s["capacity_bytes"] for s in there["slots"]] == [80 << 30] * 2
    here = make_plan(cfg, model, RATES).as_dict()  # CPU slots: auto is a tight capacity
    assert not here["pinned"] and here["slots"][0]["capacity_bytes"] < 1 << 30
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="give run.slot_memory"):
            make_plan(cfg, model, dataclasses.replace(gpu, slot_bytes=0))
    sized = load_config(overrides=["run.slots=2", "run.slot_memory=40GiB"])
    assert make_plan(sized, model, dataclasses.replace(gpu, slot_bytes=0)).as_dict()[
        "slots"][0]["capacity_bytes"] == 40 << 30
    # a host short of memory for backups: CPU slots' go to disk, a GPU's cannot (yet)
    short = load_config(overrides=["run.policy=exclusive", "run.host_memory=1000"])
    assert make_plan(short, model, RATES).fits
    refused = make_plan(short, model, gpu)
    assert not refused.fits and "run.host_memory" in refused.why and "disk" in refused.why


def test_a_vllm_copy_over_tensor_parallel_ranks_holds_its_share_of_the_kv_heads():
    """Each rank of a copy holds its share of the key/value heads (vLLM splits them), at
    least one (past their number vLLM repeats them): what the engine reserves per rank and
    what the plan sizes."""
    from colocate.engines.generator import KV_BLOCK_TOKENS, kv_cache_bytes
    from examples.rl_loop.budget import tenant_sizes

    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "num_hidden_layers": 2}
    whole = kv_cache_bytes(config, 8, 64)
    assert kv_cache_bytes(config, 8, 64, tensor_parallel=2) == whole // 2
    assert kv_cache_bytes(config, 8, 64, tensor_parallel=4) == whole // 2  # a head each

    def planned(tp: int) -> int:
        cfg = load_config(overrides=["run.engine=vllm", "run.slots=2", "model.heads=2",
                                     "model.kv_heads=2", f"generator.tensor_parallel_size={tp}"])
        sizes = tenant_sizes(cfg, model_config(cfg, task.ALPHABET))
        return sizes["generator"].stages["kv_cache"][0]

    assert planned(2) == planned(1) // 2 > 0
    # sized for the sequences the generator serves (generator.max_model_len), not the
    # model's positions
    cfg = load_config(overrides=["run.engine=vllm", "model.max_positions=64"])
    served = load_config(overrides=["run.engine=vllm", "model.max_positions=64",
                                    "generator.max_model_len=32", "generator.block_size=32"])
    for config in (cfg, served):
        assert tenant_sizes(config, model_config(config, task.ALPHABET))["generator"].stages[
            "kv_cache"][0] == kv_cache_bytes(model_config(config, task.ALPHABET).to_dict(), 64,
                                             config.served_positions or 64,
                                             config.generator.block_size or KV_BLOCK_TOKENS)
    with pytest.raises(ValueError, match="generator.max_model_len=-1: must be >= 0"):
        load_config(overrides=["generator.max_model_len=-1"])


def test_the_anchor_plans_hold_a_7b_and_a_32b_model_as_their_parameters_say():
    """bench/anchors.py (docs/plan_anchors.md): Qwen2.5-7B fits each H100 whole and only
    syncs in place; 32B moves AdamW's state out and back each step (vLLM's weights are
    dropped and the sync refills them), and a host short of memory for the backups is
    refused before a GPU run would send them to disk."""
    from bench.anchors import H100, plan_row

    small = plan_row("Qwen2.5-7B", "1TiB", H100)
    params = 7.6156e9  # Qwen2.5-7B's, float32 here
    assert small["stages_gb"]["generator/weights"] == pytest.approx(4 * params / 1e9, rel=1e-3)
    assert small["stages_gb"]["trainer/weights"] == pytest.approx(4 * params / 8e9, rel=1e-2)
    assert small["fits"] and small["moved_per_step_gb"] == 0
    assert [way for _, way, *_ in small["switches"]] == ["none", "none", "in_place"]
    big = plan_row("Qwen2.5-32B", "1TiB", H100)
    optimizer = big["stages_gb"]["trainer/optimizer"]
    assert big["fits"] and big["moved_per_step_gb"] == pytest.approx(8 * 2 * optimizer, rel=1e-6)
    short = plan_row("Qwen2.5-32B", "256GiB", H100, beta=0.04)  # a reference's backups too
    assert not short["fits"] and "run.host_memory" in short["why"]


def test_slots_apart_plan_each_side_of_the_sync_on_its_own_slot():
    """Not colocated (vLLM copies on slots of their own): a slot holds the trainer or the
    generator, and each side of the sync only wakes there; nothing is handed off."""
    trainer = TenantSpec("trainer", {"weights": (100, True), "optimizer": (200, True)})
    generator = TenantSpec("generator", {"weights": (100, False)}, working_bytes=50)
    step = [Wake("generator"), Wake("trainer"), Sync("trainer", "generator")]
    start = [Sync("trainer", "generator")]
    plan = plan_run([[trainer], [generator]], step, 400, RATES, start=start)
    assert plan.fits and all(f.moved_per_step() == 0 for f in plan.slots)
    assert [s.way for f in plan.slots for s in f.step] == ["none"] * 6
    assert plan.slots[1].step[2].turn == "sync trainer -> generator"


async def test_a_short_run_checks_its_plan(tmp_path, rates_file):
    from examples.rl_loop.loop import Loop

    cfg = load_config(overrides=["run.steps=3", "run.eval_every=3", "run.save_every=0",
                                 f"run.out={tmp_path}", f"run.rates={rates_file}"])
    summary = await Loop(cfg).run()
    checked = summary["plan"]
    assert checked["fits"]
    for name in ("bytes_moved", "switch_time", "peak_slot", "peak_host"):
        figure = checked[name]
        assert figure["error"] == pytest.approx(
            (figure["predicted"] - figure["measured"]) / figure["measured"])
    assert abs(checked["bytes_moved"]["error"]) <= 0.01
    assert abs(checked["peak_slot"]["error"]) <= 0.10
    assert checked["bytes_moved"]["predicted"] > 0
    assert checked["measured_host_backup_bytes"] > 0  # the trainer's weights, out a step
    assert (tmp_path / "plan.json").exists()
    assert [line.split(":")[0] for line in checked["off"]] == [
        name for name in ("bytes_moved", "switch_time", "peak_slot", "peak_host")
        if not checked[name]["within"]]
