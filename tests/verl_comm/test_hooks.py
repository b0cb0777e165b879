"""One-process tests of the hooks and their state (no process group: W = 1).

Buckets are :class:`StrictBucket` objects that offer only GradBucket's six methods, so a hook
touching anything else fails here exactly as it would with the bucketed reducer's buckets.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from verl_comm.compression import CompressionConfig
from verl_comm.hooks import (
    HOOKS,
    CommHookState,
    GradBucket,
    NonFiniteGradientError,
    allreduce_hook,
    bf16_hook,
    fp16_hook,
    int8_hook,
    lowrank_int8_hook,
    make_hook,
    register_comm_hook,
)
from verl_comm.telemetry import CommRecorder

SHAPES = [(48, 33), (), (48, 48), (48, 48), (48,), (5, 48)]


class StrictBucket:
    """Only GradBucket's methods: buffer, gradients, parameters, index, is_last, set_buffer."""

    __slots__ = ("_b",)

    def __init__(self, buf, params, index=0, is_last=True):
        self._b = GradBucket(index, params, is_last, buffer=buf)

    def buffer(self):
        return self._b.buffer()

    def gradients(self):
        return self._b.gradients()

    def parameters(self):
        return self._b.parameters()

    def index(self):
        return self._b.index()

    def is_last(self):
        return self._b.is_last()

    def set_buffer(self, b):
        self._b.set_buffer(b)


def params(shapes=SHAPES, dtype=torch.float32):
    return [torch.zeros(s, dtype=dtype) for s in shapes]


def make_bucket(seed, shapes=SHAPES, dtype=torch.float32, index=0, is_last=True):
    ps = params(shapes, dtype)
    n = sum(p.numel() for p in ps)
    g = torch.Generator().manual_seed(seed)
    return StrictBucket(torch.randn(n, generator=g).to(dtype), ps, index, is_last)


def cfg(**kw):
    base = dict(start_iter=1, quant_block=32, residual_dtype="float32")
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CompressionConfig(**base)


INT8 = dict(gradient_compression="int8")
LOWRANK = dict(gradient_compression="int8", compression_rank=4)


@pytest.mark.parametrize("hook", [allreduce_hook, fp16_hook, bf16_hook])
def test_simple_hooks_contract_and_torch_style_state(hook):
    b = make_bucket(0)
    x = b.buffer().clone()
    fut = hook(None, b)  # torch style: a process group (None = WORLD) as state
    out = fut.value()
    assert out.shape == x.shape and out.dtype == x.dtype and out is b.buffer()
    tol = {allreduce_hook: 0, fp16_hook: 2**-11, bf16_hook: 2**-8}[hook]
    assert ((out - x).abs() <= tol * x.abs()).all()


@pytest.mark.parametrize("extra", [INT8, LOWRANK])
def test_compressing_hooks_start_iter_and_invariant(extra):
    state = CommHookState(config=cfg(start_iter=2, stats_every=1, **extra))
    hook = HOOKS[state.config.method]
    for it in range(4):
        b = make_bucket(it)
        x = b.buffer().clone()
        bs = state.buckets.get(0)
        r_old = torch.zeros_like(x)
        if bs is not None and bs.residual is not None:
            r_old = bs.residual.clone()
        out = hook(state, b).value().clone()
        stats = state.last_stats[0]
        assert stats.iteration == it and state.iteration == it + 1
        if it < 2:  # plain all-reduce while DDP rebuilds buckets
            assert stats.method == "allreduce" and torch.equal(out, x)
            continue
        assert stats.method == state.config.method
        if extra is INT8:
            # W = 1: input + old residual == aggregate + new residual
            torch.testing.assert_close(
                out + state.buckets[0].residual, x + r_old, atol=1e-5, rtol=0
            )
        assert stats.rel_error is not None and 0 <= stats.rel_error < 1
        assert stats.residual_norm is not None and stats.finite and not stats.skipped


