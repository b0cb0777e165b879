"""Build a hook and its state from a :class:`CompressionConfig` and register it with DDP."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.compression.config import CompressionConfig
from verl_comm.telemetry import CommRecorder

from .hooks import allreduce_hook, bf16_hook, fp16_hook, int8_hook, lowrank_int8_hook
from .state import CommHookState

HookFn = Callable[[CommHookState, Any], torch.futures.Future]

HOOKS: dict[str, HookFn] = {
    "none": allreduce_hook,
    "fp16": fp16_hook,
    "bf16": bf16_hook,
    "int8": int8_hook,
    "lowrank_int8": lowrank_int8_hook,
}
"""Hook per :attr:`CompressionConfig.method`."""


def make_hook(
    config: CompressionConfig,
    process_group: dist.ProcessGroup | None = None,
    recorder: CommRecorder | None = None,
    *,
    seed: int = 0,
    timeout_s: float = 300.0,
) -> tuple[HookFn, CommHookState]:
    """The hook function selected by ``config`` and a fresh state for it.

    Args:
        config: compression settings (``config.method`` picks the hook).
        process_group: group to average over; None = WORLD.
        recorder: optional telemetry sink (one record per bucket and step).
        seed: low-rank start-vector seed (equal on all ranks).
        timeout_s: how long the state waits for buckets in flight on its worker.

    Returns:
        ``(hook, state)``; call ``hook(state, bucket)`` per bucket, or hand both to
        ``DistributedDataParallel.register_comm_hook(state, hook)``.

    Raises:
        TypeError: ``config`` is not a CompressionConfig.
    """
    if not isinstance(config, CompressionConfig):
        raise TypeError(
            f"config must be a verl_comm.compression.CompressionConfig, got "
            f"{type(config).__name__}; build one with CompressionConfig(**your_dict)"
        )
    state = CommHookState(
        process_group,
        config,
        recorder=recorder,
        seed=seed,
        timeout_s=timeout_s,
    )
    return HOOKS[config.method], state


def register_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    config: CompressionConfig,
    process_group: dist.ProcessGroup | None = None,
    recorder: CommRecorder | None = None,
) -> CommHookState:
    """Build the state and hook from ``config`` and register them on ``ddp_model``.

    Args:
        ddp_model: a ``DistributedDataParallel`` module (before its first backward).
        config: compression settings.
        process_group: group to average over; None = the group DDP was built with.
        recorder: optional telemetry sink.

    Returns:
        The :class:`CommHookState` (keep it for ``state_dict()`` and stats).

    Raises:
        TypeError: ``ddp_model`` is not DDP. ValueError: DDP was built with
            ``mixed_precision=`` (it registers its own upcast hook, and DDP takes one hook
            only). RuntimeError: from DDP if a hook is already registered or training
            already started.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"ddp_model must be torch.nn.parallel.DistributedDataParallel, got "
            f"{type(ddp_model).__name__}; for DeepSpeed use verl_comm.reducer"
        )
    mp = getattr(ddp_model, "mixed_precision", None)
    if mp is not None:
        # torch/nn/parallel/distributed.py (2.x): DDP(mixed_precision=...) registers its own
        # _reducer_allreduce_and_upcast_hook, and a DDP module accepts one comm hook only.
        raise ValueError(
            f"cannot register a verl_comm comm hook on DDP built with mixed_precision={mp}: "
            "DDP's mixed precision already registered its own all-reduce-and-upcast comm hook "
            "and DDP takes only one. Build DistributedDataParallel without mixed_precision= "
            "and run the forward under torch.autocast(device_type, dtype=torch.bfloat16) "
            "instead; to send 16-bit gradients set gradient_compression='bf16' (or 'fp16')"
        )
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    cap = getattr(ddp_model, "bucket_bytes_cap", None)
    want = int(config.bucket_cap_mb * 1024 * 1024)
    if cap is not None and abs(cap - want) > 1:
        warnings.warn(
            f"DDP was built with bucket_cap_mb={cap / 2**20:g} but the config says "
            f"{config.bucket_cap_mb:g}; pass bucket_cap_mb=config.bucket_cap_mb to "
            "DistributedDataParallel",
            UserWarning,
            stacklevel=2,
        )
    hook, state = make_hook(config, process_group, recorder)
    # parameters by index, so that a loaded state can be applied in its saved bucket layout
    # on the first step of a fresh DDP (hooks.resume)
    state.param_keys = {p.data_ptr(): i for i, p in enumerate(ddp_model.parameters())}
    ddp_model.register_comm_hook(state, hook)
    return state
