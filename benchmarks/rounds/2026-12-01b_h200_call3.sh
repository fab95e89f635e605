#!/usr/bin/env bash
# Prepared in session 5, ran as session 6's call 3 (2026-12-01) on the same warm nvidia-h200 (carry [".whl"]; FA4 is installed in
# /tmp/site since call 2): 131k tokens with the fused kernels, TRL at 131k, and 64k with `--fused_kernels off` (the
# same build without our kernels), in one queue.
set -u
export SKIP_INSTALL=1 R=/tmp/r3 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD; mkdir -p $R
(while sleep 20; do tar czf /tmp/r3.tgz -C $R . && mv /tmp/r3.tgz $OUT/r3.tgz; done) & W=$!
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=220" "bench:s5_ours131:131072:3:$S" "BENCH_TIMEOUT=240" \
  "peer:trl131:131072:2" "BENCH_TIMEOUT=120" "bench:s5_off64:65536:4:$S --fused_kernels off" > /dev/null 2>&1
cat $R/summary.log
kill $W; tar czf /tmp/r3f.tgz -C $R . && mv /tmp/r3f.tgz $OUT/r3.tgz && cp $R/summary.log $OUT/
