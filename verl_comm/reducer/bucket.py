"""Bucket planning for running DDP comm hooks outside DDP (the bucket class itself is
:class:`verl_comm.hooks.bucket.GradBucket`, the one implementation shared with the hooks).

The planner is pure (no process group, no tensors): it mirrors torch's
``dist._compute_bucket_assignment_by_size`` (``torch/csrc/distributed/c10d/reducer.cpp``):
tensors are taken in the order their gradients are expected to become ready, grouped
by dtype, a bucket is closed as soon as its size reaches the current limit (the first
bucket of each dtype may have a smaller limit, DDP's ``first_bucket_bytes_cap``), and
the buckets are sorted by the position of their first tensor so that they become
ready one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verl_comm.hooks.bucket import GradBucket, HookBucket

__all__ = ["GradBucket", "HookBucket", "TensorSpec", "plan_buckets"]


@dataclass(frozen=True)
class TensorSpec:
    """What the planner needs to know about one gradient.

    Attributes:
        numel: number of elements of the gradient.
        element_size: bytes per element (4 for fp32, 2 for bf16/fp16).
        dtype_key: buckets never mix keys (e.g. ``"torch.float32"``).
    """

    numel: int
    element_size: int
    dtype_key: str

    @property
    def nbytes(self) -> int:
        """Size of the gradient in bytes."""
        return self.numel * self.element_size


def plan_buckets(
    specs: Sequence[TensorSpec],
    order: Sequence[int],
    cap_bytes: int,
    first_cap_bytes: int | None = None,
) -> list[list[int]]:
    """Group tensors into buckets of at most about ``cap_bytes`` each.

    Args:
        specs: one :class:`TensorSpec` per tensor, indexed by tensor id.
        order: tensor ids in the order their gradients are expected to become ready;
            must be a permutation of ``range(len(specs))``.
        cap_bytes: bucket size limit in bytes; a bucket is closed once it reaches it
            (a single tensor larger than the cap gets a bucket of its own).
        first_cap_bytes: limit of the first bucket of each dtype (DDP uses 1 MiB so
            that communication starts early); ``None`` means ``cap_bytes``.

    Returns:
        Buckets as lists of tensor ids (in ready order within each bucket), sorted by
        the position in ``order`` of their first tensor. Bucket ``i`` is handed to the
        hook as ``bucket.index() == i``.

    Raises:
        ValueError: ``order`` is not a permutation, or a cap is not positive.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}; set bucket_cap_mb > 0")
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if first <= 0:
        raise ValueError(f"first_cap_bytes must be positive, got {first_cap_bytes}")
    if sorted(order) != list(range(len(specs))):
        raise ValueError(
            f"order must be a permutation of range({len(specs)}), got {list(order)[:10]}..."
        )
    position = {tid: pos for pos, tid in enumerate(order)}
    open_buckets: dict[str, list[int]] = {}
    open_bytes: dict[str, int] = {}
    closed_count: dict[str, int] = {}
    result: list[list[int]] = []
    for tid in order:
        key = specs[tid].dtype_key
        open_buckets.setdefault(key, []).append(tid)
        open_bytes[key] = open_bytes.get(key, 0) + specs[tid].nbytes
        limit = first if closed_count.get(key, 0) == 0 else cap_bytes
        if open_bytes[key] >= limit:
            result.append(open_buckets.pop(key))
            open_bytes[key] = 0
            closed_count[key] = closed_count.get(key, 0) + 1
    result.extend(b for b in open_buckets.values() if b)
    result.sort(key=lambda b: position[b[0]])
    return result
