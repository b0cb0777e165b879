"""A bounded LRU cache of rewards keyed by the exact token sequence.

The key is every prompt token and every response token (plus the boundary between
them, :meth:`RewardBatch.token_key`), so a response that differs from a cached one in
any token, including only in its tail, is always scored afresh. Keying on a prefix
(prompt plus the first k response tokens, as sometimes suggested to save hashing)
returns the reward of a *different* response, which silently corrupts the PPO signal:
the tests show such a cache handing out wrong rewards.

The prompt tokens must determine the task entry (true for prompts that contain the
task's question); the entry itself is not part of the key.

Memory: 8 bytes per token per entry plus Python overhead (~100 bytes) and one float.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from verl_ppo.reward.base import RewardBatch, RewardModel, check_rewards


class CachedReward:
    """LRU cache in front of a reward model.

    Args:
        inner: the model that scores misses.
        max_entries: most cached sequences; the least recently used is evicted beyond.

    Thread-safe; duplicate sequences inside one batch are scored once. Counters
    ``hits`` and ``misses`` count samples (not batches).

    Raises:
        ValueError: if max_entries < 1.
    """

    def __init__(self, inner: RewardModel, max_entries: int = 65_536) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.inner = inner
        self.max_entries = max_entries
        self._store: OrderedDict[tuple[int, bytes], float] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._win = [0, 0]  # hits, misses since the last metrics(reset=True)

    @property
    def name(self) -> str:
        """Name of the wrapped model with a ``cached:`` prefix."""
        return "cached:" + getattr(self.inner, "name", type(self.inner).__name__)

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._store.clear()

    def score(self, batch: RewardBatch) -> torch.Tensor:
        """Float32 ``(B,)``: cached rewards for seen sequences, ``inner`` for the rest."""
        keys = [batch.token_key(i) for i in range(len(batch))]
        out: list[float | None] = [None] * len(batch)
        miss_first: dict[tuple[int, bytes], int] = {}  # key -> first sample index
        with self._lock:
            for i, k in enumerate(keys):
                v = self._store.get(k)
                if v is not None:
                    self._store.move_to_end(k)
                    out[i] = v
                    self.hits += 1
                    self._win[0] += 1
                else:
                    miss_first.setdefault(k, i)
                    self.misses += 1
                    self._win[1] += 1
        if miss_first:
            idx = list(miss_first.values())
            scored = check_rewards(self.inner.score(batch.select(idx)), len(idx), self.name)
            fresh = dict(zip(miss_first.keys(), scored.tolist()))
            with self._lock:
                for k, v in fresh.items():
                    self._store[k] = v
                    self._store.move_to_end(k)
                while len(self._store) > self.max_entries:
                    self._store.popitem(last=False)
                    self.evictions += 1
            for i, k in enumerate(keys):
                if out[i] is None:
                    out[i] = fresh[k]
        return torch.tensor(out, dtype=torch.float32)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """``reward/cache_hit_rate``: hits / lookups since the last ``reset=True`` call (or
        since creation; NaN before any lookup), so the trainer can report it per step;
        ``reward/cache_hits`` and ``reward/cache_misses`` (totals since creation, samples)
        and ``reward/cache_entries``."""
        inner = getattr(self.inner, "metrics", None)  # e.g. the custom function's extras
        with self._lock:
            h, m = self._win
            if reset:
                self._win = [0, 0]
            return {
                **(inner(reset) if inner is not None else {}),
                "reward/cache_hit_rate": h / (h + m) if h + m else float("nan"),
                "reward/cache_hits": float(self.hits),
                "reward/cache_misses": float(self.misses),
                "reward/cache_entries": float(len(self._store)),
            }
