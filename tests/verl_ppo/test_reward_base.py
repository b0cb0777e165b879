"""RewardBatch validation and JSON form, check_rewards, latency statistics."""

import json
import math
import time

import pytest
import torch

from verl_ppo.reward import (
    LatencyStats,
    RewardBatch,
    RewardError,
    RewardModel,
    TimedReward,
    check_rewards,
    percentile,
)


def _batch(n=3):
    return RewardBatch(
        [(1, 2, 3)] * n,
        [tuple(range(10 + i, 14 + i)) for i in range(n)],
        ["q"] * n,
        [f"r{i}" for i in range(n)],
        [{"answer": str(i)} for i in range(n)],
    )


def test_from_padded_strips_left_and_right_padding():
    p = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    pm = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    r = torch.tensor([[11, 12, 2, 0], [13, 0, 0, 0]])
    rm = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    b = RewardBatch.from_padded(p, pm, r, rm, ["a", "b"], ["x", "y"], [{}, {}])
    assert b.prompt_ids == ((5, 6), (7, 8, 9, 10))
    assert b.response_ids == ((11, 12, 2), (13,))
    assert len(b) == 2
    with pytest.raises(ValueError, match="prompt_mask"):
        RewardBatch.from_padded(p, pm[:, :3], r, rm, ["a", "b"], ["x", "y"], [{}, {}])


def test_validation_names_the_field():
    with pytest.raises(ValueError, match="responses has 1 items"):
        RewardBatch([(1,), (2,)], [(1,), (2,)], ["a", "b"], ["x"], [{}, {}])
    with pytest.raises(ValueError, match=r"response_ids\[0\] must hold ints"):
        RewardBatch([(1,)], [("x",)], ["a"], ["x"], [{}])
    with pytest.raises(ValueError, match=r"entries\[0\] must be a dict"):
        RewardBatch([(1,)], [(1,)], ["a"], ["x"], ["answer"])
    with pytest.raises(ValueError, match="1-D integer tensor"):
        RewardBatch([torch.ones(2)], [(1,)], ["a"], ["x"], [{}])


def test_token_key_keeps_boundary_and_every_token():
    b = RewardBatch([(1, 2), (1,)], [(3,), (2, 3)], ["", ""], ["", ""], [{}, {}])
    assert b.token_key(0) != b.token_key(1)  # same concatenation, different boundary
    big = RewardBatch([(2**40,)], [(5,)], [""], [""], [{}])
    assert big.token_key(0) != RewardBatch([(0,)], [(5,)], [""], [""], [{}]).token_key(0)


def test_json_round_trip_and_select():
    b = _batch()
    back = RewardBatch.from_json(json.loads(json.dumps(b.to_json())))
    assert back == b
    s = b.select([2, 0])
    assert s.responses == ("r2", "r0") and s.response_ids[0] == b.response_ids[2]
    with pytest.raises(ValueError, match="missing field"):
        RewardBatch.from_json({"prompts": []})


def test_check_rewards():
    out = check_rewards([0.5, 1], 2, "m")
    assert out.dtype == torch.float32 and out.tolist() == [0.5, 1.0]
    with pytest.raises(RewardError, match=r"m returned rewards of shape \(3,\)"):
        check_rewards(torch.zeros(3), 2, "m")
    with pytest.raises(RewardError, match=r"non-finite rewards at samples \[1\]"):
        check_rewards(torch.tensor([0.0, math.nan]), 2, "m")


def test_percentile_matches_torch_quantile():
    vals = [float(v) for v in torch.rand(37, generator=torch.Generator().manual_seed(0))]
    for q in (0, 50, 99, 100):
        want = torch.quantile(torch.tensor(vals, dtype=torch.float64), q / 100).item()
        assert percentile(vals, q) == pytest.approx(want, rel=1e-12)
    assert math.isnan(percentile([], 50))


class _Sleepy:
    name = "sleepy"

    def score(self, batch):
        time.sleep(0.02)
        return torch.ones(len(batch))


def test_timed_reward_records_latency():
    assert isinstance(_Sleepy(), RewardModel)
    t = TimedReward(_Sleepy(), LatencyStats(window=2))
    for _ in range(3):
        assert t.score(_batch()).tolist() == [1.0, 1.0, 1.0]
    m = t.metrics(reset=True)
    assert 0.02 <= m["reward/latency_s"] < 1.0 and m["reward/latency_p99_s"] >= 0.02
    assert len(t.stats.values()) == 0 and t.stats.count == 3


def test_build_reward_model_specs():
    from verl_ppo.reward import CachedReward, RemoteReward, RuleReward, build_reward_model

    assert isinstance(build_reward_model("rule"), RuleReward)
    cached = build_reward_model("rule", cache_entries=8)
    assert isinstance(cached, CachedReward) and cached.max_entries == 8
    assert isinstance(build_reward_model("http://127.0.0.1:9"), RemoteReward)
    with pytest.raises(ValueError, match="unknown reward model 'bogus'"):
        build_reward_model("bogus")
