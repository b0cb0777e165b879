"""Generation: the plain KV-cache sampler (``generate``) and, in ``tp_*``, the TP rollout model."""
