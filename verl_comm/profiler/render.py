"""Text table and PNG chart of a profile report."""

from __future__ import annotations

import os
from pathlib import Path

from verl_comm.extras import pyplot, save_figure
from verl_comm.profiler.analysis import BACKWARD_PHASES, ENVELOPE_OPS

PHASE_ORDER = (
    "gen",
    "reshard",
    "reward",
    "old_log_prob",
    "ref",
    "values",
    "adv",
    "update_critic",
    "update_actor",
)


def _s(x: float | None, fmt: str = ".3f", unit: str = " s") -> str:
    return "n/a" if x is None else f"{x:{fmt}}{unit}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _mb(x: int | float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.1f} MiB"


def _ordered(names):
    known = [n for n in PHASE_ORDER if n in names]
    return known + sorted(n for n in names if n not in PHASE_ORDER)


def text_report(metrics: dict, diagnosis: dict) -> str:
    """Human-readable report of one run: table, then the diagnosis."""
    n = max(metrics["step_time_max_over_ranks"]["n"], 1)
    lines = _header_lines(metrics) + _phase_lines(metrics) + _comm_lines(metrics, n)
    lines += _device_lines(metrics, n) + _tail_lines(metrics) + _diagnosis_lines(diagnosis)
    return "\n".join(lines) + "\n"


def _header_lines(metrics: dict) -> list[str]:
    """Run, ranks, device and the step-time line."""
    run, st = metrics["run"], metrics["step_time_max_over_ranks"]
    lines = [
        f"=== profile report: {run['dir']}",
        f"    ranks {run['ranks']} (world {run['world_size']}), device {run['device']}, "
        f"torch {run['torch']}, {st['n']} profiled step{'s' if st['n'] != 1 else ''}"
        + (", CUDA synchronised at phase boundaries" if run.get("cuda_sync") else ""),
    ]
    if run.get("missing_ranks"):
        lines.append(f"    MISSING profiles of ranks {run['missing_ranks']}: shown ranks only")
    return lines + [
        "",
        f"step time (max over ranks)  mean {_s(st['mean'])}  P50 {_s(st['p50'])}  "
        f"P99 {_s(st['p99'])}  P99/P50 {_s(st['p99_over_p50'], '.2f', '')}",
    ]


def _phase_lines(metrics: dict) -> list[str]:
    """The phase table (time, share, calls, memory) and the unattributed share."""
    run, phases = metrics["run"], metrics["phases"]
    lines = [
        "",
        f"{'phase':<18}{'s/step':>10}{'share':>9}{'calls':>7}"
        + (
            f"{'peak alloc':>14}{'reserved':>14}"
            if run.get("cuda")
            else f"{'RSS':>14}  (process RSS at phase edges, CPU)"
        ),
    ]
    for name in _ordered(phases):
        d = phases[name]
        indent = "  " if d["depth"] > 0 else ""
        lines.append(
            f"{indent + name:<18}{d['per_step_s']:>10.4f}{_pct(d['share']):>9}{d['count']:>7}"
            f"{_mb(d.get('mem_peak')):>14}"
            + (f"{_mb(d.get('mem_reserved_end')):>14}" if run.get("cuda") else "")
        )
    lines.append(f"{'(outside phases)':<18}{'':>10}{_pct(metrics['unattributed_share']):>9}")
    return lines


def _comm_lines(metrics: dict, n: int) -> list[str]:
    """Communication per step: time, exposed part, bytes, top tags, torch records, ranks."""
    c, phases = metrics["comm"], metrics["phases"]
    bwd = "/".join(p for p in BACKWARD_PHASES if p in phases) or "none"
    lines = [
        "",
        f"communication ({c['source']})",
        f"  {_s(c['per_step_s'])}/step = {_pct(c['share_of_step'])} of step; "
        f"{_pct(c['share_of_backward'])} of backward ({bwd})",
        f"  exposed {_s(c['exposed_s'] / n)}/step = {_pct(c['exposed_share_of_step'])} "
        f"of step ({c['exposed_note']})",
        "  bytes per step: "
        + (
            f"verl_comm wire {c['bytes_total'] / n / 1e6:.2f} MB"
            + (
                f" for {c['payload_bytes'] / n / 1e6:.2f} MB of gradient buckets"
                if c.get("payload_bytes")
                else ""
            )
            if c["bytes_total"]
            else "no verl_comm records (e.g. DeepSpeed's own reduction)"
        )
        + (
            f"; torch collectives' input {c['torch_input_bytes'] / n / 1e6:.2f} MB"
            if c.get("torch_input_bytes")
            else ""
        ),
    ]
    for tag, d in sorted(c["by_tag"].items(), key=lambda kv: -kv[1]["time_s"])[:6]:
        wraps = "  (wraps the hook rows)" if tag.split()[0] in ENVELOPE_OPS else ""
        lines.append(
            f"    {tag:<36} {d['count'] / n:5.1f}/step {d['bytes'] / n / 1e6:9.2f} MB/step "
            f"{d['time_s'] / n:8.4f} s/step{wraps}"
        )
    if c["torch_ops"]:
        lines.append(
            "  torch records: " + ", ".join(f"{k} x{v}" for k, v in sorted(c["torch_ops"].items()))
        )
    for r in metrics.get("per_rank", []):
        lines.append(
            f"  rank {r['rank']}: step P50 {_s(r['step_p50_s'])}, comm {_pct(r['comm_share_of_step'])} "
            f"of step, host phases {_pct(r['host_share'])}"
        )
    return lines


