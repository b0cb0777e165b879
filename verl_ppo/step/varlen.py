"""Packed rows through torch's own varlen attention (``torch.nn.attention.varlen``).

A packed row (:mod:`verl_ppo.step.packing`) holds several sequences; attention must stay
inside each. flash-attn's ``flash_attn_varlen_func`` does that from cumulative sequence
lengths (verl's ``use_remove_padding``); torch >= 2.10 ships the same FlashAttention kernels
as :func:`torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16), so packing needs no extra
package. With sdpa or eager attention a packed row would need a dense ``(T, T)`` mask.

How it plugs into a HF model (read in transformers 5.24, ``modeling_llama.py``): the
attention module looks its kernel up by ``config._attn_implementation`` in
``AttentionInterface``; :func:`register` adds :data:`NAME` there, and :func:`varlen_model`
switches a model to it for the duration of one packed forward. The cumulative lengths travel
as the keyword arguments ``cu_seq_lens_q`` / ``max_length_q`` (HF's ``FlashAttentionKwargs``),
which the model hands down to every attention call. A name without a mask function in
``AttentionMaskInterface`` makes HF build no mask at all (``masking_utils``), which is what
a varlen kernel wants.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

NAME = "verl_varlen"
"""The attention implementation name registered in HF's ``AttentionInterface``."""


@functools.cache
def available() -> str | None:
    """Why torch's varlen attention cannot run here (None: it can).

    It needs ``torch.nn.attention.varlen`` (torch >= 2.10) and a CUDA device (FlashAttention
    kernels; torch has no CPU implementation). Decided once per process.
    """
    try:
        import torch.nn.attention.varlen  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.10)"
    if not torch.cuda.is_available():
        return "torch's varlen attention runs FlashAttention kernels, on CUDA only"
    return None


def _torch_kernel() -> Callable[..., torch.Tensor]:
    """``varlen_attn`` called causally, with GQA handled whatever the torch release offers.

    The keyword arguments differ between releases: 2.10 has ``window_size`` (``(-1, 0)`` is
    causal), an early form had ``is_causal``; ``enable_gqa`` came later (2.12). Without it the
    key/value heads are repeated first (what HF's ``repeat_kv`` does for sdpa).
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in params

    def kernel(q, k, v, cu, max_len, scale):
        if q.shape[1] != k.shape[1]:
            if native_gqa:
                return varlen_attn(
                    q, k, v, cu, cu, max_len, max_len, scale=scale, enable_gqa=True, **causal
                )
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)

    return kernel


def reference_kernel(q, k, v, cu, max_len, scale):
    """The same computation one sequence at a time with sdpa (any device, any dtype): the
    exact reference the tests compare the adapter against on the CPU.

    Args: ``q (T, H, D)``, ``k``/``v`` ``(T, Hkv, D)``, ``cu (N+1,)`` int32, ``max_len`` unused,
    ``scale`` the softmax scale. Returns ``(T, H, D)``.
    """
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        qs = q[s:e].transpose(0, 1)  # (H, n, D)
        ks = k[s:e].transpose(0, 1).repeat_interleave(rep, dim=0)
        vs = v[s:e].transpose(0, 1).repeat_interleave(rep, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale
        )
        out[s:e] = o.transpose(0, 1)
    return out


_kernel: Callable[..., torch.Tensor] | None = None
_registered = False


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: ``query (1, H, T, D)``, ``key``/``value``
    ``(1, Hkv, T, D)`` -> ``(1, T, H, D)`` (what ``sdpa_attention_forward`` returns).

    Raises:
        ValueError: called without ``cu_seq_lens_q`` (not a packed forward) or with a batch
            dimension other than 1, or with dropout (the kernel call has none).
    """
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or query.shape[0] != 1:
        raise ValueError(
            f"attention {NAME!r} runs packed rows only: pass cu_seq_lens_q and a (1, T) batch "
            f"(got batch {query.shape[0]}, cu_seq_lens_q {'missing' if cu is None else 'set'})"
        )
    if dropout:
        raise ValueError(f"attention {NAME!r} has no dropout (got {dropout}); use eval mode")
    global _kernel
    if _kernel is None:
        _kernel = _torch_kernel()
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
    out = _kernel(q, k, v, cu, int(kwargs["max_length_q"]), scaling)
    return out[None], None


def register(kernel: Callable[..., torch.Tensor] | None = None) -> None:
    """Register :data:`NAME` in HF's ``AttentionInterface`` (idempotent).

    Args:
        kernel: ``kernel(q (T,H,D), k (T,Hkv,D), v, cu (N+1,) int32, max_len, scale)``;
            None = torch's ``varlen_attn`` (CUDA). Tests pass :func:`reference_kernel`.
    """
    from transformers import AttentionInterface

    global _kernel, _registered
    _kernel = kernel
    if not _registered:
        AttentionInterface.register(NAME, _attention)
        _registered = True


def is_registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return _registered


def packed_kwargs(seq_lens: torch.Tensor) -> dict[str, Any]:
    """The keyword arguments a packed forward passes to the model: ``cu_seq_lens_q/k``
    ``(N+1,)`` int32 over the non-empty rows, ``max_length_q/k`` as Python ints (one host
    read per micro-batch)."""
    lens = seq_lens[seq_lens > 0].to(torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    m = int(lens.max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": m, "max_length_k": m}


@contextlib.contextmanager
def varlen_model(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` (a HF model, or a DeepSpeed engine / wrapper around one) on :data:`NAME`
    inside the block, restoring its attention implementation after."""
    inner = getattr(model, "module", model)
    config = inner.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
