#!/usr/bin/env bash
# Session 4 (2026-12-01), call B on nvidia-h200-x2, right after call A (the machine keeps call A's /tmp/fa4 and
# /tmp/site). Carries .fa4b (FA4's second half) and .whl. GPU 0: FlashAttention-4 against cuDNN, then two 131k
# lever rows. GPU 1: the third 131k lever row, then the longest sequence the planner gives one H200 (704,512 tokens
# with 125 GiB of host memory) at 2 of Qwen3-4B's 36 layers, with the planner's levers; the two 32k lever rows
# missing from session 3, with a separate master copy as the other three 32k rows had.
set -u
mkdir -p /tmp/fa4 && cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm /tmp/fa4/part_*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl .whl/*.whl
export SKIP_INSTALL=1 R=/tmp/rB; mkdir -p $R
(sleep 575; tar czf $OUT/rB.tgz -C $R .) &
python3 -c "import flash_attn.cute; print('flash_attn.cute imports')" 2>&1 | tail -n 2
S="--ds_config ds_configs/zero3_bf16_states.json"
GPU=0 SUMMARY=gpu0 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=150" "attn:attn_fa4:65536,131072" "BENCH_TIMEOUT=200" \
  "bench:lev131_fused:131072:2:$S --attn_recompute always --tiled_mlp off" \
  "bench:lev131_offload:131072:2:$S --attn_recompute always --tiled_mlp off --offload_activations" \
  > /dev/null 2>&1 &
GPU=1 SUMMARY=gpu1 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=200" \
  "bench:lev131_tiled:131072:2:$S --attn_recompute always --tiled_mlp on --offload_activations" "BENCH_TIMEOUT=300" \
  "bench:longest_704k_2l:704512:2:$S --num_layers 2 --attn_recompute always --tiled_mlp on --offload_activations" \
  "BENCH_TIMEOUT=70" "bench:lev32_offload:32768:2:$S --share_master_weights false --attn_recompute always --tiled_mlp off --offload_activations" \
  "bench:lev32_tiled:32768:2:$S --share_master_weights false --attn_recompute always --tiled_mlp on --offload_activations" \
  > /dev/null 2>&1 &
wait %2 %3
cat $R/gpu0.log $R/gpu1.log
tar czf $OUT/rB.tgz -C $R . && cp $R/gpu0.log $R/gpu1.log $OUT/; ls -la $OUT
