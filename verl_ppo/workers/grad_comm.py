"""Compressed gradient communication for a DeepSpeed engine (the verl_comm hooks, via
the bucketed reducer of :mod:`verl_comm.reducer`).

DeepSpeed has no comm-hook API, so the engine's own gradient reduction is switched
off and :class:`~verl_comm.reducer.BucketedReducer` reduces the gradients instead,
bucket by bucket during backward. Use::

    handle = attach_grad_comm(engine, config, group, timeout_s=ctx.timeout_s)  # once
    for micro_batch in batches:
        loss = ...
        engine.backward(loss)
        handle.after_backward()                     # every micro-step, before step()
        engine.step()

``after_backward()`` waits for the buckets launched during backward (with a timeout)
and writes the averaged gradients into ``param.grad``; on a gradient accumulation
step (``engine.is_gradient_accumulation_boundary()`` False) it does nothing, as
DeepSpeed reduces only on the boundary.

Supported ZeRO stages and why:

* **stage 0**: ``engine.enable_backward_allreduce = False`` (the switch DeepSpeed's
  1-bit optimizers use) skips ``engine.allreduce_gradients``; the optimizer steps on
  ``param.grad``, which the reducer has averaged.
* **stage 1**: the same switch skips ``optimizer.reduce_gradients``, which would both
  reduce and build the optimizer's fp32 gradient partition (``averaged_gradients``);
  without the partition ``step()`` fails (``KeyError: 0``). After the reducer has
  averaged ``param.grad``, :meth:`GradCommHandle.after_backward` calls the ZeRO
  optimizer's ``overlapping_partition_gradients_reduce_epilogue()`` (the method the
  engine itself calls at stage 2), which with no gradient queued for reduction only
  copies each rank's partition of the (already averaged) gradients. Needs
  ``overlap_comm: false`` (with it, ZeRO-1's own gradient hooks reduce during
  backward) and no optimizer offload. That method is DeepSpeed-internal, not a
  documented API: checked with DeepSpeed 0.19.8, and tests/verl_ppo/test_grad_comm.py
  pins the result to native DeepSpeed bit for bit.
* **stage 2 and 3** are refused: they reduce-scatter each gradient inside their own
  autograd hooks as it is produced and free it, so there is no full gradient left for
  a hook to compress and no supported switch to skip their reduction.
* Mixed precision: bf16 weights with the default ``grad_accum_dtype`` work at both
  stages (stage 0 wraps the optimizer in DeepSpeed's FP16_Optimizer, which reads
  ``param.grad`` in ``step()``); fp16 takes the same path but is untested (DeepSpeed
  refuses fp16 on CPU). DeepSpeed's ``BF16_Optimizer`` (chosen for bf16 weights
  with ``data_types.grad_accum_dtype: fp32`` at stage 1, and for the pipeline engine) is
  refused: it moves gradients into its own fp32 buffers inside ``engine.backward()``,
  before the reducer's results could be written back.

``gradient_compression: none`` leaves DeepSpeed's own reduction on (no reducer).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from verl_comm.compression.config import CompressionConfig
from verl_comm.reducer import BucketedReducer, make_reducer
from verl_comm.telemetry import CommRecorder

SUPPORTED_STAGES = (0, 1)
"""ZeRO stages whose gradients a hook can compress (the config rule, :mod:`verl_ppo.job.rules`,
and :func:`attach_grad_comm` read this)."""
UNSUPPORTED_STAGE_REASON = (
    "ZeRO-2/3 reduce-scatter each gradient inside their own backward hooks, leaving no full "
    "gradient to compress"
)


class GradCommHandle:
    """What :func:`attach_grad_comm` returns: the per-step call and the reducer.

    Attributes:
        engine: the DeepSpeed engine.
        config: the compression config.
        reducer: the :class:`BucketedReducer`, or None when DeepSpeed reduces natively.
        zero_stage: the engine's ZeRO stage.
    """

    def __init__(
        self,
        engine: Any,
        config: CompressionConfig,
        reducer: BucketedReducer | None,
        zero_stage: int,
    ) -> None:
        self.engine = engine
        self.config = config
        self.reducer = reducer
        self.zero_stage = zero_stage

    @property
    def active(self) -> bool:
        """True when the reducer (not DeepSpeed) reduces the gradients."""
        return self.reducer is not None

    @property
    def hook_state(self) -> Any:
        """The hook's state (``CommHookState``: stats, ``state_dict()``), or None."""
        return None if self.reducer is None else self.reducer.state

    def after_backward(self) -> bool:
        """Finish this micro-step's gradient reduction; call after ``engine.backward``.

        Returns:
            True if gradients were reduced (accumulation boundary), else False.

        Raises:
            TimeoutError: a bucket did not complete within the reducer's timeout.
            verl_comm.hooks.NonFiniteGradientError: NaN/Inf with ``nonfinite: raise``.
        """
        if self.reducer is None:
            return False
        reduced = self.reducer.finalize()
        if reduced and self.zero_stage == 1:
            # Build ZeRO-1's fp32 gradient partition from the averaged gradients; no
            # gradient is queued in its reduction buckets, so this copies without
            # communicating (see the module docstring).
            self.engine.optimizer.overlapping_partition_gradients_reduce_epilogue()
        return reduced

    def state_dict(self) -> dict[str, Any]:
        """Hook state (error-feedback residuals, Q, iteration) and bucket layout;
        empty without a reducer. Save it next to the DeepSpeed checkpoint."""
        if self.reducer is None:
            return {}
        state = self.hook_state
        hook_sd = state.state_dict() if hasattr(state, "state_dict") else {}
        return {"hook": hook_sd, "reducer": self.reducer.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, before the first backward."""
        if self.reducer is None or not sd:
            return
        self.reducer.load_state_dict(sd["reducer"])
        state = self.hook_state
        if sd.get("hook") and hasattr(state, "load_state_dict"):
            state.load_state_dict(sd["hook"])

    def detach(self) -> None:
        """Remove the reducer, stop its hook's communication worker and give the gradient
        reduction back to DeepSpeed."""
        if self.reducer is not None:
            self.reducer.remove()
            close = getattr(self.reducer.state, "close", None)
            if callable(close):
                close()
            self.reducer = None
            self.engine.enable_backward_allreduce = True


def _check_supported(engine: Any, config: CompressionConfig) -> int:
    what = f"gradient_compression={config.gradient_compression!r}"
    stage = int(engine.zero_optimization_stage())
    if stage not in SUPPORTED_STAGES:
        raise ValueError(
            f"{what} needs DeepSpeed ZeRO stage 0 or 1, got stage {stage}: "
            f"{UNSUPPORTED_STAGE_REASON}. Fix: set zero_optimization.stage to 1, or "
            "gradient_compression: none to keep DeepSpeed's reduction."
        )
    if getattr(engine, "pipeline_parallelism", False):
        raise ValueError(
            f"{what} is not supported with DeepSpeed's PipelineEngine (it reduces gradients "
            "itself after the last micro-batch). Fix: gradient_compression: none."
        )
    if getattr(engine, "has_moe_layers", False):
        raise ValueError(
            f"{what} is not supported with MoE layers (expert gradients use their own "
            "data-parallel groups). Fix: gradient_compression: none."
        )
    opt = engine.optimizer
    name = type(opt).__name__
    if name == "BF16_Optimizer":
        raise ValueError(
            f"{what} cannot run under DeepSpeed's BF16_Optimizer (bf16 weights with "
            "data_types.grad_accum_dtype fp32 at ZeRO stage 1): it moves gradients into its "
            "own fp32 buffers inside engine.backward(). Fix: drop data_types.grad_accum_dtype "
            "(bf16 gradients, ZeRO stage 0 or 1), or gradient_compression: none."
        )
    if stage == 1:
        if getattr(opt, "overlap_comm", False):
            raise ValueError(
                f"{what} at ZeRO stage 1 needs zero_optimization.overlap_comm: false (with "
                "it, ZeRO-1's own gradient hooks reduce during backward; the reducer "
                "overlaps communication with backward instead). Fix: overlap_comm: false."
            )
        if getattr(opt, "cpu_offload", False):
            raise ValueError(
                f"{what} at ZeRO stage 1 does not support offload_optimizer (gradients "
                "are copied to the CPU inside ZeRO's own reduction). Fix: remove "
                "zero_optimization.offload_optimizer, or gradient_compression: none."
            )
        if getattr(opt, "use_grad_accum_attribute", False):
            raise ValueError(
                f"{what} at ZeRO stage 1 does not support a grad_accum_dtype different "
                "from the weights' dtype (gradients then live in param.grad_accum). Fix: "
                "drop data_types.grad_accum_dtype, or gradient_compression: none."
            )
        if not hasattr(opt, "overlapping_partition_gradients_reduce_epilogue"):
            raise ValueError(
                f"{what} at ZeRO stage 1 needs DeepSpeed's DeepSpeedZeroOptimizer, got "
                f"{name}. Fix: gradient_compression: none."
            )
    return stage


def attach_grad_comm(
    engine: Any,
    config: CompressionConfig,
    process_group: dist.ProcessGroup | None = None,
    recorder: CommRecorder | None = None,
    *,
    hook: Any = None,
    hook_state: Any = None,
    timeout_s: float,
) -> GradCommHandle:
    """Reduce a DeepSpeed engine's gradients through a verl_comm hook.

    Call once after ``deepspeed.initialize`` and before the first backward, on every
    rank. See the module docstring for the per-step call and the supported stages.

    Args:
        engine: a ``deepspeed.DeepSpeedEngine``.
        config: compression settings; ``gradient_compression: none`` keeps DeepSpeed's
            own reduction and returns an inactive handle.
        process_group: data-parallel group to average over; None = WORLD, which must
            then be the engine's data-parallel world.
        recorder: optional telemetry sink for the hook and the reducer.
        hook, hook_state: run this DDP comm hook with this state instead of the one
            ``config`` selects (e.g. torch's ``allreduce_hook`` with the group, for an
            exact comparison with DeepSpeed's own reduction); installs the reducer even
            when ``gradient_compression`` is ``none``.
        timeout_s: seconds :meth:`GradCommHandle.after_backward` waits for the buckets; the
            trainer passes its ``DistContext.timeout_s`` (``comm.timeout_s``).

    Returns:
        A :class:`GradCommHandle`.

    Raises:
        ValueError: an unsupported combination (ZeRO-2/3, BF16_Optimizer, pipeline,
            MoE, ZeRO-1 with overlap_comm or offload, group/world mismatch); the
            message names the fix.
    """
    if not isinstance(config, CompressionConfig):
        raise TypeError(
            f"config must be a verl_comm.compression.CompressionConfig, got {type(config).__name__}"
        )
    stage = int(engine.zero_optimization_stage())
    if config.gradient_compression == "none" and hook is None:
        return GradCommHandle(engine, config, None, stage)
    stage = _check_supported(engine, config)
    group_size = dist.get_world_size(process_group)
    if group_size != engine.dp_world_size:
        raise ValueError(
            f"process_group has {group_size} ranks but the engine's data-parallel world "
            f"has {engine.dp_world_size}. Fix: pass the data-parallel group as process_group."
        )

    def is_boundary() -> bool:
        return bool(engine.is_gradient_accumulation_boundary()) and not getattr(
            engine, "inside_no_sync_ctxt", False
        )

    kwargs = dict(sync_predicate=is_boundary, timeout_s=timeout_s)
    if hook is None:
        reducer = make_reducer(engine.module, config, process_group, recorder, **kwargs)
    else:
        reducer = BucketedReducer(
            engine.module,
            hook,
            hook_state,
            process_group=process_group,
            bucket_cap_mb=config.bucket_cap_mb,
            recorder=recorder,
            **kwargs,
        )
    # The supported switch (DeepSpeed's 1-bit optimizers use it): engine.backward()
    # then skips engine.allreduce_gradients(); see the module docstring per stage.
    engine.enable_backward_allreduce = False
    return GradCommHandle(engine, config, reducer, stage)
