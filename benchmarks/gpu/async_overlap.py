"""Async rollout against colocated: on one GPU (issue 31, "overlap where it can be measured"),
or on two (issue 34: one training GPU and one rollout GPU against colocated on both).

``--gpus 1`` (default): two processes share the GPU: the training rank and the rollout rank of
``rollout.mode: async`` (``comm.nproc=1``, ``rollout.n_ranks=1``, ``max_staleness=1``,
decoupled loss). Two processes, not two CUDA streams in one: that is the shipped async mode
(:mod:`verl_ppo.asyncrl`), unchanged; the GPU interleaves the two processes' kernels (time
slicing, no MPS), so the gain measured is what the shipped code gets. Their bridge groups are
gloo, staged through host memory (NCCL refuses two ranks of one communicator on one GPU:
:func:`verl_ppo.asyncrl.world.placement`); each sync is checksum-verified by the receiver (a
mismatch stops the run). Colocated: one process, generate then train.

``--gpus 2``: the same async job, but each process on a GPU of its own (``placement`` gives
every rank ``LOCAL_RANK``'s GPU and NCCL bridge groups once the visible GPUs cover both
ranks), against colocated on the same two GPUs: ``comm.nproc=2`` data-parallel ranks, each
generating and training half of the unchanged global batch. The ranks see the first
``--gpus`` visible GPUs (``CUDA_VISIBLE_DEVICES``, so ``--gpus 1`` shares one GPU on any
machine); fewer visible on a CUDA machine is refused before any launch (exit 2).

Workloads (``benchmarks/ppo_throughput.py``'s shape: random-init Qwen2.5-0.5B, 256-token
prompts, 128 sequences per step, micro-batch 8 per rank):

* ``fixed``: 256-token responses (``rollout.ignore_eos``), the benchmark shape;
* ``spread``: EOS forced per prompt at a length uniform in 16..512 (``_overlap_rank.py``,
  ``forced_lengths``; ``max_new_tokens=512``): generation runs to the batch's longest row.

Defaults per ``--gpus`` (:data:`PRESETS`; each flag overrides): 1: both workloads, the delta
wire, 3 timed steps (issue 31's run); 2: ``fixed``, the wires ``full,delta``, 10 timed
steps (issue 34's run).

Protocol: per round and workload, the colocated launch, then one async launch per wire of
``--sync-wires`` (their order turning per round), ``--rounds`` rounds while they fit in
``--budget-s``; each launch: numerics check (the first rollout's log-probs against a plain HF
forward), ``--warmup`` untimed + ``--steps`` timed steps, every metric finite; each async
launch first times the bridge (``_bridge_probe.py``: send/recv round trips of
``--probe-bytes`` between the training and the rollout rank on the bridge's transport, the
fastest one giving the line rate). ``train.torch_compile`` is off in both modes (its
compilations would take most of a launch and their late recompiles land in timed steps; the
rollout's CUDA graph stays on, auto). tokens/s = tokens trained (prompt + response, all
ranks) / wall time of the timed steps on training rank 0; per GPU = that / ``--gpus``. Per
workload and wire one record ``metric: tokens_per_s_vs_colocated`` (``gpus``, ``sync_wire``,
one ``run_id`` per call): the median of the per-round ratios async/colocated, each mode's
median tokens/s (total and per GPU), step time and spread (min, max), and the weight sync's
numbers (``_overlap_sync.py``: bytes, changed fraction, sync time, generation pause,
``pause_vs_step``, ``sync_time_vs_line_rate`` against the probe, ``delta_bytes_vs_full`` on
the delta wire), appended to ``OUT/async_rollout.jsonl``; ``OUT/async_overlap.md`` from
them, with ``--gpus 2`` each of issue 34's targets met or missed.

    python benchmarks/gpu/async_overlap.py --out OUT                   # 1 x GPU, ~6 min
    python benchmarks/gpu/async_overlap.py --gpus 2 --out OUT          # 2 x GPU (not run yet)
    python benchmarks/gpu/async_overlap.py --smoke --out /tmp/x        # CPU, tiny, CI
    python benchmarks/gpu/async_overlap.py --smoke --gpus 2 --out /tmp/x  # CPU: 2 ranks vs 1 + 1

On 2 x H200 (``nvidia-h200-x2``), from the repository root with ``.whl/`` carried, one device
call of at most 600 s (``NCCL_NVLS_ENABLE=0`` from ``_env.sh``; the script's GPUS=2 defaults:
10 timed steps, 180 s per launch, so a hung first round of 3 launches still ends in time; a
second round starts only if it fits in BUDGET_S, 420 s)::

    source benchmarks/gpu/setup.sh && GPUS=2 ROUNDS=2 bash benchmarks/gpu/async_overlap.sh OUTDIR
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _overlap_sync import TARGETS, sync_fields, verdict  # noqa: E402

from verl_comm.bench.env import commit, dirty, now_iso, versions  # noqa: E402
from verl_comm.distributed.launch import run_ranks  # noqa: E402

BENCH = "async_rollout"
WORKLOADS = {"fixed": None, "spread": (16, 512)}
SMOKE_SPREAD = (2, 16)
MODES = ("colocated", "async")
WIRES = ("full", "delta")
PRESETS = {  # per --gpus, what a flag left out means: issue 31's run on 1 GPU, issue 34's on 2
    1: {"workloads": "fixed,spread", "sync_wires": "delta", "steps": 3},
    2: {"workloads": "fixed", "sync_wires": "full,delta", "steps": 10},
}
PROBE_BYTES = 256 << 20  # the bridge probe's buffer (_bridge_probe.py); smoke: 4 MiB


def _launch(
    a, mode: str, workload: str, rnd: int, raw: Path, run_dir: str, wire: str | None = None
) -> int:
    """One launch of ``_overlap_rank.py`` (async: on ``wire``); returns its exit status.
    Colocated runs ``--gpus`` ranks, async 1 training + 1 rollout rank."""
    spread = SMOKE_SPREAD if a.smoke and WORKLOADS[workload] else WORKLOADS[workload]
    wire = wire or a.sync_wires[0]
    cmd = [sys.executable, str(Path(__file__).with_name("_overlap_rank.py")), "--mode", mode]
    cmd += ["--raw", str(raw), "--run-dir", run_dir, "--tag"]
    cmd += [json.dumps({"workload": workload, "round": rnd})]
    cmd += ["--gpus", str(a.gpus), "--probe-bytes", str(a.probe_bytes)]
    cmd += ["--warmup", str(a.warmup), "--steps", str(a.steps), "--shape", a.shape]
    cmd += ["--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len)]
    cmd += ["--rollout-batch", str(a.rollout_batch), "--micro-batch", str(a.micro_batch)]
    cmd += ["--backend", a.backend, "--rollout-dtype", a.rollout_dtype, "--sync-wire", wire]
    cmd += ["--torch-compile", a.torch_compile]
    cmd += ["--model-dir", a.model_dir] if a.model_dir else []
    cmd += ["--spread", *map(str, spread)] if spread else []
    what = f"{mode} {workload}" + (f" {wire}" if mode == "async" else "")
    print(f"# round {rnd} {what}  {time.strftime('%H:%M:%S')}", flush=True)
    # the project's launcher (as verl-ppo train): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set
    nproc = 2 if mode == "async" else a.gpus
    res = run_ranks(cmd, nproc, env=a.rank_env, deadline_s=a.launch_timeout, name=mode)
    if res.message:
        print(f"# round {rnd} {what}: {res.message}", flush=True)
    return 0 if res.message is None else 1


def _spread(xs: list[float]) -> list[float]:
    return [min(xs), max(xs)]


def _key(r: dict) -> tuple:
    return (r["round"], r["mode"], r.get("sync_wire") if r["mode"] == "async" else None)


def records(raw: list[dict], meta: dict) -> list[dict]:
    """One ``tokens_per_s_vs_colocated`` record per workload and async wire, over the rounds
    where the colocated launch and that wire's async launch both completed (ratio per round,
    median over rounds), with the sync fields (``_overlap_sync.py``)."""
    out, g = [], meta["gpus"]
    for w in WORKLOADS:
        by = {_key(r): r for r in raw if r["workload"] == w}
        for wire in meta["sync_wires"]:
            cells = {"colocated": None, "async": wire}
            rounds = sorted({k[0] for k in by if all((k[0], m, x) in by for m, x in cells.items())})
            if not rounds:
                continue
            run = {m: [by[(k, m, x)] for k in rounds] for m, x in cells.items()}
            tps = {m: [r["tokens_per_s"] for r in run[m]] for m in MODES}
            ratios = [a / c for a, c in zip(tps["async"], tps["colocated"])]
            async_steps = [s for r in run["async"] for s in r["steps"][meta["warmup"] :]]
            full = [r for k, r in by.items() if k[1:] == ("async", "full")]
            out.append(
                {
                    **meta,
                    "async_overrides": {**meta["async_overrides"], "rollout.sync_wire": wire},
                    "metric": "tokens_per_s_vs_colocated",
                    "value": statistics.median(ratios),
                    "unit": "ratio",
                    "workload": w,
                    "sync_wire": wire,
                    "response_lengths": run["colocated"][0]["spread"] or meta["response_len"],
                    "rounds": len(rounds),
                    "ratio_per_round": ratios,
                    "ratio_spread": _spread(ratios),
                    **{f"{m}_tokens_per_s": statistics.median(tps[m]) for m in MODES},
                    **{f"{m}_tokens_per_s_per_gpu": statistics.median(tps[m]) / g for m in MODES},
                    **{f"{m}_tokens_per_s_spread": _spread(tps[m]) for m in MODES},
                    **{f"{m}_tokens_per_s_per_round": tps[m] for m in MODES},
                    "colocated_step_s_median": statistics.median(
                        s["step_s"] for r in run["colocated"] for s in r["steps"][meta["warmup"] :]
                    ),
                    "numerics_ok": all(r["numerics"]["ok"] for m in MODES for r in run[m]),
                    "async_rollout_wait_s_median": statistics.median(
                        s.get("timing_s/rollout_wait", 0.0) for s in async_steps
                    ),
                    "async_weight_sync_s_median": statistics.median(
                        s.get("timing_s/weight_sync", 0.0) for s in async_steps
                    ),
                    "async_rollout_gen_s_median": statistics.median(
                        s.get("async/rollout_gen_s", 0.0) for s in async_steps
                    ),
                    "async_sync_pause_s_median": statistics.median(
                        s.get("async/sync_pause_s", 0.0) for s in async_steps
                    ),
                    "async_staleness_max": max(
                        s.get("async/staleness_max", 0) for s in async_steps
                    ),
                    **sync_fields(run["async"], meta["warmup"], full if wire == "delta" else None),
                    "raw": [r for pair in zip(run["colocated"], run["async"]) for r in pair],
                }
            )
    return out


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _bridge(recs: list[dict]) -> str:
    """The async launches' bridge, as their link probes saw it."""
    links = [x["link"] for r in recs for x in r["raw"] if x.get("link")]
    if not links:
        return "gloo bridge (host-staged)"  # a run without probes (older records' wording)
    t = links[0]["transport"]
    staged = t == "gloo" and not recs[0]["device"].startswith("cpu")
    return f"{t} bridge" + (" (host-staged)" if staged else "")


