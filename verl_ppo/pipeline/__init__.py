"""Pipeline-parallel PPO on DeepSpeed's pipeline engine (``training_sharding.pipeline_parallel_size >= 2``).

Modules (imported explicitly):

- ``layers``: the HF model's parts (embedding, decoder layers, final norm, LM / value head) as
  pipeline layers; tied embeddings through DeepSpeed's tied layers.
- ``weights``: a stage's weights by HF name (safetensors, or a seeded random-init model).
- ``strategy``: :class:`PipelineStrategy`, one ``PipelineEngine`` (stage, groups, batches,
  checkpoints, the full state dict gathered for export).
- ``roles``: actor, critic and reference with the PPO losses as the pipeline's loss function.
- ``data``: the pipeline's training batch from its members' rollouts.
- ``checks``: combinations refused before any process starts.
- ``build``: the three roles for the trainer.
"""
