"""Resharding: planned engine vs naive all-gather-then-slice, per layout pair.

Methods, side by side in the same processes: ``engine`` (verl_ppo.reshard planned
transfers, bucketed ``all_to_all_single`` with double buffering), ``engine_p2p`` (the same
plan over batched ``isend/irecv``) and
``naive_allgather`` (all-gather every parameter within the training model-parallel
group, then slice: DeepSpeed-Chat's hybrid engine / verl's FSDP path).

Model: random weights (seeded, identical on every rank) of a Qwen2.5-0.5B-shaped model
(24 layers, hidden 896, 14 heads / 2 KV heads, FFN 4864, vocab 151936, tied; ~494 M
parameters, bf16 on GPU) or, with ``--smoke``, a small Qwen2-shaped model in fp32 on CPU.
Each rank slices its training shards from the full weights (PP stages, TP slices, ZeRO-3
flat partitions, as :mod:`verl_ppo.reshard.specs` defines them).

Protocol: numerics first (each method's rollout shards must equal slicing the full
model bit for bit on every rank, else exit 1); then ``--warmup`` rounds and ``--rounds``
rounds with the methods interleaved; per call a barrier, CUDA events (perf_counter on
CPU), the max across ranks per round, the median over rounds (min and max beside it).
Bytes per rank: payload received from other ranks (max over ranks) as planned (the plan's
transfer sizes) and as counted at the transport calls (``bytes_counted_per_rank``:
:class:`verl_ppo.reshard.wire.WireCounter`, per peer, every sender's count compared with
its receiver's); lower bound: rollout bytes a rank does not already hold. Exit 1 unless
counted == planned == lower bound for the engine methods. Peak extra bytes: on GPU
``max_memory_allocated`` above the level before the call (includes the rollout shard);
on CPU the executor's own accounting (buffers + rollout shard).

Output: ``<out>/reshard.jsonl`` (one record per (pair, method)) and ``<out>/reshard.md``.

Usage::

    python benchmarks/reshard.py --out DIR                   # 2 GPUs, NCCL (< 3 min)
    python benchmarks/reshard.py --smoke --out /tmp/r        # CPU gloo, 2 processes
    python benchmarks/reshard.py --device cpu --world 4      # CPU gloo, 4 or 8 processes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing (GPU machine)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _ppo_workload (model shapes)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _ppo_workload import SHAPES  # noqa: E402

from verl_comm.bench.env import dirty  # noqa: E402
from verl_comm.distributed import DistContext  # noqa: E402
from verl_comm.distributed.launch import spawn  # noqa: E402
from verl_ppo.reshard.engine import ReshardEngine  # noqa: E402
from verl_ppo.reshard.layout import ParallelLayout  # noqa: E402
from verl_ppo.reshard.testing import (  # noqa: E402
    emulated_train_shards,
    expected_rollout,
    random_full_state,
)
from verl_ppo.reshard.wire import pairwise_mismatches  # noqa: E402

BENCH = "reshard"
METHODS = ("engine", "engine_p2p", "naive_allgather")
_ENGINE_ARGS = {
    "engine": {"method": "engine", "transport": "all_to_all"},
    "engine_p2p": {"method": "engine", "transport": "p2p"},
    "naive_allgather": {"method": "naive_allgather"},
}


def qwen25_05b() -> SimpleNamespace:
    """Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), as the PPO benchmarks use it."""
    shape = SHAPES["qwen05b"]
    return SimpleNamespace(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"])


def small_qwen(world: int) -> SimpleNamespace:
    """Small Qwen2 shape for CPU: 16 heads / 8 KV heads allow TP 1-8."""
    return SimpleNamespace(
        model_type="qwen2",
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        intermediate_size=256,
        vocab_size=1024,
        tie_word_embeddings=True,
    )


def pairs_for(world: int) -> list[tuple[ParallelLayout, ParallelLayout]]:
    """Layout pairs measured at each world size."""
    L = ParallelLayout
    if world == 2:
        return [(L(pp=2), L(tp=2)), (L(dp=2, zero_stage=3), L(tp=2)), (L(dp=2), L(tp=2))]
    if world == 4:
        return [
            (L(pp=2, dp=2), L(tp=4)),
            (L(dp=4, zero_stage=3), L(tp=2, dp=2)),
            (L(tp=2, dp=2), L(tp=4)),
        ]
    if world == 8:
        return [
            (L(tp=4, dp=2), L(tp=2, dp=4)),
            (L(pp=2, dp=2, tp=2), L(tp=4, dp=2)),
            (L(dp=8, zero_stage=3), L(tp=4, dp=2)),
        ]
    raise ValueError(f"--world must be 2, 4 or 8, got {world}")


def bench_worker(rank: int, world: int, opts: dict) -> list[dict]:
    """One rank: numerics check, then interleaved timing of both methods per pair."""
    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = qwen25_05b() if opts["model"] == "qwen2.5-0.5b" else small_qwen(world)
    out = []
    full = None
    ctx = DistContext.from_default_group(opts.get("timeout_s", 600.0))
    for train, roll in pairs_for(world):
        engines = {
            m: ReshardEngine(
                cfg, train, roll, bucket_bytes=opts["bucket_mb"] << 20, ctx=ctx, **_ENGINE_ARGS[m]
            )
            for m in METHODS
        }
        plan = engines["engine"].plan
        if full is None:
            full = random_full_state(plan.specs, seed=0, dtype=dtype, device=device)
        model_bytes = sum(t.numel() * t.element_size() for t in full.values())
        shards = emulated_train_shards(plan, rank, full)
        pair = f"{train.describe()}->{roll.describe()} rank {rank}"
        _check_numerics(engines, shards, expected_rollout(plan, rank, full), pair)
        times, peaks, phases, stats = _time_methods(engines, shards, opts, device)
        for m in METHODS:
            row = _method_row(stats[m], times[m], peaks[m], phases[m], model_bytes, device)
            out.append(
                {
                    "method": m,
                    "train_layout": train.describe(),
                    "rollout_layout": roll.describe(),
                    "rollout_rank_order": list(engines[m].plan.rollout.rank_order or range(world)),
                    **row,
                    "numerics_ok": True,
                }
            )
        del shards, engines
    return out


def _check_numerics(engines: dict, shards: dict, expected: dict, pair: str) -> None:
    """Every method's rollout shards equal the ones sliced from full weights (bit for bit:
    a reshard only moves bytes, no arithmetic, so equality holds on any CPU)."""
    for m, eng in engines.items():
        got = eng.reshard(shards)
        bad = [k for k in expected if k not in got or not torch.equal(got[k], expected[k])]
        if bad:
            raise RuntimeError(f"{m} {pair}: {len(bad)} wrong shards, e.g. {bad[:3]}")
        del got


def _timed_reshard(eng: ReshardEngine, shards: dict, device: torch.device) -> tuple[float, int]:
    """One reshard: seconds (CUDA events on GPU) and peak extra bytes (measured on GPU, the
    executor's own count on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        got = eng.reshard(shards)
        ev1.record()
        torch.cuda.synchronize(device)
        del got
        return ev0.elapsed_time(ev1) / 1e3, torch.cuda.max_memory_allocated(device) - base
    t0 = time.perf_counter()
    got = eng.reshard(shards)
    dt = time.perf_counter() - t0
    del got
    return dt, eng.last_stats.peak_extra_bytes


def _time_methods(engines: dict, shards: dict, opts: dict, device: torch.device):
    """Warm-up then timed rounds, methods interleaved in each round; per method the times
    (the slowest rank's), the peak extra bytes, the (pack, wire, unpack) seconds of each
    timed round, and the last :class:`ReshardStats`."""
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    peaks: dict[str, int] = {m: 0 for m in METHODS}
    phases: dict[str, list[tuple]] = {m: [] for m in METHODS}  # (pack, wire, unpack) s
    stats = {}
    for i in range(opts["warmup"] + opts["rounds"]):
        for m, eng in engines.items():
            dist.barrier()
            dt, peak = _timed_reshard(eng, shards, device)
            t = torch.tensor([dt], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= opts["warmup"]:
                times[m].append(t.item())
                ls = eng.last_stats
                phases[m].append((ls.pack_s, ls.wire_s, ls.unpack_s))
            peaks[m] = max(peaks[m], peak)
            stats[m] = eng.last_stats
    return times, peaks, phases, stats


def _method_row(
    s, times: list[float], peak: int, phases: list[tuple], model_bytes: int, device
) -> dict:
    """One method's record fields: median/min/max time and, the largest over the ranks,
    bytes moved, lower bound, peak, counted bytes and phase split (collective)."""
    counted = s.counted_received is not None  # the engine counts at its calls
    pairwise = (
        pairwise_mismatches(s.counted_sent_per_peer, s.counted_received_per_peer, device=device)
        if counted
        else None
    )
    vals = torch.tensor(
        [
            s.bytes_received,
            s.lower_bound_bytes,
            peak,
            s.bytes_sent,
            s.counted_received if counted else -1,
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(vals, op=dist.ReduceOp.MAX)
    split = {"pack_s": None, "wire_s": None, "unpack_s": None}
    if phases and phases[0][0] is not None:  # the engine measures its phases
        med = [statistics.median(x[k] for x in phases) for k in range(3)]
        pw = torch.tensor(med, dtype=torch.float64, device=device)
        dist.all_reduce(pw, op=dist.ReduceOp.MAX)  # the slowest rank's, as time_s
        split = dict(zip(split, pw.tolist()))
    return {
        "time_s": statistics.median(times),
        "time_min_s": min(times),
        "time_max_s": max(times),
        "repeats": len(times),
        "bytes_per_rank": int(vals[0].item()),
        "lower_bound_bytes": int(vals[1].item()),
        "peak_extra_bytes": int(vals[2].item()),
        "bytes_sent_per_rank": int(vals[3].item()),
        "bytes_counted_per_rank": int(vals[4].item()) if counted else None,
        "counts_pairwise_mismatches": pairwise,
        "model_bytes": model_bytes,
        "buckets": s.buckets,
        **split,
    }


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.cuda.is_available():
        v["cuda"] = torch.version.cuda
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            pass
    return v


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except Exception:  # noqa: BLE001
        return "unknown"


def write_results(
    recs: list[dict], out: Path, meta: dict, stem: str = BENCH, append: bool = False
) -> None:
    """Write ``<stem>.jsonl`` and ``<stem>.md`` into ``out`` (``append``: add to them)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.jsonl", "a" if append else "w") as f:
        for r in recs:
            rec = {
                "benchmark": BENCH,
                "metric": "time_s",
                "value": r["time_s"],
                "unit": "s",
                **meta,
                **r,
            }
            f.write(json.dumps(rec) + "\n")
            if r.get("bytes_counted_per_rank") is not None:
                f.write(json.dumps({**rec, **_counted_record(r)}) + "\n")
    by = {(r["train_layout"], r["rollout_layout"], r["method"]): r for r in recs}
    lines = [
        f"# reshard ({meta['device']}, {meta['model']}, {meta['dtype']}, world {meta['world_size']}, "
        f"bucket {meta['bucket_mb']} MiB, {meta['date']}, commit {meta['commit']})",
        "",
        "| train -> rollout | method | time (ms), median [min-max] | pack / wire / unpack (ms) "
        "| MB/rank planned | MB/rank counted | lower bound MB | model MB | peak extra MB "
        "| time vs naive |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def split(r: dict) -> str:
        if r.get("wire_s") is None:
            return "-"
        return " / ".join(f"{r[k] * 1e3:.2f}" for k in ("pack_s", "wire_s", "unpack_s"))

    for r in recs:
        naive = by[(r["train_layout"], r["rollout_layout"], "naive_allgather")]["time_s"]
        ratio = r["time_s"] / naive if naive > 0 else float("nan")
        lines.append(
            f"| {r['train_layout']} -> {r['rollout_layout']} | {r['method']} | {_spread(r)} | "
            f"{split(r)} | {r['bytes_per_rank'] / 1e6:.2f} | {_mb(r.get('bytes_counted_per_rank'))} | "
            f"{r['lower_bound_bytes'] / 1e6:.2f} | "
            f"{r['model_bytes'] / 1e6:.1f} | {r['peak_extra_bytes'] / 1e6:.1f} | {ratio:.2f} |"
        )
    lines += [
        "",
        f"Each time: {meta['rounds']} rounds, methods interleaved within a round, slowest rank "
        "per round. MB/rank counted: bytes handed to the backend per peer "
        "(verl_ppo/reshard/wire.py), each send matched with its receive; '-' for the naive "
        "method (not counted).",
        "Targets: engine bytes counted == planned == lower_bound_bytes for every pair; engine time <= 0.4 x "
        "naive where the lower bound is below half the model, never slower otherwise.",
        "pack / wire / unpack: ReshardStats of the engine (median over rounds, slowest rank): "
        "copies into the send buffers, time with a bucket on the wire (overlapping buckets "
        "counted once), copies out of the receive buffers; each at most the wall time.",
    ]
    text = "\n".join(lines) + "\n"
    md = out / f"{stem}.md"
    if append and md.exists():
        text = md.read_text() + "\n" + text
    md.write_text(text)


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 1e6:.2f}"


def _spread(r: dict) -> str:
    """``median [min-max]`` in ms (records before the spread was kept: the median only)."""
    if "time_max_s" not in r:
        return f"{r['time_s'] * 1e3:.2f}"
    return f"{r['time_s'] * 1e3:.2f} [{r['time_min_s'] * 1e3:.2f}-{r['time_max_s'] * 1e3:.2f}]"


def _counted_record(r: dict) -> dict:
    """The fields of the ``bytes_counted_per_rank`` record that sits beside a time record."""
    return {
        "metric": "bytes_counted_per_rank",
        "value": r["bytes_counted_per_rank"],
        "unit": "B",
        "bytes_planned_per_rank": r["bytes_per_rank"],
    }


def check_targets(recs: list[dict]) -> list[str]:
    """Violations of the byte target (a hard failure: a planner, executor or transport bug):
    for the engine methods, bytes counted at the transport calls == planned == lower bound,
    and every rank's sent count equals its peer's received count."""
    bad = []
    for r in recs:
        if not r["method"].startswith("engine"):
            continue
        pair = f"{r['train_layout']}->{r['rollout_layout']} {r['method']}"
        counted, planned, lower = (
            r.get("bytes_counted_per_rank"),
            r["bytes_per_rank"],
            r["lower_bound_bytes"],
        )
        if not counted == planned == lower:
            bad.append(f"{pair}: counted {counted} / planned {planned} / lower bound {lower} B")
        if r.get("counts_pairwise_mismatches"):
            bad.append(f"{pair}: {r['counts_pairwise_mismatches']}")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Run the reshard benchmark (see the module docstring); returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="CPU gloo, 2 processes, small model")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--world", type=int, default=2, help="processes: 2 (GPU), 2/4/8 (CPU)")
    p.add_argument("--model", choices=("qwen2.5-0.5b", "small"), default=None)
    p.add_argument("--bucket-mb", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--commit", default=None)
    p.add_argument("--stem", default=BENCH, help="output file stem (e.g. reshard.cpu)")
    p.add_argument("--append", action="store_true", help="append to existing output files")
    a = p.parse_args(argv)
    device = a.device or ("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if device == "cuda" and torch.cuda.device_count() < a.world:
        raise SystemExit(
            f"--world {a.world} needs {a.world} GPUs, found {torch.cuda.device_count()}"
        )
    opts = {
        "device": device,
        "model": a.model or ("small" if a.smoke or device == "cpu" else "qwen2.5-0.5b"),
        "bucket_mb": a.bucket_mb or (1 if device == "cpu" else 64),
        "rounds": a.rounds or (5 if a.smoke else 10),
        "warmup": a.warmup if a.warmup is not None else (1 if a.smoke else 3),
    }
    t0 = time.time()
    per_rank = spawn(
        f"{os.path.abspath(__file__)}:bench_worker",
        a.world,
        (opts,),
        timeout_s=550,
        backend="nccl" if device == "cuda" else "gloo",
    )
    recs = per_rank[0]
    dev = torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    meta = {
        "device": f"{a.world}x {dev}" if device == "cuda" else dev,
        "world_size": a.world,
        "model": opts["model"],
        "dtype": "bf16" if device == "cuda" else "fp32",
        "bucket_mb": opts["bucket_mb"],
        "rounds": opts["rounds"],
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(a.commit),
        "dirty": dirty(REPO),
    }
    write_results(recs, Path(a.out), meta, a.stem, a.append)
    print((Path(a.out) / f"{a.stem}.md").read_text())
    print(f"total {time.time() - t0:.1f} s")
    bad = check_targets(recs)
    if bad:
        print("BYTE TARGET VIOLATED:", *bad, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
