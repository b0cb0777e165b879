"""DDP communication hooks (torch's ``hook(state, bucket) -> Future[Tensor]`` contract).

Hooks: :func:`allreduce_hook`, :func:`fp16_hook`, :func:`bf16_hook`, :func:`int8_hook`,
:func:`lowrank_int8_hook`; state: :class:`CommHookState`; one-call helpers
:func:`make_hook` and :func:`register_comm_hook`. The same hook functions run outside DDP
(the bucketed reducer for DeepSpeed, :class:`TensorBucket`).
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
