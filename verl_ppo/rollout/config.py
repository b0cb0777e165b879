"""The ``rollout`` section of the PPO config (:class:`RolloutConfig`): sampling, the decode
path, and the asynchronous rollout keys. Part of the schema (:mod:`verl_ppo.config`), kept
beside the code it configures as :mod:`verl_ppo.reshard.config` is; imports no feature module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from verl_ppo.job.strict_model import StrictModel as _Strict


class RolloutConfig(_Strict):
    """Sampling of responses (KV cache always on)."""

    max_new_tokens: int = Field(32, gt=0, description="response length limit in tokens")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(0, ge=0, description="0 = no top-k filter")
    eval_max_new_tokens: int = Field(24, gt=0, description="response limit for greedy eval")
    ignore_eos: bool = Field(
        False, description="always generate max_new_tokens (fixed-length benchmarks)"
    )
    use_cuda_graph: bool | Literal["auto"] = Field(
        "auto",
        description="static KV cache + decode steps as CUDA graphs; auto = on with CUDA for "
        "supported models (verl_ppo.job.fast_path)",
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="sequences per generation call; the reward of micro-batch i is scored "
        "asynchronously while micro-batch i+1 generates (None = the whole local batch)",
    )
    mode: Literal["colocated", "async"] = Field(
        "colocated",
        description="colocated = every rank generates, then trains; async = rollout ranks of "
        "their own generate batch k+1 while the comm.nproc training ranks train on batch k "
        "(verl_ppo.asyncrl; the keys below apply to async only)",
    )
    n_ranks: int = Field(
        0,
        ge=0,
        description="async: rollout ranks started besides the comm.nproc training ranks "
        "(verl's rollout pool size); each serves comm.nproc / n_ranks training ranks",
    )
    tensor_model_parallel_size: int = Field(
        1, ge=1, description="async: TP degree of the rollout ranks (verl's name)"
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async: batch k is generated with the weights of optimizer step "
        "max(k - max_staleness, first step); 0 = on-policy (trains as colocated)",
    )
    sync_wire: Literal["full", "delta"] = Field(
        "delta",
        description="async: weights sent after each optimizer step in full, or only the "
        "rollout-dtype elements that changed (lossless, checksum-verified)",
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="async: dtype of the rollout ranks' weights (verl's rollout.dtype); delta "
        "needs bfloat16",
    )
