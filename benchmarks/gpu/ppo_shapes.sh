#!/usr/bin/env bash
# PPO throughput of ours (defaults) at two shapes beside the benchmark's (issue 33): "deep"
# (the qwen05b shape at 48 layers, 256-token prompts, 1024-token responses) and "wide" (the
# qwen15b shape, 256 + 256), 128 sequences, 3 warm-up + 3 timed steps, one torchrun launch each.
# With PREV=DIR (an older tree of this repository, its verl_comm/kernels in place), each shape
# also runs on that tree first, in the same call, tagged variant "<shape>_before" with
# PREV_COMMIT as its commit: the before/after comparison.
#   source benchmarks/gpu/setup.sh; VERL_COMMIT=<sha> VERL_DIRTY=0 \
#     [PREV=.whl/prev PREV_COMMIT=<sha>] bash benchmarks/gpu/ppo_shapes.sh OUTDIR
# Writes OUTDIR/ppo_throughput.jsonl (all records, one run_id), its report
# OUTDIR/ppo_throughput_shapes.md (benchmarks/ppo_throughput.py --report) and OUTDIR/shapes.log.
set -u -o pipefail
source "$(dirname "$0")/_env.sh" "${1:-}" || exit 1  # OUT, repository root, VERL_COMMIT/DIRTY
export VERL_RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
TOK=$(cd "${TOK_DIR:-.whl/tok}" && pwd)
FAILED=0
run() {  # run TREE COMMIT VARIANT ARGS...
  local tree=$1 commit=$2 variant=$3; shift 3
  echo "########## $variant ($commit) $(date -u +%H:%M:%S)" | tee -a "$OUT/shapes.log"
  (cd "$tree" && VERL_COMMIT=$commit PYTHONPATH=/tmp/site:$PWD timeout -k 10 "${LIMIT:-240}" \
    python3 -m torch.distributed.run --standalone --nproc_per_node=1 benchmarks/ppo_throughput.py \
    --model-dir "$TOK" --out "$OUT" --warmup 3 --steps 3 --system verl_ppo --variant "$variant" "$@") \
    >>"$OUT/shapes.log" 2>&1 || { echo "# $variant failed" | tee -a "$OUT/shapes.log"; FAILED=1; }
}
for shape in deep wide; do
  case $shape in
    deep) args=(--shape qwen05b --layers 48 --prompt-len 256 --response-len 1024) ;;
    wide) args=(--shape qwen15b --prompt-len 256 --response-len 256) ;;
  esac
  [ -n "${PREV:-}" ] && run "$PREV" "${PREV_COMMIT:?PREV needs PREV_COMMIT}" "${shape}_before" "${args[@]}"
  run . "$VERL_COMMIT" "$shape" "${args[@]}"
done
python3 benchmarks/ppo_throughput.py --report --run-id "$VERL_RUN_ID" --out "$OUT" >>"$OUT/shapes.log" 2>&1
mv "$OUT/ppo_throughput.md" "$OUT/ppo_throughput_shapes.md"  # one section per shape
exit $FAILED
