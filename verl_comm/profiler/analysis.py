"""Metrics from the files written by :class:`~verl_comm.profiler.core.VerlProfiler`.

A run is a folder with ``profile_rank{r}.json`` files (one per rank). Per rank:

- step times from the step windows; across ranks, step ``i`` takes the max over ranks;
- phase shares: top-level (depth 0) phase time / step time;
- communication: the union of intervals (counted once) of our recorder's records and
  torch's gloo work events (CPU), or of NCCL kernels when the device trace has them;
  share of step time, share of backward (``update_*``/``backward`` phases);
- exposed communication: on CUDA, NCCL kernel time not overlapped by other kernels; on
  CPU every blocking collective is exposed (the host waits for it);
- device idle gaps (CUDA): parts of each step with no kernel, memcpy or memset running;
- rollout latency per batch (``record_rollout`` or ``gen`` phase durations); reshard time
  (``reshard`` phases) and bytes (records tagged ``reshard...``); peak memory per phase.

Breakdowns are those of rank 0 unless stated (``per_rank`` keeps every rank's shares).
"""

from __future__ import annotations

import bisect
import heapq
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from verl_comm.profiler import intervals as iv

BACKWARD_PHASES = ("update_actor", "update_critic", "backward")
HOST_PHASES = ("reward", "data", "dataload", "tokenize", "reward_scoring")
ROLLOUT_PHASE = "gen"
RESHARD_PHASE = "reshard"
BETWEEN_PHASES = "(between phases)"  # where idle time outside every top-level phase goes
# Records that wrap other records (the reducer's per-bucket record around its comm hook's):
# their ``nbytes`` is the bucket's payload, not wire bytes, so they are left out of the
# wire-byte total and reported as payload.
ENVELOPE_OPS = ("bucket_reduce",)


