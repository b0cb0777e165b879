#!/usr/bin/env bash
# Issue 28's 1 x H200 targets, world size 1, every hook built through the API a user calls
# (benchmarks/comm_hooks.py: register_comm_hook(ddp, CompressionConfig(...)) with the
# defaults, records "api": "public"). Workload: 24 x Linear(4096, 4096), bf16 autocast,
# bucket_cap_mb 25; 4 warm-up rounds (numerics checked on the last), 15 interleaved timed
# rounds, median and spread; host syncs counted over one step per method.
# Targets: 0 host syncs; ours_int8 <= 1.08x none; ours_lowrank_int8_r32 <= 0.60x
# torch_powersgd_r32 and _r128 <= 0.40x torch_powersgd_r128; ours_bf16 <= 1.0x torch_bf16.
# About 2-4 minutes (building 8 models, Triton compiles, CUDA-graph captures, the rounds);
# prints the issue-28 target lines of the generated markdown (met / MISSED).
#
# Usage, from the repository root on the GPU machine (.whl/ carried along):
#   VERL_COMMIT=<branch commit> bash benchmarks/gpu/comm_hooks_public.sh OUTDIR
# Writes OUTDIR/comm_hooks.jsonl and OUTDIR/comm_hooks.md (this run only). To publish, append
# the records to benchmarks/results/comm_hooks.jsonl and regenerate the markdown:
#   cat OUTDIR/comm_hooks.jsonl >> benchmarks/results/comm_hooks.jsonl
#   python benchmarks/comm_hooks_report.py benchmarks/results/comm_hooks.jsonl
set -u -o pipefail
source "$(dirname "$0")/_env.sh" "${1:-}" || exit 1  # OUT, repository root, VERL_COMMIT/DIRTY
source benchmarks/gpu/setup.sh || exit 1
METHODS=none,torch_bf16,torch_powersgd_r32,torch_powersgd_r128,ours_bf16,ours_int8
METHODS=$METHODS,ours_lowrank_int8_r32,ours_lowrank_int8_r128
timeout 345 python3 benchmarks/comm_hooks.py --world 1 --warmup 4 --rounds 15 \
  --deadline-s 330 --methods "$METHODS" --out "$OUT"
rc=$?
grep -E "^- (issue 28|context)" "$OUT/comm_hooks.md"
exit $rc
