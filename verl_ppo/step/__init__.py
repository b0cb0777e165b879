"""One PPO step: the rollout into an :class:`~verl_ppo.step.experience.Experience`
(:mod:`.experience_maker`), its micro-batches (:mod:`.batching`, :mod:`.packing`), the update
and the held-out evaluation, composed by :class:`~verl_ppo.step.ppo_step.PPOStep`."""
