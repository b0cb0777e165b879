"""Exposed reward time inside the real trainer loop: async scoring on vs off.

Protocol (one process, one run, one ``run_id``):

1. Build two :class:`verl_ppo.PPOTrainer` s from the same config and seed, in one
   one-rank process group: ``reward.async_scoring=true`` and ``false``. Generation is
   chunked (``rollout.micro_batch_size`` sequences per chunk); with async scoring, chunk
   ``i`` is scored on a worker thread while chunk ``i + 1`` generates, so the ``reward``
   phase only waits for what is left. Without it, the ``reward`` phase scores the whole
   batch after generation.
2. Steps are interleaved (``async, sync`` on odd steps, ``sync, async`` on even ones), so
   machine load drifts hit both modes alike. The first ``--warmup`` steps are not timed.
3. Numerics first: both trainers see the same seed, so every step must produce the same
   responses (``response/length_mean`` equal exactly: token counts are integers) and the
   same rewards up to float32 rounding (``reward/mean`` within :func:`reward_tolerance`);
   otherwise exit 1 (async scoring would have changed the results). Async scoring encodes
   chunks of ``--chunk`` sequences where sync scoring encodes the whole batch, so the BLAS
   blocking, hence the order of every float32 sum, differs between the modes: bit equality
   is not a property of the computation (one ulp apart was seen on another CPU).
4. Per timed step and mode: ``timing_s/reward`` (the exposed reward time of the trainer's
   own phase timer), ``timing_s/gen``, ``reward/latency_s`` (time the scorer itself spent)
   and the wall-clock time of ``train_step``. Means over the timed steps are recorded.

Output: ``<out>/reward_latency.jsonl`` (records ``metric`` in ``reward_exposed_s``,
``step_s``, ``gen_s``, ``scoring_s``; ``mode`` ``async`` | ``sync``; one
``exposed_ratio`` record, async / sync), appended; ``<out>/reward_latency.md`` is generated
from this run's records.
The CPU here is shared: the load average before and after is recorded.

Usage::

    python benchmarks/reward_latency.py --smoke --out /tmp/rl    # tiny policy, CI, < 2 min
    python benchmarks/reward_latency.py                          # SmolLM2-135M + MiniLM
    python benchmarks/reward_latency.py --config configs/tiny.yaml --steps 4 --new-tokens 16
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
import time
import uuid
from pathlib import Path

BENCH = "reward_latency"
REPO = Path(__file__).resolve().parents[1]
MODES = ("async", "sync")
METRICS = {
    "reward_exposed_s": "timing_s/reward",
    "gen_s": "timing_s/gen",
    "scoring_s": "reward/latency_s",
}


def reward_tolerance(reward: str) -> float:
    """Absolute bound on ``reward/mean`` between async and sync scoring of the same responses.

    ``rule`` scores are exact (strings compared, no float sums): 0. A learned reward model
    is an fp32 encoder whose GEMMs reduce over at most ``K`` terms per output in each of
    ``L`` layers; a different batch shape reorders those sums, a rounding difference of
    about ``sqrt(K) * eps`` relative per layer (random-walk bound for round-to-nearest, as in
    Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 3.1 / 3.5).
    Rewards are of order 1 (a cosine or a logit), and the mean over the batch does not
    grow the error, so the bound is ``4 * L * sqrt(K) * eps_fp32`` with the encoder's
    largest ``K`` (MiniLM-L6: L = 6, K = 1536: about 1.1e-4), a factor 4 for the
    attention softmax and pooling. Changed responses are caught by the exact length check.
    """
    if reward == "rule":
        return 0.0
    eps = 2.0**-23  # float32 machine epsilon
    layers, k = 6, 1536
    return 4 * layers * k**0.5 * eps


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny random policy, 2 steps (CI)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output folder")
    p.add_argument("--reward", default="minilm", help="reward.model of both trainers")
    p.add_argument(
        "--config", default=None, help="job config (default configs/default.yaml: SmolLM2)"
    )
    p.add_argument("--steps", type=int, default=5, help="steps per mode, warm-up included")
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    p.add_argument("--batch", type=int, default=8, help="train.rollout_batch_size")
    p.add_argument("--chunk", type=int, default=2, help="rollout.micro_batch_size")
    p.add_argument("--new-tokens", type=int, default=32, help="rollout.max_new_tokens")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.warmup, a.new_tokens = 2, 1, 8
    a.config = a.config or ("configs/tiny.yaml" if a.smoke else "configs/default.yaml")
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")
    return a


def _overrides(a: argparse.Namespace, run_dir: str, async_scoring: bool) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"reward.model={a.reward}",
        f"reward.async_scoring={str(async_scoring).lower()}",
        "algorithm.adv_estimator=grpo",  # no critic: two trainers fit in memory together
        "algorithm.n_samples=2",
        f"train.rollout_batch_size={a.batch}",
        f"train.ppo_mini_batch_size={a.batch}",
        "train.micro_batch_size=2",
        f"train.num_steps={a.steps}",
        "train.save_interval=0",
        "train.logger=[jsonl]",
        f"rollout.micro_batch_size={a.chunk}",
        f"rollout.max_new_tokens={a.new_tokens}",
        "data.eval_size=0",
    ]


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device(threads: int) -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {name}, {os.cpu_count()} cores, {threads} torch thread(s)"


def run(a: argparse.Namespace) -> tuple[dict[str, list[dict]], list[str]]:
    """Interleaved steps of both trainers; returns per-mode step metrics (wall time added as
    ``wall_step_s``) and the numerics problems found (empty = the modes agree)."""
    import torch

    from verl_ppo import PPOTrainer
    from verl_ppo.config import load_config

    torch.set_num_threads(a.threads)
    config = a.config
    steps: dict[str, list[dict]] = {m: [] for m in MODES}
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            m: PPOTrainer(load_config(REPO / config, _overrides(a, f"{tmp}/{m}", m == "async")))
            for m in MODES
        }
        try:
            for t in trainers.values():
                t.setup()
            for step in range(1, a.steps + 1):
                for m in MODES if step % 2 else MODES[::-1]:
                    t0 = time.perf_counter()
                    metrics = trainers[m].train_step(step)
                    metrics["wall_step_s"] = time.perf_counter() - t0
                    steps[m].append(metrics)
                x, y = steps["async"][-1], steps["sync"][-1]
                tols = {"reward/mean": reward_tolerance(a.reward), "response/length_mean": 0.0}
                for key, tol in tols.items():
                    if abs(x[key] - y[key]) > tol:
                        problems.append(
                            f"step {step}: {key} async {x[key]} != sync {y[key]} (tol {tol:.2g})"
                        )
        finally:  # the first trainer created the process group: it closes last
            for m in reversed(MODES):
                trainers[m].close()
    return steps, problems


def records(a: argparse.Namespace, steps: dict[str, list[dict]], load: list) -> list[dict]:
    """The JSON records of one run (means over the timed steps)."""
    import torch
    import transformers

    import verl_ppo
    from verl_comm.bench.env import dirty

    common = {
        "benchmark": BENCH,
        "unit": "s",
        "device": _device(a.threads),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "verl_ppo": verl_ppo.__version__,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "dirty": dirty(REPO),
        "run_id": uuid.uuid4().hex[:12],
        "policy": "tiny random Llama" if "tiny" in a.config else "SmolLM2-135M-Instruct",
        "config": a.config,
        "reward_model": a.reward,
        "rollout_batch_size": a.batch,
        "chunk": a.chunk,
        "max_new_tokens": a.new_tokens,
        "timed_steps": a.steps - a.warmup,
        "numerics_ok": True,
        "loadavg_1m_before_after": load,
    }
    out, mean = [], {}
    for m in MODES:
        timed = steps[m][a.warmup :]
        keys = {**METRICS, "step_s": "wall_step_s"}
        for metric, key in keys.items():
            # without async scoring the reward phase is the scoring itself (no scorer metrics)
            vals = [s.get(key, s["timing_s/reward"]) for s in timed]
            mean[m, metric] = statistics.fmean(vals)
            out.append(dict(common, metric=metric, mode=m, value=mean[m, metric], per_step=vals))
    ratio = mean["async", "reward_exposed_s"] / max(mean["sync", "reward_exposed_s"], 1e-12)
    out.append(dict(common, metric="exposed_ratio", mode="async/sync", value=ratio, unit="x"))
    return out


def markdown(recs: list[dict]) -> str:
    """The report, generated from the records of one run."""
    c = recs[0]
    by = {(r["mode"], r["metric"]): r["value"] for r in recs}
    lines = [
        f"# Reward latency inside the trainer loop ({c['device']})",
        "",
        f"Policy {c['policy']}, reward `{c['reward_model']}`, {c['rollout_batch_size']} "
        f"sequences per step generated in chunks of {c['chunk']}, {c['max_new_tokens']} new "
        f"tokens; {c['timed_steps']} timed steps per mode, interleaved, same seed (responses "
        f"and rewards identical in both modes). Run {c['run_id']}, commit {c['commit']}, "
        f"{c['date']}; 1-min load average before/after {c['loadavg_1m_before_after']} on "
        f"{os.cpu_count()} cores (shared machine).",
        "",
        "| mode | reward phase, exposed (s) | scoring itself (s) | gen (s) | wall step (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in MODES:
        lines.append(
            f"| {m} | {by[m, 'reward_exposed_s']:.4f} | {by[m, 'scoring_s']:.4f} | "
            f"{by[m, 'gen_s']:.3f} | {by[m, 'step_s']:.3f} |"
        )
    lines += [
        "",
        f"Exposed reward time, async / sync: {by['async/sync', 'exposed_ratio']:.3f}. "
        f"Wall step, async - sync: {by['async', 'step_s'] - by['sync', 'step_s']:+.3f} s.",
        "",
        "`reward phase` is the trainer's `timing_s/reward`: with async scoring the wait for "
        "the last chunk's scores, without it the scoring of the whole batch. `scoring itself` "
        "is `reward/latency_s`, the scorer's own time per call.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 when the two modes disagree on results."""
    a = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    os.chdir(REPO)
    load_before = _loadavg()
    steps, problems = run(a)
    if problems:
        print("numerics: async and sync scoring disagree:\n  " + "\n  ".join(problems))
        return 1
    recs = records(a, steps, [load_before, _loadavg()])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{BENCH}.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    md = markdown(recs)
    (out / f"{BENCH}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
