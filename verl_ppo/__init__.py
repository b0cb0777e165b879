"""verl_ppo: a DeepSpeed-backed PPO trainer that uses verl_comm's hooks and a
3D resharding engine between its training and rollout layouts."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from verl_ppo.trainer import PPOTrainer


def __getattr__(name: str):
    # Lazy so that ``import verl_ppo`` stays cheap (no deepspeed/transformers import).
    if name == "PPOTrainer":
        from verl_ppo.trainer import PPOTrainer

        return PPOTrainer
    if name == "PPOConfig":
        from verl_ppo.config import PPOConfig

        return PPOConfig
    raise AttributeError(name)


__all__ = ["PPOTrainer", "PPOConfig", "__version__"]
