"""Sampling with a KV cache on a HF causal LM (the rollout when the hybrid engine is off).

Contract shared with the tensor-parallel rollout model: left-padded prompts in,
``(B, P + R)`` sequences out (prompt, then response right-padded with ``pad_token_id``
after EOS). Sampling draws from an explicit ``torch.Generator`` so a run is reproducible.
"""

from __future__ import annotations

import torch

from verl_ppo.compat import CACHE_KWARG


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering of ``logits (B, V)``; removed entries -> -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        remove = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Pick the next token ``(B,)`` int64 from ``logits (B, V)`` (greedy or sampled)."""
    if not do_sample:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Autoregressive generation with a KV cache.

    Args:
        model: a HF causal LM (``forward(input_ids, attention_mask, position_ids,
            past_key_values, use_cache)`` returning ``logits`` and ``past_key_values``).
        input_ids: ``(B, P)`` int64, LEFT-padded prompts.
        attention_mask: ``(B, P)`` int64/bool, 0 on left padding.
        max_new_tokens: response length limit R_max.
        eos_token_id, pad_token_id: a sequence is done after it emits EOS; later
            positions are filled with ``pad_token_id``.
        generator: RNG for sampling (on the logits' device).

    Returns:
        ``(B, P + R)`` int64 with ``R <= max_new_tokens`` (stops when all are done).

    Raises:
        ValueError: shapes of ``input_ids`` and ``attention_mask`` differ.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be (batch, prompt_len)"
        )
    B = input_ids.shape[0]
    mask = attention_mask.long()
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
    )
    past = out.past_key_values
    logits = out.logits[:, -1, :]
    next_pos = position_ids[:, -1] + 1
    done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    tokens = []
    for step in range(max_new_tokens):
        nxt = sample_next(logits, do_sample, temperature, top_k, top_p, generator)
        nxt = torch.where(done, torch.full_like(nxt, pad_token_id), nxt)
        tokens.append(nxt)
        done = done | (nxt == eos_token_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], dim=1)
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{CACHE_KWARG: past},
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    del past
    return torch.cat([input_ids, torch.stack(tokens, dim=1)], dim=1)


def response_mask_from(
    responses: torch.Tensor, eos_token_id: int, pad_token_id: int
) -> torch.Tensor:
    """Mask ``(B, R)`` float: 1 up to and including the first EOS, 0 after.

    When ``pad_token_id == eos_token_id`` (SmolLM2), padding after EOS is told apart from
    the EOS itself by position, never by value.
    """
    is_eos = responses == eos_token_id
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = ~after
    if pad_token_id != eos_token_id:
        mask = mask & (responses != pad_token_id)
    return mask.float()
