"""One-process tests of the compression algorithms (collective passed in).

W = 1 through :class:`LocalCollective` (invariants such as "input == aggregate + residual",
as in epfml/powersgd's tests) and W = 2/3 through :class:`ThreadGroup` (one thread per rank,
in-memory collectives).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from pydantic import ValidationError

from verl_comm.compression import (
    CompressionConfig,
    LinkModel,
    LocalCollective,
    LoopbackCollective,
    LowRankBucketState,
    ThreadGroup,
    cast_allreduce,
    decide,
    int8_allreduce,
    int8_allreduce_wire_bytes,
    lowrank_int8_allreduce,
    measure_link,
    orthonormalize,
    plan_lowrank,
    ring_allreduce_wire_bytes,
)


def run_ranks(world: int, fn):
    """Run ``fn(rank, collective)`` in ``world`` threads; return the results by rank."""
    group = ThreadGroup(world, timeout_s=30)
    return run_threads(world, lambda r: fn(r, group.collective(r)))


def run_threads(world: int, fn):
    """Run ``fn(rank)`` in ``world`` threads; return the results by rank (a thread's error
    is raised here)."""
    out: list = [None] * world
    errors: list = []

    def target(r):
        try:
            out[r] = fn(r)
        except BaseException as e:  # pragma: no cover - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


# -- config ----------------------------------------------------------------------------------


def test_config_defaults_and_method():
    c = CompressionConfig()
    assert (c.gradient_compression, c.compression_rank, c.quant_block) == ("none", None, 128)
    assert (c.error_feedback, c.start_iter, c.policy, c.nonfinite) == (True, 1, "fixed", "raise")
    assert (c.bucket_cap_mb, c.min_compression_rate, c.warm_start) == (25, 2.0, True)
    assert c.method == "none"
    assert CompressionConfig(gradient_compression="int8").method == "int8"
    assert CompressionConfig(gradient_compression="int8", compression_rank=0).method == "int8"
    assert CompressionConfig(gradient_compression="int8", compression_rank=64).method == (
        "lowrank_int8"
    )
    for f in CompressionConfig.model_fields.values():
        assert f.description


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"start_iter": 0}, "start_iter"),
        ({"compression_rank": -1}, "compression_rank"),
        ({"quant_block": 100}, "quant_block"),
        ({"gradient_compression": "int4"}, "gradient_compression"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"min_compression_rate": 0.5}, "min_compression_rate"),
        ({"compression_rank": 64}, "gradient_compression"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValidationError) as ei:
        CompressionConfig(**kw)
    assert field in str(ei.value)


def test_config_warns_below_rank_64():
    with pytest.warns(UserWarning, match="below 64"):
        CompressionConfig(gradient_compression="int8", compression_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CompressionConfig(gradient_compression="int8", compression_rank=64)


# -- int8 all-reduce -----------------------------------------------------------------------


def test_int8_invariant_input_equals_aggregate_plus_residual():
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.linspace(0.01, 10, 1000)
    r_old = torch.randn(1000) * 0.01
    r = r_old.clone()
    res = int8_allreduce(x, LocalCollective(), block=64, residual=r)
    # W = 1: the owner's requantisation of its own dequantised codes is exact
    torch.testing.assert_close(res.out + r, x + r_old, rtol=0, atol=1e-5)
    assert res.wire_bytes == 0 and bool(res.finite)


@pytest.mark.parametrize("world,n,block", [(2, 1000, 32), (3, 4099, 128), (3, 7, 64)])
def test_int8_multi_rank_bound_and_bit_identical(world, n, block):
    torch.manual_seed(world * n)
    xs = [torch.randn(n) * (1 + r) for r in range(world)]
    results = run_ranks(world, lambda r, c: int8_allreduce(xs[r], c, block=block))
    for res in results[1:]:
        assert torch.equal(res.out, results[0].out)  # replicas bit-identical
    mean = sum(xs) / world
    # per block: each rank errs by <= absmax_w / 254, the owner by <= absmax_sum / 254
    unit = world * block
    n_pad = -(-n // unit) * unit
    amax = torch.zeros(n_pad // block)
    for x in xs:
        amax += torch.nn.functional.pad(x, (0, n_pad - n)).view(-1, block).abs().amax(1)
    bound = (amax / 127 / world).repeat_interleave(block)[:n] * (1 + 1e-4) + 1e-7
    assert ((results[0].out - mean).abs() <= bound).all()
    # bytes counted by the collective == closed form; <= 0.53x a bf16 ring all-reduce
    assert results[0].wire_bytes == int8_allreduce_wire_bytes(n, world, block)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_int8_wire_bytes_vs_bf16(world):
    n = 1 << 20
    ratio = int8_allreduce_wire_bytes(n, world, 128) / ring_allreduce_wire_bytes(n, world, 2)
    assert ratio <= 0.53  # (1 + 4/128) / 2 = 0.5156, independent of W
    assert int8_allreduce_wire_bytes(n, world, 128) / ring_allreduce_wire_bytes(n, world, 4) < 0.27
    res = run_ranks(2, lambda r, c: int8_allreduce(torch.randn(5000), c, block=128))
    assert res[0].wire_bytes / ring_allreduce_wire_bytes(5000, 2, 2) <= 0.53


def test_int8_nonfinite_flag_reaches_every_rank_and_empty_input():
    def fn(r, c):
        x = torch.randn(300)
        if r == 1:
            x[17] = float("nan")
        return int8_allreduce(x, c, block=32)

    assert [bool(r.finite) for r in run_ranks(3, fn)] == [False] * 3
    empty = int8_allreduce(torch.zeros(0), LocalCollective())
    assert empty.out.numel() == 0 and empty.wire_bytes == 0 and bool(empty.finite)


def test_int8_bf16_residual_for_fp32_input_and_16bit_input():
    x = torch.randn(500)
    r = torch.zeros(500, dtype=torch.bfloat16)
    res = int8_allreduce(x, LocalCollective(), block=32, residual=r)
    assert (res.out + r.float() - x).abs().max() < 1e-2  # bf16-rounded residual
    xb = torch.randn(500, dtype=torch.bfloat16)
    out = torch.empty(500, dtype=torch.bfloat16)
    res = int8_allreduce(xb, LocalCollective(), block=32, residual=torch.zeros(500), out=out)
    assert res.out is out


def test_cast_allreduce_fp16_bf16():
    xs = [torch.randn(100), torch.randn(100)]
    for dt, eps in ((torch.float16, 2**-11), (torch.bfloat16, 2**-8)):
        res = run_ranks(2, lambda r, c, dt=dt: cast_allreduce(xs[r], c, wire_dtype=dt))
        assert torch.equal(res[0].out, res[1].out)
        mean = (xs[0] + xs[1]) / 2
        assert ((res[0].out - mean).abs() <= 3 * eps * (xs[0].abs() + xs[1].abs()) / 2).all()
        assert res[0].wire_bytes == ring_allreduce_wire_bytes(100, 2, 2)


# -- low rank ------------------------------------------------------------------------------


def test_plan_lowrank_hard_cases():
    shapes = [(64, 32), (), (10,), (64, 32), (3, 4), (128, 8, 2, 2), (40, 9), (64, 32)]
    plan = plan_lowrank(shapes, rank=4)
    by_shape = {(g.n, g.m): [s.shape for s in g.slots] for g in plan.groups}
    assert by_shape == {(64, 32): [(64, 32)] * 3, (128, 32): [(128, 8, 2, 2)]}  # batched, conv
    assert [s.shape for s in plan.rest] == [(), (10,), (3, 4), (40, 9)]  # 0-d, 1-d, small, 2r>=9
    assert plan.numel == sum(int(torch.Size(s).numel()) for s in shapes)
    # min_compression_rate: 64x32 at rank 4 shrinks 5.3x; at a rate of 6 it is not compressed
    assert not plan_lowrank([(64, 32)], 4, min_compression_rate=6).groups
    with pytest.raises(ValueError, match="rank"):
        plan_lowrank(shapes, 0)


def test_orthonormalize_batched():
    torch.manual_seed(0)
    p = torch.randn(5, 100, 8)
    q = orthonormalize(p)
    eye = torch.eye(8).expand(5, 8, 8)
    torch.testing.assert_close(q.mT @ q, eye, atol=1e-5, rtol=0)
    # same column span: projecting p onto span(q) leaves it unchanged
    torch.testing.assert_close(q @ (q.mT @ p), p, atol=1e-4, rtol=1e-4)
    assert torch.equal(orthonormalize(torch.zeros(2, 10, 3)), torch.zeros(2, 10, 3))
    deficient = torch.randn(1, 20, 1).expand(1, 20, 3).clone()  # rank 1
    assert torch.isfinite(orthonormalize(deficient)).all()


def _residual_flat(plan, st) -> torch.Tensor:
    r = torch.zeros(plan.numel)
    for gi, g in enumerate(plan.groups):
        for i, s in enumerate(g.slots):
            r[s.offset : s.offset + s.numel] = st.residuals[gi][i].reshape(-1).float()
    o = 0
    for s in plan.rest:
        r[s.offset : s.offset + s.numel] = st.rest_residual[o : o + s.numel].float()
        o += s.numel
    return r


def test_lowrank_invariant_and_warm_start():
    """W = 1: input + old residual == aggregate + new residual (error feedback), and warm
    start makes the error fall on a fixed low-rank input."""
    torch.manual_seed(0)
    shapes = [(64, 32), (64, 32), (10,), (), (128, 8, 2, 2)]
    plan = plan_lowrank(shapes, rank=4)
    u = torch.randn(2, 64, 2)
    v = torch.randn(2, 2, 32)
    flat = torch.randn(plan.numel)
    for i, s in enumerate(plan.groups[0].slots):
        flat[s.offset : s.offset + s.numel] = (u[i] @ v[i]).reshape(-1)  # rank 2 < 4
    st = LowRankBucketState()
    gen = torch.Generator().manual_seed(0)
    errs = []
    r_old = torch.zeros(plan.numel)
    for _ in range(3):
        res = lowrank_int8_allreduce(flat, plan, st, LocalCollective(), block=32, generator=gen)
        r_new = _residual_flat(plan, st)
        torch.testing.assert_close(res.out + r_new, flat + r_old, atol=1e-5, rtol=1e-5)
        errs.append(float(st.residuals[0].norm() / flat[: 2 * 64 * 32].norm()))
        r_old = r_new
        assert st.qs[0].shape == (2, 32, 4)
    assert errs[-1] < 0.05  # rank-2 matrices are captured by rank 4 (up to int8 error)
    assert float(res.error_sq) >= 0 and float(res.input_sq) > 0


@pytest.mark.parametrize("world", [2, 3])
def test_lowrank_multi_rank_bit_identical_and_bytes(world):
    torch.manual_seed(world)
    shapes = [(48, 33), (48, 48), (48, 48), (48,), ()]
    plan = plan_lowrank(shapes, rank=4)
    flats = [torch.randn(plan.numel) for _ in range(world)]

    def fn(r, c):
        st = LowRankBucketState()
        g = torch.Generator().manual_seed(7)  # same seed on every rank
        outs = []
        for _ in range(2):
            outs.append(
                lowrank_int8_allreduce(flats[r], plan, st, c, block=32, generator=g).out.clone()
            )
        return outs, c.bytes_sent

    res = run_ranks(world, fn)
    for outs, _ in res[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs, res[0][0]))
    assert res[0][1] == 2 * plan.wire_bytes(world, 32)
    fp32_bytes = ring_allreduce_wire_bytes(plan.numel, world, 4)
    assert plan.wire_bytes(world, 32) < fp32_bytes / 3


def test_lowrank_rejects_wrong_size():
    plan = plan_lowrank([(8, 8)], rank=1)
    with pytest.raises(ValueError, match="plan expects 64"):
        lowrank_int8_allreduce(torch.zeros(10), plan, LowRankBucketState(), LocalCollective())


# -- policy --------------------------------------------------------------------------------


def test_policy_decide_slow_and_fast_links():
    plain = ring_allreduce_wire_bytes(25 << 18, 2, 4)  # 25 MiB of fp32 on 2 ranks
    comp = int8_allreduce_wire_bytes(25 << 18, 2, 128)
    socket = LinkModel(alpha_s=60e-6, beta_s_per_byte=1 / 2.5e9, world_size=2)
    nvlink = LinkModel(alpha_s=60e-6, beta_s_per_byte=1 / 300e9, world_size=2)
    kw = dict(plain_bytes=plain, compressed_bytes=comp, compressed_collectives=2)
    d = decide(socket, compute_s=0.5e-3, **kw)
    assert d.compress and d.t_compressed_s < d.t_plain_s
    d = decide(nvlink, compute_s=0.5e-3, **kw)
    assert not d.compress and d.to_dict()["plain_bytes"] == plain
    assert socket.busbw_GBps == pytest.approx(2.5)


def test_measure_link_agrees_across_ranks():
    links = run_ranks(2, lambda r, c: measure_link(c, torch.device("cpu"), large_bytes=1 << 16))
    assert links[0] == links[1] and links[0].alpha_s > 0 and links[0].world_size == 2
    assert measure_link(LocalCollective(), torch.device("cpu")).beta_s_per_byte == 0


def test_loopback_collective_shapes_and_bytes():
    c = LoopbackCollective(4)
    x = torch.arange(8.0)
    out = torch.empty(8)
    c.all_to_all_single(out, x)
    assert torch.equal(out, torch.tensor([0.0, 1, 0, 1, 0, 1, 0, 1]))
    g = torch.empty(32)
    c.all_gather_into_tensor(g, x)
    assert torch.equal(g.view(4, 8)[3], x)
    assert c.bytes_sent == 3 * 32 // 4 + 3 * 32


def test_lowrank_warm_start_off_draws_fresh_q():
    plan = plan_lowrank([(64, 32)], rank=4)
    flat = torch.randn(plan.numel)
    gens = {}
    for warm in (True, False):
        gen = torch.Generator().manual_seed(0)
        st = LowRankBucketState()
        for _ in range(3):
            lowrank_int8_allreduce(
                flat, plan, st, LocalCollective(), warm_start=warm, generator=gen
            )
        gens[warm] = gen.get_state()
    fresh = torch.Generator().manual_seed(0)
    torch.randn(1, 32, 4, generator=fresh)  # one draw: warm start only draws at step 0
    assert torch.equal(gens[True], fresh.get_state())
    for _ in range(2):
        torch.randn(1, 32, 4, generator=fresh)
    assert torch.equal(gens[False], fresh.get_state())  # a fresh Q every step


# Regression: r = 128 on DDP gradients of 24 x nn.Linear(4096, 4096) raised
# NonFiniteGradientError on every compressed step (H200, NVLink and socket). The gradients
# of a deep default-init Linear stack are ~rank 1 (bias-dominated activations), so P = M Q is
# numerically rank-deficient; the fp32 Gram matrix of the old CholeskyQR2 was then
# indefinite after a shift of eps/r and Cholesky produced NaN. All inputs below made the old
# fp32 version return NaN or a non-orthonormal P.


def _near_rank1(k: int, n: int, r: int, rel_noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, n, r)`` batch of rank-1 matrices ``u w^T`` plus relative noise, and ``u``."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(k, n, 1, generator=g)
    p = u @ torch.randn(k, 1, r, generator=g) + rel_noise * torch.randn(k, n, r, generator=g)
    return p, u


@pytest.mark.parametrize("rel_noise", [0.0, 1e-5, 1e-4, 1e-3])
def test_orthonormalize_near_rank1_at_r128_is_finite_and_contracting(rel_noise):
    p, u = _near_rank1(8, 1024, 128, rel_noise)
    q = orthonormalize(p)
    assert q.dtype == torch.float32 and torch.isfinite(q).all()
    # P P^T never expands (eigenvalues of P^T P <= 1) and keeps the dominant direction
    assert float(torch.linalg.eigvalsh((q.mT @ q).double()).max()) <= 1 + 1e-5
    captured = (q @ (q.mT @ u)).norm(dim=(1, 2)) / u.norm(dim=(1, 2))
    torch.testing.assert_close(captured, torch.ones(8), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scale", [1e-42, 1e-30, 1e20, 1e30])  # subnormal .. near fp32 max
def test_orthonormalize_extreme_scales_at_r128(scale):
    g = torch.Generator().manual_seed(1)
    p = torch.randn(2, 512, 128, generator=g) * scale
    assert torch.isfinite(p).all()
    q = orthonormalize(p)
    torch.testing.assert_close(q.mT @ q, torch.eye(128).expand(2, 128, 128), atol=1e-4, rtol=0)


def test_orthonormalize_zero_and_nonfinite_inputs():
    p = torch.zeros(2, 256, 128)
    p[1, 5, 7] = 1e-45  # one subnormal entry: rank 1, its column becomes a unit vector
    q = orthonormalize(p)
    assert torch.equal(q[0], torch.zeros(256, 128))
    assert torch.isfinite(q).all() and float(q[1, 5, 7]) == pytest.approx(1.0, abs=1e-6)
    bad = torch.randn(1, 64, 8)
    bad[0, 3, 2] = float("nan")  # NaN must stay visible to the caller's non-finite check
    assert not torch.isfinite(orthonormalize(bad)).all()
    with pytest.raises(ValueError, match="eps"):
        orthonormalize(torch.randn(1, 8, 2), eps=0.0)


@pytest.mark.timeout(120)
def test_lowrank_r128_on_deep_linear_gradients_stays_finite():
    """The failing workload in small: DDP-like gradients of 24 x Linear(512, 512) (batch 64
    per rank, loss mean(out^2)) through W = 2 low rank at r = 128, bf16 residual."""
    dim, layers = 512, 24
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    flats = []
    for rank in range(2):
        x = torch.randn(64, dim, generator=torch.Generator().manual_seed(rank))
        model.zero_grad()
        model(x).square().mean().backward()
        ws = [m.weight.grad.reshape(-1) for m in model]
        flats.append(torch.cat(ws + [m.bias.grad for m in model]))
    del model
    plan = plan_lowrank([(dim, dim)] * layers + [(dim,)] * layers, rank=128)
    assert plan.groups[0].k == layers and plan.groups[0].rank == 128

    def fn(r, c):
        st = LowRankBucketState()
        g = torch.Generator().manual_seed(0)
        res = lowrank_int8_allreduce(
            flats[r], plan, st, c, generator=g, residual_dtype=torch.bfloat16
        )
        return bool(res.finite), res.out.clone(), float(res.error_sq), float(res.input_sq)

    (ok0, out0, e0, i0), (ok1, out1, _, _) = run_ranks(2, fn)
    assert ok0 and ok1 and torch.isfinite(out0).all()
    assert torch.equal(out0, out1)
    assert 0 < e0 < i0  # the approximation removes part of the (error-fed) input


@pytest.mark.parametrize("stats", [True, False])
def test_lowrank_bf16_products_keep_error_feedback_exact(stats):
    """The CUDA path (bf16 matrix products) run on CPU: input + old residual ==
    output + new residual, since the residual is taken against the applied approximation."""
    shapes = [(64, 32), (64, 32), (10,), (48, 40)]
    plan = plan_lowrank(shapes, rank=4)
    st = LowRankBucketState()
    gen = torch.Generator().manual_seed(0)
    r_old = torch.zeros(plan.numel)
    for step in range(3):
        flat = torch.randn(plan.numel, generator=torch.Generator().manual_seed(step))
        buf = flat.clone()
        res = lowrank_int8_allreduce(
            buf, plan, st, LocalCollective(), block=32, generator=gen, out=buf,
            residual_dtype=torch.float32, matmul_dtype=torch.bfloat16, stats=stats,
        )  # fmt: skip
        r_new = _residual_flat(plan, st)
        torch.testing.assert_close(res.out + r_new, flat + r_old, atol=1e-5, rtol=1e-5)
        assert res.out.data_ptr() == buf.data_ptr() and (res.error_sq is None) == (not stats)
        r_old = r_new


def test_policy_decides_with_overlap_in_view():
    """A plain all-reduce that ends in backward's shadow is kept (compression gains
    nothing); an exposed one is compressed where that ends the serial timeline earlier."""
    from verl_comm.compression import decide_overlap

    socket = LinkModel(alpha_s=60e-6, beta_s_per_byte=1 / 2.5e9, world_size=2)
    plain = ring_allreduce_wire_bytes(25 << 18, 2, 4)  # 26 MB bucket: ~10.5 ms plain
    kw = dict(plain_bytes=plain, compressed_bytes=plain // 4, compressed_collectives=2,
              compute_s=1e-3)  # fmt: skip
    hidden = decide_overlap(socket, shadow_s=0.050, link_free_s=float("-inf"), **kw)
    assert not hidden.compress and hidden.link_free_s < 0  # ends 39.5 ms before backward
    exposed = decide_overlap(socket, shadow_s=0.005, link_free_s=float("-inf"), **kw)
    assert exposed.compress and exposed.link_free_s < exposed.t_plain_s - 0.005
    # a queue: the link is busy until 20 ms after backward ends, so this bucket is exposed
    # even though it was ready 50 ms before the end
    queued = decide_overlap(socket, shadow_s=0.050, link_free_s=0.020, **kw)
    assert queued.compress and queued.link_free_s == pytest.approx(0.020 + queued.t_compressed_s)
    local = LinkModel(0.0, 0.0, 1)  # W = 1: nothing to gain, ever
    assert not decide_overlap(local, shadow_s=0.0, link_free_s=0.0, **kw).compress


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_flags_every_nan_and_inf(dtype):
    from verl_comm.compression.int8_allreduce import all_finite

    t = torch.randn(3 * 1024 + 5).to(dtype)
    assert bool(all_finite(t)) and all_finite(t).dtype == torch.bool
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, 1000, t.numel() - 1):
            u = t.clone()
            u[i] = bad
            assert not bool(all_finite(u)), (bad, i)
    assert bool(all_finite(torch.zeros(0, dtype=dtype)))
    big = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)  # finite, however large
    assert bool(all_finite(big))


def test_choose_method_takes_the_chain_that_ends_first():
    """choose_method: the fastest path on the serial timeline; the more precise one within
    the margin; a plain all-reduce hidden in backward's shadow is kept."""
    from verl_comm.compression.policy import LinkModel, PathCost, choose_method

    plain = 100_000_000  # bytes, fp32 ring all-reduce of 2 ranks
    opts = {
        "bf16": PathCost(plain // 2, 1, 0.020),
        "int8": PathCost(plain // 4, 2, 0.060),
        "lowrank_int8": PathCost(plain // 200, 6, 0.300),
    }
    gbit = LinkModel(alpha_s=1e-4, beta_s_per_byte=8e-9, world_size=2)  # 1 Gbit/s: 0.8 s
    d = choose_method(gbit, plain_bytes=plain, options=opts, shadow_s=0.0, link_free_s=0.0)
    # ends: plain 0.8, bf16 0.42, int8 0.26, low rank 0.30 (s)
    assert d.method == "int8" and d.compress and d.compressed_bytes == plain // 4
    assert abs(d.link_free_s - (0.2 + 2e-4 + 0.060)) < 1e-9
    slow = LinkModel(alpha_s=1e-4, beta_s_per_byte=40e-9, world_size=2)  # 200 Mbit/s
    d = choose_method(slow, plain_bytes=plain, options=opts, shadow_s=0.0, link_free_s=0.0)
    assert d.method == "lowrank_int8"  # 0.32 s against int8's 1.06 s
    fast = LinkModel(alpha_s=1e-5, beta_s_per_byte=1e-11, world_size=2)
    d = choose_method(fast, plain_bytes=plain, options=opts, shadow_s=0.0, link_free_s=0.0)
    assert d.method == "allreduce" and not d.compress
    # the plain all-reduce (0.8 s) ends 0.2 s before backward does: kept
    d = choose_method(gbit, plain_bytes=plain, options=opts, shadow_s=1.0, link_free_s=-1.0)
    assert d.method == "allreduce"
    # bf16 within 5% of the plain path's time of int8's end: the more precise bf16 wins
    close = {"bf16": PathCost(plain // 2, 1, 0.0), "int8": PathCost(plain // 4, 2, 0.18)}
    d = choose_method(gbit, plain_bytes=plain, options=close, shadow_s=0.0, link_free_s=0.0)
    assert d.options["bf16"] - d.options["int8"] < 0.05 * d.t_plain_s and d.method == "bf16"


def test_choose_method_pipelined_chain_overlaps_its_compute():
    """PathCost.lead_s (int8's pipelined host path): the chain takes lead + max(link,
    compute - lead), not link + compute. The measurement step on the shaped 1 Gbit/s veth
    (run c76c99e593d3, ms): bucket 0 ready 232 ms before the end of backward, int8 129 ms of
    compute and 74 of link, low rank r8 170 and ~15; summed, low rank ends first (the
    choice that run made, with low rank the slowest fixed method); overlapped, int8 does."""
    from verl_comm.compression.policy import LinkModel, PathCost, choose_method

    plain = 33_600_000
    link = LinkModel(alpha_s=2.5e-3, beta_s_per_byte=8.5e-9, world_size=2)
    t_int8 = link.time_s(plain // 4, 2)
    serial = {"int8": PathCost(plain // 4, 2, 0.129), "lowrank_int8": PathCost(168_000, 6, 0.170)}
    piped = dict(serial, int8=PathCost(plain // 4, 2, 0.129, lead_s=0.129 / 8))
    kw = dict(plain_bytes=plain, shadow_s=0.232, link_free_s=float("-inf"))
    assert choose_method(link, options=serial, **kw).method == "lowrank_int8"
    d = choose_method(link, options=piped, **kw)
    assert d.method == "int8"
    assert abs(d.options["int8"] - (-0.232 + 0.129 / 8 + max(t_int8, 0.129 * 7 / 8))) < 1e-9
    assert piped["int8"].chain_s(1.0) == 0.129 / 8 + 1.0  # link-bound: compute hidden


def test_describe_choices_names_each_bucket_path_and_the_link():
    from types import SimpleNamespace

    from verl_comm.compression.policy import LinkModel, PathCost, choose_method, describe_choices

    link = LinkModel(alpha_s=1e-4, beta_s_per_byte=8e-9, world_size=2)  # 1000 Mbit/s
    d = choose_method(
        link, plain_bytes=10**8, options={"int8": PathCost(25 * 10**6, 2, 0.06)},
        shadow_s=0.0, link_free_s=0.0,
    )  # fmt: skip
    assert describe_choices({0: SimpleNamespace(decision=None)}) is None
    line = describe_choices({1: SimpleNamespace(decision=d), 0: SimpleNamespace(decision=None)})
    assert line.startswith("bucket 1 int8 (allreduce 800, int8 260)"), line
    assert "link 1000 Mbit/s, 100 us" in line


@pytest.mark.parametrize("world,n", [(2, 20_000), (3, 30_001)])
@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16, torch.float32])
def test_int8_host_slices_bit_identical_to_one_pass(monkeypatch, world, n, residual_dtype):
    """CPU slices and the references' bounded chunks (issue 28: host memory) change neither
    the result, nor the residual, nor the bytes: blocks keep their positions (bit equality
    is the property: the same fp32 operations on the same blocks)."""
    import sys

    import verl_comm.kernels.reference as ref

    mod = sys.modules["verl_comm.compression.int8_allreduce"]
    monkeypatch.setattr(mod, "HOST_MIN_SLICE_BYTES", 1024)  # HOST_SLICES slices at this n
    monkeypatch.setattr(ref, "CHUNK_BLOCKS", 2)  # several chunks per kernel call
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, generator=g) * (1 + r) for r in range(world)]
    res0 = [None if residual_dtype is None else (torch.randn(n, generator=g) * 0.1).to(
        residual_dtype) for _ in range(world)]  # fmt: skip

    def run(fn):
        rs = [None if r is None else r.clone() for r in res0]
        return run_ranks(world, lambda r, c: (fn(xs[r], c, rs[r]), rs[r]))

    # one call of each kernel over the whole tensor (the device path)
    whole = run(lambda x, c, r: mod._reduce_direct(x, c, 64, r, True, torch.empty(n)))
    sliced = run(lambda x, c, r: int8_allreduce(x, c, block=64, residual=r))
    for (a, ra), (b, rb) in zip(whole, sliced):
        assert torch.equal(a.out, b.out) and a.wire_bytes == b.wire_bytes
        assert bool(a.finite) and bool(b.finite)
        assert (ra is None and rb is None) or torch.equal(ra, rb)
    assert sliced[0][0].wire_bytes == int8_allreduce_wire_bytes(n, world, 64)


@pytest.mark.parametrize("world,n", [(1, 2_000), (2, 3_001), (3, 1)])
@pytest.mark.parametrize("residual_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_int8_device_path_bit_identical_to_host_slices(
    monkeypatch, world, n, residual_dtype, backend
):
    """The device path (issue 28: kernels write straight into the send buffer and into
    this rank's row of the all-gather buffer, which the all-gather uses in place) gives
    the bits, residuals and bytes of the host path, at W = 1 as at W > 1; ``triton`` runs
    the kernels on CUDA tensors where there is a GPU, else in Triton's interpreter on CPU
    tensors (conftest), ``auto`` the references. n = 1 at W = 3 leaves rows of only
    padding."""
    import sys

    mod = sys.modules["verl_comm.compression.int8_allreduce"]
    lock = threading.Lock()  # Triton's interpreter runs one kernel at a time per process
    for name in ("quantize", "quantize_ef", "dequant_sum_requant", "dequantize"):

        def locked(*a, _fn=getattr(mod, name), **kw):
            with lock:
                return _fn(*a, **kw)

        monkeypatch.setattr(mod, name, locked)
    g = torch.Generator().manual_seed(n + world)
    xs = [torch.randn(n, generator=g) * (1 + r) for r in range(world)]
    xs[0][: min(n, 40)] = 0.0  # an all-zero block
    res0 = [None if residual_dtype is None else (torch.randn(n, generator=g) * 0.1).to(
        residual_dtype) for _ in range(world)]  # fmt: skip

    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"

    def run(fn, dev="cpu"):
        rs = [None if r is None else r.clone().to(dev) for r in res0]
        return run_ranks(world, lambda r, c: (fn(xs[r].to(dev), c, rs[r]), rs[r]))

    direct = run(
        lambda x, c, r: mod._reduce_direct(
            x, c, 64, r, True, torch.empty(n, device=dev), backend=backend
        ),
        dev,
    )
    host = run(lambda x, c, r: int8_allreduce(x, c, block=64, residual=r))
    for (a, ra), (b, rb) in zip(direct, host):
        assert torch.equal(a.out.cpu(), b.out) and a.wire_bytes == b.wire_bytes
        assert bool(a.finite) and bool(b.finite)
        assert (ra is None and rb is None) or torch.equal(ra.cpu(), rb)
    assert torch.equal(direct[0][0].out, direct[-1][0].out)  # replicas bit-identical


@pytest.mark.parametrize("coll", [LocalCollective(), LoopbackCollective(3)])
def test_int8_device_path_in_place_all_gather_and_nonfinite(coll):
    """The all-gather's input is this rank's row of its output (NCCL's in-place form);
    the in-process collectives take that too, and a NaN still reaches the finite flag."""
    import sys

    mod = sys.modules["verl_comm.compression.int8_allreduce"]
    x = torch.randn(1000)
    seen = []
    gather = coll.all_gather_into_tensor

    def spy(output, input):
        seen.append(input.data_ptr() - output.data_ptr())
        gather(output, input)

    coll.all_gather_into_tensor = spy
    a = mod._reduce_direct(x, coll, 32, None, True, torch.empty(1000))
    b = int8_allreduce(x, coll, block=32)
    assert torch.equal(a.out, b.out) and bool(a.finite)
    assert seen[0] == coll.rank * input_row_bytes(1000, 32, coll.world_size)
    x[7] = float("nan")
    assert not bool(mod._reduce_direct(x, coll, 32, None, True, torch.empty(1000)).finite)


def input_row_bytes(n: int, block: int, world: int) -> int:
    from verl_comm.kernels import packed_nbytes, padded_numel

    return packed_nbytes(padded_numel(n, block, multiple=world) // world, block)


@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_lowrank_bf16_products_one_pass_steps_with_a_kept_slot(residual_dtype):
    """The CUDA path's one-pass error-feedback steps (kernels/ef.py: ``M += E`` with the
    bf16 copy, ``E = M - A`` with the output), here through their torch operations: a slot
    without gradient keeps its residual bit for bit and gets the approximation of a zero
    input; elsewhere input + old residual == output + new residual up to the residual's
    rounding (half an ulp of |E| in bf16: 2**-8 relative, 8 significant bits)."""
    shapes = [(64, 32), (48, 40)]  # two single-matrix groups (k = 1)
    plan = plan_lowrank(shapes, rank=4)
    st, gen = LowRankBucketState(), torch.Generator().manual_seed(0)
    kw = dict(block=32, generator=gen, residual_dtype=residual_dtype, matmul_dtype=torch.bfloat16)
    flat = torch.randn(plan.numel, generator=torch.Generator().manual_seed(0))
    buf = flat.clone()
    lowrank_int8_allreduce(buf, plan, st, LocalCollective(), out=buf, **kw)
    r_old = _residual_flat(plan, st).clone()
    g1 = next(g for g in plan.groups if (g.n, g.m) == (48, 40))
    off, n = g1.slots[0].offset, g1.slots[0].numel
    flat = torch.randn(plan.numel, generator=torch.Generator().manual_seed(1))
    buf = flat.clone()
    res = lowrank_int8_allreduce(buf, plan, st, LocalCollective(), out=buf, keep=((off, n),), **kw)
    r_new = _residual_flat(plan, st)
    assert torch.equal(r_new[off : off + n], r_old[off : off + n])  # kept as it was
    other = torch.ones(plan.numel, dtype=torch.bool)
    other[off : off + n] = False
    tol = (2.0**-8 if residual_dtype == torch.bfloat16 else 1e-6) * r_new.abs() + 1e-5
    lhs, rhs = (res.out + r_new)[other], (flat + r_old)[other]
    assert ((lhs - rhs).abs() <= tol[other]).all()
