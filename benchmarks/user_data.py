"""Your data and your reward (issue 32): start-up cost of parquet prompts, exposed time of a
slow custom reward function, and the default job from exported files against the built-in task.

Protocol (one run, one ``run_id``; every part checks its numerics before timing):

``load``: ``--rows`` verl-format rows of the built-in task (``verl-ppo data export``'s rows,
cycled) written as parquet. Numerics: the file source draws the task's prompts. Then, in
``--rounds`` rounds with the order alternated, the two start-up pieces that differ between a
file job and a task job are timed for both: preflight's data check
(:func:`verl_ppo.job.preflight.check_data`: tokenizer load, every row checked, the drawn
prompts measured) and a rank's prompt source
(:func:`verl_ppo.data.file_source.build_prompt_source`). Added start-up = median(preflight
files - task) + ranks x median(rank files - task): counted as if the ranks loaded one after
the other (on this 2-core CPU they load at once: a bound, not an estimate). Target < 10 s.

``reward``: two one-rank trainers (tiny random Llama, GAE, ``--samples`` sequences a step
generated in chunks of ``--chunk``, fixed length) on the exported file with
``benchmarks/_sleep_reward.py`` (sleeps 50 ms per response): ``reward.num_workers`` 1 and
``--workers``. Steps interleaved (order alternated), the first untimed. Numerics: both give
identical ``reward/mean`` and response lengths each step (same prompts and seed; the same
function). Exposed reward time = the trainer's ``timing_s/reward`` (the wait for the last
chunk's scores after generation). Target < 0.15 s with 8 workers, 64 samples.

``job``: ``configs/default.yaml`` (2 ranks) run twice: the built-in task, and exported
train/val files with ``examples/arithmetic_reward.py``. Numerics = the target: every step's
``reward/mean`` and every ``eval/reward`` equal, bit for bit (the same responses scored by
the same string comparisons, averaged by the same operations).

Records: ``<out>/user_data.jsonl`` (appended), ``<out>/user_data.md`` generated from this
run's records. Usage::

    python benchmarks/user_data.py --smoke --out /tmp/ud     # CI: small sizes, tiny job
    flock <lock> python benchmarks/user_data.py --parts load reward
    flock <lock> python benchmarks/user_data.py --parts job  # ~15 min on the 2-core CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from _ppo_env import _commit, _dirty, _versions  # noqa: E402

BENCH = "user_data"
TARGET_LOAD_S = 10.0
TARGET_EXPOSED_S = 0.15
SLEEP_REWARD = "benchmarks/_sleep_reward.py"
EXAMPLE_REWARD = "examples/arithmetic_reward.py"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small sizes, tiny job (CI)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--parts", nargs="+", default=["load", "reward", "job"])
    p.add_argument("--rows", type=int, default=100_000, help="parquet rows (load)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (load)")
    p.add_argument("--samples", type=int, default=64, help="sequences per step (reward)")
    p.add_argument("--chunk", type=int, default=8, help="rollout.micro_batch_size (reward)")
    p.add_argument("--workers", type=int, default=8, help="reward.num_workers (reward)")
    p.add_argument("--steps", type=int, default=4, help="steps per mode, 1 untimed (reward)")
    p.add_argument("--new-tokens", type=int, default=32, help="rollout.max_new_tokens (reward)")
    p.add_argument("--job-config", default="configs/default.yaml", help="job part")
    a = p.parse_args(argv)
    if a.smoke:
        a.rows, a.rounds, a.samples, a.steps, a.new_tokens = 5000, 1, 16, 2, 8
        a.job_config = "configs/tiny.yaml"
    return a


def _base(a: argparse.Namespace, run_id: str) -> dict[str, Any]:
    return {
        "benchmark": BENCH,
        "device": f"cpu: {os.cpu_count()} cores (shared machine)",
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "dirty": _dirty(),
        "run_id": run_id,
        "smoke": a.smoke,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _export(config: str, split: str, n: int, out: Path) -> Path:
    from verl_ppo.data.export_cli import main as data_main

    if data_main(
        ["export", "--config", config, "--split", split, "--n", str(n), "--out", str(out)]
    ):
        raise RuntimeError(f"verl-ppo data export failed for {out}")
    return out


# -------------------------------------------------------------------- load
def part_load(a: argparse.Namespace, tmp: Path, base: dict) -> list[dict]:
    """Records of the load part (see the module docstring)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_ppo.config import build_config
    from verl_ppo.data.file_source import build_prompt_source
    from verl_ppo.data.tasks import Task
    from verl_ppo.data.verl_format import task_rows
    from verl_ppo.job.preflight import check_data
    from verl_ppo.workers.models import load_tokenizer

    task = Task("basic_arithmetic", seed=0)
    path = tmp / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(list(task_rows(task, "train", a.rows))), path)
    common = {"data.eval_size": 0, "train.num_steps": 8}
    cfgs = {
        "task": build_config(**common),
        "files": build_config(**common, **{"data.task": None, "data.train_files": [str(path)]}),
    }
    tok = load_tokenizer(cfgs["task"].model)
    src = build_prompt_source(cfgs["files"], tok)
    for i in range(64):  # numerics: the file gives the task's prompts
        if src.sample(tok, "train", i).prompt != task.sample(tok, "train", i).prompt:
            raise RuntimeError(f"load: row {i} of the parquet is not the task's prompt {i}")
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(a.rounds):
        for mode in ("files", "task") if r % 2 == 0 else ("task", "files"):
            t0 = time.perf_counter()
            check_data(cfgs[mode])
            t1 = time.perf_counter()
            build_prompt_source(cfgs[mode], tok)
            t2 = time.perf_counter()
            times.setdefault((mode, "preflight"), []).append(t1 - t0)
            times.setdefault((mode, "rank"), []).append(t2 - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    ranks = cfgs["files"].comm.nproc
    added = (med["files", "preflight"] - med["task", "preflight"]) + ranks * (
        med["files", "rank"] - med["task", "rank"]
    )
    b = dict(base, part="load", rows=a.rows, file_mb=round(path.stat().st_size / 2**20, 2),
             rounds=a.rounds, unit="s", numerics_ok=True)  # fmt: skip
    out = [
        dict(
            b, metric=f"{piece}_s", mode=mode, value=med[mode, piece], per_round=times[mode, piece]
        )  # fmt: skip
        for (mode, piece) in sorted(times)
    ]
    out.append(dict(b, metric="startup_added_s", mode=f"files vs task, {ranks} ranks serialised",
                    value=added, target=TARGET_LOAD_S, target_met=added < TARGET_LOAD_S))  # fmt: skip
    return out


# ------------------------------------------------------------------ reward
def part_reward(a: argparse.Namespace, tmp: Path, base: dict) -> list[dict]:
    """Records of the reward part (see the module docstring)."""
    from verl_ppo import PPOTrainer
    from verl_ppo.config import load_config

    train = _export("configs/tiny.yaml", "train", a.samples * a.steps, tmp / "r_train.parquet")
    modes = {f"workers_{a.workers}": a.workers, "workers_1": 1}

    def over(name: str, w: int) -> list[str]:
        return [
        f"run_dir={tmp}/{name}", "comm.nproc=1", "data.task=null", "data.task_kwargs=null",
        f"data.train_files=[{train}]", "data.eval_size=0",
        f"reward.custom_reward_function.path={SLEEP_REWARD}", f"reward.num_workers={w}",
        f"train.rollout_batch_size={a.samples}", f"train.ppo_mini_batch_size={a.samples}",
        "train.micro_batch_size=8", f"train.num_steps={a.steps}", "train.logger=[jsonl]",
        "train.export_hf=false", f"rollout.micro_batch_size={a.chunk}",
        f"rollout.max_new_tokens={a.new_tokens}", "rollout.ignore_eos=true",
    ]  # fmt: skip

    steps: dict[str, list[dict]] = {m: [] for m in modes}
    trainers = {m: PPOTrainer(load_config(REPO / "configs/tiny.yaml", over(m, w)))
                for m, w in modes.items()}  # fmt: skip
    try:
        for t in trainers.values():  # the pool of workers forks first, before any model
            t.setup()
        for step in range(a.steps):
            for m in list(modes) if step % 2 == 0 else list(modes)[::-1]:
                t0 = time.perf_counter()
                metrics = trainers[m].train_step(step)
                metrics["wall_step_s"] = time.perf_counter() - t0
                steps[m].append(metrics)
            x, y = (steps[m][-1] for m in modes)
            for key in ("reward/mean", "response/length_mean"):
                if x[key] != y[key]:  # same prompts, seed and function: identical floats
                    raise RuntimeError(f"reward: step {step} {key} differs: {x[key]} {y[key]}")
    finally:
        for m in reversed(list(trainers)):
            trainers[m].close()
    b = dict(base, part="reward", samples=a.samples, chunk=a.chunk, sleep_s=0.05,
             new_tokens=a.new_tokens, timed_steps=a.steps - 1, policy="tiny random Llama",
             unit="s", numerics_ok=True)  # fmt: skip
    out = []
    for m, w in modes.items():
        timed = steps[m][1:]
        for metric, key in (("reward_exposed_s", "timing_s/reward"), ("gen_s", "timing_s/gen"),
                            ("step_s", "wall_step_s")):  # fmt: skip
            vals = [s[key] for s in timed]
            rec = dict(b, metric=metric, mode=m, num_workers=w, value=statistics.median(vals),
                       spread=[min(vals), max(vals)], per_step=vals)  # fmt: skip
            if metric == "reward_exposed_s" and w == a.workers:
                rec.update(target=TARGET_EXPOSED_S, target_met=rec["value"] < TARGET_EXPOSED_S)
            out.append(rec)
    return out


# --------------------------------------------------------------------- job
def _train(config: str, run_dir: Path, extra: list[str], smoke: bool) -> list[dict]:
    args = [f"run_dir={run_dir}", "train.resume=never", "train.export_hf=false"]
    if smoke:
        args += ["comm.nproc=1", "train.num_steps=1"]
    cmd = [sys.executable, "-m", "verl_ppo.train", "--config", config, *args, *extra]
    # a fresh job: not the rendezvous of this process's own group (the reward part's)
    drop = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    if r.returncode:
        raise RuntimeError(f"job failed ({r.returncode}): {r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    return rows


def part_job(a: argparse.Namespace, tmp: Path, base: dict) -> list[dict]:
    """Records of the job part (see the module docstring)."""
    from verl_ppo.config import load_config
    from verl_ppo.data.file_source import train_rows_drawn

    cfg = load_config(REPO / a.job_config)
    train = _export(a.job_config, "train", max(train_rows_drawn(cfg), 64), tmp / "j_train.parquet")
    val = _export(a.job_config, "eval", cfg.data.eval_size, tmp / "j_val.parquet")
    files = ["data.task=null", "data.task_kwargs=null", f"data.train_files=[{train}]",
             f"data.val_files=[{val}]", f"reward.custom_reward_function.path={EXAMPLE_REWARD}"]  # fmt: skip
    t0 = time.perf_counter()
    runs = {"builtin": _train(a.job_config, tmp / "builtin", [], a.smoke)}
    t1 = time.perf_counter()
    runs["files"] = _train(a.job_config, tmp / "files", files, a.smoke)
    t2 = time.perf_counter()
    series = {
        m: {
            "reward": [r["reward/mean"] for r in rows if "reward/mean" in r],
            "eval": [[r["step"], r["eval/reward"]] for r in rows if "eval/reward" in r],
        }
        for m, rows in runs.items()
    }
    same = series["builtin"] == series["files"]  # identical computations: bit equality
    diff = max(abs(x - y) for x, y in zip(series["builtin"]["reward"], series["files"]["reward"]))
    b = dict(base, part="job", config=a.job_config, unit="reward", numerics_ok=same,
             overrides_files=files, wall_s={"builtin": t1 - t0, "files": t2 - t1})  # fmt: skip
    return [
        dict(b, metric="reward_per_step", mode=m, value=statistics.fmean(s["reward"]),
             per_step=s["reward"], eval=s["eval"])  # fmt: skip
        for m, s in series.items()
    ] + [dict(b, metric="max_abs_reward_diff", mode="files vs builtin", value=diff,
              target="equal rewards and eval", target_met=same)]  # fmt: skip


# ------------------------------------------------------------------ report
def latest(all_recs: list[dict]) -> list[dict]:
    """Per part, the records of the newest run that measured it (runs may measure parts
    separately: the job part is long)."""
    out = []
    for part in ("load", "reward", "job"):
        mine = [r for r in all_recs if r.get("part") == part]
        if mine:
            out += [r for r in mine if r["run_id"] == mine[-1]["run_id"]]
    return out


def markdown(recs: list[dict]) -> str:
    """The report, generated from the records (:func:`latest` of each part)."""
    c = recs[0]
    lines = [
        f"# Your data and your reward ({c['device']})",
        "",
        "Generated from `user_data.jsonl` (per part, its newest run); protocol in "
        "`benchmarks/user_data.py`.",
        "",
        *(
            f"- {r['part']}: run {r['run_id']}, commit {r['commit']}"
            f"{' (dirty)' if r['dirty'] else ''}, {r['date']}, load average {r['loadavg_1m']}"
            f"{', smoke sizes' if r['smoke'] else ''}"
            for r in recs
            if r is next(x for x in recs if x["part"] == r["part"])
        ),  # fmt: skip
        "",
        "| part | metric | mode | value | target | met |",
        "|---|---|---|---:|---|---|",
    ]
    for r in recs:
        v = r["value"]
        lines.append(
            f"| {r['part']} | {r['metric']} | {r['mode']} | "
            f"{v:.4g} {r['unit']} | {r.get('target', '')} | {r.get('target_met', '')} |"
        )
    for r in recs:
        if r["metric"] == "reward_per_step":
            lines += ["", f"- job `{r['mode']}`: reward/mean per step {r['per_step']}, "
                      f"eval (step, reward) {r['eval']}"]  # fmt: skip
        if r["metric"] == "startup_added_s":
            lines += ["", f"- load: {r['rows']} rows, {r['file_mb']} MB parquet"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the parts asked for; 0, or 1 when a numerics check fails."""
    a = _args(argv)
    os.chdir(REPO)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_ext"))
    base = _base(a, uuid.uuid4().hex[:12])
    parts = {"load": part_load, "reward": part_reward, "job": part_job}
    recs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.parts:
            try:
                recs += parts[name](a, Path(tmp), base)
            except RuntimeError as exc:
                print(f"user_data {name}: {exc}", file=sys.stderr)
                return 1
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{BENCH}.jsonl", "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    from verl_comm.bench.report import read_jsonl

    md = markdown(latest(read_jsonl(out / f"{BENCH}.jsonl")))
    (out / f"{BENCH}.md").write_text(md)
    print(md)
    return 0 if all(r["numerics_ok"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
