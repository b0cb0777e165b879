"""nccl-tests style text output, JSONL records, markdown, stability summary and comparison.

Layout (NVIDIA/nccl-tests ``src/common.cu``): a ``#`` preamble (versions, devices, topology,
effective NCCL environment, parameters), two header rows (names, then units), one row per
size with an out-of-place and an in-place group, and a footer with the average bus
bandwidth and the total ``#wrong``. Each group here has three times (mean, P50, P99, in
microseconds, max across ranks), algbw and busbw (GB/s, from the P50 time) and ``#wrong``.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

BENCHMARK = "allreduce_latency"
REGRESSION_THRESHOLD = 0.20

_GROUP_NAMES = ("time", "p50", "p99", "algbw", "busbw", "#wrong")
_GROUP_UNITS = ("(us)", "(us)", "(us)", "(GB/s)", "(GB/s)", "")
_GROUP_W = (10, 10, 10, 7, 7, 7)
_LEAD_NAMES = ("size", "count", "type", "redop", "root")
_LEAD_UNITS = ("(B)", "(elements)", "", "", "")
_LEAD_W = (12, 12, 9, 6, 5)


def _cells(values: Sequence[str], widths: Sequence[int]) -> str:
    return " ".join(f"{v:>{w}}" for v, w in zip(values, widths))


def table_header(collective: str, method: str, transport: str) -> str:
    """The title line and two header rows (names, units) of one table."""
    title = f"#\n# {collective}  method={method}  transport={transport}\n#"
    group = "  " + _cells(_GROUP_NAMES, _GROUP_W)
    units = "  " + _cells(_GROUP_UNITS, _GROUP_W)
    lead_w = sum(_LEAD_W) + len(_LEAD_W) - 1
    places = (
        f"#{'':>{lead_w - 1}}  {'out-of-place':^{len(group) - 2}}  {'in-place':^{len(group) - 2}}"
    )
    names = "#" + _cells(_LEAD_NAMES, _LEAD_W)[1:] + group + group
    unit_row = "#" + _cells(_LEAD_UNITS, _LEAD_W)[1:] + units + units
    return "\n".join([title, places, names, unit_row])


def _fmt_time(us: float) -> str:
    if us is None or math.isnan(us):
        return "N/A"
    return f"{us:.2f}" if us < 1e5 else f"{us:.4g}"


def _group_cells(rec: dict | None) -> list[str]:
    if rec is None:
        return ["N/A"] * len(_GROUP_NAMES)
    wrong = rec.get("wrong")
    return [
        _fmt_time(rec["time_us_mean"]),
        _fmt_time(rec["time_us_p50"]),
        _fmt_time(rec["time_us_p99"]),
        f"{rec['algbw']:.2f}",
        f"{rec['busbw']:.2f}",
        "N/A" if wrong is None else str(wrong),
    ]


def table_row(
    nbytes: int,
    count: int,
    dtype: str,
    redop: str,
    root: int,
    outplace: dict | None,
    inplace: dict | None,
) -> str:
    """One size: leading columns then the out-of-place and in-place groups."""
    lead = _cells([str(nbytes), str(count), dtype, redop, str(root)], _LEAD_W)
    return (
        " "
        + lead[1:]
        + "  "
        + _cells(_group_cells(outplace), _GROUP_W)
        + "  "
        + _cells(_group_cells(inplace), _GROUP_W)
    )


def table_footer(records: Iterable[dict]) -> str:
    """Average bus bandwidth over the rows' records and the total number of wrong elements."""
    recs = list(records)
    bws = [r["busbw"] for r in recs if r.get("busbw") is not None and not math.isnan(r["busbw"])]
    wrong = sum(r["wrong"] for r in recs if r.get("wrong") is not None)
    avg = sum(bws) / len(bws) if bws else float("nan")
    checked = any(r.get("wrong") is not None for r in recs)
    lines = [
        f"# Out of bounds values : {wrong if checked else 'N/A'} {'OK' if wrong == 0 else 'FAILED'}",
        f"# Avg bus bandwidth    : {avg:.4g} GB/s",
        "#",
    ]
    return "\n".join(lines)


