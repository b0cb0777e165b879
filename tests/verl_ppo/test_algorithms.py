"""PPO maths against hand-computed values."""

import math

import pytest
import torch

from verl_ppo.algorithms import (
    agg_loss,
    compute_gae,
    compute_grpo,
    kl_penalty,
    make_kl_controller,
    masked_mean,
    policy_loss_vanilla,
    value_loss_clipped,
)


def test_gae_hand_example():
    # one sequence, 3 valid tokens + 1 pad; gamma=0.9, lam=0.5
    r = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.2, 0.1, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = compute_gae(r, v, m, gamma=0.9, lam=0.5, whiten=False)
    d2 = 1.0 + 0.9 * 0.0 - 0.1
    d1 = 0.0 + 0.9 * 0.1 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.45 * a2
    a0 = d0 + 0.45 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.2, a2 + 0.1, 0.0]]))


def test_gae_padding_does_not_leak():
    r = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    v = torch.tensor([[0.3, 0.4, 0.0, 0.0]])
    m1 = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    a1, _ = compute_gae(r, v, m1, whiten=False)
    r2 = r.clone()
    r2[0, 2:] = 7.0  # garbage on padding
    v2 = v.clone()
    v2[0, 2:] = -3.0
    a2, _ = compute_gae(r2, v2, m1, whiten=False)
    torch.testing.assert_close(a1, a2)


def test_clip_edges():
    old = torch.zeros(1, 4)
    mask = torch.ones(1, 4)
    # ratios 1.3 (above 1+eps) and 0.7 (below 1-eps), with positive and negative advantages
    logp = torch.log(torch.tensor([[1.3, 0.7, 1.3, 0.7]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, m = policy_loss_vanilla(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    # per token: max(-A r, -A clip(r)) = [-1.2, -0.7, 1.3, 0.8]
    assert math.isclose(float(loss), (-1.2 - 0.7 + 1.3 + 0.8) / 4, rel_tol=1e-5)
    assert math.isclose(float(m["pg_clipfrac"]), 0.5, rel_tol=1e-6)  # tokens 0 and 3 clipped


def test_clip_gradient_is_zero_outside_the_trust_region():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.5]])).requires_grad_(True)
    loss, _ = policy_loss_vanilla(old, logp, torch.tensor([[1.0]]), torch.ones(1, 1))
    loss.backward()
    assert float(logp.grad.abs().sum()) == 0.0


def test_dual_clip_bounds_negative_advantage():
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[10.0]]))
    loss, m = policy_loss_vanilla(
        old, logp, torch.tensor([[-1.0]]), torch.ones(1, 1), clip_ratio_c=3.0
    )
    assert math.isclose(float(loss), 3.0, rel_tol=1e-6)
    assert float(m["pg_clipfrac_lower"]) == 1.0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss_vanilla(old, logp, torch.tensor([[-1.0]]), torch.ones(1, 1), clip_ratio_c=1.0)


def test_masking_ignores_padding_everywhere():
    x = torch.tensor([[1.0, 2.0, 100.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(masked_mean(x, m)) == 1.5
    assert float(agg_loss(x, m, "token-mean")) == 1.5
    assert float(agg_loss(x, m, "seq-mean-token-sum")) == 3.0
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.0, 0.0, 50.0]])
    loss, _ = policy_loss_vanilla(old, logp, torch.ones(1, 3), m)
    assert math.isclose(float(loss), -1.0, rel_tol=1e-6)


def test_token_mean_invariant_to_split():
    torch.manual_seed(0)
    x = torch.rand(4, 5)
    m = (torch.rand(4, 5) > 0.3).float()
    whole = agg_loss(x, m, "token-mean")
    # two "ranks" with two micro-batches each, divisor = global tokens / world
    div = float(m.sum()) / 2
    parts = sum(agg_loss(x[i : i + 1], m[i : i + 1], "token-mean", div) for i in range(4)) / 2
    torch.testing.assert_close(whole, parts)


