"""Adaptive compression policy (``policy: auto``): compress a bucket only where it saves time.

Model (alpha-beta, per rank)::

    t_plain      = alpha + beta * ring_bytes(bucket)              (one all-reduce)
    t_compressed = c * alpha + beta * wire_bytes(compressed) + compute_s

``alpha`` (seconds per collective) and ``beta`` (seconds per byte sent) come from timing
all-reduces of a small and a large buffer on the real group (:func:`measure_link`);
``compute_s`` is the compressor's own compute on this bucket, timed with a
:class:`~verl_comm.compression.collective.LoopbackCollective` (real shapes, no link).
Measurements are agreed with a MAX all-reduce (compute: the slowest rank's; shadows: the
least any rank had left), so every rank takes the same decision.
With overlap in view (:func:`decide_overlap`) each bucket's chain is
placed on a serial timeline that starts when its gradients are ready, ``shadow_s`` before
the end of backward (measured on a step whose transfers wait for backward's end:
:mod:`verl_comm.hooks.measure`): a plain all-reduce that ends in backward's
shadow is kept, and a bucket is compressed only where that ends the timeline earlier. On
NVLink (``beta`` ~ 3 ps/B) compression rarely pays and the policy falls back to the plain
all-reduce; on a 2.5 GB/s socket link it compresses. The hooks ask :func:`choose_method`,
which weighs every method no lossier than the one configured (plain, bf16, int8, low rank)
on the same timeline and takes the one whose chain ends first (issue 28).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .collective import Collective

logger = logging.getLogger("verl_comm.compression.policy")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Median wall time in seconds of ``fn()`` over ``reps`` runs after one warm-up.

    CUDA work is synchronised before and after each run, so the time is device time.
    """
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta model of the link of one process group.

    Attributes:
        alpha_s: seconds per collective call (latency).
        beta_s_per_byte: seconds per byte sent by one rank.
        world_size: W of the group the model was measured on.
    """

    alpha_s: float
    beta_s_per_byte: float
    world_size: int

    def time_s(self, wire_bytes: int, n_collectives: int) -> float:
        """Predicted seconds for ``n_collectives`` calls sending ``wire_bytes`` in total."""
        return n_collectives * self.alpha_s + wire_bytes * self.beta_s_per_byte

    @property
    def busbw_GBps(self) -> float:
        """Bus bandwidth implied by ``beta`` in GB/s (10^9 bytes per second)."""
        return 1e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")


def measure_link(
    coll: Collective,
    device: torch.device,
    large_bytes: int = 4 << 20,
    small_bytes: int = 4096,
    reps: int = 3,
) -> LinkModel:
    """Time fp32 all-reduces of ``small_bytes`` and ``large_bytes`` on ``coll``.

    ``alpha = t_small``; ``beta = (t_large - t_small) / ring_bytes(large)`` with ring bytes
    ``2 (W-1)/W * large_bytes``. The two numbers are maxed over ranks (one extra
    all-reduce) so all ranks hold the same model. Must be called by every rank of the group.

    Returns:
        :class:`LinkModel`. For W = 1 both numbers are 0 (nothing crosses a link).
    """
    w = coll.world_size
    if w == 1:
        return LinkModel(0.0, 0.0, 1)
    small = torch.zeros(max(small_bytes // 4, 1), device=device)
    large = torch.zeros(max(large_bytes // 4, 1), device=device)
    t_small = time_call(lambda: coll.all_reduce(small), device, reps)
    t_large = time_call(lambda: coll.all_reduce(large), device, reps)
    ring = 2 * (w - 1) * large.numel() * 4 / w
    agreed = torch.tensor([t_small, max(t_large - t_small, 0.0) / ring], device=device)
    coll.all_reduce_max(agreed)
    alpha, beta = (float(v) for v in agreed.cpu())
    return LinkModel(alpha, beta, w)


@dataclass(frozen=True)
class PolicyDecision:
    """The adaptive policy's choice for one bucket and the numbers behind it (seconds, bytes).

    Attributes:
        compress: True if the compressed path is predicted faster.
        t_plain_s, t_compressed_s: predicted times per step.
        compute_s: measured compressor compute (max over ranks).
        plain_bytes, compressed_bytes: bytes sent per rank by each path.
        alpha_s, beta_s_per_byte: the link model used.
        shadow_s: backward time still to come when the bucket was ready (measured).
        link_free_s: when (relative to the end of backward, seconds) the link is predicted
            free after this bucket on the chosen path.
        method: the path taken (``"allreduce"`` or a compressing method; ``""`` in
            decisions of :func:`decide` / :func:`decide_overlap`: read ``compress``).
        options: per method considered by :func:`choose_method`, its predicted end of
            chain in seconds relative to the end of backward.
    """

    compress: bool
    t_plain_s: float
    t_compressed_s: float
    compute_s: float
    plain_bytes: int
    compressed_bytes: int
    alpha_s: float
    beta_s_per_byte: float
    shadow_s: float = 0.0
    link_free_s: float = 0.0
    method: str = ""
    options: dict | None = None

    @property
    def path(self) -> str:
        """The reduction path: ``method``, else the compressing or the plain one."""
        return self.method or ("compressed" if self.compress else "allreduce")

    def to_dict(self) -> dict:
        """Plain dict (JSON-serialisable)."""
        return asdict(self)


def decide(
    link: LinkModel,
    *,
    plain_bytes: int,
    compressed_bytes: int,
    compressed_collectives: int,
    compute_s: float,
    margin: float = 0.05,
) -> PolicyDecision:
    """Compress iff ``t_compressed < (1 - margin) * t_plain`` under ``link`` (pure).

    Args:
        link: the measured :class:`LinkModel`.
        plain_bytes: bytes one rank sends in the plain all-reduce of the bucket.
        compressed_bytes: bytes one rank sends on the compressed path.
        compressed_collectives: number of collective calls of the compressed path.
        compute_s: seconds of compressor compute per step.
        margin: required relative saving (guards against measurement noise).

    Returns:
        :class:`PolicyDecision`.
    """
    t_plain = link.time_s(plain_bytes, 1)
    t_comp = link.time_s(compressed_bytes, compressed_collectives) + compute_s
    return PolicyDecision(
        compress=t_comp < (1.0 - margin) * t_plain,
        t_plain_s=t_plain,
        t_compressed_s=t_comp,
        compute_s=compute_s,
        plain_bytes=plain_bytes,
        compressed_bytes=compressed_bytes,
        alpha_s=link.alpha_s,
        beta_s_per_byte=link.beta_s_per_byte,
    )


def decide_overlap(
    link: LinkModel,
    *,
    plain_bytes: int,
    compressed_bytes: int,
    compressed_collectives: int,
    compute_s: float,
    shadow_s: float,
    link_free_s: float,
    margin: float = 0.05,
) -> PolicyDecision:
    """:func:`decide` with overlap in view (pure): the buckets' chains run one after the
    other on one worker/link, starting when the bucket is ready, ``shadow_s`` before the end
    of backward. Times are relative to the end of backward (0); what ends before it is
    hidden, what ends after it is exposed.

    The bucket takes the path that ends its chain earlier (that is also the path that ends
    every later bucket earlier, since a later chain starts when this one ends), with two
    guards: compress only if that ends more than ``margin`` of the plain path's own time
    earlier, and never when the plain all-reduce already ends in backward's shadow
    (compression could then gain nothing and costs compute on the shared device).

    Returns:
        :class:`PolicyDecision` whose ``link_free_s`` feeds the next bucket's decision.
    """
    t_plain = link.time_s(plain_bytes, 1)
    t_comp = link.time_s(compressed_bytes, compressed_collectives) + compute_s
    start = max(-shadow_s, link_free_s)
    end_plain, end_comp = start + t_plain, start + t_comp
    compress = end_comp < end_plain - margin * t_plain and end_plain > 0.0
    return PolicyDecision(
        compress=compress,
        t_plain_s=t_plain,
        t_compressed_s=t_comp,
        compute_s=compute_s,
        plain_bytes=plain_bytes,
        compressed_bytes=compressed_bytes,
        alpha_s=link.alpha_s,
        beta_s_per_byte=link.beta_s_per_byte,
        shadow_s=shadow_s,
        link_free_s=end_comp if compress else end_plain,
    )


@dataclass(frozen=True)
class PathCost:
    """What one compressing method costs on one bucket (input of :func:`choose_method`).

    Attributes:
        wire_bytes: bytes one rank sends. collectives: collective calls.
        compute_s: its compute, timed without the link (max over ranks).
        lead_s: None when the chain computes, then transfers (its time is link + compute);
            else the compute before its first transfer, the rest overlapping the link
            (int8's pipelined host path: one slice's share; its time is ``lead_s +
            max(link, compute_s - lead_s)``).
    """

    wire_bytes: int
    collectives: int
    compute_s: float
    lead_s: float | None = None

    def chain_s(self, link_s: float) -> float:
        """Seconds of the chain whose transfers take ``link_s``."""
        if self.lead_s is None:
            return link_s + self.compute_s
        return self.lead_s + max(link_s, self.compute_s - self.lead_s)


def choose_method(
    link: LinkModel,
    *,
    plain_bytes: int,
    options: dict[str, PathCost],
    shadow_s: float,
    link_free_s: float,
    margin: float = 0.05,
) -> PolicyDecision:
    """The fastest path for one bucket among the plain all-reduce and ``options`` (pure).

    The timeline of :func:`decide_overlap`: chains run one after the other from when the
    bucket is ready (``shadow_s`` before the end of backward) or the link is free
    (``link_free_s``), whichever is later; a path's chain takes :meth:`PathCost.chain_s` of
    ``link.time_s(wire_bytes, collectives)``. The path whose chain ends first wins; a path
    ending within ``margin`` of the plain all-reduce's own time of the best is as good, and
    then the more precise one wins (the plain all-reduce first, then
    ``options`` in their order, which the caller gives from most to least precise). A
    plain all-reduce that already ends in backward's shadow is kept.

    Returns:
        :class:`PolicyDecision` with ``method``, ``options`` (predicted ends) and
        ``link_free_s`` for the next bucket; ``t_compressed_s``, ``compute_s`` and
        ``compressed_bytes`` are those of the chosen path (the plain one's if plain won).
    """
    t_plain = link.time_s(plain_bytes, 1)
    start = max(-shadow_s, link_free_s)
    ends = {"allreduce": start + t_plain}
    for name, c in options.items():
        ends[name] = start + c.chain_s(link.time_s(c.wire_bytes, c.collectives))
    best = min(ends.values())
    if ends["allreduce"] <= 0.0:
        chosen = "allreduce"
    else:
        chosen = next(m for m in ends if ends[m] <= best + margin * t_plain)
    c = options.get(chosen, PathCost(plain_bytes, 1, 0.0))
    return PolicyDecision(
        compress=chosen != "allreduce",
        t_plain_s=t_plain,
        t_compressed_s=ends[chosen] - start,
        compute_s=c.compute_s,
        plain_bytes=plain_bytes,
        compressed_bytes=c.wire_bytes,
        alpha_s=link.alpha_s,
        beta_s_per_byte=link.beta_s_per_byte,
        shadow_s=shadow_s,
        link_free_s=ends[chosen],
        method=chosen,
        options={m: round(e, 6) for m, e in ends.items()},
    )


def describe_choices(buckets: dict) -> str | None:
    """One line saying what ``policy: auto`` chose per bucket and why (predicted end of each
    path's chain, ms from the end of backward, and the link it measured); None before any
    decision. ``buckets``: bucket index -> an object with ``decision`` (a hook state's
    ``buckets``)."""
    decs = {i: b.decision for i, b in sorted(buckets.items()) if b.decision is not None}
    if not decs:
        return None
    parts = []
    for i, d in decs.items():
        ends = ", ".join(f"{m} {e * 1e3:.0f}" for m, e in (d.options or {}).items())
        parts.append(f"bucket {i} {d.path}" + (f" ({ends})" if ends else ""))
    d0 = next(iter(decs.values()))
    bw = 8e-6 / d0.beta_s_per_byte if d0.beta_s_per_byte > 0 else float("inf")
    return (
        "; ".join(parts)
        + f" | chain ends in ms after backward, link {bw:.0f} Mbit/s, {d0.alpha_s * 1e6:.0f} us"
    )
