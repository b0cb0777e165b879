"""A stand-alone bucket with ``torch.distributed.GradBucket``'s methods.

Lets the hooks run outside DDP (one-process tests, custom reducers): a flat buffer and the
tensors it holds back to back.
"""

from __future__ import annotations

import torch


class TensorBucket:
    """GradBucket look-alike over a flat buffer.

    Args:
        buffer: contiguous 1-D tensor, the gradients of ``params`` back to back.
        params: the parameters (or any tensors with their shapes), in buffer order.
        index: bucket index (keys the per-bucket hook state).
        is_last: whether this is the last bucket of the step.

    Raises:
        ValueError: the parameter sizes do not add up to ``buffer.numel()``.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        params: list[torch.Tensor],
        index: int = 0,
        is_last: bool = True,
    ) -> None:
        total = sum(p.numel() for p in params)
        if buffer.dim() != 1 or total != buffer.numel():
            raise ValueError(
                f"buffer must be 1-D with sum of parameter sizes ({total}) elements, got "
                f"shape {tuple(buffer.shape)}"
            )
        self._buffer = buffer
        self._params = list(params)
        self._index = index
        self._is_last = is_last

    @classmethod
    def from_tensors(cls, grads: list[torch.Tensor], index: int = 0, is_last: bool = True):
        """Copy ``grads`` into a new flat buffer (dtype of the first) and wrap it."""
        dtype = grads[0].dtype if grads else torch.float32
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads]) if grads else torch.zeros(0)
        return cls(flat, grads, index, is_last)

    def index(self) -> int:
        """The bucket index."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-D buffer."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Views of the buffer shaped like each parameter."""
        out, o = [], 0
        for p in self._params:
            out.append(self._buffer[o : o + p.numel()].view(p.shape))
            o += p.numel()
        return out

    def parameters(self) -> list[torch.Tensor]:
        """The parameters in buffer order."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the last bucket of a step."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (same number of elements)."""
        if buffer.numel() != self._buffer.numel():
            raise ValueError(
                f"set_buffer needs {self._buffer.numel()} elements, got {buffer.numel()}"
            )
        self._buffer = buffer
