"""Reward curve of a PPO run: metrics.jsonl of ``verl-ppo train`` -> records, PNG and table.

The committed curve comes from ``verl-ppo train --config configs/long_grpo.yaml`` on the
2-core CPU (SmolLM2-135M-Instruct, 2 gloo ranks):

    python benchmarks/reward_curve.py --run-dir runs/long_grpo --out benchmarks/results
    python benchmarks/reward_curve.py --smoke      # CI: a 2-step tiny run, then the plot

Records: one per logged step (``metric: reward_mean``, ``response_length``) and per eval
(``metric: eval_reward``), with the usual device/versions/date/commit fields.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(step records, eval records) of ``run_dir/metrics.jsonl``.

    Raises:
        FileNotFoundError: no metrics file; ValueError: no step was logged.
    """
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [r for r in recs if "reward/mean" in r]
    evals = [r for r in recs if "eval/reward" in r]
    if not steps:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no training step")
    return steps, evals


def write(steps: list[dict], evals: list[dict], out: Path, stem: str, title: str) -> None:
    """Write ``<stem>.jsonl``, ``<stem>.png`` and ``<stem>.md`` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_comm.bench.env import commit, dirty, now_iso, versions

    meta = {
        "benchmark": "reward_curve",
        "device": f"cpu ({os.cpu_count()} cores), 2 gloo ranks",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "run": title,
    }
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{stem}.jsonl", "w") as f:
        for r in steps:
            for metric, key, unit in (
                ("reward_mean", "reward/mean", "reward"),
                ("response_length", "response/length_mean", "tokens"),
                ("kl", "actor/kl", "nats"),
            ):
                if key in r:
                    rec = {
                        **meta,
                        "step": r["step"],
                        "metric": metric,
                        "value": r[key],
                        "unit": unit,
                    }
                    f.write(json.dumps(rec) + "\n")
        for r in evals:
            rec = {**meta, "step": r["step"], "metric": "eval_reward", "value": r["eval/reward"]}
            f.write(json.dumps({**rec, "unit": "reward"}) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [r["step"] for r in steps]
    ys = [r["reward/mean"] for r in steps]
    k = 5
    smooth = [
        sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1])
        for i in range(len(ys))
    ]
    ax.plot(xs, ys, color="tab:blue", alpha=0.3, label="train reward (sampled)")
    ax.plot(xs, smooth, color="tab:blue", label=f"train reward, mean of {k}")
    ax.plot(
        [r["step"] for r in evals],
        [r["eval/reward"] for r in evals],
        "o-",
        color="tab:red",
        label="held-out eval reward (greedy)",
    )
    ax.set_xlabel("PPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.05)
    ax.set_title(title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)
    lines = [
        f"# {title}",
        "",
        f"{meta['device']}, torch {meta['versions']['torch']}, commit {meta['commit']}, {meta['date']}.",
        "",
        "| step | held-out eval reward |",
        "|---:|---:|",
        *[f"| {r['step']} | {r['eval/reward']:.3f} |" for r in evals],
        "",
        f"Train reward (sampled): first 5 steps {sum(ys[:5]) / len(ys[:5]):.3f}, "
        f"last 5 steps {sum(ys[-5:]) / len(ys[-5:]):.3f}; response length "
        f"{steps[0].get('response/length_mean', float('nan')):.1f} -> "
        f"{steps[-1].get('response/length_mean', float('nan')):.1f} tokens.",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI; returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/long_grpo")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument(
        "--title", default="SmolLM2-135M-Instruct, GRPO, basic_arithmetic (1 digit), CPU"
    )
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args(argv)
    if a.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "verl_ppo.train",
                    "--config",
                    "configs/tiny.yaml",
                    f"run_dir={tmp}",
                    "train.num_steps=2",
                ],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            if r.returncode:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            steps, evals = load(Path(tmp))
            write(steps, evals, Path(a.out), "reward_curve.smoke", "smoke: tiny model, 2 steps")
        return 0
    steps, evals = load(Path(a.run_dir))
    write(steps, evals, Path(a.out), "reward_curve", a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
