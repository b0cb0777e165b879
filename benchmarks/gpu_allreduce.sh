#!/usr/bin/env bash
# All-reduce latency/bandwidth on 2 GPUs (issue 6), about 5 minutes on 2 x H200.
#
# Usage, from the repository root (or anywhere):   bash benchmarks/gpu_allreduce.sh OUTDIR
#
# Runs, each a self-launched 2-process verl-comm bench (NCCL, one GPU per rank):
#   1. NVLink (default env): all_reduce 8 B..1 GiB x {nccl_fp32, nccl_bf16, int8}, plus
#      reduce_scatter, all_gather, all_to_all, broadcast (nccl_fp32, nccl_bf16); both placements
#   2. NVLink: 8 B and 8 MiB, harness nccl_fp32 vs a bare torch.distributed.all_reduce loop,
#      2000 iterations, 10 interleaved repeats (latency target + stability on NVLink)
#   3. socket (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1): all_reduce 8 B..1 GiB x 3 methods,
#      in-place, iterations capped by a 1.2 s budget per size (512 MiB takes ~217 ms)
#   4. fake multi-node (NCCL_HOSTID per rank, NCCL_NET=Socket, NCCL_SOCKET_IFNAME=lo): as 3
#   5. socket stability: 8 MiB, 10 repeats of 50 iterations
# Writes at most 6 files to OUTDIR:
#   allreduce_latency.jsonl  every record (+ stability summaries)
#   allreduce_latency.txt    the nccl-tests style tables of all runs (and errors)
#   allreduce_latency.md     targets, int8 crossovers, selected sizes
#   allreduce_latency.png    all_reduce: busbw and P50/P99 vs size, every method and transport
#   allreduce_latency_nvlink_ops.png   the other collectives on NVLink
# Exit status: non-zero if any run failed or found wrong elements (the others still run).
# Dry run of the plumbing on a CPU machine (gloo, small sizes, no GPU check):
#   BENCH_BACKEND=gloo BENCH_MAXBYTES=64K BENCH_MIDBYTES=4K BENCH_ITERS=5 BENCH_WARMUP=2 bash benchmarks/gpu_allreduce.sh /tmp/dry
set -u -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_allreduce.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export VERL_COMMIT=${VERL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
PY=${PYTHON:-python3}
BACKEND=${BENCH_BACKEND:-nccl}
MAXB=${BENCH_MAXBYTES:-1G}
ITERS=${BENCH_ITERS:-50}
LAT_ITERS=${BENCH_ITERS:-2000}
LAT_WARMUP=${BENCH_WARMUP:-200}
MID=${BENCH_MIDBYTES:-8M}
LOG="$OUT/allreduce_latency.txt"
JSONL="$OUT/allreduce_latency.jsonl"
: > "$LOG"
rm -f "$JSONL"
say() { echo "$*" | tee -a "$LOG"; }

# verl_comm.kernels is a package_dir mapping (kernels/ -> verl_comm.kernels): needs an install.
if ! $PY -c "import verl_comm.kernels" >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 \
    || say "# WARNING: editable install failed; the int8 method will be skipped"
fi
$PY -c "import verl_comm.compression.int8_allreduce" >>"$LOG" 2>&1 \
  || say "# WARNING: verl_comm.compression.int8_allreduce not importable; int8 rows will be skipped"
[ "$BACKEND" = nccl ] && { $PY - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
assert torch.cuda.device_count() >= 2, f"need 2 GPUs, found {torch.cuda.device_count()}"
print("# GPUs:", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1; }

FAILED=0
bench() {  # bench LABEL [ENV=VALUE ...] -- ARGS...
  local label=$1; shift
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  say ""
  say "########## $label  (env: ${envs[*]:-default})  $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  env "${envs[@]}" timeout 240 $PY -m verl_comm.cli bench allreduce --nproc 2 --backend "$BACKEND" \
    --jsonl "$JSONL" --append --timeout 120 --launch-timeout 230 "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "########## $label: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || FAILED=1
}

SOCKET=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
FAKEMN=(NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo)

bench "1 NVLink sweep" NCCL_NVLS_ENABLE=0 -- --transport nvlink -b 8 -e "$MAXB" -f 2 -n "$ITERS" -w 5 \
  --time-budget 0.5 --op all_reduce --method nccl_fp32,nccl_bf16,int8
bench "1b NVLink other collectives" NCCL_NVLS_ENABLE=0 -- --transport nvlink -b 8 -e "$MAXB" -f 4 \
  -n "$ITERS" -w 5 --time-budget 0.5 --op reduce_scatter,all_gather,all_to_all,broadcast \
  --method nccl_fp32,nccl_bf16
bench "2 NVLink 8 B latency vs bare loop + stability" NCCL_NVLS_ENABLE=0 -- --transport nvlink \
  -b 8 -e "$MID" -f 1048576 -n "$LAT_ITERS" -w "$LAT_WARMUP" --inplace --repeat 10 --method nccl_fp32,bare
bench "3 socket sweep" "${SOCKET[@]}" -- --transport socket -b 8 -e "$MAXB" -f 2 -n "$ITERS" -w 2 \
  --time-budget 1.2 --min-iters 3 --inplace --method nccl_fp32,nccl_bf16,int8
bench "4 fake multi-node sweep" "${FAKEMN[@]}" -- --transport fake_multinode \
  --per-rank-env 'NCCL_HOSTID=verlhost{rank}' -b 8 -e "$MAXB" -f 2 -n "$ITERS" -w 2 --time-budget 1.2 \
  --min-iters 3 --inplace --method nccl_fp32,nccl_bf16,int8
bench "5 socket stability" "${SOCKET[@]}" -- --transport socket -b "$MID" -e "$MID" -n "$ITERS" -w 5 \
  --inplace --repeat 10 --method nccl_fp32

say ""
say "########## summary and plots"
$PY -m verl_comm.cli bench summary "$JSONL" --md "$OUT/allreduce_latency.md" 2>&1 | tee -a "$LOG"
$PY -m verl_comm.cli bench plot "$JSONL" --collective all_reduce --png "$OUT/allreduce_latency.png" \
  --title "all_reduce, 2 ranks: every method and transport" 2>&1 | tee -a "$LOG"
$PY -m verl_comm.cli bench plot "$JSONL" --transport nvlink --png "$OUT/allreduce_latency_nvlink_ops.png" \
  --title "NVLink: every collective" 2>&1 | tee -a "$LOG"
say "########## done: failed=$FAILED, files: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
