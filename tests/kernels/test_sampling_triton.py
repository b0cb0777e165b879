"""The one-pass Triton sampler (kernels/sampling.py) and the torch sampler's draws against
``torch.multinomial``. On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), on a CUDA machine compiled on the GPU."""

from __future__ import annotations

import math

import pytest
import torch
from verl_comm.kernels.sampling import gumbel_sample

from verl_ppo.rollout.sampler import SamplingParams, sample_next

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _seed(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int64, device=DEV)


def _lp_tol(z: torch.Tensor) -> float:
    # fp32 logsumexp over V terms, chunked: a few ulp of |z| + log V per term summed
    return 8 * z.shape[-1] * torch.finfo(torch.float32).eps * (z.abs().max().item() + 1)


def test_greedy_is_argmax_and_logp_is_log_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 300, generator=g) * 3).to(DEV)
    logits[2, 5:] = float("-inf")  # a row with few finite entries
    tok, lp = gumbel_sample(logits, 0.7, None, block=128)  # 3 chunks per row
    z = logits / 0.7
    assert torch.equal(tok, logits.argmax(-1))
    want = torch.log_softmax(z, -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want, atol=_lp_tol(z[:, :5]), rtol=0)


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = torch.zeros(16, 50, device=DEV)  # uniform: the draw depends only on the seed
    a, _ = gumbel_sample(logits, 1.0, _seed(1), block=64)
    b, _ = gumbel_sample(logits.clone(), 1.0, _seed(1), block=64)
    c, _ = gumbel_sample(logits, 1.0, _seed(2), block=64)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # 16 uniform draws over 50 coinciding: p = 50**-16


def test_draws_follow_softmax_and_skip_masked_tokens() -> None:
    """200 rows of one distribution over 8 tokens (five at -inf; the interpreter runs each
    program in Python, so few rows): each token's frequency within 5 standard deviations of
    its probability (uniform draws, 0.33 each, would fail token 0's band of 0.63 +- 0.17)."""
    inf = float("-inf")
    row = torch.tensor([1.5, 0.5, inf, inf, inf, 0.0, inf, inf], device=DEV)
    logits = row.repeat(200, 1)
    tok, lp = gumbel_sample(logits, 1.0, _seed(7), block=4)  # 2 chunks per row
    p = torch.softmax(row, -1)
    n = logits.shape[0]
    freq = torch.bincount(tok, minlength=8).double() / n
    for i in range(8):
        sd = math.sqrt(p[i] * (1 - p[i]) / n)
        assert abs(freq[i] - p[i]) <= 5 * sd + 1e-12, (i, freq[i].item(), p[i].item())
    assert freq[[2, 3, 4, 6, 7]].sum() == 0
    torch.testing.assert_close(lp, torch.log(p)[tok], atol=_lp_tol(row[[0, 1, 5]]), rtol=0)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        gumbel_sample(torch.zeros(2, 8, device=DEV), 0.0, None)
    with pytest.raises(ValueError, match="power of 2"):
        gumbel_sample(torch.zeros(2, 8, device=DEV), 1.0, None, block=12)
    with pytest.raises(ValueError, match="at least 4"):
        gumbel_sample(torch.zeros(2, 8, device=DEV), 1.0, None, block=2)
    with pytest.raises(ValueError, match="batch, vocab"):
        gumbel_sample(torch.zeros(8, device=DEV), 1.0, None)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.9)])
def test_torch_sampler_draws_what_multinomial_draws(top_k: int, top_p: float) -> None:
    """The CPU sampler dropped ``torch.multinomial`` (its validity check syncs the host) for
    the same algorithm; same generator state, same tokens (exact: the same ops in order)."""
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(True, 0.8, top_k, top_p)
    tok, _ = sample_next(logits, params, torch.Generator().manual_seed(11))
    from verl_ppo.rollout.sampler import filter_logits

    probs = filter_logits(logits, 0.8, top_k, top_p).softmax(-1)
    want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(11)).squeeze(-1)
    assert torch.equal(tok, want)


