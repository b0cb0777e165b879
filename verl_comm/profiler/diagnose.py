"""The four classic symptoms, checked against a run's metrics, with evidence and remedy.

1. step-time jitter: P99/P50 of the step time above ``jitter_ratio`` -> collective
   blocking (the extra time of slow steps is communication) or allocator fragmentation
   (reserved memory far above allocated, or growing) or a host phase that varies;
2. accelerator idle while the host works: host phases (reward scoring, data loading,
   tokenization) above ``host_share`` of the step, or on CUDA device idle gaps above
   ``idle_share``. Causes follow where the idle time is: inside ``gen`` ->
   kernel-launch-bound decoding (CUDA graphs); inside other device phases -> small
   kernels (larger micro-batches, packing); host phases -> async reward path; between
   phases -> data loading / tokenization; several ranks -> padding imbalance (packing,
   dynamic batching);
3. communication above ``comm_share`` of the step or of backward -> gradient compression,
   bucket size, topology;
4. rollout latency P99 above ``rollout_p99_s`` seconds or ``rollout_ratio`` x P50 ->
   resharding, KV cache reuse, tokenization threads.

Symptoms 1 and 4 need at least ``min_samples`` steps/rollouts to be judged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from verl_comm.profiler.analysis import (
    BETWEEN_PHASES,
    ENVELOPE_OPS,
    HOST_PHASES,
    ROLLOUT_PHASE,
)


@dataclass
class Thresholds:
    """Limits of the diagnosis (fractions are of the step time unless named otherwise)."""

    jitter_ratio: float = 1.5
    host_share: float = 0.30
    idle_share: float = 0.30
    comm_share: float = 0.35
    rollout_ratio: float = 1.5
    rollout_p99_s: float | None = None
    min_samples: int = 5

    def validate(self) -> None:
        """Raise ValueError naming a bad field."""
        for k in ("host_share", "idle_share", "comm_share"):
            if not 0 < getattr(self, k) < 1:  # NaN fails too
                raise ValueError(f"threshold {k} must be in (0, 1), got {getattr(self, k)}")
        for k in ("jitter_ratio", "rollout_ratio"):
            if not getattr(self, k) > 1:  # NaN fails too
                raise ValueError(f"threshold {k} must be > 1, got {getattr(self, k)}")
        if self.rollout_p99_s is not None and not self.rollout_p99_s > 0:
            raise ValueError(f"threshold rollout_p99_s must be > 0 s, got {self.rollout_p99_s}")
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {self.min_samples}")


def _symptom(
    num: int, name: str, found: bool | None, evidence: str, causes, remedy, values
) -> dict:
    return {
        "id": num,
        "name": name,
        "found": found,
        "evidence": evidence,
        "likely_causes": list(causes) if found else [],
        "remedy": list(remedy) if found else [],
        "values": values,
    }


def _jitter(m: dict, th: Thresholds) -> dict:
    st = m["step_time_max_over_ranks"]
    name = "step time jitter"
    if st["n"] < th.min_samples:
        return _symptom(1, name, None, f"only {st['n']} steps (need {th.min_samples})", (), (), {})
    ratio = st["p99_over_p50"]
    steps = m["per_step"]  # rank 0's breakdown
    by_step = m.get("step_max_by_step") or {s["step"]: s["time_s"] for s in steps}
    slow_id = max(by_step, key=by_step.get)  # the slowest step over all ranks
    excess = by_step[slow_id] - float(np.median(list(by_step.values())))
    slow = next((s for s in steps if s["step"] == slow_id), max(steps, key=lambda s: s["time_s"]))
    names = {n for s in steps for n in s["phases"]}
    deltas = {
        n: slow["phases"].get(n, 0.0) - float(np.median([s["phases"].get(n, 0.0) for s in steps]))
        for n in names
    }
    top_phase = max(deltas, key=deltas.get) if deltas else None
    comm_excess = slow["comm_s"] - float(np.median([s["comm_s"] for s in steps]))
    values = {
        "p50_s": st["p50"],
        "p99_s": st["p99"],
        "p99_over_p50": ratio,
        "slowest_step": slow_id,
        "slowest_excess_s": excess,
        "excess_phase": top_phase,
        "excess_phase_s": deltas.get(top_phase) if top_phase else None,
        "excess_comm_s": comm_excess,
    }
    found = ratio is not None and ratio > th.jitter_ratio
    causes = []
    mem = m.get("memory_timeline") or []
    frag = None
    if mem:
        alloc = max(x["allocated"] for x in mem)
        res = max(x["reserved"] for x in mem)
        frag = res / alloc if alloc > 0 else None
        values["reserved_over_allocated"] = frag
    if excess > 0 and comm_excess >= 0.5 * excess:
        causes.append(
            f"collective blocking: {comm_excess:.3f} s of the {excess:.3f} s extra in step "
            f"{slow['step']} is communication (a rank waits for a slow peer or the network)"
        )
    if frag is not None and frag > 1.5 and m["run"].get("cuda"):
        causes.append(f"allocator fragmentation: reserved/allocated = {frag:.2f}")
    if top_phase and not causes:
        causes.append(f"phase '{top_phase}' took {deltas[top_phase]:.3f} s more than its median")
    evidence = (
        f"step time P50 {st['p50']:.3f} s, P99 {st['p99']:.3f} s, P99/P50 {ratio:.2f} "
        f"(limit {th.jitter_ratio}); slowest step {slow_id} is {excess:.3f} s over the median "
        "(max over ranks)"
        + (
            f"; on rank 0 its largest extra is in '{top_phase}' (+{deltas[top_phase]:.3f} s)"
            if top_phase and slow["step"] == slow_id
            else ""
        )
    )
    remedy = [
        "run `verl-comm doctor` (NCCL env, timeouts, topology) and `verl-comm nccl lint`",
        "read the memory timeline (memory_snapshot_rank*.pickle at pytorch.org/memory_viz); "
        "try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "balance per-rank work (sequence packing, dynamic batching) so no rank waits at the all-reduce",
    ]
    return _symptom(1, name, found, evidence, causes, remedy, values)


def _host_bound(m: dict, th: Thresholds) -> dict:
    host = m["host_share"] or 0.0
    idle = m.get("gpu_idle")
    host_phases = {
        n: d["share"] for n, d in m["phases"].items() if d.get("share") and n in HOST_PHASES
    }
    values = {"host_phase_share": host, "host_phases": host_phases}
    parts = [f"host-side phases {host:.0%} of the step (limit {th.host_share:.0%})"]
    found = host > th.host_share
    if idle is not None and idle["share"] is not None:
        values["gpu_idle_share"] = idle["share"]
        values["gpu_idle_by_phase_s"] = idle["by_phase_s"]
        parts.append(f"GPU idle {idle['share']:.0%} of the step (limit {th.idle_share:.0%})")
        found = found or idle["share"] > th.idle_share
    if host_phases:
        parts.append(", ".join(f"{n} {s:.0%}" for n, s in sorted(host_phases.items())))
    causes, remedy = [], []
    n = max(m["steps"]["n"], 1)
    idle_by = dict((idle or {}).get("by_phase_s") or {})
    idle_total = sum(idle_by.values())
    device_idle = {k: v for k, v in idle_by.items() if k not in HOST_PHASES and k != BETWEEN_PHASES}
    ranked = sorted(device_idle.items(), key=lambda kv: -kv[1])
    if idle_total > 0 and sum(device_idle.values()) > 0.5 * idle_total:
        # the device waits inside device phases: the host cannot launch kernels fast enough
        worst, worst_s = ranked[0]
        if worst == ROLLOUT_PHASE and worst_s > 0.5 * idle_total:
            causes.append(
                f"kernel-launch-bound decoding: {worst_s / n:.3f} s/step of the idle time "
                f"({worst_s / idle_total:.0%}) is in '{worst}', where each decode step "
                "launches hundreds of small kernels and the GPU waits on the host"
            )
            remedy += [
                "decode with CUDA graphs (`rollout.use_cuda_graph: true`): one graph replay "
                "per decode step instead of hundreds of launches",
                "decode more sequences at once (`rollout.micro_batch_size`)",
            ]
        else:
            where = ", ".join(f"'{k}' {v / n:.3f} s/step" for k, v in ranked[:3])
            causes.append(
                f"small kernels inside device phases ({where} idle): micro-batches too small "
                "to fill the GPU, or Python/optimizer overhead between kernels"
            )
            remedy.append(
                "larger micro-batches (`train.micro_batch_size`) or a token budget "
                "(`train.max_tokens_per_micro_batch`), `train.sequence_packing: true`"
            )
    reward_share = host_phases.get("reward") or 0.0
    if host > th.host_share or reward_share > 0.05:
        causes.append(f"reward scoring / host phases on the critical path ({host:.0%} of the step)")
        remedy.append(
            "score rewards asynchronously (`reward.async_scoring: true`; `reward.cache_entries` "
            "for the exact-key cache) so scoring overlaps generation"
        )
    between = idle_by.get(BETWEEN_PHASES, 0.0)
    if idle_total > 0 and between > 0.3 * idle_total:
        causes.append(
            f"host work between phases ({between / n:.3f} s/step idle outside any phase): "
            "data loading, tokenization, Python bookkeeping"
        )
        remedy.append("prefetch and tokenize in background threads")
    if len(m.get("per_rank", [])) > 1:
        causes.append("padding imbalance across ranks (ranks wait for the longest batch)")
        remedy.append("pack sequences / dynamic batching to cut padding")
    if not causes:
        causes += ["data loading / tokenization on the critical path", "padding imbalance"]
        remedy += [
            "score rewards asynchronously (`reward.async_scoring: true`)",
            "pack sequences / dynamic batching to cut padding",
            "prefetch and tokenize in background threads",
        ]
    return _symptom(
        2, "accelerator idle while the host works", found, "; ".join(parts), causes, remedy, values
    )


def _comm(m: dict, th: Thresholds) -> dict:
    c = m["comm"]
    if not c.get("measured", True):
        return _symptom(3, "communication-bound", None, c["source"], (), (), {})
    step_share = c["share_of_step"] or 0.0
    bwd_share = c["share_of_backward"]
    worst_rank = max(
        (r["comm_share_of_step"] or 0.0 for r in m.get("per_rank", [])), default=step_share
    )
    found = step_share > th.comm_share or (bwd_share is not None and bwd_share > th.comm_share)
    n = max(m["steps"]["n"], 1)
    tags = sorted(
        ((k, v) for k, v in c["by_tag"].items() if k.split()[0] not in ENVELOPE_OPS),
        key=lambda kv: -kv[1]["time_s"],
    )[:3]
    evidence = (
        f"communication {c['per_step_s']:.3f} s/step = {step_share:.0%} of the step "
        f"(max over ranks {worst_rank:.0%}); "
        + (f"{bwd_share:.0%} of backward; " if bwd_share is not None else "")
        + f"exposed {c['exposed_s'] / max(m['steps']['n'], 1):.3f} s/step; limit {th.comm_share:.0%}"
        + (
            "; top: "
            + ", ".join(
                f"{k} {v['time_s'] / n:.3f} s/step {v['bytes'] / n / 1e6:.1f} MB/step"
                for k, v in tags
            )
            if tags
            else ""
        )
    )
    values = {
        "share_of_step": step_share,
        "share_of_backward": bwd_share,
        "max_share_over_ranks": worst_rank,
        "per_step_s": c["per_step_s"],
        "exposed_s": c["exposed_s"],
        "bytes_total": c["bytes_total"],
    }
    causes = [
        "gradient all-reduce volume too large for the link",
        "buckets too small or not overlapped",
    ]
    methods = hook_methods(c["by_tag"])
    values["hook_methods"] = sorted(methods)
    if "lowrank_int8" in methods:
        compress = (
            "gradients are already sent as int8 low rank: a lower `compression_rank` cuts "
            "bytes further (check convergence), or `policy: auto` per bucket"
        )
    elif "int8" in methods:
        compress = (
            "gradients are already int8 (0.26x fp32 bytes): int8 low rank "
            "(`compression_rank: 128`, PowerSGD-style) sends far fewer bytes on a slow link; "
            "`policy: auto` chooses per bucket"
        )
    else:
        compress = (
            "gradient compression: `gradient_compression: int8` (0.26x fp32 bytes) "
            "or `policy: auto`"
        )
    remedy = [
        compress,
        "larger buckets (bucket_cap_mb) so communication overlaps backward",
        "check the topology and NCCL preset: `verl-comm nccl lint`, `verl-comm nccl autotune`",
    ]
    return _symptom(3, "communication-bound", found, evidence, causes, remedy, values)


def hook_methods(by_tag: dict[str, dict]) -> set[str]:
    """Reduction methods our comm hooks recorded (``allreduce``, ``fp16``, ``bf16``,
    ``int8``, ``lowrank_int8``), read from record keys ``"<op> hook/<method>/bucket<i>"``."""
    out = set()
    for key in by_tag:
        tag = key.split(" ", 1)[-1]
        parts = tag.split("/")
        if len(parts) >= 3 and parts[0] == "hook":
            out.add(parts[1])
    return out


def _rollout(m: dict, th: Thresholds) -> dict:
    r = m["rollout"]
    name = "slow rollout tail"
    if r["n"] < th.min_samples:
        return _symptom(
            4, name, None, f"only {r['n']} rollout batches (need {th.min_samples})", (), (), {}
        )
    ratio = r["p99_over_p50"] or 0.0
    found = ratio > th.rollout_ratio or (
        th.rollout_p99_s is not None and r["p99"] > th.rollout_p99_s
    )
    limit = f"{th.rollout_ratio} x P50" + (
        f" or {th.rollout_p99_s} s" if th.rollout_p99_s is not None else ""
    )
    evidence = (
        f"rollout latency P50 {r['p50']:.3f} s, P99 {r['p99']:.3f} s (P99/P50 {ratio:.2f}; "
        f"limit {limit}) over {r['n']} batches from {r['source']}"
    )
    causes = []
    if not m["reshard"]["enabled"]:
        causes.append("resharding not enabled: generation runs in the training layout")
    causes += ["KV cache not reused across decoding steps", "single-threaded tokenization"]
    remedy = [
        "enable the hybrid engine's rollout resharding (rollout TP layout)",
        "generate with the KV cache (and CUDA graphs for decoding)",
        "tokenize/detokenize in a thread pool",
    ]
    return _symptom(
        4,
        name,
        found,
        evidence,
        causes,
        remedy,
        {"p50_s": r["p50"], "p99_s": r["p99"], "ratio": ratio},
    )


def diagnose(metrics: dict, thresholds: Thresholds | None = None) -> dict:
    """Check the four symptoms; returns ``{"thresholds", "symptoms", "found"}`` where
    ``found`` lists the ids of the symptoms present (``found`` None = not enough data)."""
    th = thresholds or Thresholds()
    th.validate()
    symptoms = [
        _jitter(metrics, th),
        _host_bound(metrics, th),
        _comm(metrics, th),
        _rollout(metrics, th),
    ]
    return {
        "thresholds": asdict(th),
        "symptoms": symptoms,
        "found": [s["id"] for s in symptoms if s["found"]],
    }
