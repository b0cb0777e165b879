"""The markdown of ``benchmarks/comm_hooks.py``, generated from its JSONL records.

One table per run (``run_id``): methods are compared only within a run. Each run's
targets (issue 14 at world size 1 and on the shaped link; issue 21 on 2 GPUs; issue 28 at
world size 1 for runs whose records carry ``"api": "public"``) are stated as
measured, met or missed. Records without a ``run_id`` (issue 4's runs, each method in its
own run) stay in the JSONL and are counted, not tabulated.

Usage::

    python benchmarks/comm_hooks_report.py benchmarks/results/comm_hooks.jsonl  # rewrites .md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = "comm_hooks"
OURS_AND_REDUCER = ("ours_", "reducer_")

# (numerator, denominator, limit, issue) per kind of run
TARGETS = {
    "world1": [
        ("ours_int8", "none", 1.10, 14),
        ("ours_lowrank_int8_r32", "torch_powersgd_r32", 0.60, 14),
        ("ours_lowrank_int8_r128", "torch_powersgd_r128", 0.40, 14),
        ("ours_bf16", "torch_bf16", 1.02, 14),
        ("ours_auto", "none", 1.02, 14),
        ("reducer_none", "none", 1.03, 14),
    ],
    "world1_public": [  # issue 28: every hook built through the API a user calls
        ("ours_int8", "none", 1.08, 28),
        ("ours_lowrank_int8_r32", "torch_powersgd_r32", 0.60, 28),
        ("ours_lowrank_int8_r128", "torch_powersgd_r128", 0.40, 28),
        ("ours_bf16", "torch_bf16", 1.0, 28),
    ],
    "shaped": [
        ("ours_int8", "none", 0.60, 14),
        ("ours_int8", "torch_fp16", 0.75, 14),
        ("ours_lowrank_int8_r8", "torch_powersgd_r8", 0.80, 14),
    ],
    "socket": [
        ("ours_lowrank_int8_r128", "torch_powersgd_r128", 0.30, 21),
        ("ours_lowrank_int8_r32", "torch_powersgd_r32", 0.45, 21),
        ("ours_int8", "torch_bf16", 0.60, 21),
    ],
    "nvlink": [("ours_auto", "none", 1.05, 21), ("reducer_none", "none", 1.05, 21)],
}
CONTEXT = {  # (numerator, denominator, what the ratio says): printed, no target
    "world1": [
        ("torch_allreduce", "none", "what a Python comm hook costs over DDP's C++ all-reduce"),
        ("ours_auto", "torch_allreduce", "ours_auto against that floor"),
        ("reducer_none", "torch_allreduce", "reducer_none against that floor"),
    ],
}


def _kind(r0: dict) -> str | None:
    if r0.get("world_size") == 1:
        return "world1_public" if r0.get("api") == "public" else "world1"
    if r0.get("transport") in ("shaped_veth", "shaped_loopback"):
        return "shaped"
    return r0.get("transport") if r0.get("transport") in ("socket", "nvlink") else None


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def run_table(rs: list[dict]) -> list[str]:
    """Markdown lines of one run: header, table, targets."""
    r0 = next(r for r in rs if "workload" in r)

    def by(metric):
        return {r["hook"]: r for r in rs if r["metric"] == metric and r["rank"] in ("max", 0)}

    t = {r["hook"]: r for r in rs if r["metric"] == "step_time" and r["rank"] == "max"}
    syncs, wb, ef, hid = (
        by("host_syncs_per_step"),
        by("wire_bytes_per_step"),
        by("ef_state_bytes"),
        by("hidden_fraction"),
    )
    none = (t.get("none") or {}).get("value")
    link = f", link {r0['link_mbit']:g} Mbit/s" if r0.get("link_mbit") else ""
    lines = [
        f"## run {r0['run_id']}: {r0['device']}, world size {r0['world_size']}, transport "
        f"{r0['transport']}{link}",
        "",
        f"Workload: {r0['workload']}; warm-up {r0['warmup']}, median over {r0['rounds']} "
        f"rounds of the max across ranks; commit {r0['commit']}, {r0['date']}, versions "
        f"{r0['versions']}." + (f" {r0['note']}." if r0.get("note") else ""),
        "",
        "| hook | step ms | x none | host syncs/step | wire MB/step/rank | EF state MB | "
        "comm hidden | rel err | numerics |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for h, r in t.items():
        v = r["value"]
        lines.append(
            f"| {h} | {_fmt(v, '.2f')} | {'-' if v is None or not none else f'{v / none:.2f}x'} | "
            f"{_fmt((syncs.get(h) or {}).get('value'), 'd')} | "
            f"{_fmt((wb.get(h) or {}).get('value', 0) / 1e6, '.2f')} | "
            f"{_fmt((ef.get(h) or {}).get('value', 0) / 1e6, '.1f')} | "
            f"{_fmt((hid.get(h) or {}).get('value'), '.0%')} | "
            f"{_fmt(r.get('rel_error'), '.3g')}{' (f64 ref)' if r.get('reference', '').startswith('float64') else ''} | "
            f"{'ok' if r.get('numerics_ok') else r.get('status', 'FAILED')} |"
        )  # fmt: skip
    lines += [""] + targets(rs, t, syncs, ef) + [""]
    return lines


def targets(rs: list[dict], t: dict, syncs: dict, ef: dict) -> list[str]:
    """The run's targets as measured (met / missed / not measured)."""
    kind = _kind(next(r for r in rs if "workload" in r))
    out = []
    if kind in ("world1", "world1_public") and syncs:
        ours = {h: r["value"] for h, r in syncs.items() if h.startswith(OURS_AND_REDUCER)}
        worst = max(ours.values()) if ours else None
        got = (
            "not measured"
            if worst is None
            else f"max {worst} ({'met' if worst == 0 else 'MISSED'})"
        )
        issue = 28 if kind == "world1_public" else 14
        out.append(f"- issue {issue}: host syncs per step 0 for every hook of ours and the reducer: {got}"
                   + ("" if not ours else f" ({', '.join(f'{h} {v}' for h, v in ours.items())})"))  # fmt: skip
    for a, b, lim, issue in TARGETS.get(kind, []):
        va, vb = (t.get(a) or {}).get("value"), (t.get(b) or {}).get("value")
        if va is None or vb is None:
            why = " ".join((t.get(x) or {}).get("status", "") for x in (a, b)).strip()
            got = "not measured" + (f" ({why})" if why else "")
        else:
            got = (
                f"{va / vb:.3f} ({va:.1f} vs {vb:.1f} ms; {'met' if va / vb <= lim else 'MISSED'})"
            )
        out.append(f"- issue {issue}: {a} <= {lim} x {b}: {got}")
    if kind == "shaped":
        out += auto_vs_fastest(t)
    for a, b, what in CONTEXT.get("world1" if kind == "world1_public" else kind, []):
        va, vb = (t.get(a) or {}).get("value"), (t.get(b) or {}).get("value")
        if va is not None and vb is not None:
            out.append(f"- context: {a} / {b} = {va / vb:.3f} ({what})")
    for h, r in ef.items():
        if h.startswith("ours") and r["value"]:
            ok = r["value"] <= r["grad_bytes_bf16"]
            out.append(f"- EF state of {h} <= one bf16 copy of the gradients: {r['value'] / 1e6:.1f} "
                       f"vs {r['grad_bytes_bf16'] / 1e6:.1f} MB ({'met' if ok else 'MISSED'})")  # fmt: skip
    return out


