"""Targets and take-aways from benchmark records (``verl-comm bench summary``).

Targets of the all-reduce benchmark issue, evaluated on the records:

1. ``nccl_fp32`` all_reduce on NVLink at 512 MiB and above: busbw >= 280 GB/s (2 ranks);
2. ``int8`` all_reduce on the socket transport, 32 MiB and above: P50 time of ``nccl_bf16``
   divided by that of ``int8`` >= 1.8 at every size;
3. 8 B all_reduce on NVLink: the harness's ``nccl_fp32`` in-place P50 within 10% of the
   ``bare`` ``torch.distributed.all_reduce`` loop timed the same way.

Repeated measurements of one key are reduced to their median first.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from verl_comm.bench.report import measurements

MiB = 1 << 20


def median_table(records: Iterable[dict]) -> dict[tuple, dict]:
    """Key ``(collective, method, transport, inplace, bytes)`` -> median P50/P99/busbw."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in measurements(records):
        groups[
            (r["collective"], r["method"], r["transport"], bool(r["inplace"]), r["bytes"])
        ].append(r)
    return {
        k: {
            "p50": float(np.median([r["time_us_p50"] for r in rs])),
            "p99": float(np.median([r["time_us_p99"] for r in rs])),
            "busbw": float(np.median([r["busbw"] for r in rs])),
            "n": len(rs),
        }
        for k, rs in groups.items()
    }


def _pick(tab: dict, coll: str, method: str, transport: str, nbytes: int) -> dict | None:
    """In-place row if present, else out-of-place."""
    return tab.get((coll, method, transport, True, nbytes)) or tab.get(
        (coll, method, transport, False, nbytes)
    )


def _sizes(tab: dict, coll: str, method: str, transport: str) -> list[int]:
    return sorted({k[4] for k in tab if k[:3] == (coll, method, transport)})


def _at_least(
    name: str, unit: str, floor: float, sizes: list[int], values: list[float], fmt: str
) -> dict:
    """A target row met when the smallest of ``values`` (one per size in ``sizes``) is at
    least ``floor``; ``met`` is None without values."""
    low = min(values) if values else math.nan
    return {
        "name": name,
        "value": low,
        "unit": unit,
        "target": f">= {floor:g}",
        "met": (low >= floor) if values else None,
        "detail": ", ".join(f"{b // MiB} MiB: {fmt.format(v)}" for b, v in zip(sizes, values)),
    }


def targets(records: Iterable[dict]) -> list[dict]:
    """Evaluate the three targets; each row has ``name, value, target, met, detail``
    (``met`` is None when the records needed are absent)."""
    records = list(records)
    tab = median_table(records)
    rows = []
    big = [b for b in _sizes(tab, "all_reduce", "nccl_fp32", "nvlink") if b >= 512 * MiB]
    bws = [_pick(tab, "all_reduce", "nccl_fp32", "nvlink", b)["busbw"] for b in big]
    name = "NVLink nccl_fp32 all_reduce busbw at >= 512 MiB (min over sizes)"
    rows.append(_at_least(name, "GB/s", 280.0, big, bws, "{:.1f}"))
    sizes = [
        b
        for b in _sizes(tab, "all_reduce", "int8", "socket")
        if b >= 32 * MiB and _pick(tab, "all_reduce", "nccl_bf16", "socket", b)
    ]
    ratios = [
        _pick(tab, "all_reduce", "nccl_bf16", "socket", b)["p50"]
        / _pick(tab, "all_reduce", "int8", "socket", b)["p50"]
        for b in sizes
    ]
    name = "socket int8 speed-up over nccl_bf16 at >= 32 MiB (min over sizes)"
    rows.append(_at_least(name, "x", 1.8, sizes, ratios, "{:.2f}x"))
    # harness and bare loop from the same launch(es) (records of a launch share its date)
    dates = {
        r["date"]
        for r in measurements(records)
        if r["method"] == "bare" and r["transport"] == "nvlink" and r["bytes"] == 8
    }
    same = median_table([r for r in measurements(records) if r.get("date") in dates])
    ours = same.get(("all_reduce", "nccl_fp32", "nvlink", True, 8))
    bare = same.get(("all_reduce", "bare", "nvlink", True, 8))
    ratio = ours["p50"] / bare["p50"] if ours and bare else math.nan
    rows.append(
        {
            "name": "8 B NVLink latency, harness P50 / bare loop P50",
            "value": ratio,
            "unit": "x",
            "target": "<= 1.10",
            "met": (ratio <= 1.10) if ours and bare else None,
            "detail": (
                f"harness {ours['p50']:.1f} us (n={ours['n']}), bare {bare['p50']:.1f} us (n={bare['n']})"
                if ours and bare
                else "missing records"
            ),
        }
    )
    return rows


def crossovers(records: Iterable[dict], baseline: str = "nccl_bf16") -> list[dict]:
    """Per transport: the smallest size from which ``int8`` all_reduce is faster (P50)
    than ``baseline`` at that size and every larger measured size (None: never)."""
    tab = median_table(records)
    out = []
    for tr in sorted({k[2] for k in tab if k[1] == "int8" and k[0] == "all_reduce"}):
        sizes = [
            b
            for b in _sizes(tab, "all_reduce", "int8", tr)
            if _pick(tab, "all_reduce", baseline, tr, b)
        ]
        faster = [
            _pick(tab, "all_reduce", "int8", tr, b)["p50"]
            < _pick(tab, "all_reduce", baseline, tr, b)["p50"]
            for b in sizes
        ]
        cross = None
        for i in range(len(sizes)):
            if all(faster[i:]):
                cross = sizes[i]
                break
        out.append({"transport": tr, "baseline": baseline, "from_bytes": cross})
    return out


def markdown_summary(records: Iterable[dict]) -> str:
    """Markdown: targets table, int8 crossover sizes, and per transport the P50 and busbw of
    each method at a few sizes (8 B, 1 MiB, 32 MiB, 512 MiB, 1 GiB when measured)."""
    records = list(records)
    lines = [
        "## Targets",
        "",
        "| target | measured | goal | met | detail |",
        "|---|---:|---|---|---|",
    ]
    for t in targets(records):
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        lines.append(
            f"| {t['name']} | {t['value']:.3g} {t['unit']} | {t['target']} | {met} | {t['detail']} |"
        )
    lines += ["", "## Where int8 pays (all_reduce, P50)", ""]
    for base in ("nccl_bf16", "nccl_fp32"):
        for c in crossovers(records, base):
            where = f"from {c['from_bytes']} B up" if c["from_bytes"] else "at no measured size"
            lines.append(f"- {c['transport']}: int8 faster than {base} {where}")
    tab = median_table(records)
    lines += ["", "## all_reduce at selected sizes (P50 us / busbw GB/s)", ""]
    picks = [8, MiB, 32 * MiB, 512 * MiB, 1024 * MiB]
    lines.append("| transport | method | " + " | ".join(_h(b) for b in picks) + " |")
    lines.append("|---|---|" + "---:|" * len(picks))
    keys = sorted({(k[2], k[1]) for k in tab if k[0] == "all_reduce"})
    for tr, m in keys:
        cells = []
        for b in picks:
            r = _pick(tab, "all_reduce", m, tr, b)
            cells.append(f"{r['p50']:.1f} / {r['busbw']:.1f}" if r else "-")
        lines.append(f"| {tr} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _h(b: int) -> str:
    for s, m in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if b >= m:
            return f"{b // m} {s}"
    return f"{b} B"