def test_empty_bucket():
    for extra in ({}, INT8, LOWRANK):
        state = CommHookState(config=cfg(**extra))
        for _ in range(2):
            b = StrictBucket(torch.zeros(0), [])
            out = HOOKS[state.config.method](state, b).value()
            assert out.numel() == 0
        assert state.last_stats[0].wire_bytes == 0 and state.last_stats[0].finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("extra", [INT8, LOWRANK])
def test_half_precision_buckets(dtype, extra):
    state = CommHookState(config=cfg(start_iter=1, **extra))
    hook = HOOKS[state.config.method]
    for it in range(3):
        b = make_bucket(it, dtype=dtype)
        out = hook(state, b).value()
        assert out.dtype == dtype and torch.isfinite(out).all()


def test_bucket_methods_are_the_only_interface():
    # StrictBucket has __slots__ and only the six methods: any other access would raise
    for extra in ({}, INT8, LOWRANK):
        state = CommHookState(config=cfg(**extra))
        for it in range(3):
            HOOKS[state.config.method](state, make_bucket(it, index=0, is_last=False))
            HOOKS[state.config.method](state, make_bucket(it + 10, index=1, is_last=True))
        assert set(state.last_stats) == {0, 1}


@pytest.mark.parametrize("extra", [{}, INT8, LOWRANK])
def test_nonfinite_raise_names_bucket(extra):
    state = CommHookState(config=cfg(**extra))
    hook = HOOKS[state.config.method]
    hook(state, make_bucket(0, index=0, is_last=False))
    hook(state, make_bucket(0, index=1))
    b0, b1 = make_bucket(1, index=0, is_last=False), make_bucket(1, index=1)
    b1.buffer()[3] = float("inf")
    hook(state, b0)
    with pytest.raises(NonFiniteGradientError, match=r"bucket\(s\) \[1\]") as ei:
        hook(state, b1)
    assert ei.value.bucket_indices == [1] and ei.value.iteration == 1


@pytest.mark.parametrize("extra", [{}, INT8, LOWRANK])
def test_nonfinite_skip_zeroes_and_resets(extra):
    state = CommHookState(config=cfg(nonfinite="skip", **extra))
    hook = HOOKS[state.config.method]
    for it in range(2):
        hook(state, make_bucket(it))
    b = make_bucket(5)
    b.buffer()[7] = float("nan")
    out = hook(state, b).value()
    assert torch.equal(out, torch.zeros_like(out))
    st = state.last_stats[0]
    assert not st.finite and st.skipped and state.nonfinite_events == [(2, 0)]
    bs = state.buckets[0]
    assert bs.residual is None and bs.lowrank.qs == [] and bs.lowrank.rest_residual is None
    out = hook(state, make_bucket(6)).value()  # next step trains normally
    assert torch.isfinite(out).all() and out.abs().sum() > 0


@pytest.mark.parametrize("extra", [INT8, LOWRANK])
def test_state_dict_resume_bit_identical_and_pickle(extra):
    a = CommHookState(config=cfg(**extra), seed=3)
    hook = HOOKS[a.config.method]
    for it in range(3):
        hook(a, make_bucket(it, index=0, is_last=False))
        hook(a, make_bucket(it + 50, index=1))
    sd = a.state_dict()
    b = CommHookState(config=cfg(**extra))
    b.load_state_dict(pickle.loads(pickle.dumps(sd)))
    c = pickle.loads(pickle.dumps(a))  # the state itself pickles without a group
    assert c.process_group is None
    for it in range(3, 6):
        outs = []
        for st in (a, b, c):
            o0 = hook(st, make_bucket(it, index=0, is_last=False)).value().clone()
            o1 = hook(st, make_bucket(it + 50, index=1)).value().clone()
            outs.append((o0, o1))
        for o in outs[1:]:
            assert torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])
    assert a.iteration == b.iteration == c.iteration == 6


