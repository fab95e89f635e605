#!/usr/bin/env bash
# Session 6 (2026-12-01), call 7 on one nvidia-h200, right after call 6 parked FA4's first half
# (benchmarks/rounds/2026-12-01_x2_callC1.sh, carry [".fa4a"]); this call carries [".fa4b", ".whl"]. 131k tokens with
# the MLP untiled (`--tiled_mlp off`), against call 3's s5_ours131 (auto tiles it there): what the tiling costs in
# time and saves in memory now that the fused SwiGLU keeps one tensor less.
set -u
bash benchmarks/fa4_install.sh
export SKIP_INSTALL=1 R=/tmp/r7 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD; mkdir -p $R
(while sleep 20; do tar czf /tmp/r7.tgz -C $R . && mv /tmp/r7.tgz $OUT/r7.tgz; done) & W=$!
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=230" "bench:s6_untiled131:131072:3:$S --tiled_mlp off" > /dev/null 2>&1
cat $R/summary.log
kill $W; tar czf /tmp/r7f.tgz -C $R . && mv /tmp/r7f.tgz $OUT/r7.tgz && cp $R/summary.log $OUT/
