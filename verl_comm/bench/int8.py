"""Adapter to our int8 quantized all-reduce (``verl_comm.compression``) for the benchmark.

The benchmark needs "sum this float tensor across the group, result into ``out``"; this
module binds :func:`verl_comm.compression.int8_allreduce.int8_allreduce` (two-step scheme:
block-quantize, all-to-all of codes + scales, dequantize-sum-requantize by the owner,
all-gather; see that module for its source) to a process group, and reports a clear reason when the
implementation cannot be imported, so that the ``int8`` method is skipped with that
message instead of failing the sweep.

Settings used: block B = 128, no error feedback (a fresh call has a zero residual, so the
fused error-feedback kernel would only add a read and a write of the residual), sum
(``average=False``) so that the closed-form check of all_reduce applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

INT8_BLOCK = 128


class Int8AllReduce:
    """Lazily bound int8 all-reduce.

    Attributes:
        available: True when the implementation was imported.
        reason: why it is unavailable (empty when available).
        block: quantization block size B (elements per absmax scale).
    """

    def __init__(self, block: int = INT8_BLOCK) -> None:
        self.available = False
        self.reason = ""
        self.block = block
        self._fn: Callable | None = None
        self._coll_cls: type | None = None
        try:
            from verl_comm.compression.collective import ProcessGroupCollective
            from verl_comm.compression.int8_allreduce import int8_allreduce
        except Exception as exc:  # noqa: BLE001 - any import failure disables the method
            self.reason = (
                f"cannot import verl_comm.compression.int8_allreduce ({type(exc).__name__}: {exc})"
            )
            return
        self._fn = int8_allreduce
        self._coll_cls = ProcessGroupCollective
        self.available = True

    def make(
        self, inp: torch.Tensor, out: torch.Tensor, group: dist.ProcessGroup | None
    ) -> Callable[[], None]:
        """Return a no-argument call: ``out = sum over ranks of inp`` (1-D float tensors,
        same numel; ``out`` may alias ``inp``), bit-identical on every rank.

        Raises:
            RuntimeError: when the implementation is unavailable (see :attr:`reason`).
        """
        if self._fn is None or self._coll_cls is None:
            raise RuntimeError(f"int8 all-reduce unavailable: {self.reason}")
        fn, coll, block = self._fn, self._coll_cls(group), self.block

        def call() -> None:
            fn(inp, coll, block=block, residual=None, average=False, out=out)

        return call
