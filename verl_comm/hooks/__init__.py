"""DDP communication hooks (torch's ``hook(state, bucket) -> Future[Tensor]`` contract).

Hooks: :func:`allreduce_hook`, :func:`fp16_hook`, :func:`bf16_hook`, :func:`int8_hook`,
:func:`lowrank_int8_hook`; state: :class:`CommHookState`; one-call helpers
:func:`make_hook` and :func:`register_comm_hook`. The same hook functions run outside DDP
(the bucketed reducer for DeepSpeed, tests: :class:`GradBucket`; what a hook may call on
a bucket: :class:`HookBucket`).

Execution model (see :mod:`verl_comm.hooks._core`): a hook returns at once and its work
proceeds off the critical path. On CUDA every step of a bucket is enqueued on the state's
side stream with no host synchronisation in a step (flags and statistics are read a step
later, or at :meth:`CommHookState.flush`). On gloo (CPU, W > 1) a bucket's compress ->
communicate -> decompress chain runs on the state's worker thread in DDP's bucket order and
its Future completes when the bucket is reduced; collectives never start from
``Future.then``. :meth:`CommHookState.close` stops the worker.

Statistics (:class:`BucketStats` per bucket, :meth:`CommHookState.metrics`): bytes, ratio,
finiteness and time cost nothing and are kept every step; the relative compression error
and residual norm cost two passes over each bucket and are computed every
``CompressionConfig(stats_every=N)`` reductions, never by default (``N = 0``).

Usage::

    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import register_comm_hook

    state = register_comm_hook(ddp_model, CompressionConfig(gradient_compression="int8"))
    # error statistics every 100 steps: CompressionConfig(..., stats_every=100)
    ...
    torch.save(state.state_dict(), f"hook_state_rank{rank}.pt")  # per rank
"""

from .bucket import GradBucket, HookBucket
from .hooks import allreduce_hook, bf16_hook, fp16_hook, int8_hook, lowrank_int8_hook
from .register import HOOKS, make_hook, register_comm_hook
from .state import CommHookState, NonFiniteGradientError
from .stats import BucketStats
from .worker import CommWorkerError

__all__ = [
    "HOOKS",
    "BucketStats",
    "CommHookState",
    "CommWorkerError",
    "GradBucket",
    "HookBucket",
    "NonFiniteGradientError",
    "allreduce_hook",
    "bf16_hook",
    "fp16_hook",
    "int8_hook",
    "lowrank_int8_hook",
    "make_hook",
    "register_comm_hook",
]
