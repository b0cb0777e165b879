# Sourced by the GPU batch scripts of this folder: `source "$(dirname "$0")/_env.sh" "$1"`.
# Makes the output folder OUT (absolute), moves to the repository root, and exports what every
# batch needs: NCCL_NVLS_ENABLE=0 (multicast off on the lent machines), unbuffered Python,
# quiet tokenizers, VERL_COMMIT (the records' commit) and VERL_DIRTY (1 when changes outside
# benchmarks/results/ are uncommitted; a copy of the tree without .git cannot tell, so pass
# VERL_COMMIT / VERL_DIRTY along from where the copy is made).
OUT=${1:?usage: bash $0 OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VERL_COMMIT=${VERL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -z "${VERL_DIRTY:-}" ] && git rev-parse --git-dir >/dev/null 2>&1; then
  VERL_DIRTY=$(git status --porcelain | grep -v ' benchmarks/results/' | grep -q . && echo 1 || echo 0)
  export VERL_DIRTY
fi
