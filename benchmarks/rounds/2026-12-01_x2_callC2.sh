#!/usr/bin/env bash
# Session 4 (2026-12-01), call C2 on nvidia-h200-x2, right after C1. Carries .fa4b and .whl.
# Phase 1, one GPU each: FlashAttention-4 through our registered op (ulysses_train/fa4_op.py, outputs kept and
# offloaded) in the GPU tests and in our recommended config at 64k (GPU 0) and 131k (GPU 1).
# Phase 2, both GPUs: 1,048,576 tokens at SP=2 with 4 of Qwen3-4B's 36 layers, same flags as session 3's 2-layer
# run (recommended config, kept outputs offloaded), for the per-layer cost and the full-depth projection.
set -u
cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm /tmp/fa4/part_*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl .whl/*.whl
export SKIP_INSTALL=1 R=/tmp/rC PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD; mkdir -p $R
(sleep 585; tar czf $OUT/rC.tgz -C $R .) &
S="--ds_config ds_configs/zero3_bf16_states.json"
(CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -rs tests/test_gpu.py -k "fa4 or kernel_bf16" > $R/gpu_tests_fa4.log 2>&1
 GPU=0 SUMMARY=gpu0 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=130" \
   "bench:fa4_ours64:65536:3:$S --offload_activations --attn_kernel flash_attn_4" > /dev/null 2>&1) &
GPU=1 SUMMARY=gpu1 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=230" \
  "bench:fa4_ours131:131072:2:$S --offload_activations --attn_kernel flash_attn_4" > /dev/null 2>&1 &
wait %2 %3
tail -n 4 $R/gpu_tests_fa4.log; cat $R/gpu0.log $R/gpu1.log
SUMMARY=sp2 bash benchmarks/gpu_round.sh "LAUNCH='torchrun --nproc_per_node 2'" "BENCH_TIMEOUT=330" \
  "bench:sp2_1M_4l:1048576:2:--sp_size 2 --num_layers 4 $S --offload_activations"
tar czf $OUT/rC.tgz -C $R . && cp $R/gpu0.log $R/gpu1.log $R/sp2.log $OUT/; ls -la $OUT
