#!/usr/bin/env bash
# Session 4 (2026-12-01), call A on nvidia-h200-x2. Carries .whl and .fa4a (FA4's first half, for call B, which
# must follow within 30 s). GPU 0: the GPU tests, then the 64k lever rows (one lever added per row). GPU 1: the
# fused loss against its chunk size, TRL at 64k beside our recommended config at 64k (profiled step, shared master
# weights) and at 131k. Everything logs under $R, tarred into $OUT (a call returns at most 8 files).
set -u
mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ 2>/dev/null
export R=/tmp/rA; mkdir -p $R
(sleep 570; tar czf $OUT/rA.tgz -C $R .) &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export SKIP_INSTALL=1
S="--ds_config ds_configs/zero3_bf16_states.json"
GPU=0 SUMMARY=gpu0 bash benchmarks/gpu_round.sh env tests "BENCH_TIMEOUT=110" \
  "bench:lev64_fused:65536:2:$S --attn_recompute always --tiled_mlp off" \
  "bench:lev64_offload:65536:2:$S --attn_recompute always --tiled_mlp off --offload_activations" \
  "bench:lev64_tiled:65536:2:$S --attn_recompute always --tiled_mlp on --offload_activations" \
  "bench:lev64_all:65536:2:$S --attn_recompute never --tiled_mlp on --offload_activations" \
  "BENCH_TIMEOUT=80" "bench:lev64_none:65536:2:$S --loss plain --attn_recompute always --tiled_mlp off" \
  > /dev/null 2>&1 &
GPU=1 SUMMARY=gpu1 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=90" "loss:loss_chunks" "BENCH_TIMEOUT=150" \
  "peer:trl64:65536:3" "BENCH_ARGS='--profile_step 3 --trace /tmp/trace64.json'" \
  "bench:s4_ours64:65536:4:$S --offload_activations" "BENCH_ARGS=" "BENCH_TIMEOUT=230" \
  "bench:s4_ours131:131072:3:$S --offload_activations" > /dev/null 2>&1 &
wait %2 %3
cat $R/gpu0.log $R/gpu1.log
gzip -c /tmp/trace64.json > $OUT/trace64.json.gz 2>/dev/null  # apart: if too large to return, only it is left out
tar czf $OUT/rA.tgz -C $R . && cp $R/gpu0.log $R/gpu1.log $OUT/; ls -la $OUT
