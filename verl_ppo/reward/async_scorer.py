"""Asynchronous reward scoring: score micro-batch i while micro-batch i+1 generates.

Usage in a rollout loop::

    with AsyncRewardScorer(reward_model, max_workers=1) as scorer:
        futures = []
        for mb in micro_batches:
            batch = generate(mb)                  # runs while earlier batches score
            futures.append(scorer.submit(batch))
        rewards = [scorer.wait(f) for f in futures]   # exposed latency recorded here

Scoring runs on worker threads (torch and socket I/O release the GIL, so a GPU
generation or a remote reward server proceeds in parallel). An exception raised by the
model is re-raised by ``Future.result()`` / :meth:`AsyncRewardScorer.wait`.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from verl_ppo.reward.base import RewardBatch, RewardModel, check_rewards
from verl_ppo.reward.stats import LatencyStats


class AsyncRewardScorer:
    """Runs ``reward_model.score`` on a thread pool.

    Args:
        reward_model: any :class:`~verl_ppo.reward.base.RewardModel` (thread-safe if
            ``max_workers > 1``; all of this package's are).
        max_workers: scoring threads. 1 keeps batches in submission order and leaves
            the most cores to generation.

    Metrics (:meth:`metrics`): ``reward/latency_s`` / ``reward/latency_p99_s`` (seconds a
    batch took to score on the worker) and ``reward/exposed_s`` / ``reward/exposed_p99_s``
    (seconds the caller was blocked in :meth:`wait`, the part of the latency not hidden
    behind generation).

    Raises:
        ValueError: if max_workers < 1.
    """

    def __init__(self, reward_model: RewardModel, max_workers: int = 1) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.reward_model = reward_model
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="reward")
        self._closed = False
        self._lock = threading.Lock()
        self.latency = LatencyStats(prefix="reward/latency")
        self.exposed = LatencyStats(prefix="reward/exposed")

    def _run(self, batch: RewardBatch) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.reward_model.score(batch)
        self.latency.record(time.perf_counter() - t0)
        name = getattr(self.reward_model, "name", type(self.reward_model).__name__)
        return check_rewards(out, len(batch), name)

    def submit(self, batch: RewardBatch) -> Future[torch.Tensor]:
        """Queue ``batch`` for scoring; returns a Future of float32 ``(B,)`` rewards.

        Raises:
            RuntimeError: if the scorer was shut down.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncRewardScorer is shut down; create a new one")
            return self._pool.submit(self._run, batch)

    def wait(self, future: Future[torch.Tensor], timeout: float | None = None) -> torch.Tensor:
        """``future.result(timeout)``, recording the seconds spent blocked (exposed latency).

        Raises:
            whatever the reward model raised; ``TimeoutError`` after ``timeout`` seconds.
        """
        t0 = time.perf_counter()
        try:
            return future.result(timeout=timeout)
        finally:
            self.exposed.record(time.perf_counter() - t0)

    def metrics(self, reset: bool = False) -> dict[str, float]:
        """Latency and exposed-latency means and P99s in seconds (see the class doc)."""
        return {**self.latency.metrics(reset), **self.exposed.metrics(reset)}

    def shutdown(self, wait: bool = True, cancel_pending: bool = False) -> None:
        """Stop accepting batches; finish (or, with ``cancel_pending``, cancel) queued ones.

        Idempotent. With ``wait=True`` returns after the worker threads exit.
        """
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=cancel_pending)

    def __enter__(self) -> AsyncRewardScorer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an error in the loop, do not keep scoring batches nobody will read.
        self.shutdown(wait=True, cancel_pending=exc_type is not None)
