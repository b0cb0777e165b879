"""Token-budget micro-batches: budget respected, deterministic, balanced, exact weights."""

from __future__ import annotations

import random

import pytest
import torch

from verl_ppo.step.batching import (
    micro_batch_weights,
    padding_efficiency,
    plan_micro_batches,
    token_budget_micro_batches,
)


def _lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(5, 100) for _ in range(n)]


@pytest.mark.parametrize("mode", ["packed", "padded"])
@pytest.mark.parametrize("seed", range(5))
def test_budget_partition_and_determinism(mode, seed):
    lens = _lengths(37, seed)
    budget = 256
    mbs = token_budget_micro_batches(lens, budget, mode=mode)
    assert sorted(i for mb in mbs for i in mb) == list(range(37))  # each index once
    for mb in mbs:
        cost = sum(lens[i] for i in mb) if mode == "packed" else len(mb) * max(lens[i] for i in mb)
        assert cost <= budget and mb == sorted(mb)
    assert mbs == token_budget_micro_batches(list(lens), budget, mode=mode)
    assert mbs == token_budget_micro_batches(torch.tensor(lens), budget, mode=mode)


def test_packed_uses_near_minimal_bins_and_balances():
    lens = _lengths(64, 0)
    budget = 300
    mbs = token_budget_micro_batches(lens, budget)
    lower = -(-sum(lens) // budget)
    assert len(mbs) <= lower + 1
    loads = [sum(lens[i] for i in mb) for mb in mbs]
    assert max(loads) - min(loads) <= max(lens)  # LPT: within one sequence of each other


def test_sorted_padded_beats_fixed_chunks():
    lens = _lengths(64, 3)
    mbs = token_budget_micro_batches(lens, 8 * 100, mode="padded")
    fixed = [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert padding_efficiency(lens, mbs) > padding_efficiency(lens, fixed)


def test_min_micro_batches_and_edge_cases():
    assert token_budget_micro_batches([], 10) == []
    for mode in ("packed", "padded"):
        got = token_budget_micro_batches([1, 1, 1, 1], 100, mode=mode, min_micro_batches=3)
        assert len(got) == 3 and sorted(sum(got, [])) == [0, 1, 2, 3]
    assert token_budget_micro_batches([10, 10, 10], 10) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        token_budget_micro_batches([5, 50], 20)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        token_budget_micro_batches([5], 0)
    with pytest.raises(ValueError, match="mode"):
        token_budget_micro_batches([5], 10, mode="bogus")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_weights_make_accumulated_loss_exact(agg):
    g = torch.Generator().manual_seed(0)
    B, R = 11, 9
    x = torch.randn(B, R, generator=g, dtype=torch.float64)
    n = torch.randint(1, R + 1, (B,), generator=g)
    mask = (torch.arange(R) < n[:, None]).double()

    def loss(idx):
        xm, mm = x[idx], mask[idx]
        if agg == "token-mean":
            return (xm * mm).sum() / mm.sum()
        return ((xm * mm).sum(-1) / mm.sum(-1)).mean()

    mbs = token_budget_micro_batches(n, 20)
    w = micro_batch_weights(mbs, mask, agg)
    assert len(mbs) > 1 and abs(sum(w) - 1) < 1e-12
    total = sum(wj * loss(torch.tensor(mb)) for wj, mb in zip(w, mbs))
    torch.testing.assert_close(total, loss(torch.arange(B)), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        micro_batch_weights(mbs, mask, "sum")


def _plan_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    try:
        # rank 0: short sequences (1 micro-batch alone), rank 1: long ones (several)
        lens = torch.tensor([10, 12, 9, 11] if rank == 0 else [90, 95, 80, 85])
        out = {}
        for mode in ("packed", "padded"):
            out[mode] = plan_micro_batches(lens, 200, mode)
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_plan_micro_batches_same_count_on_every_rank():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_plan_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for mode in ("packed", "padded"):
        a, b = res[0][mode], res[1][mode]
        assert len(a) == len(b) >= 2
        for plan in (a, b):
            assert sorted(sum(plan, [])) == [0, 1, 2, 3]
    # alone, outside a process group, rank 0's batch needs one micro-batch
    assert plan_micro_batches(torch.tensor([10, 12, 9, 11]), 200) == [[0, 1, 2, 3]]
