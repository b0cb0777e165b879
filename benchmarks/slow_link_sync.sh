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
command -v tc >/dev/null && command -v ip >/dev/null || { echo "needs iproute2 (ip, tc)" >&2; exit 1; }
TAG=$$
NS0=vws0_$TAG NS1=vws1_$TAG V0=vwsa$TAG V1=vwsb$TAG
cleanup() { ip netns del "$NS0" 2>/dev/null; ip netns del "$NS1" 2>/dev/null; }
trap cleanup EXIT INT TERM
ip netns add "$NS0" && ip netns add "$NS1" || exit 1
ip link add "$V0" type veth peer name "$V1" || exit 1
ip link set "$V0" netns "$NS0" && ip link set "$V1" netns "$NS1" || exit 1
ip -n "$NS0" addr add 10.78.0.1/24 dev "$V0" && ip -n "$NS1" addr add 10.78.0.2/24 dev "$V1"
for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
ip -n "$NS0" link set "$V0" up && ip -n "$NS1" link set "$V1" up || exit 1
tc -n "$NS0" qdisc add dev "$V0" root tbf rate "${MBIT}mbit" burst 256kb latency 100ms || exit 1
tc -n "$NS1" qdisc add dev "$V1" root tbf rate "${MBIT}mbit" burst 256kb latency 100ms || exit 1
RUN_ID=${RUN_ID:-$($PY -c "import uuid; print(uuid.uuid4().hex[:12])")}
pids=() rc=0
for r in 0 1 2 3; do
  ns=$NS0 dev=$V0; [ $r -ge 2 ] && ns=$NS1 dev=$V1
  ip netns exec "$ns" env RANK=$r LOCAL_RANK=$((r % 2)) WORLD_SIZE=4 MASTER_ADDR=10.78.0.1 \
    MASTER_PORT=29571 GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" \
    timeout "${ATTEMPT_S:-900}" $PY benchmarks/weight_sync.py --transport shaped_veth \
    --link-mbit "$MBIT" --run-id "$RUN_ID" --out "$OUT" ${ARGS:-} &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
