# One H200 batch for issue 33's packing and GPU job (run from the repository root on the GPU
# machine, after `source benchmarks/gpu/setup.sh`, with the packaged GGUF installed; see
# ../README "Main job on one GPU"):
#   bash benchmarks/gpu/gpu_job.sh OUT [SEEDS...]
# GPU tests of packing (varlen vs padded) and the GPU config's preflight, the packing
# benchmark (records into OUT), then configs/gpu.yaml on the given seeds (gpu_job records).
set -uo pipefail
out=${1:?output folder}; shift
seeds=("${@:-0 1 2}")
mkdir -p "$out"
python3 -m pytest -q -p no:cacheprovider -rs tests/verl_ppo/test_varlen.py \
  tests/verl_ppo/test_packing.py tests/verl_ppo/test_gpu_config.py 2>&1 | tail -15
python3 benchmarks/packing.py --out "$out" 2>&1 | tail -5
python3 benchmarks/default_job.py --job gpu_job --seeds ${seeds[@]} --out "$out" 2>&1 | tail -12
