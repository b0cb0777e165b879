#!/usr/bin/env bash
# PPO throughput, ours (verl_ppo) vs TRL's PPO trainer (issues 8, 15), ~4-6 min on 1 or 2 x H200.
#
# Usage, from the repository root (or anywhere), with .whl/ carried along:
#   bash benchmarks/gpu_ppo_throughput.sh OUTDIR
# Needs in .whl/ (git-ignored; prepared on the CPU machine):
#   bash ../shared/gpu/fetch-wheels.sh trl==1.12.0 accelerate==1.15.0
#   python benchmarks/ppo_throughput.py --export-tokenizer .whl/tok   # config.json + tokenizer
# Runs, each an NPROC-process torchrun launch (default: every GPU, at most 2; NCCL, bf16, one
# GPU per rank), Qwen2.5-0.5B shape with random weights, 256-token prompts + 256-token
# responses, 128 sequences per step, all records under one run_id ($RUN_ID, default a UTC stamp):
#   1. verl_ppo, default settings: 3 warm-up + 3 timed steps (numerics checked first; the
#      warm-up holds torch.compile's compilations: on one H200 the last ones ran in step 3)
#   2. trl_ppo (trl 1.12.0, the last release with trl.experimental.ppo): same (SKIP_TRL=1: not)
#   2b. TRL_TUNED=1: TRL "tuned" (variant tuned): its largest micro-batch that fits, tried from
#      TRL_TUNED_MBS (default "128 64 32 16", per GPU; a size that fails, e.g. out of memory,
#      is followed by the next), with its own torch_compile (TRL_TUNED_COMPILE=0: without);
#      the report's speedup record is then against it (trl_variant: tuned)
#   3. optional: named verl_ppo variants, VARIANTS="name:key=value[,key=value] ..." (each a run)
#   4. the markdown report and the speedup record (target: ours >= 3 x TRL)
# TORCH_PROFILE=1: ours also writes OUTDIR/kernels_<variant>.txt (torch.profiler table of the
# last timed step, which the profiler slows; the timings come from the other steps' median).
# Writes 3 files to OUTDIR: ppo_throughput.jsonl, ppo_throughput.md, ppo_throughput.log.
# Exit status: non-zero if any run failed (the others still run).
# Dry run of the plumbing on a CPU machine (gloo, tiny model; wheels already on PYTHONPATH):
#   BENCH_DRY=1 PYTHON=/path/to/python bash benchmarks/gpu_ppo_throughput.sh /tmp/dry
set -u -o pipefail
OUT=${1:?usage: bash benchmarks/gpu_ppo_throughput.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export VERL_COMMIT=${VERL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# Uncommitted changes (benchmarks/results/ aside) -> "dirty": true in the records. A copy of the
# tree without .git cannot tell: check where the copy is made and pass VERL_DIRTY=0/1 along.
if [ -z "${VERL_DIRTY:-}" ] && git rev-parse --git-dir >/dev/null 2>&1; then
  VERL_DIRTY=$(git status --porcelain | grep -v ' benchmarks/results/' | grep -q . && echo 1 || echo 0)
  export VERL_DIRTY
fi
PY=${PYTHON:-python3}
TOK=${TOK_DIR:-.whl/tok}
STEPS=${STEPS:-3}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
NPROC=${NPROC:-$((NGPU < 2 ? (NGPU < 1 ? 1 : NGPU) : 2))}
export VERL_RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)}
WARMUP=${WARMUP:-3}
LOG="$OUT/ppo_throughput.log"
: > "$LOG"
rm -f "$OUT/ppo_throughput.jsonl" "$OUT/ppo_throughput.md"
say() { echo "$*" | tee -a "$LOG"; }

