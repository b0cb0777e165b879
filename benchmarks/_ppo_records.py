"""Records and report of ``benchmarks/ppo_throughput.py``: the JSON records of a system's
timed steps, the floor of the model shape, the JSONL file and the markdown report generated
from it (with the ``speedup_vs_trl`` record and the targets as measured)."""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from _ppo_env import _commit, _device, _dirty, _versions
from _ppo_workload import Setup

BENCH = "ppo_throughput"
TARGET_SPEEDUP = 3.0  # issue 15: ours with default settings >= 3x TRL tokens/s/GPU
TARGET_MFU = 0.35  # issue 15: actor and critic updates


def summarize(
    system: str, s: Setup, steps: list[dict[str, Any]], world: int, extra: dict[str, Any]
) -> list[dict[str, Any]]:
    """Records for the timed steps (after warm-up): tokens/s/GPU, step time, phases."""
    timed = steps[s.warmup :]
    step_med = statistics.median(x["step_s"] for x in timed)
    tokens = s.rollout_batch * (s.prompt_len + s.response_len)
    base = {
        "benchmark": BENCH,
        "system": system,
        "device": _device(world),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "dirty": _dirty(),
        "world_size": world,
        "shape": s.shape if s.layers is None else f"{s.shape}, {s.layers} layers",
        "prompt_len": s.prompt_len,
        "response_len": s.response_len,
        "rollout_batch": s.rollout_batch,
        "micro_batch": s.micro_batch,
        "warmup_steps": s.warmup,
        "timed_steps": len(timed),
        "overrides": s.overrides,
        "variant": s.variant or _variant(s.overrides),
        "run_id": s.run_id,
        **extra,
    }
    base.update(_micro_batch_fields(system, s, steps[0].get("token_budget")))
    numerics = steps[0].get("numerics")
    base["numerics_ok"] = bool(numerics["ok"]) if numerics else None
    base["numerics"] = numerics or "TRL: finite policy and value losses checked every step"
    if steps[0].get("fast_path"):
        base["fast_path"] = steps[0]["fast_path"]
    return [
        {
            **base,
            "metric": "tokens_per_s_per_gpu",
            "value": tokens / step_med / world,
            "unit": "tokens/s/GPU",
            "tokens_per_step": tokens,
            "step_s_all": [round(x["step_s"], 4) for x in timed],
            "warmup_step_s": [round(x["step_s"], 4) for x in steps[: s.warmup]],
        },
        {**base, "metric": "step_time_s", "value": step_med, "unit": "s"},
        *_phase_records(base, timed),
    ]


