"""GRPO's math and the toy task, as pure functions: no runtime, no model."""

from __future__ import annotations

import random

import pytest
import torch

from examples.rl_loop import task
from examples.rl_loop.grpo import (
    GRPOConfig,
    aggregate,
    group_advantages,
    grpo_loss,
    kl_k3,
    pack_batch,
    token_logprobs,
)


def test_advantages_are_centered_per_group_and_zero_for_a_constant_group():
    rewards = torch.tensor([0.0, 0.5, 1.0, 0.25, 0.7, 0.7, 0.7, 0.7])
    for scale in ("group", "none"):
        adv = group_advantages(rewards, group_size=4, scale_rewards=scale).view(2, 4)
        assert torch.allclose(adv.sum(dim=1), torch.zeros(2), atol=1e-6)
        assert torch.equal(adv[1], torch.zeros(4))
        assert adv[0].argmax() == 2 and adv[0].argmin() == 0  # the order of the rewards
    scaled = group_advantages(rewards, 4).view(2, 4)
    assert scaled[0].std().item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(rewards[:6], group_size=4)


def test_pack_batch_masks_the_completion_tokens_only():
    input_ids, targets, mask = pack_batch([[1, 5, 6], [1, 7]], [[8, 2], [9]], pad_id=0)
    assert input_ids.tolist() == [[1, 5, 6, 8], [1, 7, 0, 0]]
    assert targets.tolist() == [[5, 6, 8, 2], [7, 9, 0, 0]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]


def test_token_logprobs_pick_the_targets_under_the_temperature():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    got = token_logprobs(logits, targets, mask, temperature=0.5)
    want = torch.log_softmax(logits / 0.5, -1).gather(-1, targets[..., None])[..., 0] * mask
    assert torch.allclose(got, want)
    assert got[0, 2] == 0 and got[1, 0] == 0


def _batch(advantages: list[float], tokens: int = 3) -> dict[str, torch.Tensor]:
    rows = len(advantages)
    logprobs = torch.log(torch.rand(rows, tokens) * 0.9 + 0.05)
    return {"logprobs": logprobs.clone().requires_grad_(True), "old": logprobs.clone(),
            "advantages": torch.tensor(advantages), "mask": torch.ones(rows, tokens)}


def test_loss_at_ratio_one_is_minus_the_mean_advantage():
    b = _batch([1.5, -0.5, 0.25, -2.0])
    loss, stats = grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], GRPOConfig())
    assert loss.item() == pytest.approx(-b["advantages"].mean().item(), abs=1e-6)
    assert stats["ratio"] == pytest.approx(1.0) and stats["clip_frac"] == 0.0
    loss.backward()  # d loss / d logprob = -advantage / tokens at ratio 1
    tokens = b["mask"].sum()
    assert torch.allclose(b["logprobs"].grad, -b["advantages"][:, None].expand(4, 3) / tokens)


def test_loss_is_a_token_level_mean_over_the_mask():
    b = _batch([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 3 tokens at +1, 1 at -1
    loss, _ = grpo_loss(b["logprobs"], b["old"], b["advantages"], mask, GRPOConfig())
    assert loss.item() == pytest.approx(-(3 - 1) / 4)


@pytest.mark.parametrize("advantage, log_ratio, flows", [
    (1.0, 0.5, False),   # ratio 1.65 > 1 + eps, positive advantage: clipped, no gradient
    (1.0, -0.5, True),   # ratio 0.61 < 1 - eps, positive advantage: pushed back up
    (-1.0, -0.5, False),  # ratio 0.61 < 1 - eps, negative advantage: clipped, no gradient
    (-1.0, 0.5, True),   # ratio 1.65 > 1 + eps, negative advantage: pushed back down
    (1.0, 0.1, True),    # inside [1 - eps, 1 + eps]: always a gradient
    (-1.0, -0.1, True),
])
def test_clipping_stops_the_gradient_only_on_the_side_that_gains(advantage, log_ratio, flows):
    old = torch.log(torch.tensor([[0.3]]))
    logprobs = (old + log_ratio).requires_grad_(True)
    loss, stats = grpo_loss(logprobs, old, torch.tensor([advantage]), torch.ones(1, 1),
                            GRPOConfig(epsilon=0.2))
    loss.backward()
    grad = logprobs.grad.item()
    assert (grad != 0) == flows
    assert stats["clip_frac"] == (0.0 if flows else 1.0)
    if flows:  # the gradient always raises the probability of a positive-advantage token
        assert (grad < 0) == (advantage > 0)


def test_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logprobs = torch.log(torch.rand(4, 5) * 0.9 + 0.05)
    assert torch.allclose(kl_k3(logprobs, logprobs), torch.zeros(4, 5))
    assert (kl_k3(logprobs, logprobs + 0.3) > 0).all()
    assert (kl_k3(logprobs, logprobs - 0.3) > 0).all()
    # one token far from the reference (a sharp random init after one update) stays finite
    far = torch.tensor([-200.0, -1.0], requires_grad=True)
    kl = kl_k3(far, torch.tensor([-1.0, -1.0]))
    assert kl[0].item() == 10.0 and kl[1].item() == 0.0
    kl.sum().backward()
    assert torch.isfinite(far.grad).all()

    b = _batch([1.0, -1.0])
    cfg = GRPOConfig(beta=0.5)
    base, _ = grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], GRPOConfig())
    same, stats = grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], cfg,
                            ref_logprobs=b["old"])
    assert stats["kl"] == 0.0 and same.item() == pytest.approx(base.item())
    far, stats = grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], cfg,
                           ref_logprobs=b["old"] - 1.0)
    assert stats["kl"] > 0 and far.item() == pytest.approx(base.item() + 0.5 * stats["kl"])
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], cfg)


