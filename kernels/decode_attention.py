"""Single-token (decode) attention over the static KV cache, split over the cache length
(Triton).

The static cache of :mod:`verl_ppo.rollout.cuda_graph` has ``S`` slots per sequence, of which
only ``L = slot + 1`` are ever written by the current step; ``scaled_dot_product_attention``
with a boolean mask reads all ``S`` and runs a prefill-shaped kernel for one query row. This
is flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"; the split-K
scheme of vLLM's paged attention v2): every program takes the ``G`` query heads that share one
KV head (grouped-query attention: the cache is read once per KV head, not once per query
head) over one split of the slots, skips slots at and after ``L`` (read from a device tensor,
so the kernel runs inside a captured CUDA graph), and a second kernel merges the splits'
partial softmaxes (running max, sum of exponentials, weighted values).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_NEG_INF = tl.constexpr(float("-inf"))


class RopeNew(NamedTuple):
    """The new position of a RoPE model's decode step (see :func:`decode_attention`)."""

    k: torch.Tensor  # (B, Hkv, D), not yet rotated
    v: torch.Tensor  # (B, Hkv, D)
    cos: torch.Tensor  # (B, D)
    sin: torch.Tensor  # (B, D)


def _check_rope(rope: RopeNew, B: int, Hkv: int, D: int) -> None:
    k, v, cos, sin = rope
    if (
        k.shape != (B, Hkv, D)
        or v.shape != k.shape
        or cos.shape != (B, D)
        or sin.shape != cos.shape
    ):
        raise ValueError(
            f"decode_attention rope: k {tuple(k.shape)}, v {tuple(v.shape)}, cos "
            f"{tuple(cos.shape)}, sin {tuple(sin.shape)} (need k, v ({B}, {Hkv}, {D}), cos, sin "
            f"({B}, {D}))"
        )
    if any(t.stride(-1) != 1 for t in rope) or cos.stride() != sin.stride():
        raise ValueError("decode_attention rope: a contiguous last dim and equal cos/sin strides")


