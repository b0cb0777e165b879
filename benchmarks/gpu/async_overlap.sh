#!/usr/bin/env bash
# Async rollout against colocated (benchmarks/gpu/async_overlap.py says how). GPUS=1 (default),
# issue 31 on 1 x H200: 1 training + 1 rollout process sharing the GPU, at
# benchmarks/ppo_throughput.py's shape and with responses spread 16-512 tokens. GPUS=2, issue 34
# on 2 x H200: one training GPU and one rollout GPU (NCCL bridge) against colocated on both
# (comm.nproc=2), 256 + 256 tokens, 128 sequences per step, 10 timed steps, sync wires full and
# delta. No round starts that would end past BUDGET_S.
#
# Usage on the GPU machine, from the repository root, .whl/ carried (wheels):
#   source benchmarks/gpu/setup.sh && bash benchmarks/gpu/async_overlap.sh OUTDIR
#   source benchmarks/gpu/setup.sh && GPUS=2 ROUNDS=2 bash benchmarks/gpu/async_overlap.sh OUTDIR  # 2 x H200
# Env: GPUS (1; 2 needs 2 visible GPUs, else refused before any launch), ROUNDS (3), WARMUP (1),
#      STEPS (GPUS=1: 2, GPUS=2: 10), BUDGET_S (420: no round that would end past it),
#      LAUNCH_TIMEOUT (GPUS=1: 120 s, GPUS=2: 180 s per launch), SYNC_WIRES and WORKLOADS (comma
#      lists; default per GPUS: 1: delta / fixed,spread, 2: full,delta / fixed), TOK_DIR
#      (.whl/tok if there), RUN_ID (default a UTC stamp: one run_id for the call),
#      VERL_COMMIT / VERL_DIRTY (the records' commit, for a copy of the tree without .git).
#      NCCL_NVLS_ENABLE=0 comes from _env.sh (multicast off on the lent machines).
# Writes OUTDIR/async_rollout.jsonl (records: tokens_per_s_vs_colocated, one per workload and
# wire), OUTDIR/async_overlap.md and OUTDIR/async_overlap.log. Exit status non-zero if a launch
# failed (2: too few GPUs, nothing launched).
set -u -o pipefail
source "$(dirname "$0")/_env.sh" "${1:-}" || exit 1  # OUT, repository root, VERL_COMMIT/DIRTY
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export VERL_RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
GPUS=${GPUS:-1}
if [ "$GPUS" -ge 2 ]; then STEPS=${STEPS:-10} LAUNCH_TIMEOUT=${LAUNCH_TIMEOUT:-180}; fi
echo "# run_id $VERL_RUN_ID commit $VERL_COMMIT dirty ${VERL_DIRTY:-?} gpus $GPUS" \
  "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE" | tee "$OUT/async_overlap.log"
# the tokenizer folder of gpu_ppo_throughput.sh when carried (.whl/tok), else the packaged one
TOK=${TOK_DIR:-.whl/tok}
MD=()
[ -f "$TOK/tokenizer.json" ] && MD=(--model-dir "$TOK")
OPT=()
[ -n "${SYNC_WIRES:-}" ] && OPT+=(--sync-wires "$SYNC_WIRES")
[ -n "${WORKLOADS:-}" ] && OPT+=(--workloads "$WORKLOADS")
python3 benchmarks/gpu/async_overlap.py --out "$OUT" "${MD[@]}" --gpus "$GPUS" "${OPT[@]}" \
  --rounds "${ROUNDS:-3}" --warmup "${WARMUP:-1}" --steps "${STEPS:-2}" \
  --budget-s "${BUDGET_S:-420}" --launch-timeout "${LAUNCH_TIMEOUT:-120}" 2>&1 \
  | grep --line-buffered -v "Passing \`generation_config\` together" | tee -a "$OUT/async_overlap.log"
exit "${PIPESTATUS[0]}"
