"""A prediction, not a measurement: tokens/s of the async mode against the colocated one on
2, 4 and 8 H200 GPUs, from measured 1 x H200 phase times and the weight-sync model.

Inputs, all read from committed records (their run ids go into every output record):

- ``ppo_throughput.jsonl``: the newest ``verl_ppo`` ``default`` run on ``1 x NVIDIA H200``
  (``benchmarks/ppo_throughput.py``, the qwen05b shape, ``rollout_batch`` sequences of
  ``prompt_len + response_len`` tokens): ``step_time_s`` and the ``phase_time_s`` of ``gen``
  and ``reward``; the training side ``t = step - gen - reward`` (ref, values, advantages,
  actor and critic updates and the rest of the step); ``decode_vs_floor``;
- ``async_rollout.jsonl``: the newest non-smoke weight-sync run's median
  ``delta_bytes_vs_full`` after the first sync (CPU, bf16 rollout weights, RL learning rate);
- ``allreduce_latency.jsonl``: the median NCCL bf16 bus bandwidth over NVLink between two
  H200s at the largest size measured, taken as what one rollout GPU can receive.

Model (per step, one step off policy, steady state; N GPUs split into T training and
R = N - T rollout GPUs; the same global batch as colocated, ``rollout_batch`` sequences per
GPU; the best split is reported):

- colocated: every GPU runs every phase on its own ``rollout_batch`` sequences, the step
  of 1 GPU (data parallel; the gradient all-reduce is left out of both modes);
- async: ``max(gen_pool + reward_pool + pause, t * N / T + encode)``, where
  ``gen_pool = gen * s(N / R)`` for ``N / R`` times the sequences per rollout GPU and
  ``reward_pool = reward * N / R``. Two bounds on the generation scaling ``s(x)``:
  ``linear`` (``s = x``: decode time grows with the batch, conservative) and
  ``overhead`` (``s = max(1, x * decode_vs_floor)``: the measured decode runs at a fraction
  of its HBM floor, so a larger batch costs nothing until the floor, which grows at most
  linearly with the batch, is reached; optimistic). The sync (``2 * params * delta`` bytes
  to each rollout GPU at the NVLink bandwidth) runs while the rollout GPUs generate; the
  pause is what is left of it plus the switch's copy (``2 * 2 * params`` bytes at HBM
  bandwidth); ``encode`` on the training GPUs reads the fp32 weights and writes and
  compares the bf16 copy (``10 * params`` bytes at HBM bandwidth).
- ``HBM_GBPS``: the H200's 4.8 TB/s (NVIDIA H200 datasheet), an assumption.

Records (``async_rollout.jsonl``): ``metric: tokens_per_s_vs_colocated``,
``"prediction": true``, one per (GPUs, bound), with the split, the step times and the sync
seconds; ``async_prediction.md`` is generated from them.

    python benchmarks/async_prediction.py                 # appends records, writes the md
    python benchmarks/async_prediction.py --smoke --out /tmp/p   # CI: same, another folder
"""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_comm.bench.env import commit, dirty, now_iso, versions  # noqa: E402
from verl_comm.bench.report import read_jsonl, write_jsonl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCH, METRIC = "async_rollout", "tokens_per_s_vs_colocated"
GPUS = (2, 4, 8)
HBM_GBPS = 4800.0  # H200 HBM3e, NVIDIA H200 datasheet (an assumption, not measured here)
BOUNDS = ("linear", "overhead")


def throughput_inputs(records: list[dict]) -> dict:
    """The newest 1 x H200 ``verl_ppo`` default run's step, phase times and shape.

    Raises:
        ValueError: no such run in the records.
    """
    ours = [
        r
        for r in records
        if r.get("system") == "verl_ppo"
        and r.get("variant") == "default"
        and r.get("device") == "1 x NVIDIA H200"
        and r.get("run_id")
    ]
    if not ours:
        raise ValueError("ppo_throughput.jsonl holds no verl_ppo default run on 1 x NVIDIA H200")
    run = max(ours, key=lambda r: r["date"])["run_id"]
    rs = [r for r in ours if r["run_id"] == run]
    phase = {r["phase"]: r["value"] for r in rs if r["metric"] == "phase_time_s"}
    one = {r["metric"]: r for r in rs if r["metric"] != "phase_time_s"}
    step = one["step_time_s"]
    return {
        "run_id": run,
        "commit": step["commit"],
        "shape": step["shape"],
        "sequences": step["rollout_batch"],
        "tokens_per_seq": step["prompt_len"] + step["response_len"],
        "step_s": step["value"],
        "gen_s": phase["gen"],
        "reward_s": phase.get("reward", 0.0),
        "phases_s": phase,
        "decode_vs_floor": one["decode_vs_floor"]["value"],
    }


