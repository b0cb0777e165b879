"""Async rollout against colocated on one GPU (issue 31, "overlap where it can be measured").

Two processes share the GPU: the training rank and the rollout rank of ``rollout.mode:
async`` (``comm.nproc=1``, ``rollout.n_ranks=1``, ``max_staleness=1``, the default delta wire, decoupled
loss). Two processes, not two CUDA streams in one: that is the shipped async mode
(:mod:`verl_ppo.asyncrl`), unchanged; the GPU interleaves the two processes' kernels (time
slicing, no MPS), so the gain measured is what the shipped code gets. Their bridge groups are
gloo, staged through host memory (NCCL refuses two ranks of one communicator on one GPU:
:func:`verl_ppo.asyncrl.world.placement`); each sync is checksum-verified by the receiver (a
mismatch stops the run). Colocated: one process, generate then train.

Workloads (``benchmarks/ppo_throughput.py``'s shape: random-init Qwen2.5-0.5B, 256-token
prompts, 128 sequences per step, micro-batch 8):

* ``fixed``: 256-token responses (``rollout.ignore_eos``), the benchmark shape;
* ``spread``: EOS forced per prompt at a length uniform in 16..512 (``_overlap_rank.py``,
  ``forced_lengths``; ``max_new_tokens=512``): generation runs to the batch's longest row.

Protocol: per round, the launches colocated/async x fixed/spread in turn (interleaved),
``--rounds`` rounds; each launch: numerics check (the first rollout's log-probs against a
plain HF forward), ``--warmup`` untimed + ``--steps`` timed steps, every metric finite.
``train.torch_compile`` is off in both modes (its compilations would take most of a launch
and their late recompiles land in timed steps; the rollout's CUDA graph stays on, auto).
tokens/s = tokens trained (prompt + response) / wall time of the timed steps on the training
rank. Per workload one record ``metric: tokens_per_s_vs_colocated``: the median of the
per-round ratios async/colocated, with each mode's median tokens/s and the spread (min, max)
of all, appended to ``OUT/async_rollout.jsonl``; ``OUT/async_overlap.md`` from them.

    python benchmarks/gpu/async_overlap.py --out OUT                 # 1 x GPU, ~6 min
    python benchmarks/gpu/async_overlap.py --smoke --out /tmp/x      # CPU, tiny, CI
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from _ppo_workload import SHAPES  # noqa: E402

from verl_comm.bench.env import commit, dirty, now_iso, versions  # noqa: E402
from verl_comm.distributed.launch import run_ranks  # noqa: E402

BENCH = "async_rollout"
WORKLOADS = {"fixed": None, "spread": (16, 512)}
SMOKE_SPREAD = (2, 16)
MODES = ("colocated", "async")


def _launch(a, mode: str, workload: str, rnd: int, raw: Path, run_dir: str) -> int:
    """One launch of ``_overlap_rank.py``; returns its exit status."""
    spread = SMOKE_SPREAD if a.smoke and WORKLOADS[workload] else WORKLOADS[workload]
    cmd = [sys.executable, str(Path(__file__).with_name("_overlap_rank.py")), "--mode", mode]
    cmd += ["--raw", str(raw), "--run-dir", run_dir, "--tag"]
    cmd += [json.dumps({"workload": workload, "round": rnd})]
    cmd += ["--warmup", str(a.warmup), "--steps", str(a.steps), "--shape", a.shape]
    cmd += ["--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len)]
    cmd += ["--rollout-batch", str(a.rollout_batch), "--micro-batch", str(a.micro_batch)]
    cmd += ["--backend", a.backend, "--rollout-dtype", a.rollout_dtype, "--sync-wire", a.sync_wire]
    cmd += ["--torch-compile", a.torch_compile]
    cmd += ["--model-dir", a.model_dir] if a.model_dir else []
    cmd += ["--spread", *map(str, spread)] if spread else []
    print(f"# round {rnd} {mode} {workload}  {time.strftime('%H:%M:%S')}", flush=True)
    # the project's launcher (as verl-ppo train): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set
    res = run_ranks(cmd, 2 if mode == "async" else 1, deadline_s=a.launch_timeout, name=mode)
    if res.message:
        print(f"# round {rnd} {mode} {workload}: {res.message}", flush=True)
    return 0 if res.message is None else 1


def _spread(xs: list[float]) -> list[float]:
    return [min(xs), max(xs)]


def records(raw: list[dict], meta: dict) -> list[dict]:
    """One ``tokens_per_s_vs_colocated`` record per workload with both modes in every
    completed round (ratio per round, median over rounds)."""
    out = []
    for w in WORKLOADS:
        by = {(r["round"], r["mode"]): r for r in raw if r["workload"] == w}
        rounds = sorted({k[0] for k in by if all((k[0], m) in by for m in MODES)})
        if not rounds:
            continue
        tps = {m: [by[(k, m)]["tokens_per_s"] for k in rounds] for m in MODES}
        ratios = [a / c for a, c in zip(tps["async"], tps["colocated"])]
        async_steps = [s for k in rounds for s in by[(k, "async")]["steps"][meta["warmup"] :]]
        out.append(
            {
                **meta,
                "metric": "tokens_per_s_vs_colocated",
                "value": statistics.median(ratios),
                "unit": "ratio",
                "workload": w,
                "response_lengths": by[(rounds[0], "colocated")]["spread"] or meta["response_len"],
                "rounds": len(rounds),
                "ratio_per_round": ratios,
                "ratio_spread": _spread(ratios),
                **{f"{m}_tokens_per_s": statistics.median(tps[m]) for m in MODES},
                **{f"{m}_tokens_per_s_spread": _spread(tps[m]) for m in MODES},
                **{f"{m}_tokens_per_s_per_round": tps[m] for m in MODES},
                "numerics_ok": all(by[(k, m)]["numerics"]["ok"] for k in rounds for m in MODES),
                "async_rollout_wait_s_median": statistics.median(
                    s.get("timing_s/rollout_wait", 0.0) for s in async_steps
                ),
                "async_sync_pause_s_median": statistics.median(
                    s.get("async/sync_pause_s", 0.0) for s in async_steps
                ),
                "async_staleness_max": max(s.get("async/staleness_max", 0) for s in async_steps),
                "raw": [by[(k, m)] for k in rounds for m in MODES],
            }
        )
    return out


def markdown(recs: list[dict]) -> str:
    """``async_overlap.md`` from this run's ``tokens_per_s_vs_colocated`` records."""
    m = recs[0]
    lines = [
        "# Async rollout vs colocated, sharing one device",
        "",
        f"Generated by benchmarks/gpu/async_overlap.py from {BENCH}.jsonl, run `{m['run_id']}`, "
        f"{m['device']}, commit `{m['commit']}`{' (dirty)' if m['dirty'] else ''}, "
        f"{m['date'][:16]}. Shape {m['shape']}, {m['rollout_batch']} sequences x "
        f"{m['prompt_len']}-token prompts; {m['warmup']} warm-up + {m['steps']} timed steps per "
        "launch; async: 1 training + 1 rollout process, max_staleness 1, "
        f"{m['async_overrides']['rollout.sync_wire']} wire, "
        "gloo bridge (host-staged), decoupled loss; both modes: "
        + ", ".join(f"`{k}={v}`" for k, v in m["overrides"].items())
        + ". spread: EOS forced per prompt at a length uniform in the range.",
        "",
        "| workload | responses | rounds | colocated tok/s (min-max) | async tok/s (min-max) | "
        "async / colocated (min-max) | rollout wait s | sync pause s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        c, s = r["colocated_tokens_per_s_spread"], r["async_tokens_per_s_spread"]
        q, lens = r["ratio_spread"], r["response_lengths"]
        lens = f"{lens[0]}-{lens[1]}" if isinstance(lens, (list, tuple)) else lens
        lines.append(
            f"| {r['workload']} | {lens} | {r['rounds']} | "
            f"{r['colocated_tokens_per_s']:.0f} ({c[0]:.0f}-{c[1]:.0f}) | "
            f"{r['async_tokens_per_s']:.0f} ({s[0]:.0f}-{s[1]:.0f}) | "
            f"**{r['value']:.3f}** ({q[0]:.3f}-{q[1]:.3f}) | "
            f"{r['async_rollout_wait_s_median']:.3f} | {r['async_sync_pause_s_median']:.3f} |"
        )
    lines += ["", "Reported whatever it shows (issue 31: no target on one device)."]
    return "\n".join(lines) + "\n"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="CPU (gloo), tiny model, 1 round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--rollout-batch", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--model-dir", default=None, help="config.json + tokenizer folder")
    p.add_argument("--backend", default="auto")
    p.add_argument("--rollout-dtype", default="bfloat16")
    p.add_argument(
        "--sync-wire", choices=("full", "delta"), default="delta",
        help="rollout.sync_wire of the async mode (default: the config's default, delta; the "
        "smoke run's fp32 rollout needs full)",
    )  # fmt: skip
    p.add_argument(
        "--torch-compile", choices=("auto", "on", "off"), default="off",
        help="train.torch_compile of both modes (off: its compilations would take most of a "
        "launch, and their late recompiles land in timed steps; named in the records)",
    )  # fmt: skip
    p.add_argument("--launch-timeout", type=float, default=150.0)
    p.add_argument(
        "--budget-s", type=float, default=420.0,
        help="start a round only if the time so far plus the longest round fits in this",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.smoke:
        a.shape, a.prompt_len, a.response_len, a.rollout_batch, a.micro_batch = "tiny", 8, 4, 4, 2
        a.rounds, a.steps, a.backend, a.rollout_dtype = 1, 1, "gloo", "float32"
        a.sync_wire = "full"  # delta needs a bf16 rollout
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, append the records, write the markdown; 0 when every workload has
    at least one complete round and no launch failed."""
    import torch

    a = _args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else None
    meta = {
        "benchmark": BENCH,
        "device": f"1 x {gpu}" if gpu else f"cpu ({os.cpu_count()} cores), gloo",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "run_id": os.environ.get("VERL_RUN_ID") or uuid.uuid4().hex[:12],
        "smoke": a.smoke,
        **{k: getattr(a, k) for k in ("shape", "prompt_len", "response_len", "rollout_batch")},
        **{k: getattr(a, k) for k in ("micro_batch", "warmup", "steps", "rollout_dtype")},
        "overrides": {"train.torch_compile": a.torch_compile},
        "async_overrides": {
            "rollout.n_ranks": 1,
            "rollout.max_staleness": 1,
            "rollout.sync_wire": a.sync_wire,
            "rollout.dtype": a.rollout_dtype,
            "algorithm.policy_loss": "decoupled",
        },
    }
    t0, failed = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="async_overlap_") as tmp:
        raw = Path(tmp) / "raw.jsonl"
        raw.touch()
        longest = 0.0
        for rnd in range(a.rounds):
            if time.monotonic() - t0 + longest > a.budget_s:
                print(f"# another round would pass --budget-s {a.budget_s:g}: {rnd} round(s)")
                break
            t_round = time.monotonic()
            for w in WORKLOADS:
                for mode in MODES:
                    rd = str(Path(tmp) / f"run_{rnd}_{w}_{mode}")
                    failed += _launch(a, mode, w, rnd, raw, rd) != 0
            longest = max(longest, time.monotonic() - t_round)
        rows = [json.loads(x) for x in raw.read_text().splitlines() if x.strip()]
    recs = records(rows, meta)
    jsonl = out / (f"{BENCH}.smoke.jsonl" if a.smoke else f"{BENCH}.jsonl")
    with open(jsonl, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)
    if recs:
        (out / ("async_overlap.smoke.md" if a.smoke else "async_overlap.md")).write_text(
            markdown(recs)
        )
    for r in recs:
        print(
            f"{r['workload']}: colocated {r['colocated_tokens_per_s']:.0f} tok/s, async "
            f"{r['async_tokens_per_s']:.0f} tok/s, ratio {r['value']:.3f} "
            f"{r['ratio_spread']} over {r['rounds']} round(s)"
        )
    return 0 if len(recs) == len(WORKLOADS) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