def test_changed_world_size_or_layout_resets_with_warning():
    a = CommHookState(config=cfg(**LOWRANK))
    for it in range(3):
        lowrank_int8_hook(a, make_bucket(it))
    sd = a.state_dict()
    sd["world_size"] = 2
    b = CommHookState(config=cfg(**LOWRANK))
    with pytest.warns(RuntimeWarning, match="world size 2"):
        b.load_state_dict(sd)
    assert b.buckets == {} and b.iteration == 3
    # same bucket index, another layout: reset, never a wrong shape
    other = [(33, 48), (48,)]
    with pytest.warns(RuntimeWarning, match="bucket 0 changed"):
        out = lowrank_int8_hook(a, make_bucket(9, shapes=other)).value()
    assert out.numel() == 33 * 48 + 48
    with pytest.raises(ValueError, match="format"):
        b.load_state_dict({"format": 99})


def test_recorder_and_stats():
    rec = CommRecorder()
    hook, state = make_hook(cfg(stats_every=1, **INT8), recorder=rec)
    assert hook is int8_hook
    for it in range(3):
        hook(state, make_bucket(it, index=0, is_last=False))
        hook(state, make_bucket(it, index=1))
    records = rec.records
    assert len(records) == 6
    assert records[-1].tag == "hook/int8/bucket1" and records[-1].group_size == 1
    assert records[0].op == "allreduce"  # before start_iter
    assert {"compression_ratio", "rel_error", "finite"} <= set(records[-1].extra)
    d = state.last_stats[1].to_dict()
    assert d["method"] == "int8" and d["time_s"] >= 0
    m = state.metrics()
    assert m["comm/wire_bytes"] == 0 and m["comm/nonfinite_buckets"] == 0  # W = 1
    assert 0 < m["comm/rel_error"] < 0.05 and m["comm/ef_state_bytes"] > 0


@pytest.mark.parametrize("extra", [INT8, LOWRANK])
def test_error_statistics_off_by_default_and_sampled(extra):
    """Default config: no error statistics (no extra pass), bytes and time still tracked;
    ``stats_every=3``: computed on iterations 3 and 6 only (0 is a plain all-reduce, before
    ``start_iter``), identical output either way."""
    outs = {}
    for every in (0, 3):
        state = CommHookState(config=cfg(stats_every=every, **extra))
        hook = HOOKS[state.config.method]
        got, seen = [], []
        for it in range(7):
            got.append(hook(state, make_bucket(it)).value().clone())
            st = state.last_stats[0]
            seen.append(st.rel_error is not None)
            assert st.time_s is not None and st.time_s >= 0 and st.finite
            # the latest computed value is carried, so the metric keys stay the same
            assert ("comm/rel_error" in state.metrics()) == any(seen)
        assert seen == [every > 0 and it % every == 0 and it >= 1 for it in range(7)], seen
        outs[every] = got
    for a, b in zip(outs[0], outs[3]):
        assert torch.equal(a, b)  # statistics only read the bucket: bit-equal results


def test_error_feedback_memory_at_most_bf16_copy():
    n = sum(torch.Size(s).numel() for s in SHAPES)
    for extra in (INT8, LOWRANK):
        state = CommHookState(config=cfg(residual_dtype="bfloat16", **extra))
        for it in range(3):
            HOOKS[state.config.method](state, make_bucket(it))
        residual_bytes = state.ef_state_nbytes() - sum(
            q.numel() * 4 for q in state.buckets[0].lowrank.qs if q is not None
        )
        assert 0 < residual_bytes <= 2 * n


def test_make_hook_and_register_errors():
    assert make_hook(cfg())[0] is allreduce_hook
    assert make_hook(cfg(gradient_compression="fp16"))[0] is fp16_hook
    assert make_hook(cfg(gradient_compression="bf16"))[0] is bf16_hook
    assert make_hook(cfg(**LOWRANK))[0] is lowrank_int8_hook
    with pytest.raises(TypeError, match="CompressionConfig"):
        make_hook({"gradient_compression": "int8"})
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_comm_hook(torch.nn.Linear(2, 2), cfg())
    with pytest.raises(ValueError, match="compression_rank"):
        lowrank_int8_hook(CommHookState(config=cfg(**INT8)), make_bucket(0))


