"""Reward-path latency: remote server vs local model vs local+async vs cache hits.

Protocol (all modes see the same model spec and the same batches, in one process except
the server):

1. Build ``--batches`` batches of ``--batch-size`` real reasoning-gym entries
   (basic_arithmetic, chain_sum) with synthetic completions (half right, half wrong);
   token ids are the completions' UTF-8 bytes (exact, deterministic keys).
2. Start ``python -m verl_ppo.reward.server --port 0`` in a subprocess on loopback with
   the same model spec and thread count, and build the same model locally.
3. Numerics first: remote, async and cached rewards must equal the local ones (remote to
   1e-5, others exactly) and every cached lookup must hit; otherwise exit 1.
4. ``--warmup`` passes of every mode, then ``--rounds`` rounds; in each round the modes
   run one after another over all batches (interleaved across rounds). Per-batch wall
   time with ``time.perf_counter``:

   * ``remote``: ``RemoteReward.score`` (HTTP round trip + server-side scoring);
   * ``local``: ``reward_model.score`` in the calling thread;
   * ``local_async``: the *exposed* latency: submit batch i to
     :class:`~verl_ppo.reward.AsyncRewardScorer`, simulate generating micro-batch i+1
     (the main thread sleeps ``--gen-ms``, as a GPU decode leaves the host CPU free), then
     time only the wait for batch i's rewards;
   * ``cached``: :class:`~verl_ppo.reward.CachedReward` over the local model, all hits.

5. Mean and P99 (linear interpolation) per mode over all timed batches.

Output: ``<out>/reward_latency.jsonl`` (records ``"metric": "latency_mean_ms" |
"latency_p99_ms"``, ``"mode": "remote" | "local" | "local_async" | "cached"``) and
``<out>/reward_latency.md``. Target: local_async mean and P99 <= 0.2 x remote.

Usage::

    python benchmarks/reward_latency.py --smoke --out /tmp/rl     # CPU, < 60 s
        (smoke: 2 batches x 4, 2 rounds, 200 ms generation, embeds the extracted answers)
    python benchmarks/reward_latency.py                           # full CPU run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = "reward_latency"
MODES = ("remote", "local", "local_async", "cached")
REPO = Path(__file__).resolve().parents[1]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="small CPU run (< 60 s) for CI")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output folder")
    p.add_argument("--model", default="minilm", help="reward model spec (see reward-server)")
    p.add_argument("--text", default="response", choices=("answer", "response"))
    p.add_argument("--max-length", type=int, default=128, help="tokens per text")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed passes over the batches")
    p.add_argument(
        "--gen-ms",
        type=float,
        default=1000.0,
        help="simulated generation of one micro-batch (ms); 1 s is well below this "
        "project's CPU rollout of a micro-batch (SmolLM2, 16 x 64 tokens at ~130 tok/s)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads, local and server")
    a = p.parse_args(argv)
    if a.smoke:
        a.batch_size, a.batches, a.rounds, a.warmup = 4, 2, 2, 1
        a.max_length, a.gen_ms, a.text = 64, 200.0, "answer"
    for name in ("batch_size", "batches", "rounds", "max_length", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def make_batches(n_batches: int, batch_size: int, seed: int = 0):
    """``n_batches`` RewardBatches of real reasoning-gym entries and synthetic completions."""
    import reasoning_gym

    from verl_ppo.reward import RewardBatch

    n = n_batches * batch_size
    half = (n + 1) // 2
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=half, seed=seed))
    entries += list(reasoning_gym.create_dataset("chain_sum", size=n - half, seed=seed + 1))
    batches = []
    for b in range(n_batches):
        ents = entries[b * batch_size : (b + 1) * batch_size]
        prompts, responses = [], []
        for i, e in enumerate(ents):
            ans = e["answer"] if (b + i) % 2 == 0 else str(int(e["answer"]) + 7)
            expr = e["metadata"]["expression"]
            prompts.append(f"{e['question']} Put the final answer in <answer></answer>.")
            responses.append(
                f"Let me work through {expr} step by step. I evaluate the terms from left to "
                f"right, keeping track of the signs, and check the result once more. "
                f"<answer>{ans}</answer>"
            )
        batches.append(
            RewardBatch(
                [tuple(p.encode()) for p in prompts],
                [tuple(r.encode()) for r in responses],
                prompts,
                responses,
                ents,
            )
        )
    return batches


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start the reward server subprocess; returns (process, url). Raises on failure."""
    cmd = [
        sys.executable, "-m", "verl_ppo.reward.server", "--host", "127.0.0.1", "--port", "0",
        "--model", args.model, "--text", args.text, "--max-length", str(args.max_length),
        "--threads", str(args.threads),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    log = open(log_path, "w")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    proc._log_file = log  # type: ignore[attr-defined]
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=120)
    except queue.Empty:
        line = ""
    if " on http://" not in line:
        stop_server(proc)
        raise RuntimeError(f"reward server did not start: {line!r}\n{log_path.read_text()}")
    return proc, line.rsplit(" on ", 1)[1].strip()


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then kill after 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
    proc._log_file.close()  # type: ignore[attr-defined]


def check_numerics(batches, local, remote, cached, scorer) -> None:
    """Every mode must give the local rewards; raises AssertionError otherwise."""
    import torch

    for i, b in enumerate(batches):
        want = local.score(b)
        got_r = remote.score(b)
        if not torch.allclose(got_r, want, atol=1e-5, rtol=0):
            raise AssertionError(f"batch {i}: remote {got_r.tolist()} != local {want.tolist()}")
        got_a = scorer.wait(scorer.submit(b))
        if not torch.equal(got_a, want):
            raise AssertionError(f"batch {i}: async {got_a.tolist()} != local {want.tolist()}")
        cached.score(b)  # fills the cache
        got_c = cached.score(b)
        if not torch.equal(got_c, want):
            raise AssertionError(f"batch {i}: cached {got_c.tolist()} != local {want.tolist()}")