def delta_fraction(records: list[dict]) -> dict:
    """Median ``delta_bytes_vs_full`` after the first sync, newest non-smoke sync run.

    Raises:
        ValueError: no such records.
    """
    rs = [
        r
        for r in records
        if r.get("metric") == "delta_bytes_vs_full" and not r.get("smoke") and "wire" in r
    ]
    if not rs:
        raise ValueError("async_rollout.jsonl holds no delta_bytes_vs_full records")
    run = max(rs, key=lambda r: r["date"])["run_id"]
    v = [r["value"] for r in rs if r["run_id"] == run and not r["first_sync"]]
    return {"run_id": run, "value": statistics.median(v), "rounds": len(v)}


def nvlink_gbps(records: list[dict]) -> dict:
    """Median NCCL bf16 all-reduce bus bandwidth over NVLink on H200s, largest size.

    Raises:
        ValueError: no such records.
    """
    rs = [
        r
        for r in records
        if r.get("metric") == "busbw"
        and r.get("transport") == "nvlink"
        and r.get("method") == "nccl_bf16"
        and "H200" in str(r.get("device"))
    ]
    if not rs:
        raise ValueError("allreduce_latency.jsonl holds no nvlink nccl_bf16 busbw on H200")
    top = max(r["bytes"] for r in rs)
    v = [r["value"] for r in rs if r["bytes"] == top]
    return {"value": statistics.median(v), "bytes": top, "samples": len(v)}


def shape_params(shape: str) -> int:
    """Parameters of the benchmark shape (unique tensors, tied embedding once), from the
    reshard planner's specs: what the sync sends."""
    from transformers import AutoConfig

    from benchmarks._ppo_workload import SHAPES
    from verl_ppo.reshard.specs import model_param_specs

    kw = dict(SHAPES[shape])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    total = 0
    for s in model_param_specs(cfg):
        n = 1
        for d in s.shape:
            n *= d
        total += n
    return total


def predict(n: int, bound: str, x: dict, params: int, delta: float, link_gbps: float) -> dict:
    """The best T/R split of ``n`` GPUs under ``bound`` (module docstring)."""
    gen, reward, step = x["gen_s"], x["reward_s"], x["step_s"]
    train = step - gen - reward
    sync_s = 2 * params * delta / (link_gbps * 1e9)
    copy_s = 4 * params / (HBM_GBPS * 1e9)
    encode_s = 10 * params / (HBM_GBPS * 1e9)
    best = None
    for t in range(1, n):
        r = n - t
        scale = n / r if bound == "linear" else max(1.0, n / r * x["decode_vs_floor"])
        gen_pool = gen * scale + reward * n / r
        pause = max(0.0, sync_s - gen_pool) + copy_s
        side = {"rollout_s": gen_pool + pause, "train_s": train * n / t + encode_s}
        s = max(side.values())
        if best is None or s < best["step_s"]:
            best = {"train_gpus": t, "rollout_gpus": r, "step_s": s, **side, "pause_s": pause}
    tokens = x["sequences"] * x["tokens_per_seq"]
    best["tokens_per_s_per_gpu"] = tokens * n / best["step_s"] / n
    best["colocated_tokens_per_s_per_gpu"] = tokens / step
    best |= {"sync_s": sync_s, "sync_full_s": sync_s / delta, "encode_s": encode_s}
    return best


def records(meta: dict, x: dict, params: int, delta: dict, link: dict) -> list[dict]:
    """One ``tokens_per_s_vs_colocated`` record per (GPUs, bound)."""
    out = []
    for n in GPUS:
        for bound in BOUNDS:
            p = predict(n, bound, x, params, delta["value"], link["value"])
            out.append(
                {
                    **meta,
                    "metric": METRIC,
                    "value": p["tokens_per_s_per_gpu"] / p["colocated_tokens_per_s_per_gpu"],
                    "unit": "ratio",
                    "prediction": True,
                    "gpus": n,
                    "bound": bound,
                    **p,
                    "shape": x["shape"],
                    "params": params,
                    "inputs": {
                        "ppo_throughput_run": x["run_id"],
                        "ppo_throughput_commit": x["commit"],
                        "phases_s": x["phases_s"],
                        "step_s": x["step_s"],
                        "decode_vs_floor": x["decode_vs_floor"],
                        "delta_bytes_vs_full": delta,
                        "nvlink_busbw_gbps": link,
                        "hbm_gbps_assumed": HBM_GBPS,
                    },
                }
            )
    return out


