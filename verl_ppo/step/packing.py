"""Sequence packing for the training forward passes: no compute on padding.

A rollout batch is ``input_ids (B, L)`` with ``attention_mask (B, L)``: a left-padded prompt
of ``P`` columns, then a response right-padded after EOS. Padded, a forward pass computes
``B * L`` positions; packed, it computes only the ``T = attention_mask.sum()`` valid ones.
:func:`pack` moves the valid tokens of every row into one row ``(1, T)`` whose
``position_ids`` restart at 0 for each sequence; the model is called with
``attention_mask=None`` and these ``position_ids``.

How attention is kept inside each sequence (read in transformers 5.24; the tests pass on
5.24 and on 5.17, the GPU machine's version): ``masking_utils._preprocess_mask_arguments``
calls ``find_packed_sequence_indices(position_ids)`` when the 2D mask is ``None`` and there is no
cache; every position that does not follow its predecessor by +1 starts a new sequence,
and the causal mask is AND-ed with "same sequence" (sdpa / eager / flex build a
block-diagonal causal mask; flash-attention uses the same ``position_ids`` to call its
varlen kernel). The module's own position ids (``cumsum(mask) - 1``) are consecutive
within a sequence, so the rotary embedding sees the same positions as the padded path and
the outputs are equal up to float rounding. This is verl's ``use_remove_padding``
(``verl/workers/actor/dp_actor.py``) done through transformers' own packed-sequence
detection instead of flash-attn's ``unpad_input``.

The log-probs additionally skip the LM head on positions that predict nothing
(``logits_to_keep`` as a 1D index tensor), which matters for large vocabularies.

Which attention runs the packed row (:func:`packed_attention`): flash-attention models as
above; on CUDA otherwise torch's own varlen kernels (:mod:`verl_ppo.step.varlen`, no mask);
on the CPU the dense block-diagonal mask. With a dense mask the cost is ``(T, T)``: bound
``T`` with the token budget of :mod:`verl_ppo.step.batching` (one packed row per micro-batch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from verl_ppo.algorithms.losses import entropy_from_logits


@dataclass
class PackedBatch:
    """The valid tokens of a ``(B, L)`` batch in one row, and the map back.

    Attributes:
        input_ids: ``(1, T)`` int64, the valid tokens, row after row.
        position_ids: ``(1, T)`` int64, ``0 .. n_b - 1`` within each sequence ``b``.
        src_index: ``(T,)`` int64, flat index ``b * L + l`` of each packed token.
        seq_lens: ``(B,)`` int64, valid tokens per row (0 allowed: the row is skipped).
        batch_size: ``B``.
        seq_len: ``L``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    src_index: torch.Tensor
    seq_lens: torch.Tensor
    batch_size: int
    seq_len: int

    @property
    def num_tokens(self) -> int:
        """``T``, the packed length."""
        return int(self.input_ids.shape[1])

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter per-token outputs ``(1, T, *F)`` or ``(T, *F)`` back to ``(B, L, *F)``.

        Padding positions get ``fill``. Differentiable (index_put into a fresh tensor).

        Raises:
            ValueError: the token dimension is not ``T``.
        """
        T = self.num_tokens
        batched = packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == T
        x = packed[0] if batched else packed
        if x.shape[0] != self.num_tokens:
            raise ValueError(
                f"packed output has {x.shape[0]} tokens on dim 0, expected T={self.num_tokens}"
            )
        out = x.new_full((self.batch_size * self.seq_len, *x.shape[1:]), fill)
        out = out.index_put((self.src_index,), x)
        return out.view(self.batch_size, self.seq_len, *x.shape[1:])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Pack the valid tokens of ``input_ids (B, L)`` into one row (see module docstring).

    Args:
        input_ids: ``(B, L)`` int64.
        attention_mask: ``(B, L)`` int/bool, 1 on valid tokens. Holes are allowed (valid
            tokens need not be contiguous); positions count valid tokens only, exactly like
            :func:`verl_ppo.roles.common.position_ids_from`.

    Returns:
        A :class:`PackedBatch` on the device of ``input_ids``.

    Raises:
        ValueError: shapes differ or are not 2D, or no token is valid.
    """
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be (batch, seq_len)"
        )
    B, L = input_ids.shape
    valid = attention_mask.bool()
    src_index = valid.reshape(-1).nonzero().squeeze(-1)
    if src_index.numel() == 0:
        raise ValueError("attention_mask has no valid token: nothing to pack")
    positions = (valid.long().cumsum(-1) - 1).reshape(-1)[src_index]
    return PackedBatch(
        input_ids=input_ids.reshape(-1)[src_index][None],
        position_ids=positions[None],
        src_index=src_index,
        seq_lens=valid.sum(-1),
        batch_size=B,
        seq_len=L,
    )


def packed_attention(model: torch.nn.Module, pb: PackedBatch):
    """``(context, kwargs)`` for one packed forward of ``model`` on ``pb``.

    torch's varlen attention (:mod:`verl_ppo.step.varlen`) when the batch is on CUDA and the
    model's attention is not flash-attention already; otherwise no change (flash-attention
    finds the sequences from ``position_ids``; sdpa/eager get the dense block-diagonal mask).
    """
    from verl_ppo.step import varlen

    attn = str(getattr(getattr(model, "module", model).config, "_attn_implementation", ""))
    if not pb.input_ids.is_cuda or "flash" in attn or varlen.available() is not None:
        return contextlib.nullcontext(), {}
    if not varlen.is_registered():
        varlen.register()
    return varlen.varlen_model(model), varlen.packed_kwargs(pb.seq_lens)


