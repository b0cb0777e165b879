"""The chunked LM head (log-prob + entropy, forward and backward) against the plain path.

CPU: fp32, equal to rounding. GPU: bf16, the chunked path's error against an fp32
reference at most 2x that of the plain bf16 path (+1e-6), as for the quantization kernels.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests._models import tiny_causal_lm
from verl_ppo.algorithms.losses import entropy_from_logits
from verl_ppo.roles.common import sequence_log_probs
from verl_ppo.roles.fused_head import chunked_head_log_probs, fused_head_unsupported, head_weight
from verl_ppo.step.packing import packed_log_probs

CUDA = torch.cuda.is_available()


def _plain(h, w, t, temperature):
    z = (h @ w.t()).float() / temperature
    return torch.log_softmax(z, -1).gather(-1, t[:, None]).squeeze(-1), entropy_from_logits(z)


def _grads(fn, h, w, t, temperature, gl, ge):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    logp, ent = fn(h, w, t, temperature)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _fused(h, w, t, temperature):
    return chunked_head_log_probs(h, w, t, temperature, with_entropy=True, chunk_rows=7)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_matches_plain_fp32(temperature):
    g = torch.Generator().manual_seed(0)
    n, hdim, v = 37, 24, 1823  # odd sizes; 6 chunks of 7 rows (the last partial)
    h = torch.randn(n, hdim, generator=g)
    w = torch.randn(v, hdim, generator=g) * 0.3
    t = torch.randint(0, v, (n,), generator=g)
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ref = _grads(_plain, h, w, t, temperature, gl, ge)
    got = _grads(_fused, h, w, t, temperature, gl, ge)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_head_non_contiguous_hidden_and_no_entropy():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(10, 40, generator=g)[:, ::2]  # (10, 20), non-contiguous
    w = torch.randn(50, 20, generator=g)
    t = torch.randint(0, 50, (10,), generator=g)
    logp, ent = chunked_head_log_probs(h, w, t, chunk_rows=3)
    assert ent is None
    torch.testing.assert_close(logp, _plain(h, w, t, 1.0)[0])
    with pytest.raises(ValueError, match="must be"):
        chunked_head_log_probs(h, w[:, :5], t)


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 97, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding of the prompt (P = 5)
    mask[1, 9:] = 0  # response ends early
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_sequence_log_probs_fused_matches_plain_with_grads(packing, tied):
    ids, mask = _batch()
    valid = mask[:, 5:].bool()
    fn = packed_log_probs if packing else sequence_log_probs
    res = []
    for fused in (False, True):
        m = tiny_causal_lm("qwen2", vocab_size=97, tie_word_embeddings=tied)
        assert head_weight(m) is not None and fused_head_unsupported(m) is None
        logp, ent = fn(m, ids, mask, 5, 0.8, with_entropy=True, fused=fused)
        loss = (logp * valid).sum() + 0.3 * (ent * valid).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        res.append((logp[valid], ent[valid], grads))
    (a_lp, a_ent, a_g), (b_lp, b_ent, b_g) = res
    torch.testing.assert_close(b_lp, a_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b_ent, a_ent, rtol=1e-5, atol=1e-5)
    assert a_g.keys() == b_g.keys()
    for n in a_g:
        torch.testing.assert_close(b_g[n], a_g[n], rtol=1e-4, atol=1e-5, msg=n)


def test_gpt2_head_is_supported():
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=40)
    ).eval()  # no dropout
    ids = torch.randint(0, 40, (2, 8))
    mask = torch.ones_like(ids)
    a, _ = sequence_log_probs(m, ids, mask, 3)
    b, _ = sequence_log_probs(m, ids, mask, 3, fused=True)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="bf16 check on the GPU")
def test_fused_head_bf16_error_within_twice_plain_on_gpu():
    g = torch.Generator().manual_seed(0)
    n, hdim, v = 1500, 896, 151936  # the Qwen2.5-0.5B head, several chunks
    h32 = torch.randn(n, hdim, generator=g).cuda()
    w32 = (torch.randn(v, hdim, generator=g) * 0.02).cuda()
    t = torch.randint(0, v, (n,), generator=g).cuda()
    gl, ge = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()
    ref = _grads(_plain, h32, w32, t, 1.0, gl, ge)
    hb, wb = h32.bfloat16(), w32.bfloat16()
    plain = _grads(_plain, hb, wb, t, 1.0, gl, ge)
    fused = _grads(
        lambda h, w, t, T: chunked_head_log_probs(h, w, t, T, with_entropy=True, chunk_rows=512),
        hb,
        wb,
        t,
        1.0,
        gl,
        ge,
    )
    for name, r, p, f in zip(("logp", "entropy", "grad_h", "grad_w"), ref, plain, fused):
        err_p = (p.float() - r.float()).abs().max().item()
        err_f = (f.float() - r.float()).abs().max().item()
        assert err_f <= 2 * err_p + 1e-6, (name, err_f, err_p)

    # and the memory: the chunked forward + backward holds far less than the plain path
    def extra(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _grads(fn, hb, wb, t, 1.0, gl, ge)
        return torch.cuda.max_memory_allocated() - base

    chunked = extra(
        lambda h, w, t, T: chunked_head_log_probs(h, w, t, T, with_entropy=True, chunk_rows=256)
    )
    plain_extra = extra(_plain)
    assert chunked < 0.5 * plain_extra, (chunked / 2**20, plain_extra / 2**20)


def test_entropy_unused_in_the_loss_costs_no_gradient_term():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 12, generator=g)
    w = torch.randn(31, 12, generator=g)
    t = torch.randint(0, 31, (9,), generator=g)
    ref = _grads(_plain, h, w, t, 1.0, torch.ones(9), torch.zeros(9))
    hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = chunked_head_log_probs(hh, ww, t, with_entropy=True, chunk_rows=4)
    logp.sum().backward()  # entropy computed (a metric) but not in the loss
    torch.testing.assert_close(hh.grad, ref[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad, ref[3], rtol=1e-5, atol=1e-5)
