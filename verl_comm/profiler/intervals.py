"""Interval arithmetic on ``(start, end)`` pairs in seconds (pure, unit-tested).

Used to count communication once when several sources report the same collective (our
:class:`~verl_comm.telemetry.CommRecorder`, torch's c10d/gloo events, NCCL kernels), to
find the part of communication not overlapped by compute (exposed communication), and to
find device idle gaps.
"""

from __future__ import annotations

from collections.abc import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint union of the intervals (empty or reversed ones dropped)."""
    items = sorted((a, b) for a, b in intervals if b > a)
    out: list[Interval] = []
    for a, b in items:
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def total(intervals: Iterable[Interval]) -> float:
    """Length of the union of the intervals (seconds)."""
    return sum(b - a for a, b in union(intervals))


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """The union of the intervals restricted to ``[lo, hi]``."""
    return [(max(a, lo), min(b, hi)) for a, b in union(intervals) if min(b, hi) > max(a, lo)]


def subtract(base: Iterable[Interval], minus: Iterable[Interval]) -> list[Interval]:
    """``base \\ minus`` as a sorted disjoint list (e.g. communication not hidden by compute)."""
    out: list[Interval] = []
    cut = union(minus)
    i = 0  # both lists are sorted and disjoint: one merge pass, O(len(base) + len(cut))
    for a, b in union(base):
        while i < len(cut) and cut[i][1] <= a:
            i += 1
        cur, j = a, i
        while j < len(cut) and cut[j][0] < b:
            c, d = cut[j]
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
            if cur >= b:
                break
            j += 1
        if cur < b:
            out.append((cur, b))
    return out


def gaps(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """Parts of ``[lo, hi]`` covered by no interval (idle gaps)."""
    return subtract([(lo, hi)], intervals)