def preamble(info: dict) -> str:
    """The ``#`` preamble from the info dict built by the runner."""
    lines = [f"# verl-comm bench {info.get('command', '')}".rstrip()]
    lines.append("#")
    for key in ("versions",):
        vs = info.get(key, {})
        lines.append("# versions: " + "  ".join(f"{k} {v}" for k, v in vs.items()))
    lines.append(f"# date: {info.get('date', '')}  commit: {info.get('commit', '')}")
    for dev in info.get("devices", []):
        lines.append(f"#  {dev}")
    lines.append(f"# topology: {info.get('topology', '')}")
    lines.append(f"# transport: {info.get('transport', '')}  backend: {info.get('backend', '')}")
    env = info.get("env", {})
    if env:
        lines.append("# NCCL environment (effective, as seen by rank 0):")
        lines += [f"#   {k}={v}" for k, v in sorted(env.items())]
    else:
        lines.append("# NCCL environment: (no NCCL_* or TORCH_NCCL_* variables set)")
    for k, v in sorted(info.get("per_rank_env", {}).items()):
        lines.append(f"#   {k}={v}   (per rank)")
    lines.append(
        "# parameters: " + "  ".join(f"{k}={v}" for k, v in info.get("params", {}).items())
    )
    return "\n".join(lines)


def write_jsonl(records: Iterable[dict], path: str | os.PathLike, append: bool = False) -> Path:
    """Write one JSON object per line; creates parent folders. Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a" if append else "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec, sort_keys=False) + "\n")
    return p


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL file written by :func:`write_jsonl`.

    Raises:
        ValueError: naming the file and line of a malformed record.
    """
    out = []
    with Path(path).open() as fh:
        for i, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not a JSON line ({exc})") from None
    return out


_KEY_FIELDS = ("collective", "method", "transport", "bytes", "dtype", "inplace", "world_size")
"""What makes two measurement records the same case and size."""


def _key(r: dict) -> tuple:
    return tuple(bool(r.get(f)) if f == "inplace" else r.get(f) for f in _KEY_FIELDS)


def _key_fields(k: tuple, n: int = len(_KEY_FIELDS)) -> dict:
    """The first ``n`` fields of a :func:`_key` by name."""
    return dict(zip(_KEY_FIELDS[:n], k[:n]))


def measurements(records: Iterable[dict]) -> list[dict]:
    """Only the per-size measurement records (drops summaries)."""
    return [r for r in records if r.get("metric") == "busbw" and r.get("benchmark") == BENCHMARK]


def compare(
    new: Iterable[dict], old: Iterable[dict], threshold: float = REGRESSION_THRESHOLD
) -> tuple[list[dict], str]:
    """Compare busbw of matching sizes; a drop above ``threshold`` (fraction) is a regression.

    Records match on (collective, method, transport, bytes, dtype, placement, world size);
    repeated measurements of one key are reduced to their median busbw.

    Returns:
        ``(regressions, text)``: the flagged rows (dicts with old/new busbw and the change)
        and a printable table of every matched row.
    """
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be in (0, 1), got {threshold}")

    def by_key(recs: Iterable[dict]) -> dict[tuple, float]:
        groups: dict[tuple, list[float]] = defaultdict(list)
        for r in measurements(recs):
            if r.get("busbw") is not None and not math.isnan(r["busbw"]):
                groups[_key(r)].append(float(r["busbw"]))
        return {k: float(np.median(v)) for k, v in groups.items()}

    n, o = by_key(new), by_key(old)
    rows, flagged = [], []
    for k in sorted(set(n) & set(o), key=lambda k: tuple(str(x) for x in k[:3]) + (k[3],)):
        change = (n[k] - o[k]) / o[k] if o[k] > 0 else 0.0
        row = {
            **_key_fields(k, 6),
            "old_busbw": o[k],
            "new_busbw": n[k],
            "change": change,
            "regression": change < -threshold,
        }
        rows.append(row)
        if row["regression"]:
            flagged.append(row)
    lines = [
        f"# compare: {len(rows)} matched sizes, threshold busbw drop > {threshold:.0%}",
        f"# {'collective':<15}{'method':<10}{'transport':<15}{'bytes':>12}{'place':>7}"
        f"{'old GB/s':>10}{'new GB/s':>10}{'change':>9}",
    ]
    for r in rows:
        mark = "  REGRESSION" if r["regression"] else ""
        lines.append(
            f"  {r['collective']:<15}{r['method']:<10}{r['transport']:<15}{r['bytes']:>12}"
            f"{'in' if r['inplace'] else 'out':>7}{r['old_busbw']:>10.2f}{r['new_busbw']:>10.2f}"
            f"{r['change']:>+9.1%}{mark}"
        )
    lines.append(f"# regressions: {len(flagged)}")
    return flagged, "\n".join(lines)


