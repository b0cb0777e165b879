"""Decoupled PPO loss (truncated importance weight): equals vanilla on-policy, truncates."""

import pytest
import torch

from verl_ppo.algorithms import (
    POLICY_LOSSES,
    policy_loss_decoupled,
    policy_loss_vanilla,
    truncated_is_weight,
)


def _batch(seed=0, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logp = (old + 0.3 * torch.randn(b, t, generator=g)).requires_grad_()
    adv = torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    return old, logp, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_on_policy_equals_vanilla_exactly(mode):
    # behaviour == proximal gives w = exp(0) = 1 exactly, and x * 1.0 == x in IEEE
    # arithmetic, so loss, gradient and metrics are bit-equal (== is the property)
    old, logp, adv, mask = _batch()
    lv, mv = policy_loss_vanilla(old, logp, adv, mask, loss_agg_mode=mode)
    (gv,) = torch.autograd.grad(lv, logp)
    for rollout in (old.clone(), None):
        ld, md = policy_loss_decoupled(
            old, logp, adv, mask, loss_agg_mode=mode, rollout_log_prob=rollout
        )
        (gd,) = torch.autograd.grad(ld, logp)
        assert torch.equal(ld, lv) and torch.equal(gd, gv)
        assert all(torch.equal(md[k], mv[k]) for k in mv)
        assert md["rollout_is_weight_mean"] == 1.0 and md["rollout_is_truncated_frac"] == 0.0


def test_weight_scales_each_token_and_is_truncated():
    old, logp, adv, mask = _batch(1)
    g = torch.Generator().manual_seed(5)
    rollout = old + torch.randn(old.shape, generator=g)  # stale behaviour policy
    C = 1.5
    w_ref = torch.exp(old - rollout).clamp(max=C)
    ld, md = policy_loss_decoupled(
        old,
        logp,
        adv,
        mask,
        loss_agg_mode="seq-mean-token-sum",
        rollout_log_prob=rollout,
        rollout_is_threshold=C,
    )
    # per-token reference: vanilla on each token alone (token-sum of one token), weighted
    per = torch.stack(
        [
            torch.stack(
                [
                    policy_loss_vanilla(
                        old[i : i + 1, j : j + 1],
                        logp[i : i + 1, j : j + 1],
                        adv[i : i + 1, j : j + 1],
                        torch.ones(1, 1),
                        loss_agg_mode="seq-mean-token-sum",
                    )[0]
                    for j in range(old.shape[1])
                ]
            )
            for i in range(old.shape[0])
        ]
    )
    ref = (per * w_ref * mask).sum(-1).mean()
    # the two sides sum the same float32 terms in another order: |error| <= n eps sum|terms|
    tol = old.numel() * torch.finfo(torch.float32).eps * (per * w_ref).abs().sum().item()
    assert abs(ld.item() - ref.item()) <= tol
    trunc = ((torch.exp(old - rollout) > C).float() * mask).sum() / mask.sum()
    assert trunc > 0 and md["rollout_is_truncated_frac"] == pytest.approx(trunc.item())
    assert md["rollout_is_weight_mean"] <= C


def test_weight_is_detached_and_capped():
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[-5.0, 0.0, 0.5]]).requires_grad_()
    w, truncated = truncated_is_weight(old, rollout, 2.0)
    assert not w.requires_grad
    assert w.tolist()[0] == pytest.approx([2.0, 1.0, float(torch.exp(torch.tensor(-0.5)))])
    assert truncated.tolist() == [[True, False, False]]
    # the gradient flows only through the PPO ratio: d/dlogp of w * (-A r) at r = 1 is -A w
    logp = torch.zeros(1, 3, requires_grad=True)
    adv = torch.ones(1, 3)
    loss, _ = policy_loss_decoupled(
        old,
        logp,
        adv,
        torch.ones(1, 3),
        loss_agg_mode="seq-mean-token-sum",
        rollout_log_prob=rollout.detach(),
    )
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-x for x in w.tolist()[0]])


def test_bad_arguments_and_registration():
    old, logp, adv, mask = _batch()
    with pytest.raises(ValueError, match="rollout_is_threshold must be >= 1"):
        policy_loss_decoupled(old, logp, adv, mask, rollout_log_prob=old, rollout_is_threshold=0.5)
    with pytest.raises(ValueError, match="rollout_log_prob shape"):
        policy_loss_decoupled(old, logp, adv, mask, rollout_log_prob=old[:, :3])
    assert POLICY_LOSSES["decoupled"] is policy_loss_decoupled
