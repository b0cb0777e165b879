#!/usr/bin/env bash
# Issue 31's slow-link weight-sync benchmark on one CPU machine: 2 training ranks in one
# network namespace, 2 rollout ranks in another, joined by a veth pair whose both ends are
# shaped with a token-bucket filter (tc tbf) to RATE Mbit/s, as in benchmarks/slow_link_hooks.sh.
# Only training <-> rollout traffic crosses the veth (ranks of one namespace talk through its
# own stack). The loopback device is never touched (other jobs on the machine rely on it).
#
# Usage (root, iproute2):  bash benchmarks/slow_link_sync.sh OUTDIR [RATE_MBIT]   # 200
# Appends to OUTDIR/async_rollout.jsonl (transport "shaped_veth", link_mbit) and regenerates
# OUTDIR/async_rollout.md; extra arguments for benchmarks/weight_sync.py go in $ARGS.
set -u -o pipefail
OUT=${1:?usage: bash benchmarks/slow_link_sync.sh OUTDIR [RATE_MBIT]}
MBIT=${2:-200}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
source benchmarks/_netns.sh
netns_up vws 10.78.0 "$MBIT" || exit 1
RUN_ID=${RUN_ID:-$($PY -c "import uuid; print(uuid.uuid4().hex[:12])")}
pids=() rc=0
for r in 0 1 2 3; do
  ns=$NS0 dev=$V0; [ $r -ge 2 ] && ns=$NS1 dev=$V1
  ip netns exec "$ns" env RANK=$r LOCAL_RANK=$((r % 2)) WORLD_SIZE=4 MASTER_ADDR=$ADDR0 \
    MASTER_PORT=29571 GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" \
    timeout "${ATTEMPT_S:-900}" $PY benchmarks/weight_sync.py --transport shaped_veth \
    --link-mbit "$MBIT" --run-id "$RUN_ID" --out "$OUT" ${ARGS:-} &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
