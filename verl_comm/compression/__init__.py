"""Compressed gradient communication: pure algorithms with the collective passed in.

* :mod:`.config` — :class:`CompressionConfig`, the single source of defaults.
* :mod:`.collective` — the transport (:class:`Collective` and implementations).
* :mod:`.int8_allreduce` — two-step int8 quantized all-reduce (the all-to-all
  quantized reduce-scatter of ZeRO++'s qgZ, Wang et al. 2023, then an int8 all-gather).
* :mod:`.lowrank` — int8 low-rank (PowerSGD, Vogels et al. 2019); its orthonormalisation,
  batched shifted CholeskyQR2, in :mod:`.cholqr`.
* :mod:`.policy` — adaptive ``policy: auto``.
"""

from .cholqr import orthonormalize
from .collective import (
    Collective,
    LocalCollective,
    LoopbackCollective,
    ProcessGroupCollective,
    ThreadGroup,
)
from .config import CompressionConfig
from .int8_allreduce import (
    ReduceResult,
    cast_allreduce,
    int8_allreduce,
    int8_allreduce_wire_bytes,
    ring_allreduce_wire_bytes,
)
from .lowrank import LowRankBucketState, lowrank_int8_allreduce
from .lowrank_plan import LowRankPlan, plan_lowrank
from .policy import LinkModel, PolicyDecision, decide, decide_overlap, measure_link

__all__ = [
    "Collective",
    "CompressionConfig",
    "LinkModel",
    "LocalCollective",
    "LoopbackCollective",
    "LowRankBucketState",
    "LowRankPlan",
    "PolicyDecision",
    "ProcessGroupCollective",
    "ReduceResult",
    "ThreadGroup",
    "cast_allreduce",
    "decide",
    "decide_overlap",
    "int8_allreduce",
    "int8_allreduce_wire_bytes",
    "lowrank_int8_allreduce",
    "measure_link",
    "orthonormalize",
    "plan_lowrank",
    "ring_allreduce_wire_bytes",
]
