"""Triton int8 kernels with their torch references (installed as ``verl_comm.kernels``).

Absmax int8 block quantization (fp32 scale per block of B in {32, 64, 128, 256}), with
optional stochastic rounding or fused error feedback, plain dequantization, and the
dequantize-sum-requantize step that the owner of a chunk runs in a quantized reduce-scatter.
Launchers dispatch CUDA tensors to Triton and CPU tensors to the public ``*_ref`` torch
references, which the kernels match bit for bit. Rounding rule, error bound, NaN/Inf policy:
see :mod:`verl_comm.kernels._common`. Codes and scales of a chunk travel in one byte buffer:
:func:`pack` / :func:`unpack` (layout in :mod:`verl_comm.kernels.pack`).
"""

from ._common import QMAX, SUPPORTED_BLOCKS, TINY, packed_nbytes, padded_numel
from .ops import dequant_sum_requant, dequantize, quantize, quantize_ef
from .pack import pack, unpack
from .reference import (
    dequant_sum_requant_ref,
    dequantize_ref,
    philox_uniform_ref,
    quantize_ef_ref,
    quantize_ref,
)

__all__ = [
    "QMAX",
    "SUPPORTED_BLOCKS",
    "TINY",
    "dequant_sum_requant",
    "dequant_sum_requant_ref",
    "dequantize",
    "dequantize_ref",
    "pack",
    "packed_nbytes",
    "padded_numel",
    "philox_uniform_ref",
    "quantize",
    "quantize_ef",
    "quantize_ef_ref",
    "quantize_ref",
    "unpack",
]
