"""Asynchronous (one-step-off-policy) rollout: rollout ranks of their own generate batch
``k + 1`` while the training ranks train on batch ``k``.

``rollout.mode: async`` splits the job into ``comm.nproc`` training ranks and
``rollout.n_ranks`` rollout ranks (:mod:`~verl_ppo.asyncrl.world`). After every optimizer
step the training ranks publish the weights with the cross-group sync
(:mod:`~verl_ppo.asyncrl.weights`: :mod:`verl_ppo.reshard.group_sync`, full or delta wire,
checksum-verified); the rollout ranks (:mod:`~verl_ppo.asyncrl.rollout_worker`) generate
with weights at most ``rollout.max_staleness`` steps old, score the responses and ship
them with their own log-probs (:mod:`~verl_ppo.asyncrl.channel`); the training ranks
(:mod:`~verl_ppo.asyncrl.train_side`) train on them with the ``decoupled`` loss
(:mod:`verl_ppo.algorithms.off_policy`) and check the staleness of every batch.
"""
