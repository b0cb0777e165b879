#!/usr/bin/env bash
# GPU batch 1 (2 x H200): all-reduce sweeps (issue 6), doctor + autotune (issue 5).
# Usage on the device machine: VERL_COMMIT=<hash> bash benchmarks/gpu/batch1.sh OUTDIR
OUT=${1:?OUTDIR}
source benchmarks/gpu/setup.sh || exit 1
mkdir -p "$OUT/ar" "$OUT/doc"
timeout 330 bash benchmarks/gpu_allreduce.sh "$OUT/ar"; echo "allreduce rc=$?"
nvidia-smi topo -m > "$OUT/doc/topo_2xh200.txt"
timeout 70 python3 -m verl_comm.cli doctor --nproc 2 --backend nccl --json > "$OUT/doc/doctor_2xh200_nccl.json"; echo "doctor json rc=$?"
timeout 70 python3 -m verl_comm.cli doctor --nproc 2 --backend nccl > "$OUT/doc/doctor_2xh200_nccl.txt"; echo "doctor rc=$?"
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 70 python3 -m verl_comm.cli doctor --nproc 2 --backend nccl > "$OUT/doc/doctor_2xh200_socket.txt"; echo "doctor socket rc=$?"
timeout 110 python3 -m verl_comm.cli nccl autotune --sizes 64K,1M,64M --nproc 2 --backend nccl -n 10 -w 3 --timeout 100 --out "$OUT/doc" > "$OUT/doc/autotune.txt" 2>&1; echo "autotune rc=$?"
tail -5 "$OUT/doc/doctor_2xh200_nccl.txt"; tail -8 "$OUT/doc/autotune.txt"
(cd "$OUT" && tar czf batch1.tgz ar doc && rm -rf ar doc)