def stability_summary(records: Iterable[dict]) -> list[dict]:
    """Spread of repeated runs of the same case and size (the ``repeat`` field).

    For each key with at least two repeats: P50 across repeats (min, median, max), the
    spread ``(max - min) / median`` of the repeats' P50, and the median P99/P50 ratio (the
    per-run jitter). Returns summary records (``metric: "stability"``).
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in measurements(records):
        groups[_key(r)].append(r)
    out = []
    for k, recs in groups.items():
        if len(recs) < 2:
            continue
        p50 = np.array([r["time_us_p50"] for r in recs])
        ratio = np.array(
            [r["time_us_p99"] / r["time_us_p50"] for r in recs if r["time_us_p50"] > 0]
        )
        base = {kk: recs[0][kk] for kk in ("benchmark", "device", "versions", "date", "commit")}
        out.append(
            {
                **base,
                "metric": "stability",
                "value": float((p50.max() - p50.min()) / np.median(p50)),
                "unit": "fraction",
                **_key_fields(k),
                "repeats": len(recs),
                "p50_us_min": float(p50.min()),
                "p50_us_median": float(np.median(p50)),
                "p50_us_max": float(p50.max()),
                "p50_spread": float((p50.max() - p50.min()) / np.median(p50)),
                "p99_over_p50_median": float(np.median(ratio)) if ratio.size else float("nan"),
                "p99_over_p50_max": float(ratio.max()) if ratio.size else float("nan"),
            }
        )
    return out


def stability_text(summary: Sequence[dict]) -> str:
    """Printable table of :func:`stability_summary`."""
    if not summary:
        return ""
    lines = [
        "#",
        "# stability: repeated runs of one size",
        f"# {'collective':<15}{'method':<10}{'transport':<15}{'bytes':>12}{'runs':>5}"
        f"{'P50 min':>10}{'P50 med':>10}{'P50 max':>10}{'spread':>8}{'P99/P50':>9}{'max':>7}",
    ]
    for s in summary:
        lines.append(
            f"  {s['collective']:<15}{s['method']:<10}{s['transport']:<15}{s['bytes']:>12}"
            f"{s['repeats']:>5}{s['p50_us_min']:>10.1f}{s['p50_us_median']:>10.1f}"
            f"{s['p50_us_max']:>10.1f}{s['p50_spread']:>8.1%}{s['p99_over_p50_median']:>9.2f}"
            f"{s['p99_over_p50_max']:>7.2f}"
        )
    return "\n".join(lines)


def markdown(records: Iterable[dict]) -> str:
    """A short markdown table: one line per (collective, method, transport, placement, size)."""
    recs = measurements(records)
    lines = [
        "| collective | method | transport | place | bytes | P50 (us) | P99 (us) | busbw (GB/s) | #wrong |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in recs:
        wrong = "N/A" if r.get("wrong") is None else r["wrong"]
        lines.append(
            f"| {r['collective']} | {r['method']} | {r['transport']} | "
            f"{'in' if r['inplace'] else 'out'} | {r['bytes']} | {r['time_us_p50']:.1f} | "
            f"{r['time_us_p99']:.1f} | {r['busbw']:.2f} | {wrong} |"
        )
    return "\n".join(lines) + "\n"