def auto_vs_fastest(t: dict, limit: float = 1.05) -> list[str]:
    """Issue 28 on the shaped link: each ``ours_auto*`` within ``limit`` x the fastest
    fixed method of its run (every timed method but ``compute_only`` and the auto ones),
    with the spread (min-max over rounds) of both and what auto chose."""
    fixed = {h: r for h, r in t.items() if r["value"] is not None and h != "compute_only"
             and not h.startswith("ours_auto")}  # fmt: skip
    out = []
    for h, r in t.items():
        if not h.startswith("ours_auto"):
            continue
        if r["value"] is None or not fixed:
            out.append(f"- issue 28: {h} <= {limit} x the fastest fixed method: not measured "
                       f"({r.get('status', 'no fixed method timed')})")  # fmt: skip
            continue
        best = min(fixed, key=lambda k: fixed[k]["value"])
        va, vb = r["value"], fixed[best]["value"]
        spread = ", ".join(f"{x} {t[x].get('min_ms', 0):.0f}-{t[x].get('max_ms', 0):.0f} ms"
                           for x in (h, best))  # fmt: skip
        out.append(f"- issue 28: {h} <= {limit} x the fastest fixed method ({best}): "
                   f"{va / vb:.3f} ({va:.1f} vs {vb:.1f} ms, spread {spread}; "
                   f"{'met' if va / vb <= limit else 'MISSED'})")  # fmt: skip
        if r.get("auto_choice"):
            out.append(f"  - {h} chose: {r['auto_choice']}")
    return out


def markdown(recs: list[dict]) -> str:
    """The whole ``comm_hooks.md``: one section per run, newest first."""
    runs: dict[str, list[dict]] = {}
    legacy = 0
    for r in recs:
        if r.get("run_id"):
            runs.setdefault(r["run_id"], []).append(r)
        else:
            legacy += 1
    lines = [
        f"# {BENCH}: DDP step time with gradient comm hooks",
        "",
        "Generated by `benchmarks/comm_hooks_report.py` from `comm_hooks.jsonl`; do not edit. "
        "Each section is one run (`run_id`): its methods ran side by side, interleaved per "
        "round, and are compared only with each other. `x none` = step time over the same "
        "run's `none`. `comm hidden`: share of the buckets' communication time that the step "
        "did not expose (CPU runs only).",
        "",
    ]
    for rid, rs in sorted(
        runs.items(), key=lambda kv: max(r.get("date", "") for r in kv[1]), reverse=True
    ):
        if not any("workload" in r for r in rs):  # a run that failed before timing anything
            why = "; ".join(f"{r.get('hook')}: {r.get('status', '')}" for r in rs)
            lines += [f"## run {rid}: no timed records ({why})", ""]
            continue
        lines += run_table(rs)
    if legacy:
        lines += [f"{legacy} older records carry no `run_id` (issue 4's runs, where methods were "
                  "timed in separate runs); they stay in the JSONL and are not compared here.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the ``.md`` next to the given JSONL."""
    argv = sys.argv[1:] if argv is None else argv
    jl = Path(argv[0] if argv else "benchmarks/results/comm_hooks.jsonl")
    recs = [json.loads(x) for x in jl.read_text().splitlines() if x.strip()]
    jl.with_suffix(".md").write_text(markdown(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