def _device_lines(metrics: dict, n: int) -> list[str]:
    """GPU idle gaps by phase and the kernels with the most device time."""
    idle = metrics["gpu_idle"]
    if idle is None:
        return ["\nGPU idle gaps: n/a (no device kernels in the trace)"]
    lines = [
        f"\nGPU idle gaps: {_s(idle['total_s'] / n)}/step = {_pct(idle['share'])} of step time"
    ]
    for ph, t in sorted(idle["by_phase_s"].items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"    in {ph:<20} {t / n:.4f} s/step")
    if idle.get("kernel_count"):
        lines.append(
            f"  device busy {_s(idle['busy_s'] / n)}/step, "
            f"{idle['kernel_count'] / n:.0f} kernels/step; most device time:"
        )
        for k in idle.get("top_kernels", [])[:5]:
            lines.append(f"    {k['name'][:60]:<60} n={k['count']:<7} {k['time_s'] / n:.4f} s/step")
    return lines


def _tail_lines(metrics: dict) -> list[str]:
    """Rollout latency, reshard, and the profiler's own cost."""
    r, rs = metrics["rollout"], metrics["reshard"]
    lines = [
        f"rollout latency ({r['source']}): n={r['n']} P50 {_s(r['p50'])} P99 {_s(r['p99'])}",
        f"reshard: {'enabled' if rs['enabled'] else 'no reshard phase'}, {_s(rs['per_step_s'])}/step, "
        f"{rs['bytes'] / 1e6:.1f} MB recorded",
        f"profiler bookkeeping outside the steps (trace export and parsing, memory "
        f"snapshot): {_s(metrics['overhead']['bookkeeping_s'], '.2f')} in all",
    ]
    ov = metrics["overhead"]
    if ov.get("in_step_slowdown") is not None:
        lines.append(
            f"profiling cost inside steps: profiled step P50 {_s(ov['profiled_p50_s'])} vs "
            f"{_s(ov['unprofiled_p50_s'])} unprofiled ({ov['unprofiled_steps']} "
            f"step{'s' if ov['unprofiled_steps'] != 1 else ''}): "
            f"{ov['in_step_slowdown']:+.0%}; phase times above include it"
        )
    return lines


def _diagnosis_lines(diagnosis: dict) -> list[str]:
    """Each symptom with its verdict, evidence, causes and remedies."""
    lines = ["", "diagnosis:"]
    for sym in diagnosis["symptoms"]:
        mark = {True: "FOUND", False: "ok", None: "n/a"}[sym["found"]]
        lines.append(f"  [{mark:^5}] {sym['id']}. {sym['name']}: {sym['evidence']}")
        for cause in sym["likely_causes"]:
            lines.append(f"            cause: {cause}")
        for rem in sym["remedy"]:
            lines.append(f"            remedy: {rem}")
    if not diagnosis["found"]:
        lines.append("  no bottleneck symptom above its threshold")
    return lines


def plot_report(metrics: dict, path: str | os.PathLike) -> Path:
    """Stacked bars of the top-level phases per step, with communication time per step
    drawn as a black line over them (PNG, matplotlib Agg)."""
    plt = pyplot()

    steps = metrics["per_step"]
    names = _ordered({n for s in steps for n in s["phases"]})
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(steps) + 3), 4.5))
    xs = list(range(len(steps)))
    bottom = [0.0] * len(steps)
    cmap = plt.get_cmap("tab10")
    for i, n in enumerate(names):
        vals = [s["phases"].get(n, 0.0) for s in steps]
        ax.bar(xs, vals, bottom=bottom, label=n, color=cmap(i % 10))
        bottom = [b + v for b, v in zip(bottom, vals)]
    other = [max(0.0, s["time_s"] - b) for s, b in zip(steps, bottom)]
    ax.bar(xs, other, bottom=bottom, label="(outside phases)", color="lightgrey")
    ax.plot(xs, [s["comm_s"] for s in steps], "k.-", label="communication")
    ax.set_xticks(xs, [str(s["step"]) for s in steps])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    c = metrics["comm"]
    ax.set_title(
        f"{Path(metrics['run']['dir']).name}: step P50 {metrics['step_time_max_over_ranks']['p50']:.3f} s, "
        f"comm {(c['share_of_step'] or 0):.0%} of step"
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path)
