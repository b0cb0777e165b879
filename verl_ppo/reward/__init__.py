"""The reward path: a :class:`RewardModel` protocol, rule / model / remote scorers, an
exact-token LRU cache, asynchronous scoring and a reward server.

Typical trainer wiring::

    from verl_ppo.reward import AsyncRewardScorer, CachedReward, RuleReward, RewardBatch

    reward = CachedReward(RuleReward(), max_entries=65536)
    scorer = AsyncRewardScorer(reward, max_workers=1)
    fut = scorer.submit(RewardBatch.from_padded(p_ids, p_mask, r_ids, r_mask,
                                                prompts, responses, entries))
    ...  # generate the next micro-batch
    rewards = scorer.wait(fut)          # float32 (B,)
    metrics = {**scorer.metrics(reset=True), **reward.metrics()}
    # reward/latency_s, reward/exposed_s, reward/cache_hit_rate, ...

Modules are imported lazily where heavy (transformers is only loaded by ModelReward).
"""

from verl_ppo.reward.async_scorer import AsyncRewardScorer
from verl_ppo.reward.base import (
    RewardBatch,
    RewardError,
    RewardInputError,
    RewardModel,
    check_rewards,
)
from verl_ppo.reward.cache import CachedReward
from verl_ppo.reward.factory import build_reward_model
from verl_ppo.reward.model import ModelReward, default_encoder_path
from verl_ppo.reward.remote import RemoteReward, RemoteRewardError
from verl_ppo.reward.rule import RuleReward, extract_tagged_answer
from verl_ppo.reward.server import RewardServer
from verl_ppo.reward.stats import LatencyStats, TimedReward, percentile

__all__ = [
    "AsyncRewardScorer",
    "CachedReward",
    "LatencyStats",
    "ModelReward",
    "RemoteReward",
    "RemoteRewardError",
    "RewardBatch",
    "RewardError",
    "RewardInputError",
    "RewardModel",
    "RewardServer",
    "RuleReward",
    "TimedReward",
    "build_reward_model",
    "check_rewards",
    "default_encoder_path",
    "extract_tagged_answer",
    "percentile",
]
