"""DDP communication hooks with torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

Register them with DDP's own API, exactly like torch's built-ins::

    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import CommHookState, lowrank_int8_hook

    cfg = CompressionConfig(gradient_compression="int8", compression_rank=64)
    state = CommHookState(process_group=None, config=cfg)
    ddp_model.register_comm_hook(state, lowrank_int8_hook)

Each hook averages ``bucket.buffer()`` over the state's process group in place and returns
a completed Future holding it (same shape and dtype). The hooks call only the GradBucket
methods ``buffer``, ``index``, ``is_last`` and ``parameters`` (the bucketed reducer's bucket
objects provide the same). Annotations are real objects (no ``from __future__ import
annotations``) because DDP's ``register_comm_hook`` checks them. Execution model, streams and the non-finite policy: see
:mod:`verl_comm.hooks._core`. For torch compatibility the simple hooks also accept a
``ProcessGroup`` or None as ``state`` (like torch's ``allreduce_hook``); they then run
synchronously without statistics or non-finite policy, and keep no state anywhere.
"""

import torch
import torch.distributed as dist

from ._core import run_hook, run_stateless
from .state import CommHookState


def _run(state: CommHookState | dist.ProcessGroup | None, bucket, method: str):
    if isinstance(state, CommHookState):
        return run_hook(state, bucket, method)
    return run_stateless(state, bucket, method)  # torch's convention: a group as state


def allreduce_hook(
    state: CommHookState | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with a plain all-reduce in the bucket's dtype (DDP's default).

    Args:
        state: :class:`CommHookState`, or a ProcessGroup / None (= WORLD).
        bucket: ``torch.distributed.GradBucket`` (or an object with its methods).

    Returns:
        completed Future of ``bucket.buffer()`` (averaged in place).

    Raises:
        NonFiniteGradientError: on the last bucket of a step if any bucket held NaN/Inf and
            ``config.nonfinite == 'raise'``.
    """
    return _run(state, bucket, "allreduce")


def fp16_hook(
    state: CommHookState | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in fp16 on the wire (divide by W first, sum, cast back).

    2 bytes per element (half of fp32). Values beyond fp16's range (65504 after the
    division by W) become Inf and are caught by the non-finite policy, never spread
    silently. Args/returns/raises as :func:`allreduce_hook`.
    """
    return _run(state, bucket, "fp16")


def bf16_hook(
    state: CommHookState | dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bf16 on the wire (divide by W first, sum, cast back).

    Unlike torch's ``bf16_compress_hook`` it also runs on CPU/gloo. Args/returns/raises as
    :func:`allreduce_hook`.
    """
    return _run(state, bucket, "bf16")


def int8_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with the int8 quantized all-reduce and error feedback.

    Two-step scheme of :func:`verl_comm.compression.int8_allreduce` (all-to-all + owner
    dequantize-sum-requantize + all-gather; replicas bit-identical; 0.516x the bytes of a
    bf16 all-reduce at ``quant_block=128``). Plain all-reduce before ``config.start_iter``.

    Args:
        state: :class:`CommHookState` with ``config.quant_block``, ``error_feedback``,
            ``start_iter``, ``policy``, ``nonfinite``.
        bucket: GradBucket or equivalent.

    Returns / Raises: as :func:`allreduce_hook`.
    """
    return run_hook(state, bucket, "int8")


def lowrank_int8_hook(
    state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with int8 low-rank compression (PowerSGD, Vogels et al. 2019).

    Matrices (conv kernels reshaped) with ``n m >= min_compression_rate * r (n + m)`` and
    ``2 r < min(n, m)`` are approximated at rank ``r = config.compression_rank`` with error
    feedback and warm start, same-shape matrices batched, factors sent as int8; the other
    tensors of the bucket go through one int8 all-reduce. Plain all-reduce before
    ``config.start_iter``. See :func:`verl_comm.compression.lowrank_int8_allreduce`.

    Args:
        state: :class:`CommHookState` whose config has ``compression_rank > 0``.
        bucket: GradBucket or equivalent.

    Returns / Raises: as :func:`allreduce_hook`; ValueError if ``compression_rank`` is not set.
    """
    if not (state.config.compression_rank or 0) > 0:
        raise ValueError(
            "lowrank_int8_hook needs config.compression_rank > 0 (e.g. "
            "CompressionConfig(gradient_compression='int8', compression_rank=64)); use "
            "int8_hook for the int8 all-reduce without low rank"
        )
    return run_hook(state, bucket, "lowrank_int8")
