"""``actor.model_config.hybrid_engine``: the keys users write, with their defaults.

Example::

    actor:
      model_config:
        hybrid_engine:
          enable: true
          rollout_sharding: {tensor_parallel_size: 4}
          training_sharding: {pipeline_parallel_size: 2, data_parallel_size: 2}

Checks that need only the config run here; checks against the world size and the model
(heads, KV heads, intermediate size, vocabulary, layers) run in
:meth:`HybridEngineConfig.layouts` and :func:`verl_ppo.reshard.engine.build_plan`,
before any communication.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from verl_ppo.job.strict_model import StrictModel
from verl_ppo.reshard.layout import ParallelLayout


class RolloutSharding(StrictModel):
    """Rollout (generation) layout: tensor parallel; the rest of the ranks are DP."""

    tensor_parallel_size: int = Field(1, ge=1, description="TP degree of the rollout model.")


class TrainingSharding(StrictModel):
    """Training layout of the actor: pipeline x data parallel on DeepSpeed's engines.

    ``pipeline_parallel_size >= 2`` trains the actor and critic on DeepSpeed's pipeline
    engine (:mod:`verl_ppo.pipeline`); 1 trains data-parallel. The ZeRO stage is
    ``actor.zero_stage`` (written once, in the DeepSpeed config); the reshard engine reads
    the layout from the strategy that really runs.
    """

    pipeline_parallel_size: int = Field(1, ge=1, description="PP degree (contiguous layer ranges).")
    data_parallel_size: int | None = Field(
        None, ge=1, description="DP degree; None = world size / (PP x TP)."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="TP degree in training: 1 only (TP is refused, see the README)."
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_moved_and_tp(cls, data: Any) -> Any:
        if isinstance(data, dict) and "zero_stage" in data:
            raise ValueError(
                "training_sharding.zero_stage was removed: the ZeRO stage is set once, in "
                "actor.zero_stage, and the reshard engine reads it from the DeepSpeed engine"
            )
        if isinstance(data, dict) and (data.get("tensor_parallel_size") or 1) > 1:
            raise ValueError(
                f"training_sharding.tensor_parallel_size={data['tensor_parallel_size']}: tensor-"
                "parallel training is not supported (DeepSpeed 0.19.8's AutoTP training, "
                "tensor_parallel.autotp_size, does not combine with its pipeline engine, and "
                "the data-parallel path keeps full weights). Use tensor_parallel_size: 1 and "
                "pipeline_parallel_size to split the model in training; rollout TP is "
                "rollout_sharding.tensor_parallel_size"
            )
        return data


class HybridEngineConfig(StrictModel):
    """Switching the actor between its training and rollout layouts."""

    enable: bool = Field(False, description="Generate with the TP rollout model after resharding.")
    rollout_sharding: RolloutSharding = Field(default_factory=RolloutSharding)
    training_sharding: TrainingSharding = Field(default_factory=TrainingSharding)
    bucket_mb: float = Field(
        64.0, gt=0, description="Bucket cap: MiB sent + received per rank per bucket."
    )
    method: Literal["engine", "naive_allgather"] = Field(
        "engine", description="Planned minimal transfers, or the all-gather-then-slice baseline."
    )
    transport: Literal["all_to_all", "p2p"] = Field(
        "all_to_all", description="all_to_all_single per bucket, or batched isend/irecv."
    )
    free_grads: bool = Field(
        True, description="Set .grad to None on entering rollout (memory for the KV cache)."
    )

    def layouts(
        self, world_size: int, zero_stage: int = 0
    ) -> tuple[ParallelLayout, ParallelLayout]:
        """Training and rollout layouts for ``world_size`` ranks.

        Args:
            zero_stage: the actor's ZeRO stage (``actor.zero_stage``); only 3 changes what a
                rank holds.

        Raises:
            ValueError: a degree product that does not divide or equal the world size,
                naming the numbers.
        """
        t, r = self.training_sharding, self.rollout_sharding
        pt = t.pipeline_parallel_size * t.tensor_parallel_size
        if world_size % pt:
            raise ValueError(
                f"training_sharding: pipeline_parallel_size {t.pipeline_parallel_size} x "
                f"tensor_parallel_size {t.tensor_parallel_size} = {pt} does not divide world size "
                f"{world_size}"
            )
        dp = t.data_parallel_size if t.data_parallel_size is not None else world_size // pt
        if pt * dp != world_size:
            raise ValueError(
                f"training_sharding: pipeline_parallel_size {t.pipeline_parallel_size} x "
                f"data_parallel_size {dp} x tensor_parallel_size {t.tensor_parallel_size} = "
                f"{pt * dp} != world size {world_size}"
            )
        if world_size % r.tensor_parallel_size:
            raise ValueError(
                f"rollout_sharding.tensor_parallel_size {r.tensor_parallel_size} does not divide "
                f"world size {world_size}"
            )
        train = ParallelLayout(t.pipeline_parallel_size, dp, t.tensor_parallel_size, zero_stage)
        rollout = ParallelLayout(1, world_size // r.tensor_parallel_size, r.tensor_parallel_size)
        return train, rollout
