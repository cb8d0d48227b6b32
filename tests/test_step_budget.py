"""The bytes a slot capacity requires a step to copy, as the run's summary states them:
per slot, from what each slot really holds (DDP: a whole replica; FSDP: its shards; the
reference laid out like the trainer), summed over the slots, with any number of tenants;
and overlap refused where a slot never holds two tenants awake."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from examples.rl_loop.budget import Size, required_per_step, slot_sizes, tenant_sizes
from examples.rl_loop.config import load_config
from examples.rl_loop.runtime import model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return model_dir(load_config(), tmp_path_factory.mktemp("budget"))


def weights(path: Path) -> int:
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_fsdp_slots_hold_shards_that_sum_to_the_model_and_ddp_slots_whole_ones(tiny):
    whole = weights(tiny)
    ddp = slot_sizes(load_config(overrides=["run.slots=2"]), tiny)
    assert [s["trainer"].stages["weights"][0] for s in ddp] == [whole, whole]
    fsdp = slot_sizes(load_config(overrides=["run.slots=2", "trainer.parallel=fsdp",
                                             "grpo.beta=0.1"]), tiny)
    shards = [s["trainer"].stages["weights"][0] for s in fsdp]
    assert sum(shards) == whole and max(shards) < whole
    assert [s["reference"].stages["weights"][0] for s in fsdp] == shards  # laid out alike
    assert [s["generator"].stages["weights"][0] for s in fsdp] == [whole, whole]  # replicas
    apart = slot_sizes(load_config(overrides=["run.slots=2", "run.colocate=false"]), tiny)
    assert [sorted(s) for s in apart] == [["trainer"], ["trainer"], ["generator"],
                                          ["generator"]]


def test_two_tenants_move_the_cheapest_stages_that_let_each_turn_fit():
    sizes = {"generator": Size({"weights": (10, False)}, working=20),
             "trainer": Size({"weights": (10, True), "optimizer": (20, True),
                              "grads": (5, False)})}
    assert required_per_step(sizes, 60) == 0  # all fit
    assert required_per_step(sizes, 50) == 2 * 10  # 10 short: the weights, out and back
    assert required_per_step(sizes, 45) == 2 * 20  # 15 short: the optimizer
    assert required_per_step(sizes, 35) == 2 * 30  # 25 short: both
    assert required_per_step(sizes, 30) == 2 * 30  # no turn fits at all: all that is kept


def test_a_reference_is_a_third_turn_and_each_stage_moves_once_a_step():
    sizes = {"generator": Size({"weights": (10, False)}),
             "reference": Size({"weights": (10, True)}),
             "trainer": Size({"weights": (10, True), "optimizer": (20, True)})}
    assert required_per_step(sizes, 60) == 0
    # 40: the generator's turn fits 30 beside it, the reference's too; the trainer's (30)
    # fits the reference beside it: only the trainer's weights (10) must go, once a step
    assert required_per_step(sizes, 40) == 2 * 10
    # 30: in the generator's turn 20 of the 40 kept must go; the trainer must hold out the
    # reference: reference (10) + trainer weights (10) is the cheapest that fits every turn
    assert required_per_step(sizes, 30) == 2 * 20


def test_the_summary_sums_what_each_slot_requires(tiny):
    from colocate import ArbiterConfig
    from examples.rl_loop.budget import budget_summary

    cfg = load_config(overrides=["run.slots=2", "trainer.parallel=fsdp"])
    one = tenant_sizes(cfg, tiny, rank=0)
    kept = sum(b for b, k in one["trainer"].stages.values() if k)
    capacity = one["generator"].total + kept - 1  # a byte short: the weights go
    found = budget_summary(cfg, ArbiterConfig(policy="budget", slot_capacity_bytes=capacity),
                           tiny)
    per_slot = found["bytes_required_per_slot"]
    assert per_slot == [2 * tenant_sizes(cfg, tiny, rank)["trainer"].stages["weights"][0]
                        for rank in (0, 1)]
    assert found["bytes_required_per_step"] == sum(per_slot)
    ddp = load_config(overrides=["run.slots=2"])
    whole = tenant_sizes(ddp, tiny)
    found = budget_summary(ddp, ArbiterConfig(policy="budget", slot_capacity_bytes=capacity),
                           tiny)
    assert found["bytes_required_per_slot"] == [required_per_step(whole, capacity)] * 2


def test_overlap_under_the_exclusive_policy_is_refused_in_one_line():
    with pytest.raises(ValueError, match="rollout.overlap=true .*run.policy=exclusive") as err:
        load_config(overrides=["rollout.mode=partial", "rollout.overlap=true",
                               "run.policy=exclusive"])
    assert "\n" not in str(err.value)


@pytest.mark.timeout(600)
def test_the_budget_bench_checks_hold_for_overlap_under_a_tight_slot(tmp_path):
    """bench/budget.py's checks, on a short run of the case: the bytes moved are what the
    tight capacity requires, no slot goes over it, and the steps are those of the run it is
    compared with (the overlap: its round runs first on a slot too small for both)."""
    from bench.budget import run_case

    found = run_case("partial, overlap", 3, tmp_path)
    assert found["checks"] == [], found
    assert found["bytes_required_per_step"] > 0
