"""One-pass next-token sampling over a ``(batch, vocab)`` logits tensor (Triton).

A decode step of a small model at batch 128 spends more time sampling than it should: the
eager chain (fp32 cast, softmax, ``exponential_``, divide, argmax, logsumexp, gather) reads
and writes the ``(batch, vocab)`` tensor about ten times, and ``torch.multinomial`` checks its
input with a host sync (``.item()``) on every call, so the host can never run ahead of the GPU.
Here the logits are read once:

- the draw is the Gumbel-max trick, ``argmax_i(z_i - log(-log u_i))`` with ``z = logits / T``
  and ``u_i`` uniform from Triton's Philox (``tl.randint4x``: one call per four columns),
  which samples ``softmax(z)`` exactly (Gumbel 1954; e.g. Jang et al. 2017, eq. 1);
  ``torch.multinomial``'s own one-sample path is the same trick in its exponential form
  (``argmax p_i / e_i``,
  ``aten/src/ATen/native/Distributions.cpp``); it is computed in base 2,
  ``argmax_i(log2(e) z_i - log2(-log2 u_i))`` (the same argmax: both sides differ by a
  constant and a positive factor), with the GPU's approximate ``lg2``: Philox and two
  accurate logs per column made the kernel compute-bound, several times the time of reading
  the logits once (``benchmarks/gpu/profile_decode.py`` times the sampler alone against
  the logits' bytes);
- the log-probability of the drawn token, ``z_tok - logsumexp(z)``, comes from an online
  max / sum-of-exponentials in the same pass.

Stage 1 splits every row into chunks of ``BLOCK`` columns (one program each: enough programs to
reach HBM bandwidth at batch 128); stage 2 combines a row's chunks. The seed is read from a
device tensor, so a call never waits for the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2(x): on CUDA the hardware's approximate ``lg2.approx.f32`` (relative error about
    2^-22, PTX ISA; a few instructions instead of libdevice's accurate log); ``tl.log2`` in
    the interpreter, which runs no PTX."""
    if FAST:
        return tl.inline_asm_elementwise(
            "lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.log2(x)


@triton.jit
def _partial(
    x_ptr,
    stride,
    V,
    inv_temp,
    seed_ptr,
    m_ptr,
    s_ptr,
    g_ptr,
    i_ptr,
    z_ptr,
    NCH,
    step_ptr,
    GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
    SEED_AT_STEP: tl.constexpr,
    FAST_LOG: tl.constexpr,
):
    # One program per (row, chunk of BLOCK columns). One Philox call gives four uniforms
    # (tl.rand would make one call per column and use one of its four outputs: Philox's
    # integer multiplies, not the bytes, then bound this kernel): the chunk is four
    # contiguous quarters, and column j * Q + q of the chunk takes output j of call q.
    row = tl.program_id(0)
    ch = tl.program_id(1)
    Q: tl.constexpr = BLOCK // 4
    LOG2E: tl.constexpr = 1.4426950408889634
    q = tl.arange(0, Q)
    base = x_ptr + row.to(tl.int64) * stride
    c0 = ch * BLOCK + q
    c1 = c0 + Q
    c2 = c0 + 2 * Q
    c3 = c0 + 3 * Q
    z0 = tl.load(base + c0, mask=c0 < V, other=_NEG_INF).to(tl.float32) * inv_temp
    z1 = tl.load(base + c1, mask=c1 < V, other=_NEG_INF).to(tl.float32) * inv_temp
    z2 = tl.load(base + c2, mask=c2 < V, other=_NEG_INF).to(tl.float32) * inv_temp
    z3 = tl.load(base + c3, mask=c3 < V, other=_NEG_INF).to(tl.float32) * inv_temp
    m = tl.maximum(
        tl.maximum(tl.max(z0, 0), tl.max(z1, 0)), tl.maximum(tl.max(z2, 0), tl.max(z3, 0))
    )
    ms = tl.where(m == _NEG_INF, 0.0, m)
    s = (tl.sum(tl.exp(z0 - ms), 0) + tl.sum(tl.exp(z1 - ms), 0)) + (
        tl.sum(tl.exp(z2 - ms), 0) + tl.sum(tl.exp(z3 - ms), 0)
    )
    if GREEDY:
        g0, g1, g2, g3 = z0, z1, z2, z3
    else:
        if SEED_AT_STEP:  # seed_ptr: the rollout's seeds, one per step
            seed = tl.load(seed_ptr + tl.load(step_ptr))
        else:
            seed = tl.load(seed_ptr)
        r0, r1, r2, r3 = tl.randint4x(seed, (row * NCH + ch) * Q + q)
        # Gumbel-max in base 2: log2(e) (z - ln(-ln u)) = log2(e) z - log2(-log2 u) + const
        g0 = z0 * LOG2E - _log2(-_log2(tl.uint_to_uniform_float(r0), FAST_LOG), FAST_LOG)
        g1 = z1 * LOG2E - _log2(-_log2(tl.uint_to_uniform_float(r1), FAST_LOG), FAST_LOG)
        g2 = z2 * LOG2E - _log2(-_log2(tl.uint_to_uniform_float(r2), FAST_LOG), FAST_LOG)
        g3 = z3 * LOG2E - _log2(-_log2(tl.uint_to_uniform_float(r3), FAST_LOG), FAST_LOG)
        g0 = tl.where(c0 < V, g0, _NEG_INF)
        g1 = tl.where(c1 < V, g1, _NEG_INF)
        g2 = tl.where(c2 < V, g2, _NEG_INF)
        g3 = tl.where(c3 < V, g3, _NEG_INF)
    v0 = tl.max(g0, 0)
    v1 = tl.max(g1, 0)
    v2 = tl.max(g2, 0)
    v3 = tl.max(g3, 0)
    gmax = tl.maximum(tl.maximum(v0, v1), tl.maximum(v2, v3))
    # the first quarter holding the maximum, and its first column there (argmax's tie rule)
    best = tl.where(
        v0 == gmax,
        tl.argmax(g0, 0),
        tl.where(
            v1 == gmax,
            tl.argmax(g1, 0) + Q,
            tl.where(v2 == gmax, tl.argmax(g2, 0) + 2 * Q, tl.argmax(g3, 0) + 3 * Q),
        ),
    )
    col = ch * BLOCK + best
    zsel = tl.load(base + col, mask=col < V, other=0.0).to(tl.float32) * inv_temp
    out = row * NCH + ch
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(g_ptr + out, gmax)
    tl.store(i_ptr + out, col)
    tl.store(z_ptr + out, zsel)


@triton.jit
def _combine(
    m_ptr, s_ptr, g_ptr, i_ptr, z_ptr, tok_ptr, lp_ptr, NCH,
    step_ptr, done_ptr, finite_ptr, toks_ptr, lps_ptr, s_out, tok_in_ptr, pos_in_ptr, s_in,
    eos_ptr, N_EOS, pad,
    NCH_P2: tl.constexpr, RECORD: tl.constexpr, EOS_P2: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    c = tl.arange(0, NCH_P2)
    ok = c < NCH
    base = row * NCH
    m = tl.load(m_ptr + base + c, mask=ok, other=_NEG_INF)
    s = tl.load(s_ptr + base + c, mask=ok, other=0.0)
    g = tl.load(g_ptr + base + c, mask=ok, other=_NEG_INF)
    mx = tl.max(m, 0)
    m_safe = tl.where(m == _NEG_INF, mx, m)
    lse = mx + tl.log(tl.sum(s * tl.exp(m_safe - mx), 0))
    best = tl.argmax(g, 0)
    pick = c == best
    idx = tl.sum(tl.where(pick, tl.load(i_ptr + base + c, mask=ok, other=0), 0), 0)
    z = tl.sum(tl.where(pick, tl.load(z_ptr + base + c, mask=ok, other=0.0), 0.0), 0)
    tok = idx.to(tl.int64)
    lp = z - lse
    if RECORD:
        # the decode loop's bookkeeping (verl_ppo.rollout.generate.settle) for this row
        done = tl.load(done_ptr + row) != 0
        tok = tl.where(done, pad, tok)
        if (lp != lp) | (tl.abs(lp) == float("inf")):
            tl.store(finite_ptr, 0)  # the flag only ever goes to 0: no race between rows
        lp = tl.where(done, 0.0, lp)
        e = tl.arange(0, EOS_P2)
        eos = tl.load(eos_ptr + e, mask=e < N_EOS, other=-1)
        hit = tl.sum(((eos == tok) & (e < N_EOS)).to(tl.int32), 0) > 0
        tl.store(done_ptr + row, (done | hit).to(tl.uint8))
        step = tl.load(step_ptr)
        tl.store(toks_ptr + row * s_out + step, tok)
        tl.store(lps_ptr + row * s_out + step, lp)
        tl.store(tok_in_ptr + row * s_in, tok)
        tl.store(pos_in_ptr + row * s_in, tl.load(pos_in_ptr + row * s_in) + 1)
    tl.store(tok_ptr + row, tok)
    tl.store(lp_ptr + row, lp)


class Record(NamedTuple):
    """The decode loop's state that :func:`gumbel_sample` updates with its draw (the
    bookkeeping of ``verl_ppo.rollout.generate.settle`` and the next step's inputs, in the
    combining kernel: no extra launch).

    Attributes:
        step: ``(1,)`` int64, the response step ``t``: the draw's seed is ``seeds[t]`` and
            the token and log-prob are stored at column ``t``.
        done: ``(B,)`` bool: rows done get ``pad`` and a 0 log-prob; updated with the EOS hits.
        finite: ``()`` bool, set False when a log-prob is not finite (before the zeroing).
        tokens, log_probs: ``(B, S)`` int64 and float32 (row stride equal), column ``t`` written.
        tok_in, pos_in: ``(B, 1)`` int64 (row stride equal): the token is written to
            ``tok_in``, ``pos_in`` advances by one.
        eos: ``(n,)`` int64 EOS ids, or None. pad: the id of finished rows.
    """

    step: torch.Tensor
    done: torch.Tensor
    finite: torch.Tensor
    tokens: torch.Tensor
    log_probs: torch.Tensor
    tok_in: torch.Tensor
    pos_in: torch.Tensor
    eos: torch.Tensor | None
    pad: int


def gumbel_sample(
    logits: torch.Tensor,
    temperature: float,
    seed: torch.Tensor | None,
    *,
    block: int = 8192,
    num_warps: int = 4,
    record: Record | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``softmax(logits / temperature)`` and its log-probability.

    Args:
        logits: ``(batch, vocab)`` fp32/bf16/fp16, last dim contiguous; CUDA, or CPU under
            ``TRITON_INTERPRET=1`` (tests).
        temperature: > 0.
        seed: ``(1,)`` int64 tensor on ``logits``' device, the Philox seed of this draw
            (same seed and logits give the same tokens); None = greedy (argmax of the logits,
            no randomness). With ``record``: the rollout's ``(S,)`` seeds, of which the draw
            uses ``seed[record.step]``.
        record: the decode loop's state to update (:class:`Record`); the returned tokens and
            log-probs are then the settled ones (``pad`` and 0 for rows already done).
        block: vocabulary columns per program (a power of 2, at least 4: four per Philox
            call). num_warps: per program.

    Returns:
        ``(tokens (batch,) int64, log_probs (batch,) float32)``, ``log_probs`` being
        ``log_softmax(logits / temperature)[token]``. Non-finite logits give a non-finite
        log-probability (no host check here: callers test it at their own sync points).

    Raises:
        ValueError: bad shape, device or temperature; ``block`` not a power of 2 >= 4.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(
            f"logits must be (batch, vocab) with a contiguous last dim, got {tuple(logits.shape)}"
        )
    if logits.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("gumbel_sample runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of 2, at least 4, got {block}")
    if seed is not None and (
        (seed.numel() != 1 and record is None) or seed.device != logits.device
    ):
        raise ValueError("seed must be a one-element tensor on the logits' device")
    B, V = logits.shape
    nch = triton.cdiv(V, block)
    dev = logits.device
    # one fp32 work buffer for the per-chunk partials (three statistics and the chosen
    # token's scaled logit): the sampler runs once per decode step, so fewer allocations
    *parts, zsel = torch.empty(4, B * nch, dtype=torch.float32, device=dev).unbind(0)
    idx = torch.empty(B * nch, dtype=torch.int32, device=dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    lp = torch.empty(B, dtype=torch.float32, device=dev)
    seed_arg = seed if seed is not None else tok  # unread when greedy
    if record is not None:
        _check_record(record, B, dev)
        r = record
        eos = r.eos if r.eos is not None else tok  # unread: N_EOS = 0
        n_eos = 0 if r.eos is None else r.eos.numel()
        rec = (r.step, r.done.view(torch.uint8), r.finite.view(torch.uint8), r.tokens,
               r.log_probs, r.tokens.stride(0), r.tok_in, r.pos_in, r.tok_in.stride(0),
               eos, n_eos, r.pad)  # fmt: skip
    else:
        n_eos = 0
        rec = (tok, tok, tok, tok, lp, 0, tok, tok, 0, tok, 0, 0)  # unread
    _partial[(B, nch)](
        logits,
        logits.stride(0),
        V,
        1.0 / temperature,
        seed_arg,
        *parts,
        idx,
        zsel,
        nch,
        rec[0],
        GREEDY=seed is None,
        BLOCK=block,
        SEED_AT_STEP=record is not None,
        FAST_LOG=dev.type == "cuda",
        num_warps=num_warps,
    )
    _combine[(B,)](
        *parts, idx, zsel, tok, lp, nch, *rec,
        NCH_P2=triton.next_power_of_2(nch), RECORD=record is not None,
        EOS_P2=max(triton.next_power_of_2(n_eos), 2),
    )  # fmt: skip
    return tok, lp


def _check_record(r: Record, B: int, dev: torch.device) -> None:
    """Raise ValueError unless ``r``'s tensors have the shapes, dtypes and device it needs."""
    want = {
        "step": ((1,), torch.int64),
        "done": ((B,), torch.bool),
        "finite": ((), torch.bool),
        "tokens": ((B, r.tokens.shape[-1]), torch.int64),
        "log_probs": ((B, r.tokens.shape[-1]), torch.float32),
        "tok_in": ((B, 1), torch.int64),
        "pos_in": ((B, 1), torch.int64),
    }
    for name, (shape, dtype) in want.items():
        t = getattr(r, name)
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != dev:
            raise ValueError(
                f"gumbel_sample record.{name}: need {shape} {dtype} on {dev}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if r.tokens.stride() != r.log_probs.stride() or r.tok_in.stride() != r.pos_in.stride():
        raise ValueError("gumbel_sample record: tokens/log_probs and tok_in/pos_in strides differ")
    if r.eos is not None and (r.eos.dtype != torch.int64 or r.eos.device != dev):
        raise ValueError("gumbel_sample record.eos: need int64 ids on the logits' device")
