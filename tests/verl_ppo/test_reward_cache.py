"""CachedReward: exact-token keys, LRU bound, counters; a prefix key gives wrong rewards."""

import threading
from collections import OrderedDict

import reasoning_gym
import torch

from verl_ppo.reward import CachedReward, RewardBatch, RuleReward


class _Counting:
    """Reward = sum of response ids; counts the samples it scores."""

    name = "counting"

    def __init__(self):
        self.calls = []

    def score(self, batch):
        self.calls.append(len(batch))
        return torch.tensor([float(sum(r)) for r in batch.response_ids], dtype=torch.float32)


def _b(pairs):
    n = len(pairs)
    return RewardBatch([p for p, _ in pairs], [r for _, r in pairs], [""] * n, [""] * n, [{}] * n)


def test_hits_misses_and_different_tail_is_rescored():
    inner = _Counting()
    c = CachedReward(inner, max_entries=10)
    a = ((1, 2), (10, 20, 30))
    tail = ((1, 2), (10, 20, 31))  # same prompt and response prefix, different last token
    assert c.score(_b([a])).tolist() == [60.0]
    out = c.score(_b([a, tail]))
    assert out.tolist() == [60.0, 61.0]
    assert (c.hits, c.misses) == (1, 2) and inner.calls == [1, 1]
    m = c.metrics(reset=True)
    assert m["reward/cache_hit_rate"] == 1 / 3 and m["reward/cache_entries"] == 2
    c.score(_b([a, a]))
    m = c.metrics()
    assert m["reward/cache_hit_rate"] == 1.0 and m["reward/cache_hits"] == 3


def test_prompt_response_boundary_is_part_of_the_key():
    inner = _Counting()
    c = CachedReward(inner, 10)
    out = c.score(_b([((1, 2), (3,)), ((1,), (2, 3))]))
    assert out.tolist() == [3.0, 5.0] and c.misses == 2


def test_duplicates_in_a_batch_scored_once_and_lru_eviction():
    inner = _Counting()
    c = CachedReward(inner, max_entries=2)
    x, y, z = ((0,), (1,)), ((0,), (2,)), ((0,), (3,))
    assert c.score(_b([x, x, y])).tolist() == [1.0, 1.0, 2.0]
    assert inner.calls == [2]
    c.score(_b([x]))  # x becomes most recent, y is least recent
    c.score(_b([z]))  # evicts y
    assert len(c) == 2 and c.evictions == 1
    inner.calls.clear()
    c.score(_b([x, z]))
    assert inner.calls == []
    c.score(_b([y]))
    assert inner.calls == [1]


class _PrefixKeyedCache:
    """The cache sometimes suggested: key = prompt + first ``k`` response tokens."""

    def __init__(self, inner, k):
        self.inner, self.k, self.store = inner, k, OrderedDict()

    def score(self, batch):
        out = []
        for i in range(len(batch)):
            key = (batch.prompt_ids[i], batch.response_ids[i][: self.k])
            if key not in self.store:
                self.store[key] = float(self.inner.score(batch.select([i]))[0])
            out.append(self.store[key])
        return torch.tensor(out)


def test_prefix_key_returns_wrong_rewards_exact_key_does_not():
    entry = next(iter(reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=5)))
    ans = entry["answer"]
    # Two completions with the same first tokens; only the tail carries the answer.
    texts = [f"<answer>{ans}</answer>", f"<answer>{int(ans) + 1}</answer>"]
    ids = [(5, 6, 7, 100), (5, 6, 7, 101)]
    batch = RewardBatch([(1, 2)] * 2, ids, [entry["question"]] * 2, texts, [entry] * 2)
    truth = RuleReward().score(batch)
    assert truth.tolist() == [1.0, 0.0]
    prefix = _PrefixKeyedCache(RuleReward(), k=3)
    assert prefix.score(batch).tolist() == [1.0, 1.0]  # the wrong answer is rewarded
    exact = CachedReward(RuleReward(), 16)
    assert exact.score(batch).tolist() == truth.tolist()
    assert exact.score(batch.select([1, 0])).tolist() == [0.0, 1.0]
    assert exact.hits == 2


def test_thread_safety_under_concurrent_scoring():
    inner = _Counting()
    c = CachedReward(inner, max_entries=50)
    batches = [_b([((t,), (i, t)) for i in range(20)]) for t in range(4)]
    errors = []

    def work(t):
        try:
            for _ in range(20):
                want = [float(i + t) for i in range(20)]
                assert c.score(batches[t]).tolist() == want
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and len(c) <= 50 and c.hits + c.misses == 4 * 20 * 20
