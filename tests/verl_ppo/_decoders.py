"""The three-way check of the rollout's static-cache decoders (``test_cuda_graph.py``,
``test_decode_kernels_gpu.py``): each decoder returns the tokens of
:func:`verl_ppo.rollout.generate.generate` on the same model, greedy and sampled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verl_ppo.rollout.generate import generate


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
    generator seeded 1 on ``ids``'s device (no EOS stop, pad id 0).

    Args:
        decoders: name -> decoder, the name used in the failure message.
        ids, mask: ``(batch, prompt_len)`` left-padded prompts and their attention mask.

    Raises:
        AssertionError: a decoder's tokens differ (names the decoder and the mode).
    """
    dev = ids.device
    for sample in (False, True):
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0, do_sample=sample)
        want = generate(model, ids, mask, generator=torch.Generator(dev).manual_seed(1), **kw)
        for name, dec in decoders.items():
            got = dec.generate(ids, mask, generator=torch.Generator(dev).manual_seed(1), **kw)
            assert torch.equal(got, want), f"{name} differs from generate (do_sample={sample})"