@triton.jit
def _split(
    q_ptr, k_ptr, v_ptr, valid_ptr, len_ptr, acc_ptr, ml_ptr, o_ptr,
    kn_ptr, vn_ptr, cos_ptr, sin_ptr,
    sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, s_valid, so_b, so_h,
    skn_b, skn_h, svn_b, svn_h, sc_b,
    scale, G, NSPLIT,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr,
    DIRECT: tl.constexpr, ROPE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    rows = tl.arange(0, G_P2)
    d = tl.arange(0, D)
    q_at = q_ptr + b * sq_b + (h * G + rows)[:, None] * sq_h
    q = tl.load(q_at + d[None, :], mask=(rows < G)[:, None], other=0.0)
    length = tl.load(len_ptr)
    lo = sp * SPLIT
    hi = tl.minimum(lo + SPLIT, length)
    kb = k_ptr + b.to(tl.int64) * sk_b + h * sk_h
    vb = v_ptr + b.to(tl.int64) * sv_b + h * sv_h
    if ROPE:
        # HF's rotate-half RoPE in fp32, rounded once to the input dtype (as the separate
        # kernel kernels/rope_cache.py does): x * cos + rotate_half(x) * sin
        partner = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        c = tl.load(cos_ptr + b * sc_b + d).to(tl.float32)
        sn = tl.load(sin_ptr + b * sc_b + d).to(tl.float32)
        qp = tl.load(q_at + partner[None, :], mask=(rows < G)[:, None], other=0.0)
        q = (q.to(tl.float32) * c[None, :] + sign[None, :] * qp.to(tl.float32) * sn[None, :]).to(
            q.dtype
        )
        # the new position (slot length - 1) is attended from registers by the split that
        # holds it, which also writes it into the cache; the loop reads the slots before it
        slot = length - 1
        hi = tl.minimum(hi, slot)
    m = tl.full((G_P2,), _NEG_INF, tl.float32)
    lsum = tl.zeros((G_P2,), tl.float32)
    acc = tl.zeros((G_P2, D), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        ok = n < hi
        ok = ok & (tl.load(valid_ptr + b * s_valid + n, mask=ok, other=0) != 0)
        k = tl.load(kb + n[:, None] * sk_s + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where(ok[None, :], s, _NEG_INF)
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        v = tl.load(vb + n[:, None] * sv_s + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        lsum = lsum * alpha + tl.sum(p, 1)
        m = m_new
    if ROPE:
        if (lo <= slot) & (slot < lo + SPLIT):
            kn_at = kn_ptr + b * skn_b + h * skn_h
            ka = tl.load(kn_at + d).to(tl.float32)
            kp = tl.load(kn_at + partner).to(tl.float32)
            kn = (ka * c + sign * kp * sn).to(k_ptr.dtype.element_ty)
            vn = tl.load(vn_ptr + b * svn_b + h * svn_h + d)
            tl.store(kb + slot * sk_s + d, kn)
            tl.store(vb + slot * sv_s + d, vn.to(v_ptr.dtype.element_ty))
            s = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale
            m_new = tl.maximum(m, s)
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new)
            # as the loop's tl.dot(p.to(v.dtype), v): the weight rounded to the cache dtype
            pv = p.to(v_ptr.dtype.element_ty).to(tl.float32)
            acc = acc * alpha[:, None] + pv[:, None] * vn.to(tl.float32)[None, :]
            lsum = lsum * alpha + p
            m = m_new
    if DIRECT:  # one split: this program holds the whole softmax, no merge needed
        den = tl.where(lsum == 0.0, 1.0, lsum)  # padding rows (>= G): never stored
        tl.store(
            o_ptr + b * so_b + (h * G + rows)[:, None] * so_h + d[None, :],
            (acc / den[:, None]).to(o_ptr.dtype.element_ty),
            mask=(rows < G)[:, None],
        )
    else:
        out = ((b * tl.num_programs(1) + h) * NSPLIT + sp) * G_P2 + rows
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc)
        tl.store(ml_ptr + out * 2, m)
        tl.store(ml_ptr + out * 2 + 1, lsum)


@triton.jit
def _merge(
    acc_ptr, ml_ptr, o_ptr, so_b, so_h, G, NSPLIT,
    NS_P2: tl.constexpr, G_P2: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, NS_P2)[:, None]
    r = tl.arange(0, G_P2)[None, :]
    d = tl.arange(0, D)[None, None, :]
    ok = (sp < NSPLIT) & (r < G)
    idx = ((b * tl.num_programs(1) + h) * NSPLIT + sp) * G_P2 + r  # (NS_P2, G_P2)
    m = tl.load(ml_ptr + idx * 2, mask=ok, other=_NEG_INF)
    lsum = tl.load(ml_ptr + idx * 2 + 1, mask=ok, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == _NEG_INF, 0.0, mx)
    w = tl.where(m == _NEG_INF, 0.0, tl.exp(m - mx[None, :]))
    acc = tl.load(acc_ptr + idx[:, :, None] * D + d, mask=ok[:, :, None], other=0.0)
    num = tl.sum(acc * w[:, :, None], 0)  # (G_P2, D)
    den = tl.sum(lsum * w, 0)
    den = tl.where(den == 0.0, 1.0, den)  # padding rows (r >= G): never stored
    o = num / den[:, None]
    rows = tl.arange(0, G_P2)[:, None]
    tl.store(
        o_ptr + b * so_b + (h * G + rows) * so_h + tl.arange(0, D)[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=rows < G,
    )


def default_split(heads: int, slots: int, block_n: int, device: torch.device) -> int:
    """Slots per program for ``heads = B * Hkv`` (sequence, KV head) pairs over ``slots``
    cache slots: one split (no merge kernel) when the pairs alone fill the GPU's SMs, else
    enough splits for about two programs per SM. On one H200 at B = 128, Hkv = 2, S = 512
    one split took 12.2 us against 16.1 us for four, before the merge kernel was
    dropped for one split (``benchmarks/gpu/profile_decode.py
    --sweep``).
    """
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    nsplit = 1 if heads >= sms else min(triton.cdiv(slots, block_n), triton.cdiv(2 * sms, heads))
    return triton.cdiv(triton.cdiv(slots, nsplit), block_n) * block_n


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_valid: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    *,
    split: int | None = None,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int | None = None,
    rope: RopeNew | None = None,
) -> torch.Tensor:
    """Attention of one new query per sequence over the cache's first ``length`` slots.

    With ``rope`` the step's RoPE and cache write happen here too (one launch per layer
    instead of two): ``q`` is the un-rotated query, and the new position's key (rotated) and
    value are written at slot ``length - 1`` and attended from registers by the program
    whose split holds that slot, in the same arithmetic as
    :func:`verl_comm.kernels.rope_cache.rope_write_cache` followed by this kernel.

    Args:
        q: ``(B, Hq, D)`` queries (last dim contiguous), ``Hq = G * Hkv``.
        k_cache, v_cache: ``(B, Hkv, S, D)``, last dim contiguous, ``q``'s dtype.
        kv_valid: ``(B, S)`` bool, True where a slot may be attended (padding False).
        length: ``(1,)`` int64 on the device: slots at and after it are skipped (every row
            must have a valid slot below it).
        scale: softmax scale (``1/sqrt(D)``).
        split: slots per program (a multiple of ``block_n``); None: chosen by
            :func:`default_split`. block_n: slots per inner step (launches compared by
            ``benchmarks/gpu/profile_decode.py --sweep``); num_warps: per program of the
            split kernel. With one split the first kernel writes the output itself.
            num_stages: software-pipelining depth of the split kernel's loop (None: Triton's
            default).
        rope: the new position's ``k``/``v`` ``(B, Hkv, D)`` and rotary tables ``cos``/``sin``
            ``(B, D)`` (HF's layout), each with a contiguous last dim; ``kv_valid`` must
            already be True at slot ``length - 1``.

    Returns:
        ``(B, Hq, D)`` in ``q``'s dtype: ``softmax(q k^T * scale, masked) v`` per query head.

    Raises:
        ValueError: shapes, devices or a head count that ``Hkv`` does not divide.
    """
    B, Hq, D = q.shape
    _, Hkv, S, Dk = k_cache.shape
    if (
        Dk != D
        or v_cache.shape != k_cache.shape
        or kv_valid.shape != (B, S)
        or Hq % Hkv
        or D & (D - 1)
    ):
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, valid "
            f"{tuple(kv_valid.shape)} (need Hq divisible by Hkv and D a power of 2)"
        )
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("decode_attention runs on CUDA tensors (or CPU with TRITON_INTERPRET=1)")
    if split is None:
        split = default_split(B * Hkv, S, block_n, q.device)
    if split % block_n:
        raise ValueError(f"split {split} must be a multiple of block_n {block_n}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("kv_valid", kv_valid)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dim")
    G = Hq // Hkv
    g_p2 = max(16, triton.next_power_of_2(G))  # tl.dot needs >= 16 rows
    nsplit = triton.cdiv(S, split)
    direct = nsplit == 1
    n_part = 0 if direct else B * Hkv * nsplit * g_p2
    acc = torch.empty(n_part * D, dtype=torch.float32, device=q.device)
    ml = torch.empty(n_part * 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    valid = kv_valid.view(torch.uint8)
    if rope is not None:
        _check_rope(rope, B, Hkv, D)
        kn, vn, cos, sin = rope
    else:
        kn, vn, cos, sin = q, q, q, q  # unread
    _split[(B, Hkv, nsplit)](
        q, k_cache, v_cache, valid, length, acc, ml, out, kn, vn, cos, sin,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], kv_valid.stride(0),
        out.stride(0), out.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        cos.stride(0), scale, G, nsplit,
        SPLIT=split, BLOCK_N=block_n, G_P2=g_p2, D=D, DIRECT=direct, ROPE=rope is not None,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    if direct:
        return out
    _merge[(B, Hkv)](
        acc, ml, out, out.stride(0), out.stride(1), G, nsplit,
        NS_P2=triton.next_power_of_2(nsplit), G_P2=g_p2, D=D, num_warps=4,
    )  # fmt: skip
    return out
