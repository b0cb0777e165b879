"""Log-probs and entropy through the LM head without materialising fp32 logits over the
whole vocabulary (forward and backward).

The plain path (``model(...).logits.float()`` then ``log_softmax``) holds, per micro-batch
of ``N`` tokens, ``N x V`` logits in bf16, again in fp32, the log-softmax, the softmax of
the entropy and their gradients: at ``V = 151,936`` and ``N = 4096`` that is 2.5 GB per
fp32 copy. Here the hidden states ``(N, H)`` go through the head in chunks of ``C`` rows:
each chunk's logits ``(C, V)`` are computed, reduced to ``logsumexp``, the target's
log-prob and the entropy, and dropped; the backward pass recomputes them chunk by chunk
(one extra ``C x H x V`` matmul per chunk) and returns the gradients of the hidden states
and of the head weight. Peak extra memory is a few ``C x V`` fp32 buffers whatever ``N``.

Same idea as verl's fused linear-cross-entropy kernels (``verl/utils/kernel``) and Liger's
``FusedLinearCrossEntropy``, written in torch ops (it runs on the CPU too, and the matmuls
stay cuBLAS). Gradients, with ``z = h W^T / T``, ``p = softmax(z)``, ``lse = logsumexp(z)``,
``H = lse - sum(p z)``:

- ``d logp_target / dz = onehot(target) - p``;
- ``d H / dz = -p (z - lse + H)``.

Tested against the plain path: to fp32 rounding on the CPU, within bf16 noise on the GPU
(``tests/verl_ppo/test_fused_head.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ppo.step.compiled import CompiledOrEager

CHUNK_ELEMENTS = 1 << 27
"""fp32 elements of one chunk's logits (512 MiB): ``C = CHUNK_ELEMENTS // V`` rows."""


def head_weight(model: Any) -> torch.Tensor | None:
    """The LM head weight ``(V, H)`` of a HF causal LM, or None when the fused path does
    not apply (head with a bias, logit soft-capping or scaling, ZeRO-3 partitioned)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return None
    cfg = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, name, None) not in (None, 1.0):
            return None
    w = head.weight
    if hasattr(w, "ds_id"):  # a DeepSpeed ZeRO-3 parameter: partitioned outside its module
        return None
    return w


def fused_head_unsupported(model: Any) -> str | None:
    """Why :func:`head_weight` is None for ``model`` (a reason to report), or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "the model has no nn.Linear output embedding"
    if head.bias is not None:
        return "the LM head has a bias"
    if hasattr(head.weight, "ds_id"):
        return "ZeRO-3 partitions the LM head weight"
    if head_weight(model) is None:
        return "the model scales or soft-caps its logits"
    return None


def _chunk_stats(z_lowp, targets, temperature: float, entropy: bool):
    """One chunk's ``(lse, logp, entropy or None)`` from its logits ``(C, V)`` in the
    model's dtype: fp32 math, one fused reduction kernel when compiled."""
    z = z_lowp.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = None
    if entropy:
        p = torch.exp(z - lse[:, None])
        ent = lse - (p * z).sum(-1)
    return lse, logp, ent


def _chunk_grad(z_lowp, targets, lse, ent, gl, ge, temperature: float):
    """One chunk's ``d loss / d (h W^T)`` ``(C, V)`` in the model's dtype (module docstring's
    formulas; ``gl``, ``ge``: ``(C, 1)`` upstream gradients of logp and entropy, ``ge`` None
    without an entropy gradient): one fused pointwise kernel when compiled."""
    z = z_lowp.float()
    if temperature != 1.0:
        z = z / temperature
    lse_c = lse[:, None]
    p = torch.exp(z - lse_c)
    if ge is not None:
        gz = p * (-gl - ge * (z - lse_c + ent[:, None]))
    else:
        gz = p * -gl
    gz = gz.scatter_add(-1, targets[:, None], gl)
    if temperature != 1.0:
        gz = gz / temperature
    return gz.to(z_lowp.dtype)


# In eager mode the per-chunk fp32 softmax statistics and gradient are each several full
# passes over a (C, V) fp32 buffer (upcast, logsumexp, exp, products, sums); compiled on
# CUDA, each is one kernel reading the chunk's bf16 logits once. Dynamic in C (the last
# chunk of a micro-batch is shorter). Eager (the reference) on the CPU.
_stats = CompiledOrEager(_chunk_stats, dynamic=True)
_grad = CompiledOrEager(_chunk_grad, dynamic=True)


class _WeightGradAccumulator:
    """``acc += a @ b`` into an fp32 ``acc`` from bf16 ``a, b``: on CUDA one cuBLAS GEMM
    with fp32 output accumulating in place (``torch.addmm(..., out_dtype=float32)``), no
    ``(V, H)`` low-precision product to round and upcast; elsewhere (or if that op is not
    available) ``acc += (a @ b).float()``."""

    fused_ok = True

    @classmethod
    def add(cls, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if acc.is_cuda and a.dtype != acc.dtype and cls.fused_ok:
            try:
                torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
                return
            except (RuntimeError, TypeError):
                cls.fused_ok = False
        acc += (a @ b).to(acc.dtype)


class _ChunkedHeadLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, entropy: bool):
        n = hidden.shape[0]
        logp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32) if entropy else None
        for s in range(0, n, chunk):
            lse_c, logp_c, ent_c = _stats(
                hidden[s : s + chunk] @ weight.t(), targets[s : s + chunk], temperature, entropy
            )
            lse[s : s + chunk], logp[s : s + chunk] = lse_c, logp_c
            if entropy:
                ent[s : s + chunk] = ent_c
        ctx.save_for_backward(hidden, weight, targets, lse, ent if entropy else lse)
        ctx.set_materialize_grads(False)  # an unused entropy (metrics only) costs no backward
        ctx.temperature, ctx.chunk, ctx.entropy = temperature, chunk, entropy
        return (logp, ent) if entropy else (logp, logp.new_zeros(0))

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden) if need_h else None
        g_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        )
        with_ent = ctx.entropy and g_ent is not None and g_ent.numel() > 0
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            gl = g_logp[s : s + chunk, None] if g_logp is not None else lse.new_zeros(len(h), 1)
            ge = g_ent[s : s + chunk, None] if with_ent else None
            ent_c = ent[s : s + chunk] if with_ent else None
            gz = _grad(h @ weight.t(), targets[s : s + chunk], lse[s : s + chunk], ent_c, gl, ge, T)
            if need_h:
                g_h[s : s + chunk] = gz @ weight
            if need_w:
                _WeightGradAccumulator.add(g_w, gz.t(), h)
        return g_h, (g_w.to(weight.dtype) if need_w else None), None, None, None, None


def chunked_head_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T / T)[target]`` and the entropy, chunk by chunk.

    Args:
        hidden: ``(N, H)`` final hidden states (after the last norm), any float dtype.
        weight: ``(V, H)`` LM head weight, same dtype as ``hidden``.
        targets: ``(N,)`` int64 token ids.
        temperature: > 0.
        with_entropy: also return the entropy of each distribution.
        chunk_rows: rows per chunk; default ``CHUNK_ELEMENTS // V``.

    Returns:
        ``(log_prob (N,) float32, entropy (N,) float32 or None)``; differentiable with
        respect to ``hidden`` and ``weight``.

    Raises:
        ValueError: shapes or dtypes that do not match.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} must be (N, H), (V, H)"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be ({hidden.shape[0]},)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but the head weight is {weight.dtype}")
    chunk = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    logp, ent = _ChunkedHeadLogProb.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk), bool(with_entropy)
    )
    return logp, (ent if with_entropy else None)
