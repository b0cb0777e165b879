"""Build a reward model from a short spec string (CLI flags and config values)."""

from __future__ import annotations

from pathlib import Path

from verl_ppo.reward.base import RewardModel

SPECS = "'rule', 'minilm', a Hugging Face model folder, or an http(s):// reward server URL"


def build_reward_model(
    spec: str,
    *,
    device: str = "cpu",
    max_length: int = 256,
    text: str = "answer",
    cache_entries: int = 0,
    deadline_s: float | None = None,
) -> RewardModel:
    """Reward model named by ``spec``.

    Args:
        spec: ``"rule"`` (reasoning-gym scorers), ``"minilm"`` (packaged encoder, similarity
            to the reference answer), a HF folder path (classifier or encoder, detected),
            or ``http://host:port`` (a reward server).
        device, max_length, text: passed to :class:`~verl_ppo.reward.model.ModelReward`.
        cache_entries: > 0 wraps the model in a :class:`~verl_ppo.reward.cache.CachedReward`
            of that many entries.
        deadline_s: cap on the seconds of one remote ``score`` call, retries included (the
            trainer passes ``comm.timeout_s``); None = the retry budget only.

    Raises:
        ValueError: for a spec that is none of these (the message lists them).
    """
    if cache_entries < 0:
        raise ValueError(f"cache_entries must be >= 0, got {cache_entries}")
    model: RewardModel
    if spec == "rule":
        from verl_ppo.reward.rule import RuleReward

        model = RuleReward()
    elif spec.startswith(("http://", "https://")):
        from verl_ppo.reward.remote import RemoteReward

        model = RemoteReward(spec, deadline_s=deadline_s)
    elif spec == "minilm" or Path(spec).is_dir():
        from verl_ppo.reward.model import ModelReward

        path = None if spec == "minilm" else spec
        model = ModelReward(path, device=device, max_length=max_length, text=text)
    else:
        raise ValueError(f"unknown reward model {spec!r}: use {SPECS}")
    if cache_entries:
        from verl_ppo.reward.cache import CachedReward

        model = CachedReward(model, cache_entries)
    return model
