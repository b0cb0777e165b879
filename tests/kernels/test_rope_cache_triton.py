"""The fused RoPE + KV-cache write kernel (kernels/rope_cache.py) against the eager reference
of the rollout model (rotate-half RoPE, then ``index_copy_`` into the cache), in Triton's
interpreter on CPU and compiled on a CUDA machine."""

from __future__ import annotations

import pytest
import torch
from verl_comm.kernels.rope_cache import rope_write_cache

from verl_ppo.rollout.tp_model import _rope_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tables(pos: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=pos.device) / d))
    f = pos[:, None].float() * inv
    emb = torch.cat((f, f), -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_rope_then_index_copy_on_a_fused_qkv_view(dtype: torch.dtype) -> None:
    """q, k, v as views into one fused projection row (strided heads), an odd batch, and a
    cache already holding other slots: the kernel's rotated q and cache equal the eager
    reference; every other slot is untouched."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, S, slot = 3, 6, 2, 16, 9, 5
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, generator=g).to(DEV, dtype)
    q, k, v = qkv.split((Hq * D, Hkv * D, Hkv * D), dim=1)
    q, k, v = q.view(B, Hq, D), k.view(B, Hkv, D), v.view(B, Hkv, D)
    cos, sin = _tables(torch.tensor([7, 0, 130], device=DEV), D)
    cos, sin = cos.to(dtype), sin.to(dtype)
    kc = torch.randn(B, Hkv, S, D, generator=g).to(DEV, dtype)
    vc = torch.randn(B, Hkv, S, D, generator=g).to(DEV, dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.tensor([slot], device=DEV)

    out = rope_write_cache(q, k, v, cos, sin, kc, vc, slots)

    # reference in fp32 (the kernel rounds once); the eager bf16 path rounds each product
    qr, kr = _rope_ref(q.float(), k.float(), cos.float()[:, None], sin.float()[:, None])
    kc_ref.index_copy_(2, slots, kr.to(dtype)[:, :, None])
    vc_ref.index_copy_(2, slots, v[:, :, None])
    # fp32: x*c + x'*s with |c|,|s| <= 1: two products and a sum (maybe one FMA), a few ulp;
    # bf16: the same fp32 value rounded once on both sides, but Triton's interpreter rounds
    # to bf16 by truncation: one bf16 ulp (2**-7 relative) apart at most
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(out.float(), qr.to(dtype).float(), **tol)
    torch.testing.assert_close(kc.float(), kc_ref.float(), **tol)
    assert torch.equal(vc, vc_ref)  # values are copied, not computed


def test_bad_input_is_refused() -> None:
    q = torch.zeros(2, 4, 16, device=DEV)
    k = torch.zeros(2, 2, 16, device=DEV)
    cs = torch.zeros(2, 16, device=DEV)
    cache = torch.zeros(2, 2, 8, 16, device=DEV)
    slot = torch.tensor([0], device=DEV)
    with pytest.raises(ValueError, match="power-of-2"):
        rope_write_cache(q, k[:, :1], k, cs, cs, cache, cache, slot)
    with pytest.raises(ValueError, match="dtype"):
        rope_write_cache(q, k.double(), k, cs, cs, cache, cache, slot)
    with pytest.raises(ValueError, match="contiguous last dim"):
        qt = torch.zeros(2, 16, 4, device=DEV).transpose(1, 2)
        rope_write_cache(qt, k, k, cs, cs, cache, cache, slot)