@pytest.mark.parametrize("field, value", [
    ("group_size", 1), ("prompts_per_step", 0), ("updates_per_batch", 0), ("lr", 0.0),
    ("temperature", -1.0), ("epsilon", 1.0), ("epsilon", 0.0), ("beta", -0.1),
])
def test_grpo_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        GRPOConfig(**{field: value})


def test_reward_gives_full_partial_and_no_credit():
    assert task.reward("312>", "312") == 1.0
    assert task.reward("312>", "") == 0.0
    assert task.reward("312>", "9") == 0.0
    assert 0 < task.reward("312>", "319") < 1  # two of three right
    assert task.reward("312>", "3129") < task.reward("312>", "312")  # too long loses credit
    assert task.reward("312>", "31") < task.reward("312>", "312")  # too short too
    with pytest.raises(ValueError, match="expected digits"):
        task.reward("312", "312")


def test_prompts_are_in_the_alphabet_and_the_eval_set_is_fixed_and_held_out():
    cfg = task.TaskConfig(min_digits=1, max_digits=2, eval_size=20)
    held_out = task.eval_prompts(cfg)
    assert held_out == task.eval_prompts(task.TaskConfig(min_digits=1, max_digits=2,
                                                         eval_size=20))
    assert held_out != task.eval_prompts(task.TaskConfig(min_digits=1, max_digits=2,
                                                         eval_size=20, eval_seed=7))
    assert len(set(held_out)) == 20
    train = task.sample_prompts(cfg, 500, random.Random(0))
    assert not set(train) & set(held_out)
    assert train == task.sample_prompts(cfg, 500, random.Random(0))
    for prompt in train + held_out:
        assert set(prompt) <= set(task.ALPHABET) and 1 <= len(task.answer(prompt)) <= 2
    assert cfg.max_new_tokens == 3


def test_task_config_rejects_bad_values():
    with pytest.raises(ValueError, match="min_digits"):
        task.TaskConfig(min_digits=3, max_digits=2)
    with pytest.raises(ValueError, match="eval_size"):
        task.TaskConfig(min_digits=1, max_digits=1, eval_size=6)  # 10 prompts in all


# ---- the GRPO options (TRL's names), each against a hand computation on a small batch ----

def _two_rows() -> dict[str, torch.Tensor]:
    """Two sequences at ratio 1: row 0 has 3 completion tokens at advantage +1, row 1 one
    token at advantage -1 (its other positions are padding)."""
    old = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.5, 0.9, 0.9]]))
    return {"logprobs": old.clone().requires_grad_(True), "old": old,
            "advantages": torch.tensor([1.0, -1.0]),
            "mask": torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])}


@pytest.mark.parametrize("loss_type, want", [
    ("dapo", -(3 * 1.0 - 1 * 1.0) / 4),          # every token weighs the same: -(3 - 1) / 4
    ("grpo", -((3 / 3) + (-1 / 1)) / 2),          # per sequence (+1, -1), then their mean: 0
    ("dr_grpo", -(3 - 1) / (2 * 5)),              # the sum over 2 rows x 5 (the constant)
])
def test_loss_type_aggregates_as_trl(loss_type, want):
    b = _two_rows()
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=5)
    loss, _ = grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], cfg)
    assert loss.item() == pytest.approx(want, abs=1e-6)


