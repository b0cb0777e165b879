"""Cross-group weight sync: plan (pure) and 4 gloo ranks (2 training + 2 rollout, TP2).

Bit equality is the property under test (the rollout shard must be the trainer's weights
cast to bf16 exactly), so shards are compared with ``torch.equal`` on their int16 views.
"""

import time

import pytest
import torch

from verl_comm.distributed import DistContext
from verl_comm.distributed.launch import spawn
from verl_ppo.reshard.delta import checksum, choose_encoding, encoded_nbytes
from verl_ppo.reshard.group_plan import plan_group_sync
from verl_ppo.reshard.group_sync import SyncReceiver, SyncSender, WeightSyncError
from verl_ppo.reshard.layout import ParallelLayout as L
from verl_ppo.reshard.specs import model_dims, shard_for, slice_shard
from verl_ppo.reshard.testing import random_full_state, tiny_config

BUCKET = 300  # elements: several buckets per stream, streams not a multiple of it


def _states(specs, steps):
    """Seeded full fp32 states all ranks agree on; step 2 changes nothing."""
    state = random_full_state(specs, seed=11)
    out = [state]
    for k in range(1, steps):
        g = torch.Generator().manual_seed(100 + k)
        lr = 0.0 if k == 2 else [1e-4, 1e-3][k % 2]
        state = {n: t - lr * torch.randn(t.shape, generator=g).sign() for n, t in state.items()}
        out.append(state)
    return out


def _expected(plan, rank, full):
    return {
        n: slice_shard(full[n].to(torch.bfloat16), sh)
        for n, sh in plan.rollout_shards_of(rank).items()
    }


def _expected_bytes(plan, rank, old, new):
    """Receive bytes of a delta sync computed from the weights, not from the sync code."""
    total = 0
    for s in plan.recvs_of(rank):
        names = [plan.specs[p].name for p in s.params]
        a = torch.cat([old[n].reshape(-1) for n in names]).view(torch.int16)
        b = torch.cat([new[n].reshape(-1) for n in names]).view(torch.int16)
        for lo, hi in s.buckets(plan.bucket_elems):
            k = int((a[lo:hi] != b[lo:hi]).sum())
            total += encoded_nbytes(choose_encoding(hi - lo, k), hi - lo, k)
        total += 8 * (2 + 2 * len(s.buckets(plan.bucket_elems)))
    return total


def _run_case(rank, kind, train, wire, group, steps=4, bucket=BUCKET):
    cfg = tiny_config(kind)
    plan = plan_group_sync(cfg, train, L(tp=2), [0, 1], [2, 3], bucket_elems=bucket)
    states = _states(plan.specs, steps)
    res = []
    if rank < 2:
        dims = model_dims(cfg)
        sender = SyncSender(plan, rank, group, wire=wire, timeout_s=150)
        for full in states:
            held = {s.name: full[s.name] for s in plan.specs if shard_for(s, train, rank, dims)}
            st = sender.start(held)
            sender.finish()
            # the buffers the weights were cast into (delta: what the receivers now hold)
            bufs = sender._ref if wire == "delta" else sender._spare
            res.append(
                {
                    "sent": st.bytes_sent,
                    "header": st.header_bytes,
                    "enc": st.encodings,
                    "bufs": sorted(t.data_ptr() for t in bufs.values()),
                }
            )
        return res
    rx = SyncReceiver(plan, rank, group, wire=wire, timeout_s=150)
    prev = {n: torch.zeros_like(t) for n, t in rx.live.items()}
    for full in states:
        exp = _expected(plan, rank, full)
        rx.start()
        while not rx.ready():  # generation would run here on the old weights
            time.sleep(0.01)
        old_kept = all(
            torch.equal(rx.live[n].view(torch.int16), prev[n].view(torch.int16)) for n in exp
        )
        st = rx.switch()
        res.append(
            {
                "equal": all(
                    torch.equal(rx.live[n].view(torch.int16), exp[n].view(torch.int16)) for n in exp
                ),
                "checksums": all(checksum(rx.live[n]) == checksum(exp[n]) for n in exp),
                "old_kept_until_switch": old_kept,
                "verified": st.verified,
                "recv": st.bytes_received,
                "want": _expected_bytes(plan, rank, prev, exp),
                "pause_s": st.pause_s,
                "transfer_s": st.transfer_s,
            }
        )
        prev = exp
    return res


def worker(rank, world):
    ctx = DistContext.from_default_group(120.0)
    group = ctx.new_group(list(range(world)))
    out = {
        "dp2_full": _run_case(rank, "llama", L(dp=2), "full", group),
        "dp2_delta": _run_case(rank, "llama", L(dp=2), "delta", group),
        "pp2_delta": _run_case(rank, "qwen2", L(pp=2), "delta", group),
        # buckets that split 64-bit words: the receiver checksums whole streams instead
        "dp2_delta_odd": _run_case(rank, "llama", L(dp=2), "delta", group, bucket=BUCKET + 1),
    }
    # a peer that never sends: the receivers time out naming rank and phase
    lost = ctx.new_group(list(range(world)))
    plan = plan_group_sync(tiny_config("llama"), L(dp=2), L(tp=2), [0, 1], [2, 3])
    if rank >= 2:
        rx = SyncReceiver(plan, rank, lost, wire="delta", timeout_s=2.0)
        t0 = time.monotonic()
        rx.start()
        try:
            rx.switch()
            out["timeout"] = ("no error", 0.0)
        except WeightSyncError as e:
            out["timeout"] = (str(e), time.monotonic() - t0)
    else:
        time.sleep(4.0)  # alive but silent past the receivers' deadline (gone = another error)
    return out