DRY=${BENCH_DRY:-0}
SIZE=()
[ "$DRY" = 1 ] && SIZE=(--shape tiny --prompt-len 16 --response-len 8 --rollout-batch 8 --micro-batch 2)
if [ "$DRY" = 1 ]; then
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
elif ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$LOG" 2>&1 || { say "# ERROR: installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  say "# WARNING: no .whl/*.whl here; using whatever is installed"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# verl_comm.kernels is a package_dir mapping (kernels/ -> verl_comm.kernels): needs an install.
if ! $PY -c "import verl_comm.kernels" >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$LOG" 2>&1 \
    || { say "# ERROR: editable install of the repository failed"; exit 1; }
fi
[ -f "$TOK/config.json" ] && [ -f "$TOK/tokenizer.json" ] || {
  say "# ERROR: $TOK lacks config.json/tokenizer.json: run"
  say "#   python benchmarks/ppo_throughput.py --export-tokenizer .whl/tok  (CPU machine), carry .whl"
  exit 1
}
say "# run_id $VERL_RUN_ID, $NPROC process(es)"
DRY=$DRY NPROC=$NPROC $PY - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib.metadata as md, os, torch
if os.environ["DRY"] != "1":
    n = int(os.environ["NPROC"])
    assert torch.cuda.device_count() >= n, f"need {n} GPUs, found {torch.cuda.device_count()}"
    print("# GPUs:", [torch.cuda.get_device_name(i) for i in range(n)])
print("# torch", torch.__version__)
for p in ("transformers", "deepspeed", "trl", "accelerate", "pydantic"):
    try:
        print("#", p, md.version(p))
    except md.PackageNotFoundError:
        print("#", p, "MISSING")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

FAILED=0
bench() {  # bench LABEL TIMEOUT_S ARGS...
  local label=$1 limit=$2; shift 2
  say ""
  say "########## $label  $(date -u +%H:%M:%S)"
  local t0=$SECONDS
  timeout -k 10 "$limit" $PY -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    benchmarks/ppo_throughput.py --model-dir "$TOK" --out "$OUT" --warmup "$WARMUP" \
    --steps "$STEPS" "${SIZE[@]}" ${TORCH_PROFILE:+--torch-profile "$OUT"} "$@" 2>&1 | grep --line-buffered -v "Passing \`generation_config\` together" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  say "########## $label: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || FAILED=1
  return "$rc"
}

bench "1 verl_ppo default" "${LIMIT:-240}" --system verl_ppo
[ "${SKIP_TRL:-0}" = 1 ] || bench "2 trl_ppo" "${LIMIT:-240}" --system trl_ppo
if [ "${TRL_TUNED:-0}" = 1 ]; then
  before=$FAILED found=0
  for mb in ${TRL_TUNED_MBS:-128 64 32 16}; do
    compile=()
    [ "${TRL_TUNED_COMPILE:-1}" = 1 ] && compile=(--trl-compile)
    if bench "2b trl_ppo tuned, micro-batch $mb" "${LIMIT:-240}" --system trl_ppo --variant tuned \
      --trl-micro-batch "$mb" "${compile[@]}"; then found=1; break; fi
  done
  FAILED=$before  # the sizes that did not fit are the search, not failures
  [ "$found" = 1 ] || { say "# ERROR: no TRL micro-batch of ${TRL_TUNED_MBS:-128 64 32 16} ran"; FAILED=1; }
fi
for v in ${VARIANTS:-}; do
  name=${v%%:*}
  sets=()
  IFS=, read -ra kvs <<< "${v#*:}"
  for kv in "${kvs[@]}"; do sets+=(--set "$kv"); done
  bench "3 verl_ppo $name" "${LIMIT:-240}" --system verl_ppo --variant "$name" "${sets[@]}"
done

say ""
say "########## report"
$PY benchmarks/ppo_throughput.py --report --run-id "$VERL_RUN_ID" --out "$OUT" 2>&1 | tee -a "$LOG"
cat "$OUT/ppo_throughput.md" 2>/dev/null | tee -a "$LOG"
say "########## done: failed=$FAILED, files: $(ls "$OUT" | tr '\n' ' ')"
exit $FAILED
