"""PNG plot of benchmark records: busbw and P50/P99 latency against message size."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from verl_comm.bench.report import measurements
from verl_comm.extras import pyplot, save_figure


def _series(records: Iterable[dict]) -> dict[tuple, dict[int, dict]]:
    """Per (collective, method, transport): per size, median P50/P99/busbw over repeats.

    In-place rows are preferred; out-of-place rows are used where no in-place row exists.
    """
    raw: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in measurements(records):
        raw[(r["collective"], r["method"], r["transport"], bool(r["inplace"]))][r["bytes"]].append(
            r
        )
    out: dict[tuple, dict[int, dict]] = {}
    for (coll, meth, tr, inplace), by_size in raw.items():
        key = (coll, meth, tr)
        if not inplace and (coll, meth, tr, True) in raw:
            continue
        out[key] = {
            b: {
                "p50": float(np.median([x["time_us_p50"] for x in rs])),
                "p99": float(np.median([x["time_us_p99"] for x in rs])),
                "busbw": float(np.median([x["busbw"] for x in rs])),
            }
            for b, rs in sorted(by_size.items())
        }
    return out


def plot_records(records: Iterable[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Write a two-panel PNG: busbw (GB/s) and latency (P50 solid, P99 dashed, us) against
    message size in bytes (log scales), one line per collective/method/transport.

    Raises:
        ValueError: when there are no measurement records to plot.
    """
    plt = pyplot()

    series = _series(records)
    if not series:
        raise ValueError("plot: no measurement records (metric 'busbw') to plot")
    fig, (ax_bw, ax_lat) = plt.subplots(1, 2, figsize=(14, 5.5))
    cmap = plt.get_cmap("tab20")
    for i, (key, pts) in enumerate(sorted(series.items())):
        label = "/".join(key)
        sizes = list(pts)
        color = cmap(i % 20)
        ax_bw.plot(sizes, [pts[s]["busbw"] for s in sizes], marker=".", color=color, label=label)
        ax_lat.plot(sizes, [pts[s]["p50"] for s in sizes], marker=".", color=color, label=label)
        ax_lat.plot(sizes, [pts[s]["p99"] for s in sizes], linestyle="--", color=color, alpha=0.6)
    for ax in (ax_bw, ax_lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.set_yscale("log")
    ax_bw.set_ylabel("busbw (GB/s, from P50)")
    ax_bw.set_title("bus bandwidth")
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("time per call (us): P50 solid, P99 dashed")
    ax_lat.set_title("latency")
    ax_bw.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)