def _phase_records(base: dict[str, Any], timed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over the timed steps: each phase's time, the trainer's own tokens/s/GPU, and
    ours' MFU, TFLOP/s, peak memory per phase and decode rate against its floor."""
    recs = []
    for name in timed[0]["phases"]:
        recs.append(
            {
                **base,
                "metric": "phase_time_s",
                "phase": name,
                "value": statistics.median(x["phases"].get(name, 0.0) for x in timed),
                "unit": "s",
            }
        )
    if "trainer_tokens_per_s_per_gpu" in timed[0]:
        recs.append(
            {
                **base,
                "metric": "trainer_tokens_per_s_per_gpu",
                "value": statistics.median(x["trainer_tokens_per_s_per_gpu"] for x in timed),
                "unit": "tokens/s/GPU",
                "note": "the trainer's perf/throughput_tokens_per_s_per_gpu: non-pad tokens "
                "over the sum of its phase times",
            }
        )
    units = {"perf/mfu/": ("mfu", "fraction"), "perf/tflops/": ("tflops", "TFLOP/s/GPU")}
    units["memory/peak_gib/"] = ("peak_memory", "GiB")
    for key in timed[0].get("perf", {}):
        vals = [x["perf"][key] for x in timed if key in x.get("perf", {})]
        for prefix, (metric, unit) in units.items():
            if key.startswith(prefix):
                recs.append(
                    {**base, "metric": metric, "phase": key[len(prefix) :], "unit": unit,
                     "value": statistics.median(vals)}
                )  # fmt: skip
        if key.startswith("perf/decode"):
            unit = "x" if key.endswith("vs_floor") else "tokens/s/GPU"
            recs.append(
                {**base, "metric": key.split("/", 1)[1], "unit": unit,
                 "value": statistics.median(vals)}
            )  # fmt: skip
    return recs


def floor_record(s: Setup, world: int, base: dict[str, Any]) -> dict[str, Any] | None:
    """The step-time floor of the workload from the model shape (1 x the device peaks):
    matmul FLOPs of what PPO needs (actor and critic updates, ref and values forwards; the
    LM head on response positions) at peak FLOP/s plus the rollout's decode floor
    (:mod:`verl_ppo.observe.perf`). None off CUDA or on an unknown device."""
    from types import SimpleNamespace

    from verl_ppo.observe.perf import ModelFlops, device_peaks

    if not torch.cuda.is_available():
        return None
    peak = device_peaks(torch.device("cuda", torch.cuda.current_device()))
    if peak is None:
        return None
    mf = ModelFlops.of(SimpleNamespace(**s.model_fields()))
    local = s.rollout_batch // world
    lens = torch.full((local,), s.prompt_len + s.response_len)
    resp = local * s.response_len
    fa, fc = mf.forward(lens, resp), mf.forward(lens, 0)
    model_s = (3 * fa + 3 * fc + fa + fc) / peak[0]
    gen_s = mf.decode_floor_s(local, s.prompt_len, s.response_len, peak)
    step = model_s + gen_s
    tokens = s.rollout_batch * (s.prompt_len + s.response_len)
    return {
        **{
            k: base.get(k)
            for k in ("benchmark", "device", "versions", "date", "commit", "dirty", "run_id")
        },
        "system": "floor",
        "variant": "model shape at 100% of peak",
        "shape": s.shape if s.layers is None else f"{s.shape}, {s.layers} layers",
        "prompt_len": s.prompt_len,
        "response_len": s.response_len,
        "world_size": world,
        "metric": "tokens_per_s_per_gpu",
        "value": tokens / step / world,
        "unit": "tokens/s/GPU",
        "step_s": step,
        "model_flops_s": model_s,
        "gen_floor_s": gen_s,
        "peak_flops": peak[0],
        "hbm_bytes_per_s": peak[1],
    }


def _same(r: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in r.items() if k != "date"}, sort_keys=True)


