#!/usr/bin/env bash
# The main job across two "hosts" joined by a slow link, on one Linux machine: two network
# namespaces joined by a veth pair whose both ends are shaped with a token-bucket filter (tc
# tbf) to RATE Mbit/s (as benchmarks/slow_link_hooks.sh), and in each namespace the README's
# multi-node torchrun line with one rank per host:
#   torchrun --nnodes=2 --nproc_per_node=1 --node_rank=i --rdzv_backend=c10d
#            --rdzv_endpoint=HOST0:29500 -m verl_ppo.train --config CONFIG ...
# once per gradient-compression method (none, int8, int8 low rank r64), one after another.
# After each method, benchmarks/two_host_job.py turns the job's run folder into records
# (median step time of steps 2..N, final eval) appended to OUTDIR/two_host_job.jsonl, and
# regenerates OUTDIR/two_host_job.md. The loopback device is never touched.
#
# Usage (root, iproute2):
#   bash benchmarks/two_host_job.sh OUTDIR [RATE_MBIT]          # 200; configs/default.yaml
#   bash benchmarks/two_host_job.sh --smoke OUTDIR [RATE_MBIT]  # configs/tiny.yaml, 2 steps
# Environment: METHODS (default none,int8,int8_r64; int8_rR = int8 low rank at rank R),
# CONFIG, SEED (0), RUN_ID, JOB_S (time limit of one job, s), PYTHON.
# Exit codes: 0 records written; 1 a job or the report failed; 3 namespaces cannot be made
# (not root, no ip/tc), with the reason on stderr.
set -u -o pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT=${1:?usage: bash benchmarks/two_host_job.sh [--smoke] OUTDIR [RATE_MBIT]}
MBIT=${2:-200}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
[ "$(id -u)" = 0 ] || { echo "needs root to make network namespaces" >&2; exit 3; }
if [ $SMOKE = 1 ]; then
  CONFIG=${CONFIG:-configs/tiny.yaml} METHODS=${METHODS:-none,int8}
  EXTRA=(train.num_steps=2 train.eval_interval=2)
else
  CONFIG=${CONFIG:-configs/default.yaml} METHODS=${METHODS:-none,int8,int8_r64}
  EXTRA=()
fi
SEED=${SEED:-0}
# DeepSpeed compiles its CPU shared-memory op into TORCH_EXTENSIONS_DIR at the first
# init_distributed; a folder of this interpreter's own keeps other environments on the
# machine (which rebuild the same op for their torch) from holding its lock.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions/$($PY -c \
  "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:12])")}
WORK=$(mktemp -d)
source benchmarks/_netns.sh
netns_up vth 10.78.0 "$MBIT" || exit 3
RUN_ID=${RUN_ID:-$($PY -c "import uuid; print(uuid.uuid4().hex[:12])")}
echo "two_host_job: run_id $RUN_ID, ${MBIT} Mbit/s, $CONFIG, methods $METHODS, logs in $WORK" >&2

run_method() {  # $1 = method name; runs the job on both "hosts", then collects its records
  local m=$1 comp rank pids=() rc=0 load0 t0
  case "$m" in
    none) comp=none rank=null ;;
    int8) comp=int8 rank=null ;;
    int8_r*) comp=int8 rank=${m#int8_r} ;;
    *) echo "unknown method $m (none, int8, int8_rR)" >&2; return 1 ;;
  esac
  local dir=$WORK/$m
  mkdir -p "$dir"
  load0=$(cut -d' ' -f1 /proc/loadavg) t0=$(date +%s)
  for r in 0 1; do
    local ns=$NS0 dev=$V0 addr=$ADDR0 host=1
    [ $r = 1 ] && ns=$NS1 dev=$V1 addr=$ADDR1 host=0
    # HOME and the caches are shared: both "hosts" read the same converted model. is_host:
    # the namespace's address is not what the machine's hostname resolves to, so torchrun
    # cannot tell by itself which agent hosts the rendezvous store.
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$dev" OMP_NUM_THREADS=1 \
      PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout "${JOB_S:-3600}" \
      $PY -m torch.distributed.run --nnodes=2 --nproc_per_node=1 --node_rank=$r \
      --rdzv_backend=c10d --rdzv_endpoint=$ADDR0:29500 --rdzv_conf=is_host=$host --local_addr=$addr \
      -m verl_ppo.train --config "$CONFIG" seed="$SEED" run_dir="$dir/run" \
      train.resume=never gradient_compression=$comp compression_rank=$rank "${EXTRA[@]}" \
      >"$dir/host$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  if [ $rc != 0 ]; then
    echo "two_host_job: $m failed (exit $rc); last lines of host 0 and 1:" >&2
    tail -n 30 "$dir/host0.log" "$dir/host1.log" >&2
    return 1
  fi
  $PY benchmarks/two_host_job.py collect --run-dir "$dir/run" --out "$OUT" --run-id "$RUN_ID" \
    --link-mbit "$MBIT" --method "$m" --gradient-compression $comp --compression-rank $rank \
    --config "$CONFIG" --seed "$SEED" --load-1m-start "$load0" --wall-s $(( $(date +%s) - t0 )) \
    --log "$dir/host0.log" $([ $SMOKE = 1 ] && echo --smoke)
}

status=0
for m in ${METHODS//,/ }; do run_method "$m" || status=1; done
$PY benchmarks/two_host_job.py report --out "$OUT" $([ $SMOKE = 1 ] && echo --smoke) || status=1
exit $status