def run_round(batches, local, remote, cached, scorer, gen_s: float) -> dict[str, list[float]]:
    """One pass of every mode over all batches; per-batch seconds for each mode."""
    t: dict[str, list[float]] = {m: [] for m in MODES}
    for b in batches:
        t0 = time.perf_counter()
        remote.score(b)
        t["remote"].append(time.perf_counter() - t0)
    for b in batches:
        t0 = time.perf_counter()
        local.score(b)
        t["local"].append(time.perf_counter() - t0)
    for b in batches:
        fut = scorer.submit(b)
        time.sleep(gen_s)  # generation of the next micro-batch
        t0 = time.perf_counter()
        scorer.wait(fut)
        t["local_async"].append(time.perf_counter() - t0)
    hits0 = cached.hits
    for b in batches:
        t0 = time.perf_counter()
        cached.score(b)
        t["cached"].append(time.perf_counter() - t0)
    n = sum(len(b) for b in batches)
    if cached.hits - hits0 != n:
        raise AssertionError(f"cached mode missed: {cached.hits - hits0} hits of {n}")
    return t


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


def _loadavg() -> float | None:
    """1-minute load average of the machine (other processes compete for the cores)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _commit() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "verl_ppo/reward", "benchmarks/reward_latency.py"],
            cwd=REPO, capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0, or 1 if numerics disagree or the server fails."""
    args = _args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import transformers

    import verl_ppo
    from verl_ppo.reward import (
        AsyncRewardScorer,
        CachedReward,
        RemoteReward,
        build_reward_model,
        percentile,
    )

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    commit = _commit()  # the code that runs, read before it runs
    load_before = _loadavg()
    batches = make_batches(args.batches, args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(args, Path(tmp) / "server.log")
        try:
            local = build_reward_model(args.model, max_length=args.max_length, text=args.text)
            remote = RemoteReward(url, timeout_s=120.0)
            cached = CachedReward(local, max_entries=4 * len(batches) * args.batch_size)
            with AsyncRewardScorer(local, max_workers=1) as scorer:
                try:
                    check_numerics(batches, local, remote, cached, scorer)
                except AssertionError as exc:
                    print(f"{BENCH}: numerics check FAILED: {exc}", file=sys.stderr)
                    return 1
                for _ in range(args.warmup):
                    run_round(batches, local, remote, cached, scorer, args.gen_ms / 1e3)
                times: dict[str, list[float]] = {m: [] for m in MODES}
                for _ in range(args.rounds):
                    for m, v in run_round(
                        batches, local, remote, cached, scorer, args.gen_ms / 1e3
                    ).items():
                        times[m] += v
                worker = scorer.metrics()["reward/latency_s"]
        finally:
            stop_server(proc)

    stats = {m: (1e3 * sum(v) / len(v), 1e3 * percentile(v, 99.0)) for m, v in times.items()}
    common = {
        "benchmark": BENCH,
        "unit": "ms",
        "device": _device(args.threads),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "verl_ppo": verl_ppo.__version__,
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "model": getattr(local, "name", args.model),
        "text": args.text,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "n_batches": args.batches,
        "rounds": args.rounds,
        "samples_per_mode": len(times["local"]),
        "gen_ms": args.gen_ms,
        "smoke": args.smoke,
        "numerics_ok": True,
        "loadavg_1m_before_after": [load_before, _loadavg()],
    }
    r_mean, r_p99 = stats["remote"]
    records = []
    for m in MODES:
        mean, p99 = stats[m]
        for metric, val, ref in (("latency_mean_ms", mean, r_mean), ("latency_p99_ms", p99, r_p99)):
            rec = {**common, "metric": metric, "value": round(val, 4), "mode": m}
            rec["ratio_to_remote"] = round(val / ref, 4)
            if m == "local_async":
                rec["target"] = "<= 0.2 x remote"
                rec["target_met"] = val <= 0.2 * ref
                rec["scoring_latency_mean_ms"] = round(1e3 * worker, 4)
            records.append(rec)
    with open(out / f"{BENCH}.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    met = all(r["target_met"] for r in records if r["mode"] == "local_async")
    md = [
        f"# Reward latency ({common['device']})",
        "",
        f"model `{common['model']}` (text={args.text}, max_length={args.max_length}), "
        f"{args.batches} batches x {args.batch_size} samples, {args.rounds} rounds, "
        f"simulated generation {args.gen_ms:.0f} ms, commit {common['commit']}, "
        f"{common['date']}. Numerics: all modes agree with local. 1-min load average "
        f"before/after: {common['loadavg_1m_before_after']} on {os.cpu_count()} cores.",
        "",
        "| mode | mean (ms) | P99 (ms) | mean / remote | P99 / remote |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in MODES:
        mean, p99 = stats[m]
        md.append(f"| {m} | {mean:.2f} | {p99:.2f} | {mean / r_mean:.3f} | {p99 / r_p99:.3f} |")
    md += [
        "",
        f"local_async = exposed wait after generation; its scoring on the worker took "
        f"{1e3 * worker:.1f} ms per batch on average.",
        f"Target local_async mean and P99 <= 0.2 x remote: {'met' if met else 'NOT met'}.",
    ]
    (out / f"{BENCH}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"{BENCH}: wrote {out / (BENCH + '.jsonl')} in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