def test_tensor_bucket():
    grads = [torch.ones(2, 3), torch.zeros(4)]
    b = GradBucket.from_tensors(grads, index=2, is_last=False)
    assert b.buffer().numel() == 10 and b.index() == 2 and not b.is_last()
    assert [g.shape for g in b.gradients()] == [(2, 3), (4,)]
    with pytest.raises(ValueError, match="set_buffer"):
        b.set_buffer(torch.zeros(3))
    with pytest.raises(ValueError, match="sum of parameter sizes"):
        GradBucket(0, grads, buffer=torch.zeros(5))


@pytest.mark.parametrize("slow", [True, False])
def test_auto_policy_uses_link_model_and_logs(slow, caplog):
    """Two thread ranks; the link model is given (socket-like or NVLink-like), the compute
    cost is measured: a slow link compresses, a fast one falls back to the plain path."""
    from tests._threads import run_threads
    from verl_comm.compression import LinkModel, ThreadGroup

    group = ThreadGroup(2, timeout_s=30)
    beta = 1e-4 if slow else 1e-15  # 10 kB/s (dwarfs compute on a loaded CPU) vs infinite
    states, outs = [], [None, None]

    def rank(r):
        st = CommHookState(config=cfg(policy="auto", **INT8), collective=group.collective(r))
        st.link = LinkModel(alpha_s=1e-6, beta_s_per_byte=beta, world_size=2)
        states.append(st)
        for it in range(3):
            outs[r] = int8_hook(st, make_bucket(it + 100 * r)).value().clone()

    with caplog.at_level("INFO", logger="verl_comm.hooks"):
        run_threads(rank)
    assert torch.equal(outs[0], outs[1])
    for st in states:
        d = st.buckets[0].decision
        assert (
            d is not None and d.compress is slow and d.method == ("int8" if slow else "allreduce")
        )
        assert set(d.options) == {"allreduce", "bf16", "int8"}  # each path weighed
        assert (d.compute_s > 0) is slow  # the chosen path's compute (none for plain)
        assert st.last_stats[0].method == ("int8" if slow else "allreduce")
    assert "policy auto: bucket 0" in caplog.text
    states[0].recalibrate()
    assert states[0].link is None and states[0].buckets[0].decision is None


def test_auto_measurement_step_holds_inline_buckets_until_the_last():
    """In-process collectives: on ``policy: auto``'s measurement step (start_iter) each
    bucket's Future stays pending until the last bucket's hook, which reduces them all in
    order, so the ready times it notes are backward's alone; the decisions of the next step
    use them (fails on ddc6801: bucket 0 was reduced inside its own hook)."""
    import time

    st = CommHookState(config=cfg(policy="auto", **INT8))
    outs = {}
    for it in range(3):
        futs = []
        for i in range(3):
            b = make_bucket(10 * it + i, index=i, is_last=i == 2)
            expect = b.buffer().clone()  # W = 1: the plain all-reduce is the identity
            futs.append(int8_hook(st, b))
            if it == 1 and i < 2:
                assert not futs[-1].done()  # held until the step's last bucket
                time.sleep(0.05)  # backward between this bucket and the next one
            if it == 1:
                outs[i] = (futs[-1], expect)
        assert all(f.done() for f in futs)
    for f, expect in outs.values():
        assert torch.equal(f.value(), expect)
    shadows = [st.buckets[i].decision.shadow_s for i in range(3)]
    assert shadows[2] == 0.0 and 0.05 <= shadows[1] < shadows[0]
    assert shadows[0] >= 0.1 and shadows[0] < 1.1  # two sleeps; 1 s of slack on a busy CPU
    assert st.iteration == 3 and st.last_stats[0].method in ("allreduce", "bf16", "int8")
