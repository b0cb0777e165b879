"""Multi-process resharding on CPU gloo: bit-equal shards, exact byte counts, TP decoding.

One spawn per world size (process start-up dominates on a small CPU machine); each worker
runs several layout pairs and returns a summary the parent asserts on.
"""

import torch
import torch.distributed as dist

from tests._models import left_padded_prompts
from verl_comm.distributed import DistContext
from verl_comm.distributed.launch import spawn
from verl_comm.telemetry import CommRecorder
from verl_ppo.reshard.engine import ReshardEngine
from verl_ppo.reshard.layout import ParallelLayout as L
from verl_ppo.reshard.testing import (
    emulated_train_shards,
    expected_rollout,
    random_full_state,
    tiny_config,
)
from verl_ppo.reshard.wire import pairwise_mismatches


def _check_pair(
    rank, kind, train, roll, method="engine", transport="all_to_all", bucket=2048, full=None
):
    """Reshard once; return (bit-equal?, bytes received, plan figure, lower bound, recorded,
    bytes counted at the transport calls and their sender/receiver agreement)."""
    cfg = tiny_config(kind)
    rec = CommRecorder()
    eng = ReshardEngine(
        cfg,
        train,
        roll,
        bucket_bytes=bucket,
        method=method,
        transport=transport,
        recorder=rec,
        ctx=DistContext.from_default_group(120.0),
    )
    full = full if full is not None else random_full_state(eng.plan.specs, seed=7)
    out = eng.reshard(emulated_train_shards(eng.plan, rank, full))
    exp = expected_rollout(eng.plan, rank, full)
    equal = out.keys() == exp.keys() and all(torch.equal(out[k], exp[k]) for k in exp)
    s = eng.last_stats
    pairwise = None
    if s.counted_sent_per_peer is not None:  # the engine counts at its transport calls
        pairwise = pairwise_mismatches(s.counted_sent_per_peer, s.counted_received_per_peer)
    return (
        {
            "equal": equal,
            "recv": s.bytes_received,
            "plan": eng.plan.recv_elems[rank] * 4,
            "lower": s.lower_bound_bytes,
            "recorded_sent": rec.total_bytes(),
            "sent": s.bytes_sent,
            "buckets": s.buckets,
            "peak": s.peak_extra_bytes,
            "rollout_bytes": s.rollout_bytes,
            "counted": s.counted_received,
            "counted_sent": s.counted_sent,
            "pairwise": pairwise,
        },
        eng,
        out,
        full,
    )


def _hf_greedy(cfg, full, ids, mask, steps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg).eval()
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=steps,
        do_sample=False,
        eos_token_id=1,
        pad_token_id=2,
    )
    del model
    return out


PROMPTS = dict(vocab=(3, 64), pads={0: 2}, pad_id=2)  # row 0 left-padded


def worker_4(rank, world):
    from verl_ppo.rollout.tp_generate import tp_generate
    from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup

    res = {}
    r, eng, out, full = _check_pair(rank, "qwen2", L(pp=2, dp=2), L(tp=4))
    res["pp2dp2_tp4"] = r
    # TP4 greedy decoding on the resharded weights (GQA KV heads replicated, tied, biases)
    lay = eng.rollout_layout
    tp = TPGroup(None, 4, lay.coords(rank)[2], lay.tp_group(rank))
    ids, mask = left_padded_prompts(
        rank, (3, 6), **PROMPTS
    )  # each rank its own prompts: the TP group gathers them
    got = tp_generate(
        TPCausalLM(tiny_config("qwen2"), out, tp),
        ids,
        mask,
        8,
        do_sample=False,
        eos_token_id=1,
        pad_token_id=2,
    )
    res["tp4_greedy_equal"] = torch.equal(got, _hf_greedy(tiny_config("qwen2"), full, ids, mask, 8))
    res["p2p"] = _check_pair(rank, "qwen2", L(pp=2, dp=2), L(tp=4), transport="p2p")[0]
    res["naive"] = _check_pair(rank, "qwen2", L(pp=2, dp=2), L(tp=4), method="naive_allgather")[0]
    res["zero3"] = _check_pair(rank, "gpt2", L(dp=4, zero_stage=3), L(tp=2, dp=2), bucket=1024)[0]
    # a bad layout fails on every rank before any traffic; the group stays usable
    rec = CommRecorder()
    try:
        ReshardEngine(tiny_config("gpt2", n_head=2, n_embd=32), L(dp=4), L(tp=4), recorder=rec)
        res["bad_layout"] = "no error"
    except ValueError as e:
        res["bad_layout"] = str(e)
    # the pairwise check can fail: rank 0 claims 8 bytes more sent to rank 1 than arrived
    sent = [0, 24, 0, 0] if rank == 0 else [0] * 4
    recv = [16, 0, 0, 0] if rank == 1 else [0] * 4
    res["pairwise_fabricated"] = pairwise_mismatches(sent, recv)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    res["after_bad_layout_allreduce"] = t.item()
    res["bad_layout_records"] = len(rec.records)
    return res


def worker_8(rank, world):
    return {
        "tp4dp2_tp2dp4": _check_pair(rank, "llama", L(tp=4, dp=2), L(tp=2, dp=4))[0],
        "pp2dp2tp2_tp4dp2": _check_pair(rank, "llama", L(pp=2, dp=2, tp=2), L(tp=4, dp=2))[0],
    }


def _assert_exact(r):
    assert r["equal"], r
    # counted at the calls (per peer, from the tensors) == planned == lower bound
    assert r["counted"] == r["recv"] == r["plan"] == r["lower"], r
    assert r["counted_sent"] == r["sent"] and r["pairwise"] == [], r
    assert r["recorded_sent"] == r["sent"], r


def test_reshard_four_processes():
    res = spawn(f"{__file__}:worker_4", 4, timeout_s=400)
    for rank, r in enumerate(res):
        for key in ("pp2dp2_tp4", "p2p", "zero3"):
            _assert_exact(r[key])
        assert r["naive"]["equal"] and r["naive"]["recv"] > r["pp2dp2_tp4"]["recv"]
        assert r["pp2dp2_tp4"]["recv"] > 0 and r["zero3"]["buckets"] > 1
        # extra memory bounded by two buckets plus the rollout shard
        z = r["zero3"]
        assert z["peak"] <= 2 * 1024 + z["rollout_bytes"], z
        assert r["tp4_greedy_equal"], rank
        assert r["pairwise_fabricated"] == ["rank 0 -> 1: sent 24 B, received 16 B"]
        assert "does not divide the 2 attention heads" in r["bad_layout"], r["bad_layout"]
        assert r["after_bad_layout_allreduce"] == 10.0 and r["bad_layout_records"] == 0


def test_reshard_eight_processes():
    res = spawn(f"{__file__}:worker_8", 8, timeout_s=500)
    for r in res:
        _assert_exact(r["tp4dp2_tp2dp4"])
        _assert_exact(r["pp2dp2tp2_tp4dp2"])
