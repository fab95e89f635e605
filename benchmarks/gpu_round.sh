#!/usr/bin/env bash
# One device call: install the carried wheels, then run the named parts, each logging under $OUT.
#   bash benchmarks/gpu_round.sh env tests "bench:LABEL:SEQ:STEPS:FLAGS" "peer:LABEL:SEQ:STEPS" ...
#   (also "attn:LABEL:SEQS" for benchmarks/attn_bench.py, "loss:LABEL" for benchmarks/loss_bench.py)
# Parts run in the order given; the table of BENCH/RESULT lines is printed last. VAR=VALUE parts set, for the parts
# after them: LAUNCH (e.g. "torchrun --nproc_per_node 2"), BENCH_TIMEOUT, LAYERS (peer depth), TESTS (the test files of
# "tests", tests/test_gpu.py by default), TEST_TIMEOUT and BENCH_ARGS
# (step_bench's own flags, e.g. "--profile_step 3" for the per-kernel breakdown).
# Environment: GPU=N pins every part to that GPU (two rounds on two GPUs can run at once, see benchmarks/rounds/);
# R=DIR writes the logs there instead of $OUT (a device call returns at most 8 files: tar R at the end);
# SUMMARY=NAME names the summary log; SKIP_INSTALL=1 when the wheels are already in /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/out}; R=${R:-$OUT}; mkdir -p "$R"
[ -n "${GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$GPU
if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
M4B="--model_config qwen3-4b --ds_config ds_configs/zero3.json --lr 1e-5"
bench() {  # bench LABEL SEQ STEPS [extra flags...]
  local label=$1 seq=$2 steps=$3; shift 3
  timeout ${BENCH_TIMEOUT:-400} ${LAUNCH:-python3} benchmarks/step_bench.py --json "$R/$label.json" --label "$label" ${BENCH_ARGS:-} -- \
    $M4B --seq_len "$seq" --steps "$steps" --output_dir /tmp/run_$label "$@" > "$R/$label.log" 2>&1
  echo "[$label] rc=$? $(grep -h BENCH "$R/$label.log")"
}
peer() {  # peer LABEL SEQ STEPS
  timeout ${BENCH_TIMEOUT:-400} env CUDA_VISIBLE_DEVICES=${GPU:-0} LAYERS=${LAYERS:-36} python3 benchmarks/peers/trl_sft_1gpu.py "$2" "$3" \
    > "$R/$1.log" 2>&1
  echo "[$1] rc=$? $(grep -h RESULT "$R/$1.log")"
}
for part in "$@"; do
  case $part in
    env) nvidia-smi --query-gpu=name,memory.total --format=csv; python3 -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)" ;;
    attn:*) IFS=: read -r _ label seqs <<< "$part"
      timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/attn_bench.py --json "$R/$label.json" --seq ${seqs//,/ } \
        > "$R/$label.log" 2>&1; echo "[$label] rc=$?"; grep -v Warning "$R/$label.log" | tail -n 12 ;;
    loss:*) IFS=: read -r _ label <<< "$part"
      timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/loss_bench.py --json "$R/$label.json" > "$R/$label.log" 2>&1
      echo "[$label] rc=$?"; tail -n 12 "$R/$label.log" ;;
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs ${TESTS:-tests/test_gpu.py} > "$R/gpu_tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu_tests.log" ;;
    *=*) eval "$part" ;;  # NAME=VALUE sets a variable for the parts after it
    bench:*) IFS=: read -r _ label seq steps flags <<< "$part"; bench "$label" "$seq" "$steps" $flags ;;
    peer:*) IFS=: read -r _ label seq steps <<< "$part"; peer "$label" "$seq" "$steps" ;;
    peersp:*) IFS=: read -r _ label seq steps n <<< "$part"
      timeout ${BENCH_TIMEOUT:-400} env LAYERS=${LAYERS:-36} torchrun --nproc_per_node "$n" benchmarks/peers/trl_sft_sp.py \
        "$seq" "$steps" > "$R/$label.log" 2>&1; echo "[$label] rc=$? $(grep -h RESULT "$R/$label.log")" ;;
    *) echo "unknown part $part" ;;
  esac
done 2>&1 | tee "$R/${SUMMARY:-summary}.log"
