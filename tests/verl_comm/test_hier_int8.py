"""The hierarchical int8 all-reduce (verl_comm/compression/hier_int8.py) on in-memory ranks:
H hosts x L local ranks, one thread per rank, a ThreadGroup per host and per local rank."""

from __future__ import annotations

import pytest
import torch

from tests.verl_comm.test_compression import run_ranks, run_threads
from verl_comm.compression.collective import ThreadGroup
from verl_comm.compression.hier_int8 import (
    Hierarchy,
    chunk_numel,
    hier_int8_allreduce,
    hier_int8_allreduce_wire_bytes,
)
from verl_comm.compression.int8_allreduce import int8_allreduce


def run_hier(hosts: int, local: int, fn):
    """Run ``fn(rank, Hierarchy)`` for rank = host * local + l in threads; results by rank."""
    intra = [ThreadGroup(local, timeout_s=30) for _ in range(hosts)]
    inter = [ThreadGroup(hosts, timeout_s=30) for _ in range(local)]

    def rank(r):
        h, lr = divmod(r, local)
        return fn(r, Hierarchy(intra[h].collective(lr), inter[lr].collective(h)))

    return run_threads(hosts * local, rank)


def _bound(xs: list[torch.Tensor]) -> float:
    """Largest error of one reduction: half a step (absmax / 254) of each of the three
    quantizations (a rank's input, its host's average, the owner's average over hosts),
    each at most the largest |input| (averages of averages), over the inputs' weight 1."""
    a = max(float(x.abs().max()) for x in xs)
    return 3 * a / 254 * 1.02


@pytest.mark.parametrize("hosts,local,n", [(2, 2, 3000), (2, 3, 1000), (3, 2, 777)])
def test_average_identical_and_within_bound(hosts, local, n):
    world = hosts * local
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(n, generator=g) for _ in range(world)]
    mean = torch.stack(xs).mean(0)

    def fn(r, hier):
        res = torch.zeros(n)
        x = xs[r].clone()
        host = torch.zeros(chunk_numel(n, hier, 32))
        out = hier_int8_allreduce(x, hier, block=32, residual=res, host_residual=host)
        assert torch.equal(x, xs[r])  # the input is left alone
        return out, res, hier.bytes_sent

    outs = run_hier(hosts, local, fn)
    for o, _, _ in outs[1:]:
        assert torch.equal(o.out, outs[0][0].out)
    err = float((outs[0][0].out - mean).abs().max())
    assert 0 < err <= _bound(xs)
    assert all(bool(o.finite) for o, _, _ in outs)
    for r, (o, res, sent) in enumerate(outs):
        # error feedback: what this rank's input lost to its own quantization, as the flat
        # scheme keeps it; bytes counted where they are sent
        assert 0 < float(res.abs().max()) <= float(xs[r].abs().max()) / 254 * 1.01
        assert o.wire_bytes == sent
        assert sent == hier_int8_allreduce_wire_bytes(n, Hierarchy(*_fake(hosts, local, r)), 32)


class _Stub:
    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank, self.bytes_sent = world_size, rank, 0


def _fake(hosts, local, r):
    h, lr = divmod(r, local)
    return _Stub(local, lr), _Stub(hosts, h)


def test_error_feedback_as_in_the_flat_scheme():
    """Repeated with the same inputs, the outputs' running sum drifts from T x the mean only
    by the owner's requantization errors (not fed back, as in the flat two-step scheme):
    error feedback holds the drift to that of the flat int8 all-reduce on the same ranks,
    and well under the drift without it, which grows by a full step's error each step."""
    hosts, local, n, steps = 2, 2, 512, 24
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g) for _ in range(hosts * local)]
    target = steps * torch.stack(xs).mean(0).double()

    def run(reduce, ef):
        res = torch.zeros(n) if ef else None
        acc = torch.zeros(n, dtype=torch.float64)
        for _ in range(steps):
            acc += reduce(res).out.double()
        return float((acc - target).abs().max())

    def hier(ef):
        def rank(r, h):
            host = torch.zeros(chunk_numel(n, h)) if ef else None
            return run(
                lambda res: hier_int8_allreduce(xs[r], h, residual=res, host_residual=host), ef
            )

        return run_hier(hosts, local, rank)[0]

    flat = run_ranks(
        hosts * local, lambda r, c: run(lambda res: int8_allreduce(xs[r], c, residual=res), True)
    )[0]
    with_ef, without = hier(True), hier(False)
    assert with_ef <= 1.5 * flat
    assert with_ef <= 0.5 * without


def test_a_flat_steps_residual_is_sent():
    """The residual has the flat scheme's shape and meaning: one left by a flat int8 step
    is sent by the next hierarchical step (inputs constant per block: int8 is exact)."""
    hosts, local, n = 2, 2, 256
    xs = [torch.full((n,), float(r)) for r in range(4)]

    def fn(r, hier):
        res = torch.full((n,), 0.25)
        out = hier_int8_allreduce(xs[r], hier, residual=res).out
        assert bool((res == 0).all())
        return out

    outs = run_hier(hosts, local, fn)
    assert torch.equal(outs[0], torch.full((n,), 1.75))  # (0 + 1 + 2 + 3 + 4 x 0.25) / 4


def test_nonfinite_on_one_rank_is_seen_by_every_rank():
    hosts, local, n = 2, 2, 300

    def fn(r, hier):
        x = torch.ones(n)
        if r == 3:
            x[7] = float("nan")
        return bool(hier_int8_allreduce(x, hier).finite)

    assert run_hier(hosts, local, fn) == [False] * 4


def test_host_layout_needs_two_hosts_of_the_same_size():
    from verl_comm.hooks.hierarchy import host_layout

    assert host_layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert host_layout(["a", "b", "a", "b"]) == [[0, 2], [1, 3]]
    assert host_layout(["a", "a", "a", "a"]) is None  # one host
    assert host_layout(["a", "b", "c", "d"]) is None  # one rank a host: flat is the same
    assert host_layout(["a", "a", "b", "b", "b"]) is None  # uneven hosts


def test_hierarchical_auto_refused_where_it_cannot_apply():
    """In-process collectives (no gloo group of W > 1): a set ``hierarchical: auto`` is
    refused with a message naming the key and the fix, never silently flat."""
    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import CommHookState, GradBucket, int8_hook

    state = CommHookState(
        config=CompressionConfig(gradient_compression="int8", hierarchical="auto")
    )
    with pytest.raises(ValueError, match="hierarchical='auto'.*set hierarchical: off"):
        int8_hook(state, GradBucket.from_tensors([torch.ones(64)]))
    state.close()
    ok = CommHookState(config=CompressionConfig(gradient_compression="int8"))
    assert torch.equal(
        int8_hook(ok, GradBucket.from_tensors([torch.ones(64)])).wait(), torch.ones(64)
    )
    ok.close()