def test_value_loss_clipping():
    v = torch.tensor([[1.0]])
    old = torch.tensor([[0.0]])
    ret = torch.tensor([[1.0]])
    loss, m = value_loss_clipped(v, old, ret, torch.ones(1, 1), cliprange_value=0.2)
    assert math.isclose(float(loss), 0.5 * 0.64, rel_tol=1e-6)  # clipped to 0.2: (0.2-1)^2
    assert float(m["vf_clipfrac"]) == 1.0


def test_grpo_group_normalisation():
    r = torch.zeros(4, 2)
    r[:, 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    m = torch.ones(4, 2)
    g = torch.tensor([0, 0, 1, 1])
    adv, _ = compute_grpo(r, m, g)
    assert adv[0, 0] > 0 > adv[1, 0]
    assert torch.all(adv[2:] == 0)  # identical scores in group 1
    adv_nostd, _ = compute_grpo(r, m, g, norm_by_std=False)
    torch.testing.assert_close(adv_nostd[:2, 0], torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match="at least 2 samples"):
        compute_grpo(r[:3], m[:3], torch.tensor([0, 0, 1]))


def test_kl_estimators():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), lp - ref)
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), 0.5 * (lp - ref) ** 2)
    k3 = kl_penalty(lp, ref, "k3")
    assert torch.all(k3 >= 0)
    assert float(kl_penalty(lp, lp, "k3").abs().max()) == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(lp, ref, "k9")


def test_adaptive_kl_controller_moves_towards_target():
    c = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    c.update(current_kl=0.5, n_steps=10)  # too much KL -> raise beta
    assert c.value > 0.1
    c2 = make_kl_controller("adaptive", 0.1, target_kl=0.05, horizon=100)
    c2.update(current_kl=0.0, n_steps=10)
    assert c2.value < 0.1
    f = make_kl_controller("fixed", 0.1)
    f.update(1.0, 10)
    assert f.value == 0.1


def test_registries_name_what_the_config_selects():
    from verl_ppo.algorithms import (
        ADV_ESTIMATORS,
        KL_ESTIMATORS,
        POLICY_LOSSES,
        REWARD_SHAPERS,
        last_token_rewards,
    )
    from verl_ppo.config import AlgorithmConfig, KLConfig, build_config

    assert POLICY_LOSSES["vanilla"] is policy_loss_vanilla
    assert REWARD_SHAPERS["last_token"] is last_token_rewards
    # every choice the config offers has an entry
    for name, registry in [("adv_estimator", ADV_ESTIMATORS)]:
        assert set(AlgorithmConfig.model_fields[name].annotation.__args__) <= set(registry)
    assert set(KLConfig.model_fields["estimator"].annotation.__args__) <= set(KL_ESTIMATORS)
    with pytest.raises(ValueError, match="policy_loss 'nope'"):
        build_config({"algorithm": {"policy_loss": "nope"}})


def test_last_token_rewards_place_score_and_subtract_kl():
    from verl_ppo.algorithms import last_token_rewards

    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -9.0]]).repeat(3, 1)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]]).repeat(3, 1)
    scores = torch.tensor([2.0, -1.0, 0.5])
    r, kl = last_token_rewards(scores, m, old, ref, kl_coef=0.1, kl_estimator="k1")
    torch.testing.assert_close(kl, (old - ref) * m)
    expect = torch.zeros(3, 4)
    expect[0, 2], expect[1, 0], expect[2, 0] = 2.0, -1.0, 0.5  # empty response: position 0
    torch.testing.assert_close(r, expect - 0.1 * (old - ref) * m)
    r_no, _ = last_token_rewards(scores, m, old, ref, kl_coef=0.1, use_kl_in_reward=False)
    torch.testing.assert_close(r_no, expect)
    assert float(kl[0, 3]) == 0.0  # padding carries no KL


def test_explained_variance():
    from verl_ppo.algorithms import explained_variance

    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ret = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    assert abs(float(explained_variance(ret, ret, m)) - 1.0) < 1e-6
    assert abs(float(explained_variance(ret, torch.full_like(ret, 2.0), m))) < 1e-6


def test_a_name_is_registered_once():
    from verl_ppo.algorithms import register_policy_loss

    with pytest.raises(ValueError, match="'vanilla' is registered already"):
        register_policy_loss("vanilla")(lambda *a, **k: None)