@pytest.mark.parametrize("sampled", [True, False])
def test_record_does_the_decode_loops_bookkeeping(sampled: bool) -> None:
    """``record=``: the draw of ``seed=seeds[t:t+1]``, then ``settle`` (pad and 0 for rows
    already done, the finite flag, EOS), the token and log-prob at column ``t``, the next
    token and position: the torch bookkeeping of the decode loop, bit for bit."""
    from verl_comm.kernels.sampling import Record

    from verl_ppo.rollout.generate import settle

    g = torch.Generator().manual_seed(3)
    B, V, S, t = 6, 40, 5, 2
    logits = (torch.randn(B, V, generator=g) * 2).to(DEV)
    logits[:, 7] = 9.0  # likely drawn: an EOS id
    logits[4, 3] = float("inf")  # a diverged row: a NaN log-prob, the finite flag drops
    seeds = torch.randint(0, 2**62, (S,), generator=g).to(DEV) if sampled else None
    eos = torch.tensor([7, 11], device=DEV)
    done0 = torch.tensor([False, True, False, False, False, True], device=DEV)
    tok, lp = gumbel_sample(logits, 0.8, seeds[t : t + 1] if sampled else None, block=16)
    done_ref, fin_ref = done0.clone(), torch.ones((), dtype=torch.bool, device=DEV)
    tok, lp = settle(tok, lp, done_ref, fin_ref, eos, 3)

    rec = Record(
        step=torch.tensor([t], device=DEV),
        done=done0.clone(),
        finite=torch.ones((), dtype=torch.bool, device=DEV),
        tokens=torch.zeros(B, S, dtype=torch.int64, device=DEV),
        log_probs=torch.zeros(B, S, device=DEV),
        tok_in=torch.zeros(B, 1, dtype=torch.int64, device=DEV),
        pos_in=torch.arange(B, device=DEV)[:, None] + 10,
        eos=eos,
        pad=3,
    )
    got_tok, got_lp = gumbel_sample(logits, 0.8, seeds, block=16, record=rec)
    assert torch.equal(got_tok, tok) and torch.equal(got_lp.nan_to_num(-1), lp.nan_to_num(-1))
    assert torch.equal(rec.done, done_ref) and bool(rec.finite) == bool(fin_ref) is False
    assert torch.equal(rec.tokens[:, t], tok) and not rec.tokens[:, [0, 1, 3, 4]].any()
    assert torch.equal(rec.log_probs[:, t].nan_to_num(-1), lp.nan_to_num(-1))
    assert torch.equal(rec.tok_in[:, 0], tok)
    assert torch.equal(rec.pos_in[:, 0], torch.arange(B, device=DEV) + 11)
    assert rec.done[[1, 5]].all() and (tok[[1, 5]] == 3).all() and (lp[[1, 5]] == 0).all()
    assert rec.done.sum() > 2  # an EOS was drawn by a row not done before


def test_record_refuses_mismatched_state() -> None:
    from verl_comm.kernels.sampling import Record

    B = 2
    rec = Record(
        step=torch.zeros(1, dtype=torch.int64, device=DEV),
        done=torch.zeros(B, dtype=torch.bool, device=DEV),
        finite=torch.ones((), dtype=torch.bool, device=DEV),
        tokens=torch.zeros(B, 4, dtype=torch.int64, device=DEV),
        log_probs=torch.zeros(B, 4, device=DEV),
        tok_in=torch.zeros(B, 1, dtype=torch.int32, device=DEV),  # wrong dtype
        pos_in=torch.zeros(B, 1, dtype=torch.int64, device=DEV),
        eos=None,
        pad=0,
    )
    with pytest.raises(ValueError, match="record.tok_in"):
        gumbel_sample(torch.zeros(B, 8, device=DEV), 1.0, None, block=8, record=rec)
