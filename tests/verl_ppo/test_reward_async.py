"""AsyncRewardScorer: overlap with generation, exceptions, order, shutdown."""

import threading
import time

import pytest
import torch

from verl_ppo.reward import AsyncRewardScorer, RewardBatch


def _b(v, n=2):
    return RewardBatch([(1,)] * n, [(v,)] * n, [""] * n, [""] * n, [{}] * n)


class _Slow:
    name = "slow"

    def __init__(self, delay):
        self.delay = delay
        self.threads = set()

    def score(self, batch):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if batch.response_ids[0][0] < 0:
            raise ValueError("negative token")
        return torch.full((len(batch),), float(batch.response_ids[0][0]))


@pytest.mark.timeout(60)
def test_scoring_overlaps_generation():
    delay, gen, n = 0.15, 0.2, 4
    model = _Slow(delay)
    blocked = 0.0  # seconds the "trainer" spent in submit/wait instead of generating
    with AsyncRewardScorer(model, max_workers=1) as scorer:
        futs = []
        for i in range(n):
            time.sleep(gen)  # "generate" micro-batch i while i-1 scores
            t0 = time.perf_counter()
            futs.append(scorer.submit(_b(i)))
            blocked += time.perf_counter() - t0
        t0 = time.perf_counter()
        out = [scorer.wait(f, timeout=10) for f in futs]
        blocked += time.perf_counter() - t0
    assert [o.tolist() for o in out] == [[float(i)] * 2 for i in range(n)]
    # Scoring in line would block n * delay = 0.6 s; overlapped, only the last batch shows.
    assert blocked < 0.5 * n * delay, blocked
    m = scorer.metrics()
    assert m["reward/latency_s"] >= delay
    assert m["reward/exposed_s"] < m["reward/latency_s"]  # earlier batches were ready
    assert all(name.startswith("reward") for name in model.threads)


def test_exception_propagates_at_result_and_scorer_keeps_working():
    with AsyncRewardScorer(_Slow(0.0)) as scorer:
        bad = scorer.submit(_b(-1))
        good = scorer.submit(_b(3))
        with pytest.raises(ValueError, match="negative token"):
            scorer.wait(bad, timeout=10)
        assert good.result(timeout=10).tolist() == [3.0, 3.0]


def test_shutdown_rejects_new_work_and_cancels_on_error():
    scorer = AsyncRewardScorer(_Slow(0.05))
    f = scorer.submit(_b(1))
    scorer.shutdown(wait=True)
    assert f.done() and f.result().tolist() == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="shut down"):
        scorer.submit(_b(1))
    scorer.shutdown()  # idempotent
    futs = []
    with pytest.raises(KeyError):
        with AsyncRewardScorer(_Slow(0.2)) as s2:
            futs = [s2.submit(_b(i)) for i in range(5)]
            raise KeyError("trainer failed")
    assert any(f.cancelled() for f in futs)
    with pytest.raises(ValueError, match="max_workers"):
        AsyncRewardScorer(_Slow(0), max_workers=0)


def test_wrong_shape_from_model_is_an_error_at_result():
    class Bad:
        def score(self, batch):
            return torch.zeros(len(batch) + 1)

    with AsyncRewardScorer(Bad()) as s:
        with pytest.raises(Exception, match=r"shape \(3,\), expected \(2,\)"):
            s.submit(_b(1)).result(timeout=10)