def packed_forward(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    fill: float = 0.0,
) -> torch.Tensor:
    """Run a per-token function on the packed batch and unpack its output.

    Args:
        fn: ``fn(input_ids (1, T), position_ids (1, T)) -> (1, T, *F)`` per-token outputs;
            it must call the HF model with ``attention_mask=None`` and these
            ``position_ids`` (and ``use_cache=False``) so the packed mask is used.
        input_ids, attention_mask: ``(B, L)`` as in :func:`pack`.
        fill: value at padding positions.

    Returns:
        ``(B, L, *F)`` in ``fn``'s dtype.
    """
    pb = pack(input_ids, attention_mask)
    return pb.unpack(fn(pb.input_ids, pb.position_ids), fill)


def _run_packed(model: torch.nn.Module, pb: PackedBatch, call: Callable[..., Any]) -> Any:
    """``call(**kwargs)`` inside :func:`packed_attention`'s context for ``model``."""
    ctx, kwargs = packed_attention(model, pb)
    with ctx:
        return call(**kwargs)


def _response_predictors(attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``(B, L)`` bool: position ``l`` is valid and predicts a valid response token ``l+1``."""
    valid = attention_mask.bool()
    pred = torch.zeros_like(valid)
    pred[:, prompt_len - 1 : -1] = valid[:, prompt_len - 1 : -1] & valid[:, prompt_len:]
    return pred


def packed_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed drop-in for :func:`verl_ppo.roles.common.sequence_log_probs`.

    Args:
        model: a HF causal LM accepting ``position_ids``, ``use_cache`` and
            ``logits_to_keep`` (Llama, Qwen2, ...), or a DeepSpeed engine around one.
        input_ids, attention_mask: ``(B, P + R)``.
        prompt_len: ``P`` (``>= 1``).
        temperature: the sampling temperature.
        with_entropy: also return the entropy of each predicting distribution.
        fused: the chunked LM head of :mod:`verl_ppo.roles.fused_head` on the kept positions.

    Returns:
        ``(log_prob (B, R) float32, entropy (B, R) float32 or None)``. Equal to the padded
        path wherever the response token is valid; 0 at padded response positions (the
        padded path leaves garbage there, which callers mask out anyway).

    Raises:
        ValueError: ``prompt_len`` outside ``[1, L - 1]`` or bad shapes (from :func:`pack`).
    """
    L = input_ids.shape[-1]
    if not 1 <= prompt_len < L:
        raise ValueError(f"prompt_len={prompt_len} must be in [1, {L - 1}] for L={L}")
    pb = pack(input_ids, attention_mask)
    pred_flat = _response_predictors(attention_mask, prompt_len).reshape(-1)
    keep = pred_flat[pb.src_index].nonzero().squeeze(-1)  # packed positions that predict
    src = pb.src_index[keep]  # their flat (b*L + l) index; the target is at src + 1
    targets = input_ids.reshape(-1)[src + 1]
    logp, ent_k = _kept_log_probs(model, pb, keep, targets, temperature, with_entropy, fused)
    B = input_ids.shape[0]

    def to_response(x: torch.Tensor) -> torch.Tensor:
        full = x.new_zeros(B * L).index_put((src,), x).view(B, L)
        return full[:, prompt_len - 1 : -1]

    ent = to_response(ent_k) if ent_k is not None else None
    return to_response(logp), ent


def _kept_log_probs(
    model: torch.nn.Module,
    pb: PackedBatch,
    keep: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``(K,)`` float32 of ``targets`` at the packed positions ``keep (K,)`` (and
    their entropies), through the chunked head when ``fused``, else ``logits_to_keep``.

    Raises:
        RuntimeError: the model ignored ``logits_to_keep`` as an index tensor.
    """
    if fused:
        from verl_ppo.job.model_family import decoder_of
        from verl_ppo.roles.fused_head import chunked_head_log_probs, head_weight

        h = _run_packed(
            model,
            pb,
            lambda **kw: decoder_of(model)(
                input_ids=pb.input_ids,
                position_ids=pb.position_ids,
                attention_mask=None,
                use_cache=False,
                **kw,
            ),
        ).last_hidden_state[0, keep]
        return chunked_head_log_probs(h, head_weight(model), targets, temperature, with_entropy)
    out = _run_packed(
        model,
        pb,
        lambda **kw: model(
            input_ids=pb.input_ids,
            position_ids=pb.position_ids,
            attention_mask=None,
            use_cache=False,
            logits_to_keep=keep,
            **kw,
        ),
    )
    logits = out.logits[0].float()  # (K, V)
    if logits.shape[0] != keep.numel():
        raise RuntimeError(
            f"model returned {logits.shape[0]} logits for {keep.numel()} kept positions: "
            "it does not honour logits_to_keep as an index tensor"
        )
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    return logp, entropy_from_logits(logits) if with_entropy else None


def packed_values(
    value_model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: int,
) -> torch.Tensor:
    """Packed values of the states before each response token.

    Args:
        value_model: a :class:`verl_ppo.roles.critic.ValueModel` (uses its ``backbone``, a
            HF base model returning ``last_hidden_state``, and ``value_head``).
        input_ids, attention_mask: ``(B, P + R)``.
        prompt_len: ``P``.

    Returns:
        ``(B, R)`` float32: ``values[:, P-1 : -1]`` as the padded ``ValueModel`` computes
        them, 0 where the position is padding.
    """

    pb = pack(input_ids, attention_mask)
    h = _run_packed(
        value_model.backbone,
        pb,
        lambda **kw: value_model.backbone(
            input_ids=pb.input_ids,
            position_ids=pb.position_ids,
            attention_mask=None,
            use_cache=False,
            **kw,
        ),
    ).last_hidden_state
    values = value_model.value_head(h).squeeze(-1).float()
    return pb.unpack(values)[:, prompt_len - 1 : -1]