def append_records(out: Path, recs: list[dict[str, Any]]) -> None:
    """Append JSON lines to ``out/ppo_throughput.jsonl``, leaving out a record equal to one
    already there apart from its ``date`` (the floor of a run, written by each of its
    invocations with ``--variant``, is the same record each time)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{BENCH}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    seen = {_same(json.loads(x)) for x in lines if x.strip()}
    with open(path, "a") as f:
        for r in recs:
            if _same(r) not in seen:
                seen.add(_same(r))
                f.write(json.dumps(r) + "\n")


def _variant(overrides: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "default"


def _fmt(rec: dict[str, Any] | None, spec: str) -> str:
    return "-" if rec is None else format(rec["value"], spec)


def _micro_batch_fields(system: str, s: Setup, token_budget: int | None) -> dict[str, Any]:
    """What one training forward/backward of a rank holds, as run: ``effective_micro_batch``
    (sequences), ``micro_batch_tokens`` and ``token_budget`` (ours: the resolved
    ``train.max_tokens_per_micro_batch``, None = fixed micro-batches; TRL has none)."""
    seq = s.prompt_len + s.response_len
    if system == "trl_ppo":
        micro = s.trl_micro_batch or s.micro_batch
        return {
            "effective_micro_batch": micro,
            "micro_batch_tokens": micro * seq,
            "token_budget": None,
            "trl_torch_compile": s.trl_compile,
        }
    micro = token_budget // seq if token_budget else s.micro_batch  # fixed-length sequences
    return {
        "effective_micro_batch": micro,
        "micro_batch_tokens": token_budget or micro * seq,
        "token_budget": token_budget,
    }


def _workload(r: dict[str, Any], by_date: dict[str, tuple]) -> tuple:
    """``(shape, prompt_len, response_len)`` of a record; a floor record without them takes
    those of the launch that wrote it (same ``date``)."""
    if r.get("shape") is not None:
        return (r["shape"], r.get("prompt_len"), r.get("response_len"))
    return by_date.get(r.get("date"), ("?", None, None))


def write_report(out: Path, run_id: str | None = None) -> dict[str, Any] | None:
    """Write ``out/ppo_throughput.md`` from the JSON lines of one run (``run_id``; default:
    that of the last record) and append a ``speedup_vs_trl`` record (ours with default
    settings over TRL) when both were measured and the run holds no record of that ratio yet
    (writing the report again adds nothing); returns that record or None.

    Tables: every system and variant next to TRL and the floor of the model shape; then,
    for ours, MFU, TFLOP/s and peak memory per phase; then the targets as measured. A run
    over several workloads (shape, prompt and response lengths) gets a section each."""
    recs = [json.loads(x) for x in (out / f"{BENCH}.jsonl").read_text().splitlines() if x]
    run_id = run_id or next((r.get("run_id") for r in reversed(recs) if r.get("run_id")), None)
    recs = [r for r in recs if r.get("run_id") == run_id]
    by_date = {r["date"]: _workload(r, {}) for r in recs if r.get("shape") is not None}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in recs:
        groups.setdefault(_workload(r, by_date), []).append(r)
    lines, speed = [f"# {BENCH}", "", f"run_id `{run_id}`", ""], None
    for (shape, p_len, r_len), group in groups.items():
        if len(groups) > 1:
            lines += [f"## {shape}, prompt {p_len} + response {r_len} tokens", ""]
        body, sp = _report(out, group)
        lines += body
        speed = speed or sp
    (out / f"{BENCH}.md").write_text("\n".join(lines) + "\n")
    return speed


def _report(out: Path, recs: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any] | None]:
    """The tables of one workload's records (see :func:`write_report`)."""
    last: dict[tuple, dict[str, Any]] = {}
    for r in recs:
        if r["metric"] != "speedup_vs_trl":
            last[(r["system"], r.get("variant", "default"), r["metric"], r.get("phase"))] = r
    rows = sorted(
        {k[:2] for k in last if k[2] == "tokens_per_s_per_gpu"},
        key=lambda k: (k[0] == "floor", k[0], k[1] != "default", k[1]),
    )
    get = last.get
    # the claim is against the strongest TRL measured: "tuned" (its largest micro-batch that
    # fits, its own speed options) when the run has it, else TRL as configured by default
    trl = get(("trl_ppo", "tuned", "tokens_per_s_per_gpu", None)) or get(
        ("trl_ppo", "default", "tokens_per_s_per_gpu", None)
    )
    lines = _systems_table(last, rows, trl)
    real = [k for k in rows if k[0] != "floor"]
    ours = [k for k in real if k[0] == "verl_ppo"]
    if ours:
        lines += _ours_table(last, ours)
    for k, r in last.items():
        if k[2] == "skipped":
            lines.append(f"\n{k[0]} skipped: {r['reason']}")
    speed = None
    if trl and ("verl_ppo", "default") in set(rows):
        speed = _speedup_record(last, trl)
        # The report is rewritten whenever a system of the run is added: append the ratio
        # only when it is new for this run (bit-equal: the same division of the same records)
        if not any(
            r["metric"] == "speedup_vs_trl" and r.get("value") == speed["value"] for r in recs
        ):
            append_records(out, [speed])
        lines += _targets(last, trl, speed)
    return lines, speed


