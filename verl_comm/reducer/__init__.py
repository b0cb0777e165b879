"""Bucketed gradient reducer: the DDP comm hooks of :mod:`verl_comm.hooks` (or torch's)
run outside DDP, e.g. under DeepSpeed, which has no comm-hook API.

``BucketedReducer(params, hook, state, process_group=..., bucket_cap_mb=...)`` hands
:class:`GradBucket` objects (torch's ``GradBucket`` methods) to ``hook(state, bucket)``
as gradients become ready during backward; ``finalize()`` waits and writes the
averaged gradients back before the optimizer step. ``make_reducer`` builds one from a
``CompressionConfig``.
"""

from verl_comm.reducer.bucket import GradBucket, TensorSpec, plan_buckets
from verl_comm.reducer.build import make_reducer
from verl_comm.reducer.reducer import DEFAULT_FIRST_BUCKET_MB, BucketedReducer

__all__ = [
    "DEFAULT_FIRST_BUCKET_MB",
    "BucketedReducer",
    "GradBucket",
    "TensorSpec",
    "make_reducer",
    "plan_buckets",
]
