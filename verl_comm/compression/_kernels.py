"""The int8 kernel entry points used by the algorithms (one import site).

``verl_comm.kernels`` dispatches CUDA tensors to Triton and CPU tensors to the torch
references.
"""

from __future__ import annotations

try:
    from verl_comm.kernels import (
        dequant_sum_requant,
        dequantize,
        pack,
        packed_nbytes,
        padded_numel,
        quantize,
        quantize_ef,
        unpack,
    )
except ImportError:  # pragma: no cover - kernels package not yet exporting its launchers
    from verl_comm.kernels._common import packed_nbytes, padded_numel
    from verl_comm.kernels.pack import pack, unpack
    from verl_comm.kernels.reference import dequant_sum_requant_ref as dequant_sum_requant
    from verl_comm.kernels.reference import dequantize_ref as dequantize
    from verl_comm.kernels.reference import quantize_ef_ref as quantize_ef
    from verl_comm.kernels.reference import quantize_ref as quantize

__all__ = [
    "dequant_sum_requant",
    "dequantize",
    "pack",
    "packed_nbytes",
    "padded_numel",
    "quantize",
    "quantize_ef",
    "unpack",
]