def _systems_table(last: dict[tuple, dict], rows: list[tuple], trl: dict | None) -> list[str]:
    """The setup line and one row per system and variant (with TRL and the floor), then
    the untimed warm-up steps."""
    get = last.get
    floor = next((last[(*k, "tokens_per_s_per_gpu", None)] for k in rows if k[0] == "floor"), None)
    lines: list[str] = []
    real = [k for k in rows if k[0] != "floor"]
    if real:
        r0 = last[(*real[0], "tokens_per_s_per_gpu", None)]
        lines += [
            f"{r0['device']}; {r0['shape']} shape (random weights), prompt {r0['prompt_len']}"
            f" + response {r0['response_len']} tokens, rollout batch {r0['rollout_batch']} "
            f"(global), micro-batch {r0['micro_batch']} per rank (ours: unless a token budget "
            f"applies); median of {r0['timed_steps']} steps after {r0['warmup_steps']} warm-up; "
            "each system in its own launch. tokens/s/GPU = batch x (prompt + response) / "
            "step time / GPUs. Floor: the model shape's matmul FLOPs of PPO (updates 3x, ref and "
            "values 1x a forward) at the dense bf16 peak plus the decode floor (weights + KV "
            "cache read per step at HBM bandwidth).",
            "",
            "| system | variant | tokens/s/GPU | vs TRL | of floor | step (s) | micro-batch "
            "(seq / tokens) | phases: median s | numerics | commit, date |",
            "|---|---|---:|---:|---:|---:|---|---|---|---|",
        ]
    for row in rows:
        tps = last[(*row, "tokens_per_s_per_gpu", None)]
        st = get((*row, "step_time_s", None))
        ph = ", ".join(
            f"{k[3]} {v['value']:.3g}" for k, v in last.items() if k[:3] == (*row, "phase_time_s")
        )
        if row[0] == "floor":
            ph = f"model FLOPs {tps['model_flops_s']:.3g}, gen {tps['gen_floor_s']:.3g}"
        num = tps.get("numerics")
        if isinstance(num, dict):
            num = (
                f"{'ok' if num['ok'] else 'FAILED'}: |rollout-HF| {num['rollout_vs_hf']:.3g}, "
                f"|actor-HF| {num['actor_vs_hf']:.3g} < {num['bound']:.3g}"
            )
        vs_trl = f"{tps['value'] / trl['value']:.2f}" if trl else "-"
        of_floor = f"{tps['value'] / floor['value']:.0%}" if floor else "-"
        step = tps.get("step_s") if st is None else st["value"]
        mb = "-"
        if tps.get("effective_micro_batch"):  # older records: the --micro-batch only
            mb = f"{tps['effective_micro_batch']} / {tps['micro_batch_tokens']}"
            mb += " (token budget)" if tps.get("token_budget") else ""
        lines.append(
            f"| {row[0]} | {row[1]} | {tps['value']:.0f} | {vs_trl} | {of_floor} | {step:.3g} "
            f"| {mb} | {ph} | {num or '-'} | {tps['commit']}, {tps['date']} |"
        )
    warm = [
        f"{k[0]} {k[1]}: " + ", ".join(f"{x:.3g}" for x in last[(*k, m, None)]["warmup_step_s"])
        for k in real
        for m in ("tokens_per_s_per_gpu",)
        if last[(*k, m, None)].get("warmup_step_s")
    ]
    if warm:  # compilation, CUDA-graph capture, allocator growth: paid once, not timed
        lines += ["", "Warm-up steps (untimed), s: " + "; ".join(warm) + "."]
    return lines


