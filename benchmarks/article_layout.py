"""The article's layout end to end: train PP2 x DP on DeepSpeed's pipeline engine, generate TP4.

Runs the PPO main job (``python -m verl_ppo.train``, which launches its own gloo ranks) with
``actor.model_config.hybrid_engine``: training ``pipeline_parallel_size: 2`` (real pipeline
training: each rank holds its stage only), rollout ``tensor_parallel_size: 4`` (a tiny Llama
with 8 heads / 4 KV heads, which TP4 splits), side by side in one run: the resharding engine
and the naive all-gather baseline (``method: naive_allgather``). World 4 is PP2 x DP2 -> TP4;
world 8 is PP2 x DP4 -> TP4 x DP2.

Protocol: ``--repeats`` jobs per method, interleaved (engine, naive, naive, engine, ...: the
order alternates so neither method always runs first); each job runs ``--steps`` steps. Time
figures (reshard, step, throughput, and the step's phases) are the median over every step
after the first of every job (all steps when ``--steps 1``), with min and max beside it.

Correctness is checked before any figure is reported: every run must finish its steps and
the engine must move exactly the planner's lower bound on every rank (the mean over ranks of
bytes / lower bound is 1.0, and bytes never go below the bound), and the bytes counted at the
engine's transport calls (``reshard/bytes_counted_per_rank``,
:class:`verl_ppo.reshard.wire.WireCounter`) must equal the planned bytes. Records (one per
metric, sharing a ``run_id``) are appended to ``<out>/article_layout.jsonl``; the markdown
table is generated from the newest run of each world size.

    python benchmarks/article_layout.py --world 4 --steps 3     # CPU, 4 gloo processes, 5 repeats
    python benchmarks/article_layout.py --world 8 --steps 3     # CPU, 8 gloo processes, 5 repeats
    python benchmarks/article_layout.py --smoke                 # CI: world 4, 1 step, 1 repeat

GPUs (issue 22; needs several GPUs, not run here)::

    torchrun --nproc_per_node=4 -m verl_ppo.train --config configs/tiny.yaml \\
      actor.model_config.hybrid_engine.enable=true \\
      actor.model_config.hybrid_engine.training_sharding.pipeline_parallel_size=2 \\
      actor.model_config.hybrid_engine.rollout_sharding.tensor_parallel_size=4

Wall-clock figures on the shared 2-core CPU are disturbed by other processes; the byte and
memory figures are exact.
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
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "{hidden_size: 128, intermediate_size: 256, num_hidden_layers: 4, "
    "num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: 512, "
    "tie_word_embeddings: false}"
)
METHODS = ("engine", "naive_allgather")
HE = "actor.model_config.hybrid_engine"
KEYS = {  # record metric -> (logged key, unit)
    "bytes_per_rank": ("reshard/bytes_per_rank", "bytes"),
    "bytes_counted_per_rank": ("reshard/bytes_counted_per_rank", "bytes"),
    "lower_bound_bytes": ("reshard/lower_bound_bytes", "bytes"),
    "bytes_over_lower_bound": ("reshard/bytes_over_lower_bound", "ratio"),
    "reshard_time": ("reshard/enter_s", "s"),
    "reshard_wire_and_copy_time": ("reshard/wire_and_copy_s", "s"),
    "peak_param_bytes_per_rank": ("memory/actor_param_bytes_per_rank_max", "bytes"),
    "peak_param_bytes_generating": ("memory/actor_param_bytes_generating_max", "bytes"),
    "peak_param_vs_full_over_pp": ("memory/actor_param_vs_full_over_pp_max", "ratio"),
    "full_param_bytes": ("memory/policy_full_param_bytes", "bytes"),
    "step_time": ("timing_s/step", "s"),
    "throughput": ("perf/throughput_tokens_per_s_per_gpu", "tokens/s/rank"),
}
TIMED = ("reshard_time", "reshard_wire_and_copy_time", "step_time", "throughput")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
        return out.stdout.decode().strip() or "unknown"
    except OSError:
        return "unknown"


def run_one(method: str, world: int, steps: int, run_dir: Path) -> list[dict]:
    """Run the job with ``method``; return every step's metrics (raises on failure)."""
    args = [
        sys.executable,
        "-m",
        "verl_ppo.train",
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"run_dir={run_dir}",
        f"comm.nproc={world}",
        f"model.tiny={TINY}",
        f"train.num_steps={steps}",
        f"train.rollout_batch_size={2 * world}",
        f"train.ppo_mini_batch_size={2 * world}",
        "train.micro_batch_size=2",
        "data.eval_size=0",
        "train.resume=never",
        "actor.zero_stage=1",
        "critic.zero_stage=1",
        f"{HE}.enable=true",
        f"{HE}.rollout_sharding.tensor_parallel_size=4",
        f"{HE}.training_sharding.pipeline_parallel_size=2",
        f"{HE}.method={method}",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=2400)
    if r.returncode != 0:
        raise RuntimeError(f"{method}: job failed:\n{r.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps_m = [json.loads(x) for x in lines if "reward/mean" in x]
    if len(steps_m) != steps:
        raise RuntimeError(f"{method}: {len(steps_m)} steps logged, expected {steps}")
    return steps_m


def _spread(rec: dict | None, digits: int) -> str:
    """``median [min-max]`` of a timed record (a single value for older records)."""
    if not rec or rec.get("value") is None:
        return "n/a"
    if "min" not in rec:
        return f"{rec['value']:.{digits}f}"
    return f"{rec['value']:.{digits}f} [{rec['min']:.{digits}f}-{rec['max']:.{digits}f}]"


def summarize(jobs: list[list[dict]]) -> dict[str, dict]:
    """Per metric of :data:`KEYS`, the record fields from one method's jobs.

    Timed metrics: median, min, max and the samples over every step after the first of
    every job (every step when jobs ran one step), plus, for ``step_time``, the median of
    each ``timing_s/<phase>``. Others (bytes, memory): the last step of the last job.
    """
    skip = 1 if len(jobs[0]) > 1 else 0
    steps = [m for hist in jobs for m in hist[skip:]]
    out = {}
    for metric, (k, unit) in KEYS.items():
        if metric in TIMED:
            xs = [m[k] for m in steps if m.get(k) is not None]
            out[metric] = {"unit": unit, "value": statistics.median(xs) if xs else None}
            if xs:
                out[metric].update(min=min(xs), max=max(xs), samples=xs)
        else:
            out[metric] = {"unit": unit, "value": jobs[-1][-1].get(k)}
    phases = sorted({k for m in steps for k in m if k.startswith("timing_s/")} - {"timing_s/step"})
    out["step_time"]["phases_s"] = {
        p.removeprefix("timing_s/"): statistics.median(m.get(p, 0.0) for m in steps) for p in phases
    }
    return out


def check(rows: dict[str, list[list[dict]]]) -> list[str]:
    """Byte checks over every step of every job: no method below the lower bound; the
    engine exactly at it, and its counted bytes equal to its planned bytes."""
    bad = []
    for meth, jobs in rows.items():
        for j, hist in enumerate(jobs):
            for i, m in enumerate(hist):
                at = f"{meth} job {j + 1} step {i + 1}"
                if m["reshard/bytes_per_rank"] < m["reshard/lower_bound_bytes"]:
                    bad.append(f"{at}: below the lower bound (impossible)")
                if meth != "engine":
                    continue
                if abs(m["reshard/bytes_over_lower_bound"] - 1.0) > 1e-12:
                    bad.append(f"{at}: bytes/lower bound {m['reshard/bytes_over_lower_bound']}")
                # means over ranks of per-rank integers, equal per rank: bit-equal means
                if m.get("reshard/bytes_counted_per_rank") != m["reshard/bytes_per_rank"]:
                    bad.append(
                        f"{at}: counted {m.get('reshard/bytes_counted_per_rank')} != planned "
                        f"{m['reshard/bytes_per_rank']}"
                    )
    return bad


def render(records: list[dict]) -> str:
    """Markdown from the newest pipeline run of each world size in ``records``."""
    runs: dict[int, str] = {}
    for r in records:
        if r.get("train_engine") == "deepspeed_pipeline":
            runs[r["world_size"]] = r["run_id"]  # later lines are newer
    lines = [
        "# article layout on CPU: PP2 x DP training on DeepSpeed's pipeline engine -> TP4 rollout",
        "",
        "Generated by `benchmarks/article_layout.py` from `article_layout.jsonl` (newest run per "
        "world size). Byte and memory figures of the last step; bytes are per rank (mean over ranks; the "
        "bytes/lower bound column is the mean of per-rank ratios, 1.0 = every rank at its "
        "bound); peak parameter bytes are the largest rank's. Wall-clock times are from a "
        "shared 2-core CPU and noisy. Older records without `train_engine` came from the "
        "emulated training layout (full weights sliced) and are not shown. Times: median "
        "[min-max] over the steps of the interleaved repeats (records with `repeats`; older "
        "ones are a single sample). bytes counted: at the engine's transport calls "
        "(verl_ppo/reshard/wire.py); the naive method is not counted.",
        "",
        "| world | train | rollout | method | repeats x steps | bytes/rank | bytes counted | "
        "lower bound | bytes/bound | reshard s | step s | naive reshard s | peak param B/rank "
        "| full/PP B | peak/(full/PP) | peak while generating B | step phases s (median) |",
        "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for world in sorted(runs):
        rid = runs[world]
        by = {}
        for r in records:
            if r.get("run_id") == rid:
                by.setdefault(r["method"], {})[r["metric"]] = r
        naive_t = by.get("naive_allgather", {}).get("reshard_time", {}).get("value")
        for meth, ms in by.items():
            meta = next(iter(ms.values()))

            def v(k, fmt="{:.0f}", ms=ms):
                x = ms.get(k, {}).get("value")
                return "n/a" if x is None else fmt.format(x)

            full_pp = ms["full_param_bytes"]["value"] / meta["pp"]
            phases = ms.get("step_time", {}).get("phases_s") or {}
            lines.append(
                f"| {world} | PP{meta['pp']}xDP{meta['dp']} | TP{meta['tp']}xDP{world // meta['tp']} "
                f"| {meth} | {meta.get('repeats', 1)} x {meta['steps']} | {v('bytes_per_rank')} | "
                f"{v('bytes_counted_per_rank')} | {v('lower_bound_bytes')} | "
                f"{v('bytes_over_lower_bound', '{:.3f}')} | {_spread(ms.get('reshard_time'), 3)} | "
                f"{_spread(ms.get('step_time'), 2)} | "
                f"{'n/a' if naive_t is None else f'{naive_t:.3f}'} | "
                f"{v('peak_param_bytes_per_rank')} | {full_pp:.0f} | "
                f"{v('peak_param_vs_full_over_pp', '{:.3f}')} | "
                f"{v('peak_param_bytes_generating')} | "
                + (", ".join(f"{k} {x:.2f}" for k, x in phases.items()) or "n/a")
                + " |"
            )
    lines += [
        "",
        "Target peak/(full/PP) <= 1.15 during training (untied embeddings: the last stage holds "
        "lm_head, the first the embedding).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run both methods, check bytes, append JSONL, regenerate markdown; returns exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--repeats", type=int, default=5, help="jobs per method, interleaved")
    p.add_argument("--smoke", action="store_true", help="world 4, 1 step, 1 repeat (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.world, a.steps, a.repeats = 4, 1, 1
    if a.world % 4:
        p.error("--world must be a multiple of 4 (rollout TP=4)")
    import deepspeed
    import torch

    from verl_comm.bench.env import dirty

    pp, dp, tp = 2, a.world // 2, 4
    meta = {
        "benchmark": "article_layout",
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo",
        "versions": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "python": platform.python_version(),
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "dirty": dirty(REPO),
        "run_id": uuid.uuid4().hex[:12],
        "world_size": a.world,
        "train_engine": "deepspeed_pipeline",
        "pp": pp,
        "dp": dp,
        "tp": tp,
        "zero_stage": 1,
        "train_layout": f"PP{pp}xDP{dp}",
        "rollout_layout": f"TP{tp}xDP{a.world // tp}",
        "model": f"tiny llama {TINY}",
        "steps": a.steps,
        "repeats": a.repeats,
    }
    rows: dict[str, list[list[dict]]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.repeats):  # interleaved; the order alternates
            for method in METHODS if rep % 2 == 0 else METHODS[::-1]:
                rows[method].append(run_one(method, a.world, a.steps, Path(tmp) / f"{method}{rep}"))
    bad = check(rows)
    if bad:
        print("numerics check failed:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "article_layout.smoke" if a.smoke else "article_layout"
    path = out / f"{stem}.jsonl"
    with open(path, "a") as f:
        for meth, jobs in rows.items():
            for metric, fields in summarize(jobs).items():
                if metric == "bytes_counted_per_rank" and fields["value"] is None:
                    continue  # the naive method is not counted
                f.write(json.dumps({**meta, "method": meth, "metric": metric, **fields}) + "\n")
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    md = render(records)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
