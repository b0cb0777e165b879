"""The weight sync's numbers in ``benchmarks/gpu/async_overlap.py``'s records (issue 34's targets).

Every async launch's training rank logs per step ``k`` (``_overlap_rank.py`` keeps them):
``async/sync_bytes_sent`` and ``async/sync_changed_frac`` of version ``k`` (published at the
start of step ``k``; mean over the training ranks, so x ``training_ranks`` is the total),
``async/weights_version`` (the version batch ``k`` was generated with) and, shipped with the
batch by its rollout rank, ``async/sync_pause_s`` and ``async/sync_transfer_s`` of the switch
to that version (the last switch before the batch). :func:`versions` pairs them per version;
a version appears once even when two batches were generated with it (the first sync serves
batches 0 and 1 at ``max_staleness: 1``), and the last version, switched in after the last
batch, has bytes but no pause or transfer in the metrics.

Definitions (the first sync, version 0, always full, is left out of every summary: "after the
first step"):

* sync time = ``sync_transfer_s``: on the rollout rank, from the first header's arrival to
  the last bucket decoded and every checksum verified (the senders' cast/compare/encode
  before the first header, ``async/sync_encode_s``, is not in it; what overlaps the wire is);
* generation pause = ``sync_pause_s``: the seconds the rollout rank's ``switch()`` blocked
  (waiting for the last bucket, then copying into the live weights; it also holds any wait
  for the training rank to publish when the rollout rank is ahead);
* ``pause_vs_step`` = median pause / median timed step time of the async launches;
  ``sync_own_pause_vs_step`` the same with each pause capped at its sync time,
  ``min(pause, sync time)``: the pause without the rollout rank's idle wait for the
  publication (when the first header arrived after ``switch()`` began, the pause is that
  wait + the transfer + the copy; when before, at most the transfer's rest + the copy, so the
  cap leaves out at most the copy into the live weights);
* ``sync_time_vs_line_rate`` = median over versions of sync time / (bytes / the bridge's
  bandwidth measured in the same launch, ``_bridge_probe.py``);
* ``delta_bytes_vs_full`` (delta wire) = median delta bytes / the full wire's bytes (the
  full-wire launches of the same run when there are any, else the delta launch's own first
  sync, which is sent in full: ``full_bytes_from`` says which).
"""

from __future__ import annotations

import statistics
from typing import Any

TARGETS = {  # issue 34, on 2 GPUs: field: (bound, "min" = at least / "max" = at most)
    "tokens_per_s_vs_colocated": (1.3, "min"),
    "pause_vs_step": (0.10, "max"),
    "sync_own_pause_vs_step": (0.10, "max"),  # the same target without the idle wait
    "delta_bytes_vs_full": (0.2, "max"),
    "sync_time_vs_line_rate": (1.2, "max"),
}


def versions(run: dict) -> list[dict[str, Any]]:
    """Per weights version of one async launch (raw row of ``_overlap_rank.py``):
    ``{"version", "bytes", "changed_frac", "pause_s", "transfer_s"}`` (pause and transfer
    None where no batch reports the switch), ascending."""
    steps, n = run["steps"], run.get("training_ranks") or 1
    out = {}
    for k, s in enumerate(steps):
        if "async/sync_bytes_sent" in s:
            out[k] = {
                "version": k,
                "bytes": s["async/sync_bytes_sent"] * n,
                "changed_frac": s.get("async/sync_changed_frac"),
                "pause_s": None,
                "transfer_s": None,
            }
    for s in steps:
        v = s.get("async/weights_version")
        if v is not None and int(v) in out and out[int(v)]["pause_s"] is None:
            out[int(v)]["pause_s"] = s.get("async/sync_pause_s")
            out[int(v)]["transfer_s"] = s.get("async/sync_transfer_s")
    return [out[k] for k in sorted(out)]


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def sync_fields(
    runs: list[dict], warmup: int, full_runs: list[dict] | None = None
) -> dict[str, Any]:
    """The sync fields of one (workload, wire) record from its async launches ``runs``
    (one per round); ``full_runs``: the same workload's full-wire launches (for
    ``delta_bytes_vs_full`` of the delta wire; None or [] for the full wire itself)."""
    later = []  # (version row, the launch's link bandwidth), versions >= 1
    for r in runs:
        bw = (r.get("link") or {}).get("bytes_per_s")
        later += [(v, bw) for v in versions(r) if v["version"] >= 1]
    step_s = _median([s["step_s"] for r in runs for s in r["steps"][warmup:]])
    pause = _median([v["pause_s"] for v, _ in later])
    own = _median(
        [min(v["pause_s"], v["transfer_s"]) for v, _ in later if v["pause_s"] is not None]
    )
    line = [(v["transfer_s"], v["bytes"] / bw) for v, bw in later if bw and v["transfer_s"]]
    bws = [(r.get("link") or {}).get("bytes_per_s") for r in runs]
    wire = runs[0]["sync_wire"] if runs else None
    out = {
        "sync_versions": [versions(r) for r in runs],
        "sync_bytes_first": _median([versions(r)[0]["bytes"] for r in runs if versions(r)]),
        "sync_bytes_median": _median([v["bytes"] for v, _ in later]),
        "sync_changed_frac_median": _median([v["changed_frac"] for v, _ in later]),
        "sync_time_s_median": _median([v["transfer_s"] for v, _ in later]),
        "sync_pause_s_median": pause,
        "async_step_s_median": step_s,
        "pause_vs_step": _ratio(pause, step_s),
        "sync_own_pause_s_median": own,
        "sync_own_pause_vs_step": _ratio(own, step_s),
        "link": [r.get("link") for r in runs],
        "link_bytes_per_s": _median(bws),
        "sync_line_s_median": _median([x[1] for x in line]),
        "sync_time_vs_line_rate": _median([t / s for t, s in line]),
    }
    if wire == "delta":
        full = [v["bytes"] for r in full_runs or [] for v in versions(r)]
        src = "full wire launches"
        if not full:  # the delta wire's first sync is sent in full
            full, src = [versions(r)[0]["bytes"] for r in runs if versions(r)], "first sync"
        out["full_bytes"] = _median(full)
        out["full_bytes_from"] = src
        out["delta_bytes_vs_full"] = _ratio(out["sync_bytes_median"], out["full_bytes"])
    return out


def verdict(field: str, value: float | None) -> str:
    """``met`` / ``missed`` against :data:`TARGETS` (``n/a`` without a value)."""
    if value is None:
        return "n/a"
    bound, kind = TARGETS[field]
    ok = value >= bound if kind == "min" else value <= bound
    return "met" if ok else "missed"