def _ours_table(last: dict[tuple, dict], ours: list[tuple]) -> list[str]:
    """Ours per phase: MFU, TFLOP/s, peak memory, decode against its floor; what ``auto``
    resolved to."""
    get = last.get
    lines = []
    if ours:
        lines += [
            "",
            "Ours per phase (median over the timed steps): MFU = model FLOPs (verl's counting "
            "with causal attention, verl_ppo/observe/perf.py) / time / dense bf16 peak; peak = max CUDA memory allocated.",
            "",
            "| variant | phase | MFU | TFLOP/s | peak GiB |",
            "|---|---|---:|---:|---:|",
        ]
        for row in ours:
            phases = sorted({k[3] for k in last if k[:2] == row and k[2] == "peak_memory"})
            phases += sorted(
                {k[3] for k in last if k[:2] == row and k[2] in ("mfu", "tflops")} - set(phases)
            )
            for ph in phases:
                mfu, tf = get((*row, "mfu", ph)), get((*row, "tflops", ph))
                mem = get((*row, "peak_memory", ph))
                lines.append(
                    f"| {row[1]} | {ph} | {_fmt(mfu, '.1%')} | {_fmt(tf, '.0f')} | "
                    f"{_fmt(mem, '.1f')} |"
                )
            dec, fl = get((*row, "decode_tokens_per_s", None)), get((*row, "decode_vs_floor", None))
            if dec and fl:
                lines.append(
                    f"| {row[1]} | gen: decode {dec['value']:.0f} tokens/s | "
                    f"{fl['value']:.0%} of the floor | | |"
                )
        fp = last[(*ours[0], "tokens_per_s_per_gpu", None)].get("fast_path")
        if fp:
            lines += ["", "What `auto` resolved to (ours, default):", ""]
            lines += [f"- `{k}` = {v}" for k, v in fp.items()]
    return lines


def _speedup_record(last: dict[tuple, dict], trl: dict) -> dict[str, Any]:
    """The ``speedup_vs_trl`` record: ours with default settings over ``trl``."""
    o = last[("verl_ppo", "default", "tokens_per_s_per_gpu", None)]
    ratio = o["value"] / trl["value"]
    return {
        **{
            k: o.get(k)
            for k in ("benchmark", "device", "versions", "date", "commit", "dirty", "run_id")
        },
        "system": "verl_ppo",
        "variant": "default",
        "world_size": o.get("world_size"),
        "metric": "speedup_vs_trl",
        "value": ratio,
        "unit": "x",
        "target": TARGET_SPEEDUP,
        "met": ratio >= TARGET_SPEEDUP,
        "trl_stand_ins": trl.get("trl_stand_ins"),
        "trl_variant": trl.get("variant", "default"),
    }


def _targets(last: dict[tuple, dict], trl: dict, speed: dict[str, Any]) -> list[str]:
    """The targets of issue 15 as measured: the speed-up, the MFU of the updates."""
    get, ratio = last.get, speed["value"]
    lines: list[str] = []
    lines += ["", "Targets (issue 15), as measured:", ""]
    lines.append(
        f"- ours with default settings >= {TARGET_SPEEDUP} x TRL ({speed['trl_variant']}) "
        "tokens/s/GPU: "
        f"{ratio:.2f} x -> {'met' if speed['met'] else 'NOT met'}"
    )
    for ph in ("actor", "critic"):
        mfu = get(("verl_ppo", "default", "mfu", ph))
        if mfu:
            ok = mfu["value"] >= TARGET_MFU
            lines.append(
                f"- MFU of the {ph} update (default) >= {TARGET_MFU:.0%}: "
                f"{mfu['value']:.1%} -> {'met' if ok else 'NOT met'}"
            )
    if trl.get("trl_stand_ins"):
        lines.append(
            f"\nTRL {trl['versions'].get('trl')} ran with import-time stand-ins for "
            f"{', '.join(trl['trl_stand_ins'])} (not installed; unused by its PPO loop)."
        )
    return lines


def _skip_record(system: str, reason: str, run_id: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "benchmark": BENCH,
        "system": system,
        "metric": "skipped",
        "value": None,
        "unit": None,
        "reason": reason,
        "device": _device(1),
        "versions": _versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "dirty": _dirty(),
    }
