"""All-reduce latency and bandwidth benchmark, nccl-tests style (thin wrapper).

Everything lives in :mod:`verl_comm.bench` (also ``verl-comm bench allreduce``); this script
adds the benchmark conventions of this repository: ``--out DIR`` (default
``benchmarks/results``) receives ``allreduce_latency.jsonl`` and ``allreduce_latency.md``.

Protocol: closed-form check of every case before timing (``#wrong``), warm-up, per-iteration
CUDA events (perf_counter on CPU), max across ranks per iteration, mean/P50/P99, algbw and
busbw from the P50 time with nccl-tests' factors. Methods of all_reduce run side by side in
one process group.

Usage::

    python benchmarks/allreduce_latency.py --smoke --out /tmp/bench          # CPU, gloo, < 60 s
    NCCL_NVLS_ENABLE=0 python benchmarks/allreduce_latency.py --backend nccl --nproc 2 \\
        -b 8 -e 1G --method nccl_fp32,nccl_bf16,int8 --plot allreduce_latency.png
    bash benchmarks/gpu_allreduce.sh OUTDIR     # the full H200 set (about 5 minutes)

All other options are those of ``verl-comm bench allreduce --help``.
"""

from __future__ import annotations

import sys

from verl_comm.bench.cli import main as bench_main

DEFAULT_OUT = "benchmarks/results"


def main(argv: list[str] | None = None) -> int:
    """Run ``verl-comm bench allreduce`` with ``--out`` defaulting to benchmarks/results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("--out", "--jsonl", "-h", "--help") or a.startswith("--out=") for a in argv):
        argv += ["--out", DEFAULT_OUT]
    return bench_main(["allreduce", *argv])


if __name__ == "__main__":
    sys.exit(main())
