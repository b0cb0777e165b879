"""Rotary embedding of a decode step's new query and key, fused with the KV-cache write
(Triton).

A single-token decode step of a Llama-family layer applies RoPE to ``q`` and ``k`` (HF's
rotate-half form: ``x * cos + rotate_half(x) * sin``) and writes ``k`` and ``v`` into the
static cache at the step's slot. In eager PyTorch that is a RoPE kernel plus two
``index_copy_`` launches per layer, each reading and writing a few kilobytes per sequence: the
launches, not the bytes, cost the time. This kernel does all three in one launch per layer;
the slot is read from a device tensor, so it runs inside a captured CUDA graph (the same
fusion as vLLM's ``rotary_embedding`` + ``reshape_and_cache`` pair, done in one kernel).

Arithmetic: the rotation in fp32 with ``cos``/``sin`` as given, rounded once to the output
dtype (as ``torch.compile`` of the eager rotate-half expression does).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_cache(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, qo_ptr,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc_b,
    skc_b, skc_h, skc_s, svc_b, svc_h, svc_s, sqo_b, sqo_h,
    NQ, NKV, D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    r = tl.program_id(1)  # rows: NQ query heads, then NKV key heads, then NKV value heads
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (d + half) % D
    sign = tl.where(d < half, -1.0, 1.0)
    slot = tl.load(slot_ptr)
    if r < NQ + NKV:
        c = tl.load(cos_ptr + b * sc_b + d).to(tl.float32)
        s = tl.load(sin_ptr + b * sc_b + d).to(tl.float32)
        if r < NQ:
            src = q_ptr + b * sq_b + r * sq_h
        else:
            src = k_ptr + b * sk_b + (r - NQ) * sk_h
        x = tl.load(src + d).to(tl.float32)
        xp = tl.load(src + partner).to(tl.float32)
        y = x * c + sign * xp * s
        if r < NQ:
            tl.store(qo_ptr + b * sqo_b + r * sqo_h + d, y.to(qo_ptr.dtype.element_ty))
        else:
            h = r - NQ
            dst = kc_ptr + b.to(tl.int64) * skc_b + h * skc_h + slot * skc_s
            tl.store(dst + d, y.to(kc_ptr.dtype.element_ty))
    else:
        h = r - NQ - NKV
        v = tl.load(v_ptr + b * sv_b + h * sv_h + d)
        dst = vc_ptr + b.to(tl.int64) * svc_b + h * svc_h + slot * svc_s
        tl.store(dst + d, v)


def rope_write_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: torch.Tensor,
) -> torch.Tensor:
    """RoPE on one new position per sequence; rotated ``k`` and ``v`` written into the cache.

    Args:
        q: ``(B, Hq, D)`` query heads of the new position (last dim contiguous; may be a view
            into a fused q/k/v projection output).
        k, v: ``(B, Hkv, D)`` key and value heads (last dim contiguous).
        cos, sin: ``(B, D)`` rotary tables of each sequence's position (last dim contiguous),
            HF's layout (the ``D/2`` frequencies repeated twice).
        k_cache, v_cache: ``(B, Hkv, S, D)`` static caches (last dim contiguous), written at
            slot ``slot`` in place.
        slot: ``(1,)`` int64 on the device: the cache slot of the new position.

    Returns:
        ``(B, Hq, D)`` rotated queries, contiguous, in ``q``'s dtype.

    Raises:
        ValueError: shapes, strides, dtypes or devices that do not match.
    """
    B, Hq, D = q.shape
    _, Hkv, S, Dk = k_cache.shape
    shapes_ok = (
        k.shape == v.shape == (B, Hkv, D)
        and cos.shape == sin.shape == (B, D)
        and v_cache.shape == k_cache.shape
        and Dk == D
        and k_cache.shape[0] == B
        and D % 2 == 0
        and D & (D - 1) == 0
    )
    if not shapes_ok or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(
            f"rope_write_cache: q {tuple(q.shape)}, k {tuple(k.shape)} {k.dtype}, v "
            f"{tuple(v.shape)} {v.dtype}, cos {tuple(cos.shape)}, cache {tuple(k_cache.shape)} "
            f"{k_cache.dtype} (need a power-of-2 head dim and the cache's dtype)"
        )
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("rope_write_cache runs on CUDA tensors (or CPU with TRITON_INTERPRET=1)")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_write_cache: {name} needs a contiguous last dim")
    if cos.stride() != sin.stride() or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_write_cache: cos/sin strides differ or a cache is not contiguous")
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    _rope_cache[(B, Hq + 2 * Hkv)](
        q, k, v, cos, sin, k_cache, v_cache, slot, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        Hq, Hkv, D=D, num_warps=1,
    )  # fmt: skip
    return out