def test_the_default_loss_type_is_the_token_mean_the_loop_always_used():
    """The digit task's loss before loss_type existed: sum over the batch's tokens / tokens."""
    assert GRPOConfig().loss_type == "dapo"
    assert aggregate(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor(
        [[1.0, 1.0], [1.0, 0.0]]), "dapo") == pytest.approx((1 + 2 + 3) / 3)
    with pytest.raises(ValueError, match="needs max_completion_length"):
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "dr_grpo")


def test_epsilon_high_clips_the_top_only():
    """Ratio 1.25 at advantage +1: clipped at 1.2 with epsilon=0.2 (loss -1.2, no gradient);
    with epsilon_high=0.28 it is inside (loss -1.25, a gradient); ratio 0.75 < 0.8 at
    advantage -1 is clipped at the bottom either way (loss 0.8)."""
    old = torch.log(torch.tensor([[0.4], [0.4]]))
    logprobs = (old + torch.log(torch.tensor([[1.25], [0.75]]))).requires_grad_(True)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 1)
    loss, stats = grpo_loss(logprobs, old, adv, mask, GRPOConfig(epsilon=0.2))
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-6)
    assert stats["clip_frac"] == 1.0 and stats["clip_frac_high"] == 0.5
    assert stats["clip_frac_low"] == 0.5
    high, stats = grpo_loss(logprobs, old, adv, mask,
                            GRPOConfig(epsilon=0.2, epsilon_high=0.28))
    assert high.item() == pytest.approx((-1.25 + 0.8) / 2, abs=1e-6)
    assert stats["clip_frac_high"] == 0.0 and stats["clip_frac_low"] == 0.5
    high.backward()
    assert logprobs.grad[0, 0] != 0 and logprobs.grad[1, 0] == 0


def test_beta_adds_the_k3_kl_aggregated_like_the_loss():
    """ref - logp = log 2 on row 0's tokens: k3 = 2 - log 2 - 1 per token; 0 on row 1."""
    b = _two_rows()
    ref = b["old"].clone()
    ref[0] += torch.log(torch.tensor(2.0))
    k3 = 2 - torch.log(torch.tensor(2.0)).item() - 1
    for loss_type, kl_want in (("dapo", 3 * k3 / 4), ("grpo", (k3 + 0) / 2)):
        cfg = GRPOConfig(beta=0.1, loss_type=loss_type)
        loss, stats = grpo_loss(b["logprobs"], b["old"], b["advantages"], b["mask"], cfg,
                                ref_logprobs=ref)
        assert stats["kl"] == pytest.approx(kl_want, abs=1e-6)
        assert loss.item() == pytest.approx(stats["pg_loss"] + 0.1 * kl_want, abs=1e-6)


def test_scale_rewards_group_batch_none_as_trl():
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0, 2.0, 4.0])  # groups of 3
    centered = torch.tensor([-1.0, 0.0, 1.0, -2 / 3, -2 / 3, 4 / 3])
    none = group_advantages(rewards, 3, scale_rewards="none")
    assert torch.allclose(none, centered)
    group = group_advantages(rewards, 3, scale_rewards="group", eps=0.0)
    stds = torch.tensor([1.0] * 3 + [(4 / 3) ** 0.5] * 3)  # unbiased: var 1, var 4/3
    assert torch.allclose(group, centered / stds)
    batch = group_advantages(rewards, 3, scale_rewards="batch", eps=0.0)
    assert torch.allclose(batch, centered / rewards.std())


def test_samples_without_a_reward_get_zero_and_leave_the_group_stats():
    """Group [1, ?, 3, 5]: mean 3 and unbiased std 2 over the three scored; the unscored one
    gets 0. A group with one scored sample gets 0 everywhere."""
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0, 7.0, 0.0, 0.0, 0.0])
    valid = torch.tensor([True, False, True, True, True, False, False, False])
    adv = group_advantages(rewards, 4, eps=0.0, valid=valid)
    assert torch.allclose(adv, torch.tensor([-1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(group_advantages(rewards, 4, scale_rewards="none", valid=valid),
                          torch.tensor([-2.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("field, value", [
    ("epsilon", 0.0), ("epsilon_high", 0.1), ("beta", -1.0), ("loss_type", "sum"),
    ("scale_rewards", "global"), ("max_completion_length", 0),
])
def test_grpo_config_rejects_bad_new_values(field, value):
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        GRPOConfig(**{field: value})
