"""The three-way check of the rollout's static-cache decoders (``test_cuda_graph.py``,
``test_decode_kernels_gpu.py``): each decoder returns the tokens of
:func:`verl_ppo.rollout.generate.generate` on the same model, greedy and sampled.

In fp32 the tokens must be identical. In bf16 two correct forwards differ by rounding, and
a token can flip where the top two logits are within that rounding of each other (HF's own
greedy steps of the tiny bf16 model have margins down to 0.016, one bf16 ulp, and an H100
flipped one): there, greedy tokens must agree up to each row's first difference, and at it
HF's logit of its own token may exceed that of the decoder's by at most the bf16 bound
below; sampled rows must give HF's log-probabilities of the decoder's own tokens
(teacher-forced) within twice that bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_ppo.rollout.generate import generate, sampling_kwargs


def _hf_logits(model, seq: torch.Tensor, mask: torch.Tensor, P: int) -> torch.Tensor:
    """HF's fp32 logits ``(B, R, V)`` at the positions that predict ``seq[:, P:]``."""
    full = torch.cat([mask, torch.ones_like(seq[:, P:])], 1)
    pos = (full.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=seq, attention_mask=full, position_ids=pos).logits
    return out[:, P - 1 : -1].float()


def _bf16_bound(logits: torch.Tensor) -> float:
    """Rounding of a bf16 forward's logits: 8 bf16 half-ulps (2**-9 each, relative) of the
    largest logit, for the handful of bf16 roundings between two kernels' results."""
    return 8 * 2**-9 * logits.abs().max().item()


def _assert_greedy_bf16(model, got, want, mask, P: int, name: str) -> None:
    """Greedy bf16 tokens: equal up to each row's first difference, where HF's (fp32-read)
    logit of its own token exceeds the decoder's token's by at most :func:`_bf16_bound`."""
    lg = _hf_logits(model, want, mask, P)
    bound = _bf16_bound(lg)
    for r in range(want.shape[0]):
        diff = (got[r, P:] != want[r, P:]).nonzero()
        if len(diff):
            t = int(diff[0])
            gap = (lg[r, t, want[r, P + t]] - lg[r, t, got[r, P + t]]).item()
            assert gap <= bound, f"{name}: row {r} step {t}: greedy token off by {gap} > {bound}"


def assert_decoders_match_generate(
    model: torch.nn.Module,
    decoders: Mapping[str, Any],
    ids: torch.Tensor,
    mask: torch.Tensor,
    max_new_tokens: int,
) -> None:
    """Greedy, then sampled: every decoder's ``generate`` (a
    :class:`~verl_ppo.rollout.cuda_graph.StaticCacheDecoder`) and ``generate(model, ...)``
    give the same ``(batch, prompt_len + max_new_tokens)`` tokens, each call with a fresh
    generator seeded 1 on ``ids``'s device (no EOS stop, pad id 0); in bf16, the same up to
    rounding (module docstring).

    Args:
        decoders: name -> decoder, the name used in the failure message.
        ids, mask: ``(batch, prompt_len)`` left-padded prompts and their attention mask.

    Raises:
        AssertionError: a decoder's tokens differ (names the decoder and the mode).
    """
    dev, P = ids.device, ids.shape[1]
    exact = next(model.parameters()).dtype == torch.float32
    for sample in (False, True):
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0, do_sample=sample)
        want = generate(model, ids, mask, generator=torch.Generator(dev).manual_seed(1), **kw)
        for name, dec in decoders.items():
            if exact or not sample:
                got = dec.generate(ids, mask, generator=torch.Generator(dev).manual_seed(1), **kw)
                if exact:
                    assert torch.equal(got, want), (
                        f"{name} differs from generate (do_sample={sample})"
                    )
                else:
                    _assert_greedy_bf16(model, got, want, mask, P, name)
                continue
            gen = torch.Generator(dev).manual_seed(1)
            out = dec.rollout(ids, mask, generator=gen, **sampling_kwargs(kw))
            lg = _hf_logits(model, out.sequences, mask, P)
            hf_lp = torch.log_softmax(lg, -1).gather(-1, out.sequences[:, P:, None]).squeeze(-1)
            bound = 2 * _bf16_bound(lg)  # a log-prob holds the token's logit and the logsumexp
            err = (out.log_probs - hf_lp).abs().max().item()
            assert err <= bound, f"{name}: sampled log-probs off HF's by {err} > {bound}"
