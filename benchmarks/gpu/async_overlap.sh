#!/usr/bin/env bash
# Issue 31 on 1 x H200: async rollout (1 training + 1 rollout process sharing the GPU) against
# colocated, at benchmarks/ppo_throughput.py's shape and with responses spread 16-512 tokens
# (benchmarks/gpu/async_overlap.py says how; < 8 min: no round starts that would end past BUDGET_S).
#
# Usage on the GPU machine, from the repository root, .whl/ carried (wheels):
#   source benchmarks/gpu/setup.sh && bash benchmarks/gpu/async_overlap.sh OUTDIR
# Env: ROUNDS (3), WARMUP (1), STEPS (2), BUDGET_S (420: no round that would end past it),
#      LAUNCH_TIMEOUT (120 s per launch), TOK_DIR (.whl/tok if there), RUN_ID (default a UTC stamp),
#      VERL_COMMIT / VERL_DIRTY (the records' commit, for a copy of the tree without .git).
# Writes OUTDIR/async_rollout.jsonl (records: tokens_per_s_vs_colocated, one per workload),
# OUTDIR/async_overlap.md and OUTDIR/async_overlap.log. Exit status non-zero if a launch failed.
set -u -o pipefail
source "$(dirname "$0")/_env.sh" "${1:-}" || exit 1  # OUT, repository root, VERL_COMMIT/DIRTY
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export VERL_RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
echo "# run_id $VERL_RUN_ID commit $VERL_COMMIT dirty ${VERL_DIRTY:-?}" | tee "$OUT/async_overlap.log"
# the tokenizer folder of gpu_ppo_throughput.sh when carried (.whl/tok), else the packaged one
TOK=${TOK_DIR:-.whl/tok}
MD=()
[ -f "$TOK/tokenizer.json" ] && MD=(--model-dir "$TOK")
python3 benchmarks/gpu/async_overlap.py --out "$OUT" "${MD[@]}" --rounds "${ROUNDS:-3}" \
  --warmup "${WARMUP:-1}" --steps "${STEPS:-2}" --budget-s "${BUDGET_S:-420}" \
  --launch-timeout "${LAUNCH_TIMEOUT:-120}" 2>&1 \
  | grep --line-buffered -v "Passing \`generation_config\` together" | tee -a "$OUT/async_overlap.log"
exit "${PIPESTATUS[0]}"
