"""Weight sync from training ranks to rollout ranks: bytes and time of the full and delta wires.

Issue 31's sync measurements, before the asynchronous trainer exists: 2 training ranks (DP2
replicas of a Llama-shaped model, trained by AdamW on a causal-LM loss of seeded random
tokens, the same batch on both replicas, so they stay identical as DP replicas do) and 2
rollout ranks (TP2, bf16) on other ranks, synced with
:class:`~verl_ppo.reshard.group_sync.SyncSender` / ``SyncReceiver``.

Protocol: per round, one optimizer step, then both wires sync the same new weights, in an
order that alternates per round (interleaved); each wire keeps its own receiver copy (delta
against what that receiver holds). While a sync is in flight the rollout ranks generate
``--gen-tokens`` greedy tokens with their live (old) weights through the TP model, then
``switch()``. The rollout ranks start generating when the round starts, as they start batch
``k + 1`` when the trainers start step ``k``: the sync runs after the optimizer step, so the
generation must outlast the step plus the transfer for the switch to wait only for the
last bucket (64 tokens, ~1.3 s on a shared 2-core CPU, against a ~0.5 s step and the full
wire's 0.57 s at 200 Mbit/s; with 32 a loaded machine made the switch wait for the wire). Numerics first: every sync's checksum must match on the receiver (the rollout
shard is bit-identical to the trainer's weights cast to bf16) and the bytes handed to
``isend`` must equal those handed to ``irecv``; a record says ``numerics_ok``. Round 0 is the
first sync (full on both wires) and is recorded but left out of the summaries.

Per round and wire: ``wall_s`` = last receiver done - first sender start (one host, one
clock; the two training ranks end their step together, as DP replicas do), bytes over the link, the changed fraction, transfer and pause times. Metrics
(``benchmarks/results/async_rollout.jsonl``): ``delta_bytes_vs_full`` (same round),
``sync_time_vs_line_rate`` (``wall_s`` over the bytes' time at ``--link-mbit``; only when a
link rate is given) and ``pause_vs_transfer`` (generation paused in ``switch()`` over the
transfer time).

Usage::

    python benchmarks/weight_sync.py --smoke --out /tmp/ws        # 4 gloo processes, loopback
    bash benchmarks/slow_link_sync.sh benchmarks/results 200      # namespaces, veth at 200 Mbit/s
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_comm.bench.env import commit, dirty, now_iso, versions  # noqa: E402
from verl_comm.bench.report import read_jsonl, write_jsonl  # noqa: E402
from verl_comm.distributed import DistContext, init_distributed  # noqa: E402
from verl_comm.distributed.launch import spawn  # noqa: E402

BENCH = "async_rollout"
TRAIN, ROLL = [0, 1], [2, 3]


def _config(a: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=a["vocab"],
        hidden_size=a["hidden"],
        intermediate_size=a["intermediate"],
        num_hidden_layers=a["layers"],
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def _train_step(model, opt, a: dict, step: int) -> float:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, a["vocab"], (4, 64), generator=g)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, a: dict) -> list[dict]:
    """One rank's rounds; returns this rank's per-(round, wire) observations."""
    from transformers import LlamaForCausalLM

    from verl_ppo.reshard.group_plan import plan_group_sync
    from verl_ppo.reshard.group_sync import SyncReceiver, SyncSender
    from verl_ppo.reshard.layout import ParallelLayout
    from verl_ppo.rollout.tp_generate import tp_generate
    from verl_ppo.rollout.tp_model import TPCausalLM, TPGroup

    ctx = DistContext.from_default_group(a["timeout_s"])
    sync_group = ctx.new_group(list(range(world)))
    tp_pg = ctx.new_group(ROLL)
    dp_pg = ctx.new_group(TRAIN)  # the replicas' gradient all-reduce point
    cfg = _config(a)
    plan = plan_group_sync(
        cfg, ParallelLayout(dp=2), ParallelLayout(tp=2), TRAIN, ROLL, a["bucket_elems"]
    )
    wires = ("full", "delta")
    if rank in TRAIN:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=a["lr"])
        ends = {w: SyncSender(plan, rank, sync_group, w, timeout_s=a["timeout_s"]) for w in wires}
    else:
        ends = {w: SyncReceiver(plan, rank, sync_group, w, timeout_s=a["timeout_s"]) for w in wires}
        tp = TPGroup(tp_pg, 2, ROLL.index(rank), ROLL)
        models = {w: TPCausalLM(cfg, ends[w].live, tp) for w in wires}
        ids = torch.randint(3, a["vocab"], (4, 8), generator=torch.Generator().manual_seed(rank))
    out = []
    for rnd in range(a["rounds"]):
        train_s = None
        for w in wires if rnd % 2 == 0 else wires[::-1]:
            dist.barrier()
            obs = {"round": rnd, "wire": w, "rank": rank}
            if rank in TRAIN:
                if train_s is None:
                    train_s = _train_step(model, opt, a, rnd) if rnd else 0.0
                    # DP replicas leave the step together (DeepSpeed's gradient all-reduce
                    # waits for the slowest); these two share no gradients, so without it
                    # the sync clock started at the first one's end, up to ~0.1 s early
                    dist.barrier(group=dp_pg)
                params = {n: p for n, p in model.named_parameters()}
                st = ends[w].start(params)
                ends[w].finish()
                obs |= {"train_s": train_s, "sent": st.bytes_sent, "started_at": st.started_at}
                obs |= {"encode_s": st.encode_s, "changed": st.changed, "elems": st.elems}
            else:
                ends[w].start()
                t0 = time.perf_counter()
                if a["gen_tokens"]:
                    tp_generate(models[w], ids, torch.ones_like(ids), a["gen_tokens"], False)
                gen_s = time.perf_counter() - t0
                st = ends[w].switch()
                obs |= {"recv": st.bytes_received, "verified": st.verified, "gen_s": gen_s}
                obs |= {"transfer_s": st.transfer_s, "pause_s": st.pause_s, "done_at": st.done_at}
            out.append(obs)
    return out


def _records(per_rank: list[list[dict]], a: dict, meta: dict) -> list[dict]:
    by = {}
    for rows in per_rank:
        for o in rows:
            by.setdefault((o["round"], o["wire"]), {})[o["rank"]] = o
    recs, base = [], {"benchmark": BENCH, **meta}
    for (rnd, w), ranks in sorted(by.items()):
        tr, ro = [ranks[r] for r in TRAIN], [ranks[r] for r in ROLL]
        sent, recv = sum(o["sent"] for o in tr), sum(o["recv"] for o in ro)
        wall = max(o["done_at"] for o in ro) - min(o["started_at"] for o in tr)
        transfer, pause = max(o["transfer_s"] for o in ro), max(o["pause_s"] for o in ro)
        common = base | {
            "round": rnd,
            "wire": w,
            "first_sync": rnd == 0,
            "bytes": recv,
            "wall_s": wall,
            "transfer_s": transfer,
            "pause_s": pause,
            "gen_s": max(o["gen_s"] for o in ro),
            "train_s": tr[0]["train_s"],
            "encode_s": max(o["encode_s"] for o in tr),  # sender start(): cast, count, encode
            "changed_frac": sum(o["changed"] for o in tr) / sum(o["elems"] for o in tr),
            "numerics_ok": sent == recv and all(o["verified"] for o in ro),
        }
        recs.append(common | {"metric": "pause_vs_transfer", "value": pause / transfer})
        if a["link_mbit"]:
            line = recv * 8 / (a["link_mbit"] * 1e6)
            recs.append(
                common | {"metric": "sync_time_vs_line_rate", "value": wall / line, "line_s": line}
            )
        if w == "delta":
            full = sum(by[(rnd, "full")][r]["recv"] for r in ROLL)
            recs.append(common | {"metric": "delta_bytes_vs_full", "value": recv / full})
    for r in recs:
        r["unit"] = "ratio"
    return recs


def markdown(recs: list[dict]) -> str:
    """Summary table (median and range over rounds >= 1) generated from the records."""
    lines = [
        f"# {BENCH}: weight sync between rank groups",
        "",
        "Generated by benchmarks/weight_sync.py from async_rollout.jsonl (sync records). "
        "Targets (issue 31): delta_bytes_vs_full <= 0.2 after the first step; "
        "sync_time_vs_line_rate <= 1.2; pause_vs_transfer <= 0.2.",
        "",
        "| run_id | transport | link Mbit/s | wire | metric | median | min | max | rounds "
        "| changed frac (median) | bytes (median) | numerics |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for r in recs:
        if r.get("benchmark") == BENCH and "wire" in r and not r["first_sync"]:
            key = (r["run_id"], r["transport"], r["link_mbit"], r["wire"], r["metric"])
            groups.setdefault(key, []).append(r)
    for (run, tr, mbit, w, m), rs in groups.items():
        v = [r["value"] for r in rs]
        lines.append(
            f"| {run} | {tr} | {mbit or '-'} | {w} | {m} | {statistics.median(v):.3f} | "
            f"{min(v):.3f} | {max(v):.3f} | {len(v)} | "
            f"{statistics.median(r['changed_frac'] for r in rs):.4f} | "
            f"{int(statistics.median(r['bytes'] for r in rs))} | "
            f"{'ok' if all(r['numerics_ok'] for r in rs) else 'FAILED'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the full vs delta sync rounds (module docstring), append the records and write
    the markdown; returns the exit code (1 when a numerics check failed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 rounds, loopback")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (RL-sized)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--gen-tokens", type=int, default=None)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--link-mbit", type=float, default=None, help="shaped link rate, if any")
    p.add_argument("--transport", default="loopback")
    p.add_argument("--run-id", default=None)
    p.add_argument("--timeout-s", type=float, default=300.0)
    x = p.parse_args(argv)
    hidden = x.hidden or (64 if x.smoke else 256)
    a = {
        "rounds": x.rounds or (3 if x.smoke else 8),
        "lr": x.lr,
        "hidden": hidden,
        "intermediate": hidden * 11 // 4,
        "layers": x.layers or (2 if x.smoke else 4),
        "vocab": x.vocab or (512 if x.smoke else 8192),
        "gen_tokens": x.gen_tokens if x.gen_tokens is not None else (4 if x.smoke else 64),
        "bucket_elems": int(x.bucket_mb * (1 << 20)) // 2,
        "link_mbit": x.link_mbit,
        "timeout_s": x.timeout_s,
    }
    meta = {
        "device": "cpu",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(),
        "run_id": x.run_id or uuid.uuid4().hex[:12],
        "transport": x.transport,
        "world_size": 4,
        "layout": "train DP2 -> rollout TP2 (other ranks)",
        "rollout_dtype": "bf16",
        "smoke": x.smoke,
    } | {k: a[k] for k in a if k != "timeout_s"}
    if "RANK" in os.environ:  # launched per rank (benchmarks/slow_link_sync.sh)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init_distributed("gloo", a["timeout_s"])
        try:
            rows = rank_main(rank, world, a)
            gathered = [None] * world
            dist.all_gather_object(gathered, rows)
        finally:
            dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        gathered = spawn(rank_main, 4, (a,), timeout_s=a["timeout_s"])
    recs = _records(gathered, a, meta)
    out = Path(x.out)
    write_jsonl(recs, out / f"{BENCH}.jsonl", append=True)
    mine = [r for r in read_jsonl(out / f"{BENCH}.jsonl") if "wire" in r]
    (out / f"{BENCH}.md").write_text(markdown(mine))
    bad = [r for r in recs if not r["numerics_ok"]]
    print(markdown(recs))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
