"""The article's layout end to end: rollout TP=4, training PP=2 x DP (issue 10).

Runs the PPO main job (``python -m verl_ppo.train``, which launches its own gloo ranks) with
``actor.model_config.hybrid_engine`` = rollout TP4 from training PP2 x DP(world/2), side by
side: the resharding engine, the naive all-gather baseline, and the engine with
``gradient_compression: int8``. Correctness is checked before any figure is reported: the
engine must move exactly the planner's lower bound of bytes per rank, and every run must
finish its steps. Records go to ``<out>/article_layout.jsonl`` plus a markdown table.

    python benchmarks/article_layout.py --world 8 --steps 3        # CPU, 8 gloo processes
    python benchmarks/article_layout.py --smoke                    # CI: world 4, 1 step
On GPUs the same job runs under ``torchrun --nproc_per_node=8 -m verl_ppo.train``; 4 and 8
GPU machines were not available (issue 10), so this script records the CPU run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = (
    "{hidden_size: 128, intermediate_size: 256, num_hidden_layers: 4, "
    "num_attention_heads: 8, num_key_value_heads: 4, max_position_embeddings: 512}"
)
METHODS = {
    "engine": ["actor.model_config.hybrid_engine.method=engine"],
    "naive_allgather": ["actor.model_config.hybrid_engine.method=naive_allgather"],
    "engine_int8": ["actor.model_config.hybrid_engine.method=engine", "gradient_compression=int8"],
}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
        return out.stdout.decode().strip() or "unknown"
    except OSError:
        return "unknown"


def run_one(method: str, world: int, steps: int, run_dir: Path) -> dict:
    """Run the job with ``method``; return the last step's metrics (raises on failure)."""
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
        "actor.model_config.hybrid_engine.enable=true",
        "actor.model_config.hybrid_engine.rollout_sharding.tensor_parallel_size=4",
        "actor.model_config.hybrid_engine.training_sharding.pipeline_parallel_size=2",
        f"actor.model_config.hybrid_engine.training_sharding.data_parallel_size={world // 2}",
        *METHODS[method],
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    if r.returncode != 0:
        raise RuntimeError(f"{method}: job failed:\n{r.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps_m = [json.loads(x) for x in lines if "reward/mean" in x]
    if len(steps_m) != steps:
        raise RuntimeError(f"{method}: {len(steps_m)} steps logged, expected {steps}")
    return steps_m[-1]


def main(argv: list[str] | None = None) -> int:
    """Run every method, check bytes, write JSONL + markdown; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="world 4, 1 step (CI)")
    a = p.parse_args(argv)
    if a.smoke:
        a.world, a.steps = 4, 1
    if a.world % 4:
        p.error("--world must be a multiple of 4 (rollout TP=4)")
    import torch

    meta = {
        "benchmark": "article_layout",
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), gloo",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "world_size": a.world,
        "train_layout": f"PP2xDP{a.world // 2}",
        "rollout_layout": f"TP4xDP{a.world // 4}",
        "model": f"tiny llama {TINY}",
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            m = run_one(method, a.world, a.steps, Path(tmp) / method)
            rows.append((method, m))
    bad = [
        meth
        for meth, m in rows
        if meth.startswith("engine")
        and m["reshard/bytes_per_rank"] != m["reshard/lower_bound_bytes"]
    ]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = {
        "reshard_bytes_per_rank": ("reshard/bytes_per_rank", "bytes"),
        "lower_bound_bytes": ("reshard/lower_bound_bytes", "bytes"),
        "reshard_time": ("timing_s/reshard", "s"),
        "peak_extra_bytes": ("reshard/peak_extra_bytes", "bytes"),
        "step_time": ("timing_s/step", "s"),
        "throughput": ("perf/throughput_tokens_per_s_per_gpu", "tokens/s/rank"),
    }
    stem = "article_layout.smoke" if a.smoke else "article_layout"
    with open(out / f"{stem}.jsonl", "w") as f:
        for meth, m in rows:
            for metric, (k, unit) in keys.items():
                rec = {**meta, "method": meth, "metric": metric, "value": m.get(k), "unit": unit}
                f.write(json.dumps(rec) + "\n")
    lines = [
        f"# article layout on CPU: training {meta['train_layout']} -> rollout {meta['rollout_layout']}",
        "",
        f"{meta['device']}, torch {torch.__version__}, {meta['model']}, {a.steps} steps, "
        f"commit {meta['commit']}, {meta['date']}. Last step's figures.",
        "",
        "| method | bytes/rank | lower bound | reshard s | step s | tokens/s/rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for meth, m in rows:
        lines.append(
            f"| {meth} | {m['reshard/bytes_per_rank']:.0f} | {m['reshard/lower_bound_bytes']:.0f} | "
            f"{m['timing_s/reshard']:.3f} | {m['timing_s/step']:.2f} | "
            f"{m['perf/throughput_tokens_per_s_per_gpu']:.1f} |"
        )
    lines.append("")
    lines.append("engine bytes == lower bound: " + ("no: " + ", ".join(bad) if bad else "yes"))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
