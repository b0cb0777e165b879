"""DDP communication hooks (torch's ``hook(state, bucket) -> Future[Tensor]`` contract).

Hooks: :func:`allreduce_hook`, :func:`fp16_hook`, :func:`bf16_hook`, :func:`int8_hook`,
:func:`lowrank_int8_hook`; state: :class:`CommHookState`; one-call helpers
:func:`make_hook` and :func:`register_comm_hook`. The same hook functions run outside DDP
(the bucketed reducer for DeepSpeed, :class:`TensorBucket`).

Execution model (all backends): a hook starts and waits on its collectives in the hook body
and returns an already-completed Future. Chaining collectives in ``Future.then`` callbacks
(torch's PowerSGD hook) deadlocks on gloo (FACTS 7), so it is not used. On CUDA the body
runs on a side stream that waits for the current stream, so a blocking NCCL call only makes
that side stream wait and backward compute keeps overlapping; the Future is CUDA-aware and
makes DDP's stream wait for the side stream. One host sync per step (on ``is_last()``)
reads the per-bucket finiteness flags and statistics.

Usage::

    from verl_comm.compression import CompressionConfig
    from verl_comm.hooks import register_comm_hook

    state = register_comm_hook(ddp_model, CompressionConfig(gradient_compression="int8"))
    ...
    torch.save(state.state_dict(), f"hook_state_rank{rank}.pt")  # per rank
"""

from .bucket import TensorBucket
from .hooks import allreduce_hook, bf16_hook, fp16_hook, int8_hook, lowrank_int8_hook
from .register import HOOKS, make_hook, register_comm_hook
from .state import BucketStats, CommHookState, NonFiniteGradientError

__all__ = [
    "HOOKS",
    "BucketStats",
    "CommHookState",
    "NonFiniteGradientError",
    "TensorBucket",
    "allreduce_hook",
    "bf16_hook",
    "fp16_hook",
    "int8_hook",
    "lowrank_int8_hook",
    "make_hook",
    "register_comm_hook",
]