def markdown(recs: list[dict]) -> str:
    """``async_overlap.md`` from this run's ``tokens_per_s_vs_colocated`` records; with
    ``gpus >= 2`` each of issue 34's targets (:data:`_overlap_sync.TARGETS`) met or missed."""
    m, g = recs[0], recs[0].get("gpus", 1)
    wires = ", ".join(dict.fromkeys(r["sync_wire"] for r in recs))
    where = "sharing one device" if g == 1 else f"on {g} devices"
    b = m["rollout_batch"]
    colo = f"colocated: {g} data-parallel processes, each generating {b // g} of the {b}"
    colo = colo if g > 1 else "colocated: one process"
    lines = [
        f"# Async rollout vs colocated, {where}",
        "",
        f"Generated by benchmarks/gpu/async_overlap.py from {BENCH}.jsonl, run `{m['run_id']}`, "
        f"{m['device']}, commit `{m['commit']}`{' (dirty)' if m['dirty'] else ''}, "
        f"{m['date'][:16]}. Shape {m['shape']}, {m['rollout_batch']} sequences x "
        f"{m['prompt_len']}-token prompts; {m['warmup']} warm-up + {m['steps']} timed steps per "
        "launch; async: 1 training + 1 rollout process"
        + (" (one GPU each)" if g > 1 and not m["device"].startswith("cpu") else "")
        + f", max_staleness 1, {wires} wire, {_bridge(recs)}, decoupled loss; {colo}; both "
        "modes: "
        + ", ".join(f"`{k}={v}`" for k, v in m["overrides"].items())
        + ". spread: EOS forced per prompt at a length uniform in the range.",
        "",
        "| workload | wire | responses | rounds | colocated tok/s (min-max) | async tok/s "
        "(min-max) | async / colocated (min-max) | rollout wait s | sync pause s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        c, s = r["colocated_tokens_per_s_spread"], r["async_tokens_per_s_spread"]
        q, lens = r["ratio_spread"], r["response_lengths"]
        lens = f"{lens[0]}-{lens[1]}" if isinstance(lens, (list, tuple)) else lens
        lines.append(
            f"| {r['workload']} | {r['sync_wire']} | {lens} | {r['rounds']} | "
            f"{r['colocated_tokens_per_s']:.0f} ({c[0]:.0f}-{c[1]:.0f}) | "
            f"{r['async_tokens_per_s']:.0f} ({s[0]:.0f}-{s[1]:.0f}) | "
            f"**{r['value']:.3f}** ({q[0]:.3f}-{q[1]:.3f}) | "
            f"{r['async_rollout_wait_s_median']:.3f} | {r['async_sync_pause_s_median']:.3f} |"
        )
    lines += [
        "",
        "Steps and weight sync (medians; the sync columns over the versions after the "
        "first, whose sync is always full; benchmarks/gpu/_overlap_sync.py defines them): "
        "line rate = the bridge's bandwidth measured at the launch's start "
        "(benchmarks/gpu/_bridge_probe.py), line s = sync bytes at that rate; pause = what "
        "the rollout rank's switch() blocked, with its idle wait for the publication when it "
        "is ahead of training; own = each pause capped at its sync time.",
        "",
        "| workload | wire | step s colocated / async | tok/s/GPU colocated / async | "
        "sync bytes first / later | changed frac | sync s | line rate GB/s | line s | "
        "sync / line | pause s (own) | pause / step (own) | delta / full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in recs:
        bw = r.get("link_bytes_per_s")
        lines.append(
            f"| {r['workload']} | {r['sync_wire']} | {r['colocated_step_s_median']:.3f} / "
            f"{_f(r['async_step_s_median'])} | {r['colocated_tokens_per_s_per_gpu']:.0f} / "
            f"{r['async_tokens_per_s_per_gpu']:.0f} | {_f(r['sync_bytes_first'], '.0f')} / "
            f"{_f(r['sync_bytes_median'], '.0f')} | {_f(r['sync_changed_frac_median'], '.4f')} | "
            f"{_f(r['sync_time_s_median'], '.4f')} | {_f(bw and bw / 1e9, '.2f')} | "
            f"{_f(r['sync_line_s_median'], '.4f')} | {_f(r['sync_time_vs_line_rate'])} | "
            f"{_f(r['sync_pause_s_median'], '.4f')} ({_f(r['sync_own_pause_s_median'], '.4f')}) | "
            f"{_f(r['pause_vs_step'])} ({_f(r['sync_own_pause_vs_step'])}) | "
            f"{_f(r.get('delta_bytes_vs_full'))} |"
        )
    if g == 1:
        lines += ["", "Reported whatever it shows (issue 31: no target on one device)."]
        return "\n".join(lines) + "\n"
    lines += [
        "",
        f"Targets (issue 34, on {g} GPUs)"
        + (
            ": this run is on the CPU, its verdicts only exercise the plumbing."
            if m["device"].startswith("cpu")
            else ":"
        ),
        "",
        "| target | bound | workload | wire | value | |",
        "|---|---|---|---|---|---|",
    ]
    for field, (bound, kind) in TARGETS.items():
        for r in recs:
            if field != "tokens_per_s_vs_colocated" and field not in r:
                continue  # delta_bytes_vs_full: on the delta wire's records
            v = r["value"] if field == "tokens_per_s_vs_colocated" else r[field]
            sign = ">=" if kind == "min" else "<="
            lines.append(
                f"| {field} | {sign} {bound:g} | {r['workload']} | {r['sync_wire']} | "
                f"{_f(v)} | **{verdict(field, v)}** |"
            )
    return "\n".join(lines) + "\n"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--smoke", action="store_true", help="CPU (gloo), tiny model, 1 round")
    p.add_argument(
        "--gpus", type=int, choices=sorted(PRESETS), default=1,
        help="1: async's training and rollout processes share one GPU, colocated is one "
        "process; 2: they get one GPU each (NCCL bridge), colocated is 2 data-parallel "
        "processes (comm.nproc=2), the global batch the same. The first N visible GPUs are "
        "used; fewer visible on a CUDA machine is refused before any launch",
    )  # fmt: skip
    p.add_argument(
        "--workloads", default=None,
        help=f"comma list of {', '.join(WORKLOADS)} (default: per --gpus, "
        + "; ".join(f"{g}: {v['workloads']}" for g, v in PRESETS.items()) + ")",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--steps", type=int, default=None,
        help="timed steps per launch (default: per --gpus, "
        + "; ".join(f"{g}: {v['steps']}" for g, v in PRESETS.items()) + "; smoke: 1 / 2)",
    )  # fmt: skip
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen05b")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--rollout-batch", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--model-dir", default=None, help="config.json + tokenizer folder")
    p.add_argument("--backend", default="auto")
    p.add_argument("--rollout-dtype", default="bfloat16")
    p.add_argument(
        "--sync-wires", default=None,
        help="comma list of rollout.sync_wire values, one async launch each per round and "
        "workload (default: per --gpus, "
        + "; ".join(f"{g}: {v['sync_wires']}" for g, v in PRESETS.items())
        + "; smoke: full at --gpus 1, whose rollout is fp32, full,delta at 2, in bf16)",
    )  # fmt: skip
    p.add_argument(
        "--sync-wire", choices=WIRES, default=None,
        help="one wire: the same as --sync-wires WIRE",
    )  # fmt: skip
    p.add_argument(
        "--probe-bytes", type=int, default=None,
        help=f"bytes of the bridge probe at each async launch's start (default {PROBE_BYTES}, "
        "smoke 4 MiB; 0: none)",
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
    preset = PRESETS[a.gpus]
    if a.sync_wire and a.sync_wires:
        p.error("give --sync-wire or --sync-wires, not both")
    wires = a.sync_wire or a.sync_wires
    if a.smoke:
        a.shape, a.prompt_len, a.response_len, a.rollout_batch, a.micro_batch = "tiny", 8, 4, 4, 2
        a.rounds, a.backend = 1, "gloo"
        a.steps = 1 if a.gpus == 1 else 2  # 2: a version after the first is switched in
        wires = wires or ("full" if a.gpus == 1 else "full,delta")
        a.rollout_dtype = "bfloat16" if "delta" in wires else "float32"  # delta needs bf16
        a.probe_bytes = 4 << 20 if a.probe_bytes is None else a.probe_bytes
    a.sync_wires = _names(p, "--sync-wires", wires or preset["sync_wires"], WIRES)
    a.workloads = _names(p, "--workloads", a.workloads or preset["workloads"], WORKLOADS)
    a.steps = preset["steps"] if a.steps is None else a.steps
    a.probe_bytes = PROBE_BYTES if a.probe_bytes is None else a.probe_bytes
    if a.rollout_batch % a.gpus:
        p.error(f"--rollout-batch {a.rollout_batch} must divide over --gpus {a.gpus}")
    return a


def _names(p: argparse.ArgumentParser, flag: str, value: str, allowed) -> list[str]:
    """A comma list of names from ``allowed``, in the given order, no repeats."""
    names = list(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        p.error(f"{flag} {value!r}: choose from {', '.join(allowed)}")
    return names


def _gpu_env(gpus: int) -> tuple[dict[str, str] | None, str | None]:
    """The ranks' ``CUDA_VISIBLE_DEVICES`` (the first ``gpus`` visible GPUs; None without
    CUDA) and, when fewer are visible, why the run is refused."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    n = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x] if visible else [str(i) for i in range(n)]
    if n < gpus:
        return None, (
            f"--gpus {gpus} needs {gpus} visible GPUs, this machine shows {n} "
            f"(CUDA_VISIBLE_DEVICES={visible!r}): nothing launched. Run on a machine with "
            f"{gpus} GPUs, or --gpus {n} (CUDA_VISIBLE_DEVICES= runs --smoke on the CPU)"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[:gpus])}, None


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, append the records, write the markdown; 0 when every workload and
    wire has at least one complete round and no launch failed (2: too few GPUs, refused)."""
    import torch

    a = _args(argv)
    a.rank_env, refused = _gpu_env(a.gpus)
    if refused:
        print(f"async_overlap.py: {refused}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not a.smoke else None
    meta = {
        "benchmark": BENCH,
        "device": f"{a.gpus} x {gpu}" if gpu else f"cpu ({os.cpu_count()} cores), gloo",
        "versions": versions(),
        "date": now_iso(),
        "commit": commit(),
        "dirty": dirty(REPO),
        "run_id": os.environ.get("VERL_RUN_ID") or uuid.uuid4().hex[:12],
        "smoke": a.smoke,
        "gpus": a.gpus,
        "sync_wires": a.sync_wires,
        "workloads": a.workloads,
        "probe_bytes": a.probe_bytes,
        **{k: getattr(a, k) for k in ("shape", "prompt_len", "response_len", "rollout_batch")},
        **{k: getattr(a, k) for k in ("micro_batch", "warmup", "steps", "rollout_dtype")},
        "overrides": {"train.torch_compile": a.torch_compile},
        "async_overrides": {
            "rollout.n_ranks": 1,
            "rollout.max_staleness": 1,
            "rollout.sync_wire": a.sync_wires[0],  # each record: its own
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
            k = rnd % len(a.sync_wires)  # the wires' order turns per round (interleaved)
            launches = [("colocated", None)]
            launches += [("async", x) for x in a.sync_wires[k:] + a.sync_wires[:k]]
            for w in a.workloads:
                for mode, wire in launches:
                    rd = str(Path(tmp) / f"run_{rnd}_{w}_{mode}{'_' + wire if wire else ''}")
                    failed += _launch(a, mode, w, rnd, raw, rd, wire) != 0
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
            f"{r['workload']} {r['sync_wire']}: colocated {r['colocated_tokens_per_s']:.0f} "
            f"tok/s, async {r['async_tokens_per_s']:.0f} tok/s, ratio {r['value']:.3f} "
            f"{r['ratio_spread']} over {r['rounds']} round(s); pause/step "
            f"{_f(r['pause_vs_step'])}, sync/line {_f(r['sync_time_vs_line_rate'])}"
            + (f", delta/full {_f(r['delta_bytes_vs_full'])}" if "delta_bytes_vs_full" in r else "")
        )
    return 0 if len(recs) == len(a.workloads) * len(a.sync_wires) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
