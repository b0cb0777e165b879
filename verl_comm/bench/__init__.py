"""Collective benchmarks in NVIDIA/nccl-tests' layout (``verl-comm bench allreduce``).

Modules: :mod:`~verl_comm.bench.sweep` (sizes, bandwidth factors, statistics; pure),
:mod:`~verl_comm.bench.ops` (buffers, collective calls, closed-form checks),
:mod:`~verl_comm.bench.timing` (per-iteration CUDA events / perf_counter, max across ranks),
:mod:`~verl_comm.bench.runner` (the sweep per rank, torchrun or spawned launch),
:mod:`~verl_comm.bench.report` (text layout, JSONL, markdown, stability, ``--compare``),
:mod:`~verl_comm.bench.plot` (PNG), :mod:`~verl_comm.bench.cli` (``verl-comm bench``),
:mod:`~verl_comm.bench.autotune` (the fastest NCCL preset per size, ``verl-comm nccl autotune``).
"""

from verl_comm.bench.runner import BenchConfig, launch
from verl_comm.bench.sweep import bandwidths, busbw_factor, parse_size, size_sweep

__all__ = ["BenchConfig", "launch", "bandwidths", "busbw_factor", "parse_size", "size_sweep"]
