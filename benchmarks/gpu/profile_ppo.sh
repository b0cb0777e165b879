#!/usr/bin/env bash
# Issue 9's GPU evidence: profile 3 PPO steps over the NCCL socket transport with
# gradient_compression none, then int8, and write both reports (text, JSON, PNG).
#
# Usage on the GPU machine, from the repository root, .whl/ carried (wheels + .whl/tok):
#   source benchmarks/gpu/setup.sh && bash benchmarks/gpu/profile_ppo.sh OUTDIR
# Env: NPROC (default: all GPUs, at most 2), STEPS (3), WARMUP (3), PER_GPU_BATCH (64),
#      TRANSPORT=socket|default (socket: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1),
#      RUN_TIMEOUT (270 s per run, so that both runs fit one 10-minute device call),
#      EXTRA="key=value ..." (more config overrides for every run) with SUFFIX (run-name tail).
# Writes OUTDIR/profile/<run>/{report.txt,report.json,report.png,profile_rank*.json},
# OUTDIR/profile_ppo.{jsonl,md} and OUTDIR/profile_ppo.log. With one GPU only the
# `none` run is made (no data-parallel gradients to compress); its report checks the
# profiler's CUDA path (kernels, CUDA-event phases, memory) but cannot show communication.
set -u -o pipefail
source "$(dirname "$0")/_env.sh" "${1:-}" || exit 1  # OUT, repository root, VERL_COMMIT/DIRTY
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
NPROC=${NPROC:-$((NGPU < 2 ? NGPU : 2))}
STEPS=${STEPS:-3}
WARMUP=${WARMUP:-3}
BATCH=$((${PER_GPU_BATCH:-64} * NPROC))
TRANSPORT=${TRANSPORT:-socket}
LOG="$OUT/profile_ppo.log"
: >>"$LOG"
say() { echo "$*" | tee -a "$LOG"; }
[ "$NPROC" -ge 1 ] || { say "# ERROR: no GPU found"; exit 1; }
[ -f .whl/tok/config.json ] || { say "# ERROR: .whl/tok missing (ppo_throughput.py --export-tokenizer)"; exit 1; }
if [ "$TRANSPORT" = socket ]; then
  export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
fi
say "# profile_ppo: $NPROC GPU(s), transport $TRANSPORT, batch $BATCH, $WARMUP+$STEPS steps, commit $VERL_COMMIT"
COMPS=(none int8)
[ "$NPROC" -lt 2 ] && COMPS=(none) && say "# one GPU: int8 run skipped (no data-parallel gradients)"
status=0
for comp in "${COMPS[@]}"; do
  name="h200x${NPROC}_${TRANSPORT}_${comp}${SUFFIX:-}"
  sets=(--set "gradient_compression=$comp")
  for kv in ${EXTRA:-}; do sets+=(--set "$kv"); done
  say "## $name"
  t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-270}" torchrun --standalone --nproc_per_node="$NPROC" benchmarks/profile_ppo.py \
    --model-dir .whl/tok --name "$name" --out "$OUT" --warmup "$WARMUP" --steps "$STEPS" \
    --rollout-batch "$BATCH" "${sets[@]}" >>"$LOG" 2>&1
  rc=$?
  say "## $name rc=$rc in $(($(date +%s) - t0)) s"
  [ $rc -eq 0 ] || status=1
  # a run stopped by the timeout leaves its large Chrome traces / memory snapshots behind
  rm -rf "$OUT/profile/$name"/trace_rank*.json "$OUT/profile/$name"/memory_snapshot_* \
    "$OUT/profile/$name/_run"
  [ -f "$OUT/profile/$name/report.txt" ] && cat "$OUT/profile/$name/report.txt"
done
python3 benchmarks/profile_ppo.py --compare --out "$OUT" | tee -a "$LOG"
exit $status
