"""What a hook may call on a bucket (:class:`HookBucket`), and the one bucket class that
runs the hooks outside DDP (:class:`GradBucket`: the bucketed reducer, tests).

``torch.distributed.GradBucket`` (DDP's) satisfies :class:`HookBucket`; so does
:class:`GradBucket`, which owns (or wraps) one flat, contiguous 1-D buffer holding the
gradients of its parameters back to back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

Keep = tuple[tuple[int, int], ...]
"""``(offset, numel)`` ranges of a bucket whose parameter got no gradient this step."""


def keep_ranges(bucket: Any) -> Keep:
    """Ranges of ``bucket``'s parameters with no gradient this step (``param.grad is None``
    of a parameter that requires grad), in buffer order."""
    out, off = [], 0
    for p in bucket.parameters():
        n = p.numel()
        if getattr(p, "requires_grad", False) and p.grad is None:
            out.append((off, n))
        off += n
    return tuple(out)


@runtime_checkable
class HookBucket(Protocol):
    """The methods of ``torch.distributed.GradBucket`` a comm hook may call."""

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer ``(sum of numels,)`` of the bucket's gradients."""

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into :meth:`buffer`, each of its parameter's shape."""

    def parameters(self) -> list[torch.Tensor]:
        """The parameters, in buffer order."""

    def index(self) -> int:
        """Bucket index (0 = first to become ready); hooks key per-bucket state on it."""

    def is_last(self) -> bool:
        """True for the last bucket of an iteration."""

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (same number of elements)."""


class GradBucket:
    """A bucket with the methods of ``torch.distributed.GradBucket`` (:class:`HookBucket`).

    ``gradients()`` are views into the buffer shaped like the parameters, so a hook that
    writes into them (as torch's ``powerSGD_hook`` does) writes into the buffer.

    Args:
        index: bucket index (0 = first to become ready).
        params: the parameters (or tensors with their shapes), in buffer order.
        is_last: whether this is the last bucket reduced in an iteration.
        buffer: an existing contiguous 1-D buffer to wrap (its numel must be the sum of
            the parameter sizes); None allocates a zero buffer of ``dtype`` on ``device``.
        dtype, device: of the allocated buffer (default: the first parameter's).

    Raises:
        ValueError: ``buffer`` is not 1-D with the sum of the parameter sizes.
    """

    def __init__(
        self,
        index: int,
        params: Sequence[torch.Tensor],
        is_last: bool = True,
        *,
        buffer: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self._index = int(index)
        self._params = list(params)
        self._is_last = bool(is_last)
        self.offsets: list[int] = []
        total = 0
        for p in self._params:
            self.offsets.append(total)
            total += p.numel()
        if buffer is None:
            first = self._params[0] if self._params else None
            dtype = dtype or (first.dtype if first is not None else torch.float32)
            device = device or (first.device if first is not None else "cpu")
            buffer = torch.zeros(total, dtype=dtype, device=device)
        elif buffer.dim() != 1 or buffer.numel() != total:
            raise ValueError(
                f"buffer must be 1-D with sum of parameter sizes ({total}) elements, got "
                f"shape {tuple(buffer.shape)}"
            )
        self._buffer = buffer
        self._views = self._make_views(buffer)

    @classmethod
    def from_tensors(
        cls, grads: Sequence[torch.Tensor], index: int = 0, is_last: bool = True
    ) -> GradBucket:
        """Copy ``grads`` into a new flat buffer and wrap it.

        The buffer's dtype is the promotion of the gradients' dtypes
        (``torch.promote_types``: fp16 + fp32 -> fp32, bf16 + fp16 -> fp32), so no gradient
        loses precision or range on the way in: casting an fp32 gradient to fp16 would
        flush 1e-8 to zero and turn 1e5 into Inf without a word. A bucket is one flat
        buffer (torch's GradBucket contract), so mixed dtypes cost the wider dtype's bytes;
        build one bucket per dtype (as DDP and the bucketed reducer do) to avoid that.
        """
        dtype = torch.float32
        if grads:
            dtype = grads[0].dtype
            for g in grads[1:]:
                dtype = torch.promote_types(dtype, g.dtype)
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads]) if grads else torch.zeros(0)
        return cls(index, grads, is_last, buffer=flat)

    def _make_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [
            buffer.narrow(0, off, p.numel()).view(p.shape)
            for off, p in zip(self.offsets, self._params)
        ]

    def index(self) -> int:
        """Bucket index; hooks key their per-bucket state (residuals, Q) on it."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer of shape ``(sum of numels,)`` holding the gradients."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter views into :meth:`buffer`, each of its parameter's shape."""
        return self._views

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of this bucket, in buffer order."""
        return self._params

    def is_last(self) -> bool:
        """True for the last bucket of an iteration (hooks advance their iteration on it)."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer by ``buffer`` (same numel; views are rebuilt on it).

        Raises:
            ValueError: ``buffer`` is not a 1-D tensor with the bucket's numel.
        """
        if buffer.dim() != 1 or buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer needs a 1-D tensor of {self._buffer.numel()} elements, "
                f"got shape {tuple(buffer.shape)}"
            )
        self._buffer = buffer
        self._views = self._make_views(buffer)

    def nbytes(self) -> int:
        """Bytes of the buffer (uncompressed payload of the bucket)."""
        return self._buffer.numel() * self._buffer.element_size()

    def __repr__(self) -> str:
        return (
            f"GradBucket(index={self._index}, params={len(self._params)}, "
            f"numel={self._buffer.numel()}, dtype={self._buffer.dtype}, is_last={self._is_last})"
        )


_META = ("method", "rank", "block", "residual dtype", "error feedback")


def describe_change(old_sig: tuple, new_sig: tuple, old_meta: tuple, new_meta: tuple) -> str:
    """Name the parts of a bucket's ``(numel, dtype, param shapes)`` signature and
    ``(method, rank, block, residual dtype, error feedback)`` meta that differ, e.g.
    ``"parameter 0 of 2: shape (64, 32) -> (64,)"``."""
    parts = []
    if old_sig[0] != new_sig[0]:
        parts.append(f"numel {old_sig[0]} -> {new_sig[0]}")
    if old_sig[1] != new_sig[1]:
        parts.append(f"dtype {old_sig[1]} -> {new_sig[1]}")
    a, b = list(old_sig[2]), list(new_sig[2])
    if a != b:
        if len(a) != len(b):
            parts.append(f"{len(a)} -> {len(b)} parameters")
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if tuple(x) != tuple(y)), None)
        if i is not None:
            parts.append(
                f"parameter {i} of {len(b)}: shape {tuple(a[i])} -> {tuple(b[i])} "
                "(other parameters: DDP rebuilt its buckets?)"
            )
    for name, x, y in zip(_META, old_meta, new_meta):
        if x != y:
            parts.append(f"{name} {x!r} -> {y!r}")
    return "; ".join(parts) or "unchanged"