def markdown(recs: list[dict]) -> str:
    """``async_prediction.md`` from the newest prediction run's records."""
    run = max(recs, key=lambda r: r["date"])["run_id"]
    rs = [r for r in recs if r["run_id"] == run]
    i = rs[0]["inputs"]
    lines = [
        "# Async rollout on 2, 4 and 8 H200: a PREDICTION (not measured)",
        "",
        f"Generated by benchmarks/async_prediction.py from {BENCH}.jsonl "
        f'(`{METRIC}`, `"prediction": true`), run `{run}`, commit `{rs[0]["commit"]}`. '
        "The model (module docstring of the script): colocated = the measured 1 x H200 step "
        f"on every GPU ({rs[0]['shape']}, ppo_throughput run `{i['ppo_throughput_run']}`: "
        f"step {i['step_s']:.3f} s, gen {i['phases_s']['gen']:.3f} s, training side "
        f"{rs[0]['inputs']['step_s'] - i['phases_s']['gen'] - i['phases_s'].get('reward', 0):.3f}"
        " s); async = the slower of the rollout pool (generation scaled by `s(x)`, x = "
        "sequences per rollout GPU over the measured 128) and the training pool (linear), "
        "plus the sync's pause. Bounds: `linear` s(x) = x (conservative); `overhead` "
        f"s(x) = max(1, x * decode_vs_floor = {i['decode_vs_floor']:.3f}) (optimistic). "
        f"Sync: {rs[0]['params'] / 1e6:.0f} M parameters in bf16, delta fraction "
        f"{i['delta_bytes_vs_full']['value']:.3f} (CPU run `{i['delta_bytes_vs_full']['run_id']}`), "
        f"NVLink {i['nvlink_busbw_gbps']['value']:.0f} GB/s (measured NCCL bf16 busbw, "
        "allreduce_latency.jsonl), HBM "
        f"{i['hbm_gbps_assumed']:.0f} GB/s (H200 datasheet, assumed). Gradient all-reduce "
        "left out of both modes; no response-length tail (fixed 256 tokens), where async "
        "would gain more.",
        "",
        "| GPUs | bound | split (train + rollout) | colocated tok/s/GPU | async tok/s/GPU | "
        "async / colocated | async step s (rollout, train) | sync s delta (full) | pause s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rs, key=lambda r: (r["gpus"], r["bound"])):
        lines.append(
            f"| {r['gpus']} | {r['bound']} | {r['train_gpus']} + {r['rollout_gpus']} | "
            f"{r['colocated_tokens_per_s_per_gpu']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | "
            f"**{r['value']:.2f}** | {r['step_s']:.3f} ({r['rollout_s']:.3f}, "
            f"{r['train_s']:.3f}) | {r['sync_s'] * 1e3:.2f} ms ({r['sync_full_s'] * 1e3:.1f} ms)"
            f" | {r['pause_s'] * 1e3:.2f} ms |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI: read the input records, append the prediction records, write the markdown."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results"), help="inputs")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="CI: the same into --out")
    a = p.parse_args(argv)
    src = Path(a.results)
    x = throughput_inputs(read_jsonl(src / "ppo_throughput.jsonl"))
    delta = delta_fraction(read_jsonl(src / f"{BENCH}.jsonl"))
    link = nvlink_gbps(read_jsonl(src / "allreduce_latency.jsonl"))
    meta = {
        "benchmark": BENCH,
        "device": "prediction for N x NVIDIA H200 from 1 x NVIDIA H200 records",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "run_id": uuid.uuid4().hex[:12],
        "smoke": a.smoke,
    }
    recs = records(meta, x, shape_params(x["shape"]), delta, link)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / (f"{BENCH}.smoke.jsonl" if a.smoke else f"{BENCH}.jsonl")
    write_jsonl(recs, jsonl, append=True)
    mine = [r for r in read_jsonl(jsonl) if r.get("metric") == METRIC and r.get("prediction")]
    md = markdown(mine)
    (out / ("async_prediction.smoke.md" if a.smoke else "async_prediction.md")).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
