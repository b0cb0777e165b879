"""The gated MLP's activation fused into its down projection, for decode-sized batches
(Triton).

A decode step of a Llama-family layer runs ``down(silu(gate) * up)`` on a few hundred rows
at most. Eagerly that is a SiLU-mul kernel (reading ``gate`` and ``up``, writing the
activation) and a GEMM whose output, ``(rows, hidden)``, has too few tiles to fill the GPU,
so cuBLAS splits its reduction dimension and adds a reduction kernel. Here the activation
is formed while the GEMM's A tile is loaded (``silu(g) * u`` in fp32, rounded once to the
input dtype: what ``torch.compile`` of the eager expression stores), the reduction
dimension is split over enough programs to fill the GPU (split-K, as in CUTLASS's
``GemmSplitKParallel`` and Triton's matmul tutorial), and a second kernel sums the fp32
partial tiles in split order (deterministic, no atomics) and casts.

Both kernels read their sizes from arguments only, so they run inside a captured CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _partial(
    gu_ptr, w_ptr, p_ptr, M, N, K, s_gu, s_w, K_SPLIT,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    ps = tl.program_id(2)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    row_ok = rm < M
    col_ok = rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    k0 = ps * K_SPLIT
    for k in range(k0, k0 + K_SPLIT, BK):
        rk = k + tl.arange(0, BK)
        k_ok = rk < K
        a_ok = row_ok[:, None] & k_ok[None, :]
        ga = gu_ptr + rm[:, None].to(tl.int64) * s_gu + rk[None, :]
        g = tl.load(ga, mask=a_ok, other=0.0).to(tl.float32)
        u = tl.load(ga + K, mask=a_ok, other=0.0).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g)) * u).to(gu_ptr.dtype.element_ty)
        w = tl.load(
            w_ptr + rn[None, :].to(tl.int64) * s_w + rk[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc += tl.dot(a, w)
    out = p_ptr + (ps * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_splits(p_ptr, o_ptr, MN, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLITS):
        acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(o_ptr + i, acc.to(o_ptr.dtype.element_ty), mask=ok)


MAX_ROWS = 512
"""Rows (tokens) up to which the decode path uses this kernel; above, cuBLAS GEMMs are
better (prefill)."""


def default_splits(tiles: int, k: int, block_k: int, device: torch.device) -> int:
    """Splits of the reduction dimension: about two programs per SM over ``tiles`` output
    tiles, at most one ``block_k`` step per split."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * sms, tiles)))


def silu_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    *,
    splits: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """``F.linear(silu(g) * u, weight)`` with ``g, u = gate_up.chunk(2, -1)``, in two kernels.

    Args:
        gate_up: ``(..., 2K)`` fp16/bf16, last dim contiguous (the fused gate/up GEMM's
            output: ``gate`` in the first half, ``up`` in the second); at most
            :data:`MAX_ROWS` rows is what it is made for (any count works).
        weight: ``(N, K)`` of ``gate_up``'s dtype, last dim contiguous (``nn.Linear``'s).
        splits: programs along K (None: :func:`default_splits`); block_m (None: the rows
            rounded up to a power of two in [16, 128]), block_n, block_k, num_warps,
            num_stages: the launch, for sweeps.

    Returns:
        ``(..., N)`` in ``gate_up``'s dtype: the activation rounded to that dtype once (fp32
        SiLU-mul), products summed in fp32 per split, splits summed in order, rounded once.

    Raises:
        ValueError: shapes, dtypes, strides or devices that do not fit.
    """
    *lead, k2 = gate_up.shape
    n, k = weight.shape
    if (
        k2 != 2 * k
        or gate_up.dtype != weight.dtype
        or gate_up.dtype not in (torch.float16, torch.bfloat16)
        or gate_up.stride(-1) != 1
        or weight.stride(-1) != 1
        or gate_up.device != weight.device
    ):
        raise ValueError(
            f"silu_mul_linear: gate_up {tuple(gate_up.shape)} {gate_up.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}: need (..., 2K) and (N, K) of one 16-bit "
            "dtype, last dims contiguous, one device"
        )
    if gate_up.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("silu_mul_linear runs on CUDA tensors (or CPU with TRITON_INTERPRET=1)")
    x = gate_up.reshape(-1, k2)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    bm = block_m or min(128, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, block_n)
    s = splits or default_splits(tiles, k, block_k, x.device)
    k_split = triton.cdiv(triton.cdiv(k, s), block_k) * block_k
    s = triton.cdiv(k, k_split)  # no empty split
    part = torch.empty(s, m, n, dtype=torch.float32, device=x.device)
    _partial[(triton.cdiv(m, bm), triton.cdiv(n, block_n), s)](
        x, weight, part, m, n, k, x.stride(0), weight.stride(0), k_split,
        BM=bm, BN=block_n, BK=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _sum_splits[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLITS=s, BLOCK=1024)
    return out.view(*lead, n)