def find_runs(path: str | Path) -> list[Path]:
    """Folders under ``path`` (itself included) holding ``profile_rank*.json``, sorted.

    Raises:
        FileNotFoundError: when there is none (the message names the folder).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if root.is_file():
        root = root.parent  # a profile_rank*.json itself: its folder is the run
    runs = sorted({p.parent for p in root.rglob("profile_rank*.json")})
    if not runs:
        raise FileNotFoundError(
            f"no profile_rank*.json under {root}; point it at the profiler's output_dir "
            "(`profiler.output_dir`, written when training ends)"
        )
    return runs


def load_run(run_dir: str | Path) -> list[dict]:
    """The per-rank profile dicts of one run, sorted by rank.

    Raises:
        ValueError: a file that is not a profiler JSON, or files of different runs (run
            id, world size) or a rank missing: the message names the files and the fix.
    """
    out = []
    for p in sorted(Path(run_dir).glob("profile_rank*.json")):
        try:
            d = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: not a profiler JSON ({exc})") from None
        if not isinstance(d, dict) or not isinstance(d.get("meta"), dict) or "steps" not in d:
            raise ValueError(f"{p}: not a profiler JSON (no 'meta'/'steps')")
        d["_file"] = p.name
        out.append(d)
    out.sort(key=lambda d: d["meta"].get("rank", 0))
    ids = {d["meta"].get("run_id") for d in out}
    worlds = {d["meta"].get("world_size") for d in out}
    if len(ids) > 1 or len(worlds) > 1:
        files = ", ".join(f"{d['_file']} (run {d['meta'].get('run_id')})" for d in out)
        raise ValueError(
            f"{run_dir}: profiles of different runs mixed ({files}); give each run its "
            "own output_dir or delete the stale files"
        )
    ranks = [d["meta"].get("rank", 0) for d in out]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{run_dir}: the same rank twice in {[d['_file'] for d in out]}")
    return out


def _pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def _stats(values) -> dict:
    if not len(values):
        return {"n": 0, "mean": None, "p50": None, "p99": None, "p99_over_p50": None}
    p50, p99 = _pct(values, 50), _pct(values, 99)
    return {
        "n": len(values),
        "mean": float(np.mean(values)),
        "p50": p50,
        "p99": p99,
        "p99_over_p50": p99 / p50 if p50 > 0 else None,
        "max": float(np.max(values)),
    }


def device_summary(
    kernels: list[dict], comm_iv: list[iv.Interval], windows: list[iv.Interval], top: list[dict]
) -> dict:
    """What the report needs from a device timeline, so that a profile need not keep every
    kernel (a profiled PPO step launches ~10^5 of them).

    Args:
        kernels: ``{"name", "t0", "t1", "comm"}`` per device kernel/memcpy (seconds).
        comm_iv: communication intervals (union of the NCCL kernels).
        windows: ``(t0, t1)`` of the profiled steps; top: top-level phase dicts.

    Returns:
        ``exposed_comm_s`` (communication with no compute kernel running),
        ``idle_total_s`` / ``idle_by_phase_s`` / ``largest_gaps`` (times inside the windows
        when no kernel runs, attributed to the phase holding the gap's middle),
        ``busy_s``, ``kernel_count`` and ``top_kernels`` (15 names with most device time).
    """
    windows = sorted(windows)
    wstarts = [a for a, _ in windows]

    def window_of(t: float) -> int | None:
        j = bisect.bisect_right(wstarts, t) - 1
        return j if j >= 0 and t <= windows[j][1] else None

    exposed = 0.0
    if comm_iv:  # one subtraction over the whole run, then clipped per window
        rest = iv.subtract(comm_iv, ((k["t0"], k["t1"]) for k in kernels if not k.get("comm")))
        exposed = sum(iv.total(iv.clip(rest, a, b)) for a, b in windows)
    busy = iv.union((k["t0"], k["t1"]) for k in kernels)  # sorted once
    bstarts = [a for a, _ in busy]
    phases = sorted(((p["t0"], p["t1"], p["name"]) for p in top), key=lambda x: x[0])
    pstarts = [p[0] for p in phases]
    by_phase: dict[str, float] = defaultdict(float)
    largest: list[tuple[float, float, float, str]] = []  # min-heap of the 5 longest gaps
    idle_total = busy_s = 0.0
    for a, b in windows:
        lo = max(bisect.bisect_right(bstarts, a) - 1, 0)
        seg = iv.clip(busy[lo : bisect.bisect_left(bstarts, b)], a, b)  # this window's slice
        busy_s += iv.total(seg)
        for g0, g1 in iv.gaps(seg, a, b):
            mid = 0.5 * (g0 + g1)
            j = bisect.bisect_right(pstarts, mid) - 1
            where = phases[j][2] if j >= 0 and phases[j][1] >= mid else BETWEEN_PHASES
            by_phase[where] += g1 - g0
            idle_total += g1 - g0
            item = (g1 - g0, g0, g1, where)
            heapq.heappush(largest, item) if len(largest) < 5 else heapq.heappushpop(largest, item)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for k in kernels:
        if window_of(k["t0"]) is not None:
            d = per_name[k["name"]]
            d[0] += 1
            d[1] += k["t1"] - k["t0"]
    top_k = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "exposed_comm_s": exposed,
        "idle_total_s": idle_total,
        "idle_by_phase_s": dict(by_phase),
        "largest_gaps": [
            {"t0": g0, "t1": g1, "dur_s": dur, "phase": where}
            for dur, g0, g1, where in sorted(largest, reverse=True)
        ],
        "busy_s": busy_s,
        "kernel_count": int(sum(v[0] for v in per_name.values())),
        "top_kernels": [{"name": n, "count": int(c), "time_s": t} for n, (c, t) in top_k],
    }


def _comm_intervals(data: dict) -> tuple[list[iv.Interval], str]:
    """Communication intervals and their source description."""
    kernels = [
        (e["t0"], e["t1"]) for e in data.get("torch_comm", []) if e.get("source") == "kernel"
    ]
    if kernels:
        return iv.union(kernels), "NCCL kernels (device timeline)"
    rec = [
        (r["start_s"], r["start_s"] + r["duration_s"])
        for r in data.get("comm", [])
        if r.get("start_s", 0.0) > 0
    ]
    work = [(e["t0"], e["t1"]) for e in data.get("torch_comm", []) if e.get("source") == "gloo"]
    parts = (["verl_comm hook/reducer/reshard records"] if rec else []) + (
        ["torch gloo work events"] if work else []
    )
    if not parts:
        if data.get("meta", {}).get("torch_profiler"):
            return [], "no collective seen (torch.profiler on, no gloo work / NCCL kernel)"
        return [], "not measured: no verl_comm records and torch.profiler off"
    return iv.union(rec + work), " + ".join(parts) + " (host blocking)"


def _in_step_overhead(wall: list[dict]) -> dict:
    """Profiled vs unprofiled step wall time of one rank: ``unprofiled_p50_s``,
    ``profiled_p50_s`` and ``in_step_slowdown`` (profiled / unprofiled - 1), the cost of
    profiling inside the step (torch.profiler, CUDA syncs, memory history). The baseline
    is the unprofiled step just before the first profiled one plus unprofiled steps after
    the last: earlier steps may still warm up (allocation, compilation, a compression
    hook's plain all-reduce before ``start_iter``). Empty when the step before profiling
    is the first one and none follows."""
    idx = [i for i, w in enumerate(wall) if w["profiled"]]
    if not idx:
        return {}
    base = [wall[idx[0] - 1]["s"]] if idx[0] >= 2 else []
    base += [w["s"] for w in wall[idx[-1] + 1 :] if not w["profiled"]]
    prof = [wall[i]["s"] for i in idx]
    if not base:
        return {}
    b, p = float(np.median(base)), float(np.median(prof))
    return {
        "unprofiled_steps": len(base),
        "unprofiled_p50_s": b,
        "profiled_p50_s": p,
        "in_step_slowdown": p / b - 1.0 if b > 0 else None,
    }


def _phase_sums(top: list[dict], step: int) -> dict[str, float]:
    """Seconds per top-level phase name in ``step``."""
    ph: dict[str, float] = defaultdict(float)
    for p in top:
        if p["step"] == step:
            ph[p["name"]] += p["t1"] - p["t0"]
    return dict(ph)


def _phase_table(records: list[dict], n_steps: int, step_total: float) -> dict[str, dict]:
    """Per phase name: total and per-step seconds, calls, depth (the shallowest), share of
    the step time (top-level phases only) and the memory peak / reserved at exit."""
    phases: dict[str, dict] = {}
    for p in records:
        d = phases.setdefault(
            p["name"], {"total_s": 0.0, "count": 0, "depth": p.get("depth", 0), "mem_peak": None}
        )
        d["total_s"] += p["t1"] - p["t0"]
        d["count"] += 1
        d["depth"] = min(d["depth"], p.get("depth", 0))
        if p.get("mem_peak") is not None:
            d["mem_peak"] = max(d["mem_peak"] or 0, p["mem_peak"])
            d["mem_reserved_end"] = max(d.get("mem_reserved_end", 0), p["mem_end"]["reserved"])
    for d in phases.values():
        d["per_step_s"] = d["total_s"] / n_steps
        d["share"] = d["total_s"] / step_total if step_total > 0 and d["depth"] == 0 else None
    return phases


def _torch_comm(events: list[dict], in_steps) -> tuple[dict[str, int], int]:
    """Counts of torch's communication records by name, and the input bytes of those in the
    profiled steps (c10d calls left out: they wrap the gloo/NCCL work)."""
    torch_ops: dict[str, int] = defaultdict(int)
    torch_bytes = 0
    for e in events:
        if e["source"] == "kernel":
            torch_ops[f"nccl {e['collective']}" if e.get("collective") else "nccl kernel"] += 1
        else:
            torch_ops[e["name"]] += 1
        if e["source"] != "c10d" and in_steps({"start_s": e["t0"]}):
            torch_bytes += int(e.get("in_bytes", 0))
    return dict(torch_ops), torch_bytes


def _idle(dev: dict, step_total: float) -> dict:
    """Device idle gaps of :func:`device_summary` as the report shows them."""
    return {
        "total_s": dev["idle_total_s"],
        "share": dev["idle_total_s"] / step_total if step_total > 0 else None,
        "by_phase_s": dev["idle_by_phase_s"],
        "largest": dev["largest_gaps"],
        "kernel_count": dev["kernel_count"],
        "busy_s": dev["busy_s"],
        "top_kernels": dev["top_kernels"],
    }


def _in_steps(r: dict, windows: list[tuple[float, float]]) -> bool:
    """Whether record ``r`` (``start_s``) lies in a profiled step; a record without a start
    time counts. Records outside profiled steps are not counted."""
    t = r.get("start_s", 0.0)
    return t <= 0 or any(a <= t <= b for a, b in windows)


def _comm_metrics(
    data: dict,
    records: list[dict],
    top: list[dict],
    windows: list[tuple[float, float]],
    comm: tuple[list[iv.Interval], str],
    dev: dict | None,
    n_steps: int,
    step_total: float,
) -> dict:
    """The ``comm`` section of :func:`analyze_rank`: time in the steps and in backward, the
    exposed part, our records by tag, torch's own collectives. ``comm``: the
    :func:`_comm_intervals` of ``data``."""
    comm_iv, comm_source = comm
    comm_total = sum(iv.total(iv.clip(comm_iv, a, b)) for a, b in windows)
    bwd = [(p["t0"], p["t1"]) for p in top if p["name"] in BACKWARD_PHASES]
    bwd_total = iv.total(bwd)
    comm_bwd = sum(iv.total(iv.clip(comm_iv, a, b)) for a, b in iv.union(bwd))
    if dev and comm_source.startswith("NCCL"):
        exposed = dev["exposed_comm_s"]
        exposed_note = "NCCL kernel time with no compute kernel running"
    else:
        exposed = comm_total
        exposed_note = "host-blocking: all of it exposed" if comm_iv else "nothing to overlap"
    by_tag: dict[str, dict] = {}
    for r in records:
        key = f"{r['op']} {r.get('tag', '')}".strip()
        d = by_tag.setdefault(key, {"count": 0, "bytes": 0, "time_s": 0.0})
        d["count"] += 1
        d["bytes"] += int(r["nbytes"])
        d["time_s"] += float(r["duration_s"])
    torch_ops, torch_bytes = _torch_comm(
        data.get("torch_comm", []), lambda r: _in_steps(r, windows)
    )
    return {
        "source": comm_source,
        "measured": not comm_source.startswith("not measured"),
        "total_s": comm_total,
        "per_step_s": comm_total / n_steps,
        "share_of_step": comm_total / step_total if step_total > 0 else None,
        "backward_s": bwd_total,
        "share_of_backward": comm_bwd / bwd_total if bwd_total > 0 else None,
        "exposed_s": exposed,
        "exposed_share_of_step": exposed / step_total if step_total > 0 else None,
        "exposed_note": exposed_note,
        "by_tag": by_tag,
        "bytes_total": sum(int(r["nbytes"]) for r in records if r["op"] not in ENVELOPE_OPS),
        "payload_bytes": sum(int(r["nbytes"]) for r in records if r["op"] in ENVELOPE_OPS),
        # input message bytes of torch's collectives in the profiled steps (ours and
        # DeepSpeed's alike): NCCL kernels' args on GPU, gloo work events' shapes on CPU
        "torch_input_bytes": torch_bytes,
        "torch_ops": torch_ops,
    }


def _rollout_metrics(data: dict) -> dict:
    """Rollout latencies: ``record_rollout`` records, else the rollout phase's durations."""
    rollouts = [r["latency_s"] for r in data.get("rollouts", [])]
    rollout_source = "record_rollout"
    if not rollouts:
        rollouts = [p["t1"] - p["t0"] for p in data.get("phases", []) if p["name"] == ROLLOUT_PHASE]
        rollout_source = f"'{ROLLOUT_PHASE}' phase durations"
    return {**_stats(rollouts), "source": rollout_source}


def analyze_rank(data: dict) -> dict:
    """Metrics of one rank's profile dict (see the module docstring)."""
    steps = data.get("steps", [])
    windows = [(s["t0"], s["t1"]) for s in steps]
    step_total = sum(b - a for a, b in windows)
    top = [p for p in data.get("phases", []) if p.get("depth", 0) == 0]
    comm = _comm_intervals(data)
    comm_iv = comm[0]
    per_step = [
        {"step": s["step"], "time_s": b - a, "phases": _phase_sums(top, s["step"]),
         "comm_s": iv.total(iv.clip(comm_iv, a, b))}
        for s, (a, b) in zip(steps, windows)
    ]  # fmt: skip
    n_steps = max(len(steps), 1)
    phases = _phase_table(data.get("phases", []), n_steps, step_total)
    top_share = sum(d["share"] or 0.0 for d in phases.values())
    kernels = data.get("kernels", [])
    dev = device_summary(kernels, comm_iv, windows, top) if kernels else data.get("device")
    records = [r for r in data.get("comm", []) if _in_steps(r, windows)]
    reshard_bytes = sum(
        int(r["nbytes"]) for r in records if str(r.get("tag", "")).startswith("reshard")
    )
    host = sum(phases[n]["total_s"] for n in HOST_PHASES if n in phases and phases[n]["depth"] == 0)
    meta = data.get("meta", {})
    return {
        "rank": meta.get("rank", 0),
        "steps": _stats([s["time_s"] for s in per_step]),
        "per_step": per_step,
        "step_total_s": step_total,
        "phases": phases,
        "unattributed_share": max(0.0, 1.0 - top_share) if step_total > 0 else None,
        "comm": _comm_metrics(data, records, top, windows, comm, dev, n_steps, step_total),
        "gpu_idle": _idle(dev, step_total) if dev else None,
        "host_share": host / step_total if step_total > 0 else None,
        "rollout": _rollout_metrics(data),
        "reshard": {
            "time_s": phases.get(RESHARD_PHASE, {}).get("total_s", 0.0),
            "per_step_s": phases.get(RESHARD_PHASE, {}).get("per_step_s", 0.0),
            "bytes": reshard_bytes,
            "enabled": RESHARD_PHASE in phases,
        },
        "overhead": {
            "bookkeeping_s": meta.get("overhead_s", 0.0),
            "share_of_step": (meta.get("overhead_s", 0.0) / step_total) if step_total > 0 else None,
            **_in_step_overhead(data.get("step_wall", [])),
        },
        "memory_timeline": data.get("memory", []),
    }


def analyze_run(run_dir: str | Path) -> dict:
    """Metrics of one run: rank 0's breakdown, step times as the max over ranks per step,
    and every rank's communication and host shares (``per_rank``).

    Raises:
        ValueError: when the run has no profiled step.
    """
    ranks = load_run(run_dir)
    per = [analyze_rank(d) for d in ranks]
    if not per or not per[0]["per_step"]:
        raise ValueError(
            f"{run_dir}: no profiled step (steps requested: "
            f"{ranks[0]['meta'].get('steps_requested')}; check profiler.steps against the "
            "steps the job ran, or call prof.step() after each step)"
        )
    by_step: dict[int, float] = defaultdict(float)
    for a in per:
        for s in a["per_step"]:
            by_step[s["step"]] = max(by_step[s["step"]], s["time_s"])
    main = dict(per[0])
    main["step_time_max_over_ranks"] = _stats(list(by_step.values()))
    main["step_max_by_step"] = dict(by_step)
    main["per_rank"] = [
        {
            "rank": a["rank"],
            "step_p50_s": a["steps"]["p50"],
            "comm_share_of_step": a["comm"]["share_of_step"],
            "comm_share_of_backward": a["comm"]["share_of_backward"],
            "host_share": a["host_share"],
        }
        for a in per
    ]
    meta = ranks[0]["meta"]
    main["run"] = {
        "dir": str(run_dir),
        "ranks": len(ranks),
        "world_size": meta.get("world_size"),
        "missing_ranks": sorted(
            set(range(meta.get("world_size") or 1)) - {d["meta"].get("rank", 0) for d in ranks}
        ),
        "device": meta.get("device"),
        "cuda": meta.get("cuda"),
        "torch": meta.get("torch"),
        "cuda_sync": meta.get("cuda_sync"),
        "torch_profiler": meta.get("torch_profiler"),
        "trace": meta.get("trace"),
    }
    return main


def flat_metrics(m: dict) -> dict[str, float]:
    """Namespaced scalar metrics of :func:`analyze_run`'s result, for loggers
    (``timing_s/<phase>`` per step, ``comm/share_of_step``, ``memory/peak_bytes/<phase>``, ...).
    Missing values are left out."""
    st = m["step_time_max_over_ranks"]
    out: dict[str, float | None] = {
        "timing_s/step_mean": st["mean"],
        "timing_s/step_p50": st["p50"],
        "timing_s/step_p99": st["p99"],
        "timing/step_p99_over_p50": st["p99_over_p50"],
        "comm/time_s_per_step": m["comm"]["per_step_s"],
        "comm/share_of_step": m["comm"]["share_of_step"],
        "comm/share_of_backward": m["comm"]["share_of_backward"],
        "comm/exposed_share_of_step": m["comm"]["exposed_share_of_step"],
        "comm/bytes_total": m["comm"]["bytes_total"],
        "comm/torch_input_bytes": m["comm"].get("torch_input_bytes") or None,
        "perf/host_phase_share": m["host_share"],
        "perf/gpu_idle_share": (m["gpu_idle"] or {}).get("share"),
        "rollout/latency_s_p50": m["rollout"]["p50"],
        "rollout/latency_s_p99": m["rollout"]["p99"],
        "reshard/time_s_per_step": m["reshard"]["per_step_s"],
        "reshard/bytes": m["reshard"]["bytes"],
        "profile/overhead_share": m["overhead"]["share_of_step"],
        "profile/in_step_slowdown": m["overhead"].get("in_step_slowdown"),
    }
    for name, d in m["phases"].items():
        out[f"timing_s/{name}"] = d["per_step_s"]
        out[f"timing/share_{name}"] = d["share"]
        out[f"memory/peak_bytes/{name}"] = d.get("mem_peak")
    return {k: float(v) for k, v in out.items() if v is not None}
