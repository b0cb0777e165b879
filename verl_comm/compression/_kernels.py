"""The int8 kernel entry points used by the algorithms (one import site).

``verl_comm.kernels`` dispatches CUDA tensors to Triton and CPU tensors to the torch
references.
"""

from __future__ import annotations

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
