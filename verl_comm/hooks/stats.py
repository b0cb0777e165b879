"""Per-bucket statistics of the verl_comm hooks: the typed record a reduction leaves
(:class:`BucketRecord`), the statistics a step resolves to (:class:`BucketStats`), and the
conversion between them (:func:`resolve_records`).

What is always tracked (no extra pass over a bucket): the path taken, bytes sent, the
finiteness flag the reduction already computes, and the time of the hook's work (host
seconds on CPU; on CUDA, device seconds from two events around the bucket's work). What costs passes over the bucket (``||M||^2`` of the
error-fed input and ``||E||^2`` of the new residual, giving ``rel_error`` and
``residual_norm``) is computed only every ``CompressionConfig.stats_every`` reductions
(0 = never, the default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from verl_comm.telemetry import CommRecord


@dataclass
class BucketStats:
    """Statistics of one bucket reduction as seen by this rank.

    Attributes:
        index: ``bucket.index()``. iteration: hook iteration. method: path taken (``allreduce``,
        ``fp16``, ``bf16``, ``int8``, ``lowrank_int8``). numel, dtype: of the bucket buffer.
        wire_bytes: bytes this rank sent. plain_bytes: bytes a ring all-reduce of the buffer
        in its own dtype would send. compression_ratio: ``plain_bytes / wire_bytes``.
        time_s: seconds of the hook's work (CPU: host time; CUDA: device time from two
        events), None where not measured.
        rel_error: ``||M - M^|| / ||M||`` of this rank's input (M with error feedback; for
        int8 the local quantization error), None when not computed this step (see
        ``CompressionConfig.stats_every``). residual_norm: L2 norm of the new error-feedback
        residual, None without error feedback or when not computed. finite: the reduced
        bucket was finite. skipped: the update was zeroed (``nonfinite='skip'``).
    """

    index: int
    iteration: int
    method: str
    numel: int
    dtype: str
    wire_bytes: int
    plain_bytes: int
    compression_ratio: float
    time_s: float | None
    rel_error: float | None
    residual_norm: float | None
    finite: bool
    skipped: bool

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return asdict(self)


@dataclass
class BucketRecord:
    """What one bucket reduction leaves for the end of its step (device values unread).

    Attributes:
        index: ``bucket.index()``. method: path taken. numel, dtype: of the buffer (dtype
            without the ``torch.`` prefix). world_size: W of the collective.
        wire_bytes / plain_bytes: bytes sent / a plain ring all-reduce would send.
        finite: 0-dim bool tensor on the buffer's device.
        err_sq, in_sq: 0-dim tensors ``||E||^2`` and ``||M||^2`` when statistics were
            computed, else None. has_residual: the path keeps error feedback.
        time_s: host seconds of the hook's work. start_s: ``perf_counter`` at its start.
        submitted_s: ``perf_counter`` when the hook handed the bucket over.
        t_start, t_end: CUDA events around the work (device time), or None.
    """

    index: int
    method: str
    numel: int
    dtype: str
    world_size: int
    wire_bytes: int
    plain_bytes: int
    finite: torch.Tensor
    err_sq: torch.Tensor | None
    in_sq: torch.Tensor | None
    has_residual: bool
    time_s: float
    start_s: float
    submitted_s: float
    t_start: Any = None
    t_end: Any = None

    @classmethod
    def of(
        cls, buf: torch.Tensor, index: int, method: str, world_size: int, wire_bytes: int, **kw
    ) -> BucketRecord:
        """The record of bucket ``buf``: its size, dtype and plain ring bytes from the buffer
        (``kw``: the remaining fields; ``err_sq``, ``in_sq`` default to None,
        ``has_residual`` to False)."""
        from verl_comm.compression.int8_allreduce import ring_allreduce_wire_bytes

        kw.setdefault("err_sq", None)
        kw.setdefault("in_sq", None)
        kw.setdefault("has_residual", False)
        return cls(
            index=index,
            method=method,
            numel=buf.numel(),
            dtype=str(buf.dtype).replace("torch.", ""),
            world_size=world_size,
            wire_bytes=wire_bytes,
            plain_bytes=ring_allreduce_wire_bytes(buf.numel(), world_size, buf.element_size()),
            **kw,
        )


def pack_scalars(records: list[BucketRecord]) -> torch.Tensor:
    """The device scalars of a step in one float32 tensor: ``(len(records),)`` finiteness
    flags, or ``(3 len(records),)`` rows ``(finite, err_sq, in_sq)`` (NaN where not
    computed) when any record carries statistics."""
    dev = records[0].finite.device
    if not any(r.err_sq is not None or r.in_sq is not None for r in records):
        return torch.stack([r.finite.reshape(()) for r in records]).float()
    nan = torch.full((), float("nan"), dtype=torch.float32, device=dev)
    scalars = []
    for r in records:
        for v in (r.finite, r.err_sq, r.in_sq):
            scalars.append(nan if v is None else v.to(dev, torch.float32).reshape(()))
    return torch.stack(scalars)


def resolve_records(
    vals: torch.Tensor, records: list[BucketRecord], iteration: int, skip: bool
) -> list[BucketStats]:
    """Turn a step's records and its scalars read on the host (:func:`pack_scalars`'s
    layout) into :class:`BucketStats`; ``skip``: ``nonfinite == 'skip'``."""
    flat = vals.view(-1).tolist()
    if len(flat) == len(records):  # flags only
        rows = [(ok, float("nan"), float("nan")) for ok in flat]
    else:
        rows = [flat[3 * k : 3 * k + 3] for k in range(len(records))]
    out = []
    for r, (ok, e, i) in zip(records, rows):
        ok = ok == 1.0
        time_s: float | None = r.time_s
        if r.t_end is not None:  # CUDA events (completed: the copy after them landed)
            time_s = r.t_start.elapsed_time(r.t_end) / 1e3
        elif r.finite.is_cuda:
            time_s = None  # the host only enqueued the work
        rel = res = None
        if e == e and i == i:  # both computed (not NaN)
            rel = (e / i) ** 0.5 if i > 0 else 0.0
            if r.has_residual:
                res = e**0.5
        wire = r.wire_bytes
        out.append(
            BucketStats(
                index=r.index,
                iteration=iteration,
                method=r.method,
                numel=r.numel,
                dtype=r.dtype,
                wire_bytes=wire,
                plain_bytes=r.plain_bytes,
                compression_ratio=r.plain_bytes / wire if wire else 1.0,
                time_s=time_s,
                rel_error=rel,
                residual_norm=res,
                finite=bool(ok),
                skipped=(not ok) and skip,
            )
        )
    return out


def comm_record(r: BucketRecord, st: BucketStats) -> CommRecord:
    """The telemetry record of one bucket reduction."""
    extra = {
        "compression_ratio": st.compression_ratio,
        "rel_error": st.rel_error,
        "residual_norm": st.residual_norm,
        "finite": float(st.finite),
        "iteration": float(st.iteration),
        "submitted_s": r.submitted_s,
    }
    return CommRecord(
        op=r.method,
        nbytes=r.wire_bytes,
        group_size=r.world_size,
        duration_s=st.time_s if st.time_s is not None else r.time_s,
        tag=f"hook/{r.method}/bucket{r.index}",
        start_s=r.start_s,
        extra={k: float(v) for k, v in extra.items() if v is not None},
    )


def summarize(stats: list[BucketStats]) -> dict[str, float]:
    """The ``comm/*`` metrics of one step's statistics (see ``CommHookState.metrics``);
    ``comm/rel_error`` and ``comm/residual_norm`` only if the step computed them."""
    wire = sum(s.wire_bytes for s in stats)
    plain = sum(s.plain_bytes for s in stats)
    times = [s.time_s for s in stats if s.time_s is not None]
    rel = [s.rel_error for s in stats if s.rel_error is not None]
    res = [s.residual_norm for s in stats if s.residual_norm is not None]
    out = {
        "comm/wire_bytes": float(wire),
        "comm/plain_bytes": float(plain),
        "comm/compression_ratio": plain / wire if wire else 1.0,
        "comm/nonfinite_buckets": float(sum(not s.finite for s in stats)),
    }
    if times:
        out["comm/hook_time_s"] = sum(times)
    if rel:
        out["comm/rel_error"] = sum(rel) / len(rel)
    if res:
        out["comm/residual_norm"] = sum(r * r for r in res) ** 0.5
    return out
