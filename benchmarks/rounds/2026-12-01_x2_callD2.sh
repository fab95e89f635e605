#!/usr/bin/env bash
# Session 4 (2026-12-01), call D2 on nvidia-h200-x2, right after D1 (= callC1.sh: parks .fa4a). Carries .fa4b and
# .whl. With FlashAttention-4 installed, `--attn_kernel auto` (the default) now picks it: our recommended config at
# 64k (profiled step 3) and 131k on GPU 0, TRL 1.16 at the same lengths on GPU 1, side by side.
set -u
cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm /tmp/fa4/part_*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl .whl/*.whl
export SKIP_INSTALL=1 R=/tmp/rD; mkdir -p $R
(sleep 420; tar czf $OUT/rD.tgz -C $R .) &
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
GPU=0 SUMMARY=gpu0 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=150" "BENCH_ARGS='--profile_step 3'" \
  "bench:auto_ours64:65536:4:$S" "BENCH_ARGS=" "BENCH_TIMEOUT=230" "bench:auto_ours131:131072:2:$S" > /dev/null 2>&1 &
GPU=1 SUMMARY=gpu1 bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=150" "peer:trl64:65536:3" "BENCH_TIMEOUT=230" \
  "peer:trl131:131072:2" > /dev/null 2>&1 &
wait %2 %3
cat $R/gpu0.log $R/gpu1.log
tar czf $OUT/rD.tgz -C $R . && cp $R/gpu0.log $R/gpu1.log $OUT/; ls -la $OUT
