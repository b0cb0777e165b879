#!/usr/bin/env bash
# Issue 14's slow-link benchmark on one CPU machine: 2 gloo ranks in two network namespaces
# joined by a veth pair whose both ends are shaped with a token-bucket filter (tc tbf) to
# RATE; DDP on 6 x Linear(2048, 2048) (25.2 M parameters, 6 buckets of 16.8 MB at
# bucket_cap_mb 25), loss x 1024 (torch's fp16 hook underflows on this model's unscaled
# gradients: 6.7% error), methods side by side in one run (benchmarks/comm_hooks.py).
# The loopback device is never touched (other jobs on the machine rely on its speed).
#
# Usage (root, iproute2):  bash benchmarks/slow_link_hooks.sh OUTDIR [RATE_MBIT]   # 1000
# WORLD=4 (even; default 2): WORLD/2 ranks per namespace ("host"); ranks of one host talk over
# that namespace's loopback, only the ring's cross-host hops cross the shaped link.
# TRACE=1 METHODS=torch_fp16,ours_int8@1,ours_int8 [TRACE_ARGS="--rounds 5"]: per-bucket timelines
# (benchmarks/slow_link_trace.py)
# on stdout instead of the benchmark.
# Appends to OUTDIR/comm_hooks.jsonl (transport "shaped_veth", link_mbit) and regenerates
# OUTDIR/comm_hooks.md. torch's powerSGD_hook can hang or mismatch collectives on gloo (it
# chains collectives in Future.then callbacks): if the first attempt fails (a gloo error,
# or the process-group timeout), the failure and its first error line are recorded for it
# and the run is repeated without it, under the same run_id.
set -u -o pipefail
OUT=${1:?usage: bash benchmarks/slow_link_hooks.sh OUTDIR [RATE_MBIT]}
MBIT=${2:-1000}
WORLD=${WORLD:-2}
[ $((WORLD % 2)) = 0 ] && [ "$WORLD" -ge 2 ] || { echo "WORLD=$WORLD: give an even number >= 2" >&2; exit 1; }
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
source benchmarks/_netns.sh
netns_up vch 10.77.0 "$MBIT" || exit 1
RUN_ID=${RUN_ID:-$($PY -c "import uuid; print(uuid.uuid4().hex[:12])")}
# ours_auto_r8: policy auto may take any path down to low rank r8, the lossiest fixed method
# it is compared with (auto never lowers the configured rank: verl_comm.compression.config)
METHODS=${METHODS:-compute_only,none,torch_fp16,ours_bf16,ours_int8,ours_lowrank_int8_r8,ours_auto_r8}
ARGS=(--cpu --transport shaped_veth --link-mbit "$MBIT" --run-id "$RUN_ID" --world "$WORLD" --layers 6 --dim 2048
      --batch 64 --loss-scale 1024 --warmup 4 --rounds "${ROUNDS:-9}" --pg-timeout-s "${PG_TIMEOUT_S:-120}" --out "$OUT")
if [ "${TRACE:-0}" = 1 ]; then  # per-bucket timeline instead (benchmarks/slow_link_trace.py)
  for r in $(seq 0 $((WORLD - 1))); do
    ns=$NS0 dev=$V0; [ "$r" -ge $((WORLD / 2)) ] && ns=$NS1 dev=$V1
    ip netns exec "$ns" env RANK=$r GROUP_RANK=$((r / (WORLD / 2))) WORLD_SIZE=$WORLD MASTER_ADDR=$ADDR0 MASTER_PORT=29561 \
      GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" \
      timeout "${ATTEMPT_S:-900}" $PY benchmarks/slow_link_trace.py --methods "${METHODS}" ${TRACE_ARGS:-} &
  done
  wait
  exit 0
fi
attempt() {  # $1 = methods; returns the worst rank exit code
  local pids=() rc=0 half=$((WORLD / 2))
  for r in $(seq 0 $((WORLD - 1))); do
    ns=$NS0 dev=$V0; [ "$r" -ge $half ] && ns=$NS1 dev=$V1
    ip netns exec "$ns" env RANK=$r LOCAL_RANK=$((r % half)) GROUP_RANK=$((r / half)) LOCAL_WORLD_SIZE=$half WORLD_SIZE=$WORLD MASTER_ADDR=$ADDR0 \
      MASTER_PORT=29561 GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 PYTHONPATH="$PWD:${PYTHONPATH:-}" \
      timeout "${ATTEMPT_S:-900}" $PY benchmarks/comm_hooks.py "${ARGS[@]}" --methods "$1" \
      2> >(tee "$LOGDIR/rank$r.err" >&2) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  return $rc
}
LOGDIR=$(mktemp -d)
start=$(date +%s)
if attempt "$METHODS"; then exit 0; fi
case "$METHODS" in *torch_powersgd*) ;; *) exit 1 ;; esac
took=$(( $(date +%s) - start ))
why=$(cat "$LOGDIR"/rank*.err | grep -m1 -E "enforce fail|Timed out|timed out|Error" | cut -c1-300)
echo "first attempt failed after ${took} s ($why); recording torch_powersgd as failed, rerunning without it" >&2
$PY - "$OUT" "$RUN_ID" "$took" "$MBIT" "$why" "$WORLD" <<'PYEOF'
import json, sys
out, run_id, took, mbit, why = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
rec = {"benchmark": "comm_hooks", "run_id": run_id, "transport": "shaped_veth", "world_size": int(sys.argv[6]),
       "link_mbit": mbit, "hook": "torch_powersgd_r8", "metric": "step_time", "rank": "max",
       "unit": "ms", "value": None, "numerics_ok": False,
       "status": f"failed on gloo after {took} s ({why.strip()}); run repeated without it"}
with open(f"{out}/comm_hooks.jsonl", "a") as f:
    f.write(json.dumps(rec) + "\n")
PYEOF
attempt "$(echo "$METHODS" | tr ',' '\n' | grep -v torch_powersgd | paste -sd,)"