def test_group_sync_four_ranks():
    res = spawn(f"{__file__}:worker", 4, timeout_s=300)
    for case in ("dp2_full", "dp2_delta", "pp2_delta", "dp2_delta_odd"):
        sent = [sum(r["sent"] for r in res[i][case]) for i in (0, 1)]
        assert min(sent) > 0, (case, sent)  # both training ranks send: no single sender
        for rank in (2, 3):
            for step, r in enumerate(res[rank][case]):
                assert r["equal"] and r["checksums"] and r["verified"], (case, rank, step, r)
                assert r["old_kept_until_switch"], (case, rank, step)
                if case != "dp2_full" and step > 0:
                    assert r["recv"] == r["want"], (case, rank, step, r)
        # what the senders handed to isend is what the receivers handed to irecv
        for step in range(4):
            assert sum(res[i][case][step]["sent"] for i in (0, 1)) == sum(
                res[j][case][step]["recv"] for j in (2, 3)
            )
    for i in (0, 1):  # host buffers cast into again: full every sync, delta every other
        bufs = [r["bufs"] for r in res[i]["dp2_full"]]
        assert bufs[0] and all(b == bufs[0] for b in bufs), bufs
        bufs = [r["bufs"] for r in res[i]["dp2_delta"]]
        assert bufs[0] == bufs[2] and bufs[1] == bufs[3] and bufs[0] != bufs[1], bufs
    full = sum(res[j]["dp2_full"][3]["recv"] for j in (2, 3))
    delta = sum(res[j]["dp2_delta"][3]["recv"] for j in (2, 3))
    nothing = sum(res[j]["dp2_delta"][2]["recv"] for j in (2, 3))
    assert delta < full and nothing < delta, (full, delta, nothing)
    for rank in (2, 3):
        msg, elapsed = res[rank]["timeout"]
        assert f"rank {rank}" in msg and "header receive" in msg and "timed out" in msg, msg
        assert 1.9 <= elapsed < 2.0 + 8.0, elapsed  # timeout_s, plus slack for a loaded CPU


def test_plan_spreads_senders_and_covers_each_shard_once():
    cfg = tiny_config("qwen2")
    plan = plan_group_sync(cfg, L(dp=3), L(tp=2, dp=2), [0, 1, 2], [3, 4, 5, 6], bucket_elems=64)
    loads = plan.send_elems()
    assert all(v > 0 for v in loads.values()), loads
    assert max(loads.values()) - min(loads.values()) <= max(s.numel for s in plan.specs) // 2
    for j, r in enumerate(plan.rollout_ranks):
        got = sorted(p for s in plan.recvs_of(r) for p in s.params)
        want = [p for p, sh in enumerate(plan.rollout_shards[j]) if sh is not None]
        assert got == want, r  # every shard exactly once
    assert all(0 < b - a <= 64 for s in plan.streams for a, b in s.buckets(64))


@pytest.mark.parametrize(
    ("train", "roll", "tr", "rr", "match"),
    [
        (L(dp=2), L(tp=2), [0, 1], [], "a group is empty"),
        (L(dp=2), L(tp=2), [0, 1], [1, 2], "disjoint"),
        (L(dp=2, tp=2), L(tp=2), [0, 1, 2, 3], [4, 5], "tensor_parallel_size 1"),
        (L(dp=2), L(tp=2), [0, 1], [2, 3, 4], "world size 3"),
        (L(dp=2), L(tp=3), [0, 1], [2, 3, 4], "does not divide"),
    ],
)
def test_plan_refuses_impossible_splits(train, roll, tr, rr, match):
    with pytest.raises(ValueError, match=match):
        plan_group_sync(tiny_config("llama"), train, roll, tr, rr)


def test_sender_receiver_refuse_bad_arguments():
    plan = plan_group_sync(tiny_config("llama"), L(dp=2), L(tp=2), [0, 1], [2, 3])
    with pytest.raises(ValueError, match="not one of"):
        SyncSender(plan, 0, wire="sparse")
    with pytest.raises(ValueError, match="not a training rank"):
        SyncSender(plan, 2)
    with pytest.raises(ValueError, match="not a rollout rank"):
        SyncReceiver(plan, 0)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        SyncReceiver(plan, 2, dtype=torch.float32)
    full32 = SyncReceiver(plan, 2, wire="full", dtype=torch.float32)  # fp32 needs full
    assert all(t.dtype == torch.float32 for t in full32.live.values())


def worker_nccl(rank, world):
    """1 training + 1 rollout rank on two GPUs, delta wire, 4 syncs (NCCL transport)."""
    ctx = DistContext.from_default_group(120.0)
    group = ctx.new_group([0, 1])
    cfg = tiny_config("qwen2")
    plan = plan_group_sync(cfg, L(dp=1), L(tp=1), [0], [1], bucket_elems=BUCKET)
    dev = torch.device("cuda", rank)
    ok = []
    for full in _states(plan.specs, 4):
        if rank == 0:
            if not ok:
                tx = SyncSender(plan, 0, group, "delta", device=dev, timeout_s=60)
            tx.start({n: t.to(dev) for n, t in full.items()})
            tx.finish()
            ok.append(True)
        else:
            if not ok:
                rx = SyncReceiver(plan, 1, group, "delta", device=dev, timeout_s=60)
            rx.start()
            st = rx.switch()
            exp = _expected(plan, 1, full)
            ok.append(
                st.verified
                and all(
                    torch.equal(rx.live[n].cpu().view(torch.int16), exp[n].view(torch.int16))
                    for n in exp
                )
            )
    return ok


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_group_sync_nccl_two_gpus():
    res = spawn(f"{__file__}:worker_nccl", 2, backend="nccl", timeout_s=180)
    assert all(res[0]) and all(res[1]) and len(res[1]) == 4, res
