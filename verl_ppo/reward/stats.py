"""Per-batch reward latency statistics for the trainer's metrics.

:class:`LatencyStats` is a thread-safe, bounded window of latencies in seconds;
:class:`TimedReward` wraps any :class:`~verl_ppo.reward.base.RewardModel` and records the
wall time of each ``score`` call. Metric keys follow the project's namespaces:
``reward/latency_s`` (mean seconds per batch), ``reward/latency_p99_s``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

import torch

from verl_ppo.reward.base import RewardBatch, RewardModel, check_rewards


def percentile(values: list[float], q: float) -> float:
    """Percentile ``q`` in [0, 100] by linear interpolation between closest ranks
    (numpy's default "linear" method). Returns NaN for an empty list.

    Raises:
        ValueError: if q is outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class LatencyStats:
    """Thread-safe window of the last ``window`` latencies (seconds).

    Args:
        window: how many recent samples to keep (bounded memory).
        prefix: metric key prefix, e.g. ``"reward/latency"``.

    Raises:
        ValueError: if window < 1.
    """

    def __init__(self, window: int = 10_000, prefix: str = "reward/latency") -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.prefix = prefix
        self._values: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self.count = 0

    def record(self, seconds: float) -> None:
        """Add one latency in seconds."""
        with self._lock:
            self._values.append(float(seconds))
            self.count += 1

    def values(self) -> list[float]:
        """A copy of the latencies in the window, oldest first (seconds)."""
        with self._lock:
            return list(self._values)

    def reset(self) -> None:
        """Forget the window (the total ``count`` is kept)."""
        with self._lock:
            self._values.clear()

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """``{prefix_s: mean, prefix_p99_s: P99}`` over the window in seconds (NaN if
        empty); ``reset=True`` clears the window afterwards (per-step metrics)."""
        with self._lock:
            vals = list(self._values)
            if reset:
                self._values.clear()
        mean = sum(vals) / len(vals) if vals else math.nan
        return {f"{self.prefix}_s": mean, f"{self.prefix}_p99_s": percentile(vals, 99.0)}


class TimedReward:
    """Wraps a reward model and records the wall time of every ``score`` call.

    Args:
        inner: the model to time.
        stats: where to record; a new :class:`LatencyStats` if None.
    """

    def __init__(self, inner: RewardModel, stats: LatencyStats | None = None) -> None:
        self.inner = inner
        self.stats = stats if stats is not None else LatencyStats()

    @property
    def name(self) -> str:
        """Name of the wrapped model."""
        return getattr(self.inner, "name", type(self.inner).__name__)

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """Score with the inner model; returns float32 ``(B,)``; records seconds taken."""
        t0 = time.perf_counter()
        out = self.inner.score(batch)
        self.stats.record(time.perf_counter() - t0)
        return check_rewards(out, len(batch), self.name)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """``reward/latency_s`` and ``reward/latency_p99_s`` (seconds per batch)."""
        return self.stats.metrics(reset=reset)
