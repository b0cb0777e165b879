#!/usr/bin/env bash
# Profile the PPO job over an emulated slow link on one CPU machine: 2 gloo ranks whose
# loopback traffic is rate-limited with a Linux token-bucket filter (tc tbf), gradient
# compression none then int8.
# The CPU counterpart of issue 9's GPU evidence: the first report must find the job
# communication-bound, the second show the communication time reduced.
#
# Usage (root, iproute2's tc; nothing else may rely on loopback speed meanwhile):
#   bash benchmarks/slow_link_profile.sh OUTDIR [RATE]        # RATE default 400mbit
# Writes OUTDIR/profile/cpux2_tbf<RATE>_{none,int8}/ and OUTDIR/profile_ppo.{jsonl,md}.
# The qdisc is removed on exit, also on failure or Ctrl-C. (netem would add delay too, but
# is missing from many kernels; tbf is everywhere.)
set -u -o pipefail
OUT=${1:?usage: bash benchmarks/slow_link_profile.sh OUTDIR [RATE]}
RATE=${2:-400mbit}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
command -v tc >/dev/null || { echo "tc (iproute2) not found" >&2; exit 1; }
if tc qdisc show dev lo | grep -qv noqueue; then
  echo "lo already has a qdisc; remove it first (tc qdisc del dev lo root)" >&2
  exit 1
fi
# burst above loopback's 64 KiB MTU, or large segments would be dropped
tc qdisc add dev lo root tbf rate "$RATE" burst 256kb latency 100ms || exit 1
trap 'tc qdisc del dev lo root 2>/dev/null' EXIT INT TERM
status=0
for comp in none int8; do
  $PY -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/profile_ppo.py \
    --shape tiny --prompt-len 16 --response-len 8 --rollout-batch 8 --micro-batch 2 \
    --warmup 3 --steps 5 --name "cpux2_tbf${RATE}_${comp}" --out "$OUT" \
    --set "gradient_compression=$comp" || status=1
done
exit $status
