#!/usr/bin/env bash
# Prepared in session 5 (2026-12-01), which had no device time left; ran in session 6 (2026-12-01) as its call 2 on one
# nvidia-h200: call 1 parks FA4's first half (benchmarks/rounds/2026-12-01_x2_callC1.sh, carry [".fa4a"]); this is
# call 2, right after it (carry [".fa4b", ".whl"]): the GPU tests (the fused kernels on CUDA, bf16 tightly), each
# fused kernel against the ops it replaces, then 64k with the fused kernels (the default) and TRL at 64k, in one
# queue. Call 3 (2026-12-01b_h200_call3.sh) runs 131k and 64k without the fused kernels.
set -u
bash benchmarks/fa4_install.sh
export SKIP_INSTALL=1 R=/tmp/r2 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD; mkdir -p $R
# every 20 s a fresh tarball replaces the last (atomic mv): a call killed at its limit still returns what ran
(while sleep 20; do tar czf /tmp/r2.tgz -C $R . && mv /tmp/r2.tgz $OUT/r2.tgz; done) & W=$!
timeout 60 python3 benchmarks/kernel_bench.py --seq 65536 131072 --json $R/s5_kernels.json > $R/kernels.log 2>&1
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
bash benchmarks/gpu_round.sh "TEST_TIMEOUT=200" tests "BENCH_TIMEOUT=150" "BENCH_ARGS='--profile_step 3'" "bench:s5_ours64:65536:4:$S" \
  "BENCH_ARGS=" "BENCH_TIMEOUT=130" "peer:trl64:65536:3" > /dev/null 2>&1
cat $R/kernels.log $R/summary.log
kill $W; tar czf /tmp/r2f.tgz -C $R . && mv /tmp/r2f.tgz $OUT/r2.tgz && cp $R/summary.log $R/kernels.log $OUT/
