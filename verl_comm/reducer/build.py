"""Build a :class:`BucketedReducer` running a :mod:`verl_comm.hooks` hook from a config."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from verl_comm.compression.config import CompressionConfig
from verl_comm.reducer.reducer import BucketedReducer
from verl_comm.telemetry import CommRecorder


def make_reducer(
    params: torch.nn.Module | Iterable[torch.nn.Parameter],
    config: CompressionConfig,
    process_group: dist.ProcessGroup | None = None,
    recorder: CommRecorder | None = None,
    **kwargs: Any,
) -> BucketedReducer:
    """A reducer whose buckets go through the hook ``config`` selects.

    Args:
        params: module or parameters whose gradients are averaged.
        config: compression settings; ``config.method`` picks the hook
            (``verl_comm.hooks.make_hook``), ``config.bucket_cap_mb`` the bucket size.
        process_group: group to average over (None = WORLD), used by hook and reducer.
        recorder: optional telemetry sink shared by the hook (wire bytes per bucket)
            and the reducer (one ``bucket_reduce`` record per bucket).
        **kwargs: further :class:`BucketedReducer` arguments (``grad_attr``,
            ``sync_predicate``, ``timeout_s``, ``first_bucket_cap_mb``, ...).

    Returns:
        The reducer; the hook state is ``reducer.state`` (a ``CommHookState`` with
        ``state_dict()``, per-bucket stats and ``ef_state_nbytes()``).

    Raises:
        TypeError: ``config`` is not a ``CompressionConfig``.
    """
    from verl_comm.hooks import make_hook  # the hooks import torch.distributed helpers

    timeout_s = kwargs.get("timeout_s", 300.0)
    hook, state = make_hook(config, process_group, recorder, timeout_s=timeout_s)
    return BucketedReducer(
        params,
        hook,
        state,
        process_group=process_group,
        bucket_cap_mb=config.bucket_cap_mb,
        recorder=recorder,
        **kwargs,
    )
