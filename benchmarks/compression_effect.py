"""Does gradient compression hurt learning? The real SmolLM2 PPO job, `none` vs `int8`.

Runs the main job (``python -m verl_ppo.train``, 2 gloo ranks) with ``configs/long_grpo.yaml``
shortened to ``--steps`` steps, for each (gradient_compression, seed) pair, and records the
held-out eval reward at the start and at the end. Seed-to-seed noise is measured as the
spread of the uncompressed runs over the seeds; the compressed run "does not learn worse"
when its end eval reward is within that spread of the uncompressed mean. Numerics: every run
must finish its steps with finite metrics. Records: ``<out>/compression_effect.jsonl`` + md.

    python benchmarks/compression_effect.py --steps 12 --seeds 0 1     # CPU, ~10 minutes
    python benchmarks/compression_effect.py --smoke                    # CI: tiny model, 2 steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(compression: str, seed: int, steps: int, run_dir: Path, smoke: bool) -> dict:
    """One job; returns {"eval_start", "eval_end", "reward_mean_last", ...}."""
    cfg = "tiny.yaml" if smoke else "long_grpo.yaml"
    args = [
        sys.executable,
        "-m",
        "verl_ppo.train",
        "--config",
        str(REPO / "configs" / cfg),
        f"run_dir={run_dir}",
        f"seed={seed}",
        f"train.num_steps={steps}",
        "train.eval_interval=0",
        "train.save_interval=0",
        "train.resume=never",
        f"gradient_compression={compression}",
    ]
    if smoke:  # one step: compress from the first gradient reduction on
        args += ["compression.start_iter=1", "data.eval_size=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    if r.returncode != 0:
        raise RuntimeError(f"{compression} seed {seed} failed:\n{r.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [x for x in recs if "eval/reward" in x]
    steps_m = [x for x in recs if "reward/mean" in x]
    if len(steps_m) != steps or not all(math.isfinite(x["actor/pg_loss"]) for x in steps_m):
        raise RuntimeError(f"{compression} seed {seed}: incomplete or non-finite run")
    last = steps_m[-1]
    return {
        "eval_start": evals[0]["eval/reward"],
        "eval_end": evals[-1]["eval/reward"],
        "reward_mean_last": last["reward/mean"],
        "compression_ratio": last.get("comm/actor/compression_ratio", 1.0),
        "step_time_s": last["timing_s/step"],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the grid, write records and a table; exit 1 if the compressed run learns worse."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.seeds = 2, [0]
    import torch

    from verl_comm.bench.env import commit, dirty, now_iso, versions

    meta = {
        "benchmark": "compression_effect",
        "device": f"cpu ({os.cpu_count()} cores), 2 gloo ranks",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "model": "tiny" if a.smoke else "SmolLM2-135M-Instruct",
        "task": "configs/long_grpo.yaml (basic_arithmetic, 1 digit, GRPO n=4)",
        "steps": a.steps,
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        grid = [("none", s) for s in a.seeds] + [("int8", a.seeds[0])]
        for comp, seed in grid:
            results[(comp, seed)] = run(comp, seed, a.steps, Path(tmp) / f"{comp}-{seed}", a.smoke)
    base = [results[("none", s)]["eval_end"] for s in a.seeds]
    mean = sum(base) / len(base)
    noise = max(base) - min(base)
    got = results[("int8", a.seeds[0])]["eval_end"]
    ok = got >= mean - max(noise, 1.0 / 48)  # at least one held-out prompt of slack
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "compression_effect.smoke" if a.smoke else "compression_effect"
    with open(out / f"{stem}.jsonl", "w") as f:
        for (comp, seed), r in results.items():
            for metric in ("eval_start", "eval_end", "reward_mean_last", "compression_ratio"):
                f.write(
                    json.dumps(
                        {
                            **meta,
                            "gradient_compression": comp,
                            "seed": seed,
                            "metric": metric,
                            "value": r[metric],
                            "unit": "reward" if "ratio" not in metric else "x",
                        }
                    )
                    + "\n"
                )
    lines = [
        f"# compression_effect: {meta['model']} PPO on CPU, none vs int8 ({a.steps} steps)",
        "",
        f"{meta['device']}, torch {torch.__version__}, {meta['task']}, commit {meta['commit']}, "
        f"{meta['date']}. Held-out eval reward (greedy, 48 prompts).",
        "",
        "| gradient_compression | seed | eval start | eval end | last step reward | compression ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (comp, seed), r in results.items():
        lines.append(
            f"| {comp} | {seed} | {r['eval_start']:.3f} | {r['eval_end']:.3f} | "
            f"{r['reward_mean_last']:.3f} | {r['compression_ratio']:.2f} |"
        )
    lines += [
        "",
        f"Seed noise (spread of `none` end eval over seeds {a.seeds}): {noise:.3f}; "
        f"`none` mean {mean:.3f}; `int8` {got:.3f} -> "
        + ("within noise (does not learn worse)." if ok else "WORSE than seed noise."),
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
