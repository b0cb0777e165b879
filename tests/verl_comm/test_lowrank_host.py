"""The host chain of low rank (issue 28): on the CPU each matrix is worked on in place as a
view of the bucket (no stacked copy in and out of a work buffer), ``P Q^T`` is formed once
per row chunk (not once for the residual and once for the output), a 16-bit residual is
widened a row chunk at a time.

Checked here: the result against a plain per-matrix reference of the same algorithm
(float64, exact wire), in place and into a separate ``out``; ``keep`` at the first step;
and the transient host memory of one call, which before this chain held a bucket-sized
fp32 copy (the stacked matrices, or the widened bf16 residual of a one-matrix group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._threads import run_threads
from verl_comm.compression import (
    LocalCollective,
    LowRankBucketState,
    ThreadGroup,
    lowrank_int8_allreduce,
    orthonormalize,
    plan_lowrank,
)
from verl_comm.compression.lowrank_plan import FactorWire

ROOT = Path(__file__).resolve().parents[2]
EXACT = FactorWire("exact", "exact", "exact")
# interleaved shapes: groups of 3, 2 and 1 matrices, a rest of a vector and a scalar; the
# (700, 40) matrices span several host row chunks only with a small chunk (see below)
SHAPES = [(700, 40), (9,), (64, 96), (700, 40), (64, 96), (), (700, 40), (50, 33)]


def _reference(flat, plan, qs, residuals, rest_res):
    """One step of the algorithm per matrix with plain torch (W = 1, exact wire)."""
    out = torch.empty_like(flat)
    new_qs, new_res = [], []
    for gi, g in enumerate(plan.groups):
        ms = torch.stack([flat[s.offset : s.offset + s.numel].view(g.n, g.m) for s in g.slots])
        ms = ms + residuals[gi]
        p = orthonormalize(ms @ qs[gi])
        q = ms.mT @ p
        approx = p @ q.mT
        for i, s in enumerate(g.slots):
            out[s.offset : s.offset + s.numel] = approx[i].reshape(-1)
        new_qs.append(q)
        new_res.append(ms - approx)
    rest = torch.cat([flat[s.offset : s.offset + s.numel] for s in plan.rest]) + rest_res
    o = 0
    for s in plan.rest:
        out[s.offset : s.offset + s.numel] = rest[o : o + s.numel]
        o += s.numel
    return out, new_qs, new_res


@pytest.mark.parametrize("in_place", [True, False])
def test_host_chain_matches_per_matrix_reference(monkeypatch, in_place):
    import verl_comm.compression.lowrank_host as lowrank_host

    monkeypatch.setattr(lowrank_host, "HOST_CHUNK_NUMEL", 40 * 128)  # 128-row chunks of (700, 40)
    plan = plan_lowrank(SHAPES, rank=4)
    assert [g.k for g in plan.groups] == [3, 2, 1]
    st = LowRankBucketState()
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        flat = torch.randn(plan.numel, dtype=torch.float64, generator=gen)
        before = [[t.clone() for t in ts] for ts in (st.qs, st.residuals)]
        rest_before = None if st.rest_residual is None else st.rest_residual.clone()
        buf = flat.clone()
        r = lowrank_int8_allreduce(
            buf, plan, st, LocalCollective(), wire=EXACT, generator=gen,
            out=buf if in_place else None,
        )  # fmt: skip
        assert (r.out.data_ptr() == buf.data_ptr()) == in_place
        if not in_place:
            assert torch.equal(buf, flat)  # the input is left as it was
        if step == 0:  # the first Q is drawn inside the call
            continue
        out, qs, res = _reference(flat, plan, *before, rest_before)
        torch.testing.assert_close(r.out, out, rtol=1e-10, atol=1e-10)
        for gi in range(len(plan.groups)):
            torch.testing.assert_close(st.residuals[gi], res[gi], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(st.qs[gi], qs[gi], rtol=1e-10, atol=1e-10)


def test_keep_at_first_step_leaves_a_zero_residual():
    """Rank 0 has no gradient for a matrix at the first compressed step, rank 1 has one:
    rank 0 sends zeros and its residual is left as it was, i.e. zero (the stacked chain
    stored ``-P Q^T`` there, the average it did not apply)."""
    plan = plan_lowrank(SHAPES, rank=4)
    s1 = plan.groups[0].slots[1]
    group = ThreadGroup(2, timeout_s=30)
    sts = [LowRankBucketState(), LowRankBucketState()]
    outs: list = [None, None]

    def rank(r: int) -> None:
        flat = torch.randn(plan.numel, generator=torch.Generator().manual_seed(r))
        keep = ((s1.offset, s1.numel),) if r == 0 else ()
        if keep:
            flat[s1.offset : s1.offset + s1.numel] = 0
        outs[r] = lowrank_int8_allreduce(
            flat, plan, sts[r], group.collective(r), block=32, keep=keep,
            generator=torch.Generator().manual_seed(0),
        ).out  # fmt: skip

    run_threads(rank)
    assert torch.equal(outs[0], outs[1])
    assert outs[0][s1.offset : s1.offset + s1.numel].abs().max() > 0  # rank 1's average
    assert torch.equal(sts[0].residuals[0][1], torch.zeros(700, 40))
    assert sts[0].residuals[0][0].abs().max() > 0 and sts[1].residuals[0][1].abs().max() > 0


PROBE = r"""
import json, re, torch
torch.set_num_threads(1)
from verl_comm.compression import LoopbackCollective, LowRankBucketState, lowrank_int8_allreduce
from verl_comm.compression import plan_lowrank

# an embedding-like matrix (one-matrix group) and two transformer layers (stacked groups
# of two), bf16 residual, W = 2 loopback: the shapes and compute of a 2-rank run
h, i, kv = 576, 1536, 192
layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h,), (h,)]
plan = plan_lowrank([(8192, h)] + 2 * layer, rank=64)
buf = torch.zeros(plan.numel)
grad = torch.randn(plan.numel, generator=torch.Generator().manual_seed(0))
st, gen = LowRankBucketState(), torch.Generator().manual_seed(0)

def step():
    buf.copy_(grad)
    lowrank_int8_allreduce(buf, plan, st, LoopbackCollective(2), residual_dtype=torch.bfloat16,
                           generator=gen, out=buf, stats=False)

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

for _ in range(2):  # the first step allocates the residuals and Q
    step()
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
step()
print(json.dumps({"extra_bytes": status("VmHWM") - base, "bucket_bytes": 4 * plan.numel,
                  "factor_bytes": 4 * (plan.p_numel + plan.q_numel)}))
"""


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux procfs")
def test_host_chain_transient_memory():
    """One call's peak host memory over the resident set before it, in a fresh process whose
    allocator returns every large block (as tests/verl_comm/test_int8_memory.py). The stacked
    chain: 48 MiB on this 45 MiB bucket; the host chain: 14.8 MiB, about twice the fp32
    factors (P and Q, the fp64 copies of P in orthonormalize, the int8 payload slices)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"low-rank host chain transient memory: {rec}")
    assert rec["extra_bytes"] <= 2.5 * rec["factor_bytes"] < 0.5 * rec["bucket_bytes"], rec
