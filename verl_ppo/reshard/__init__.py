"""Resharding between the actor's training layout and its tensor-parallel rollout layout.

Modules (imported explicitly; nothing is imported here, so the GPU benchmark runs without
pydantic or transformers):

- ``layout``: :class:`ParallelLayout` (PP x DP x TP degrees, ZeRO stage, rank placement).
- ``specs``: per-parameter shard boxes for Llama/Qwen2/Mistral and GPT-2; validation.
- ``planner``: pure transfer plan (local copies first, load spread over replicas) and buckets.
- ``executor``: bucketed ``all_to_all_single`` / batched ``isend/irecv`` with double buffering.
- ``naive``: all-gather-then-slice baseline.
- ``engine``: :class:`ReshardEngine` (validate, choose placement, plan, run).
- ``config``: pydantic ``HybridEngineConfig`` (``actor.model_config.hybrid_engine``).
- ``hybrid``: :class:`HybridEngine`, the ``with hybrid.rollout(module) as model`` context manager.
- ``testing``: multi-process harness, tiny configs and shard slicing for tests and benchmarks.
"""
