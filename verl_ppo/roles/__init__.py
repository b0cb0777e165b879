"""One class per role: Actor, Critic, Reference, RuleRewardRole (no role strings)."""

from verl_ppo.roles.actor import Actor
from verl_ppo.roles.common import sequence_log_probs
from verl_ppo.roles.critic import Critic, ValueModel
from verl_ppo.roles.reference import Reference

__all__ = ["Actor", "Critic", "Reference", "ValueModel", "sequence_log_probs"]
