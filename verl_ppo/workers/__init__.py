"""The workers a step runs on: process groups (:mod:`.distributed`), models
(:mod:`.models`), their DeepSpeed strategies (:mod:`.strategy`), gradient compression
(:mod:`.grad_comm`), composed by :class:`~verl_ppo.workers.build.Workers`."""
