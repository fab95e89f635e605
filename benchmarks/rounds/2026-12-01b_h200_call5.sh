#!/usr/bin/env bash
# Session 6 (2026-12-01), call 5 on one nvidia-h200, right after call 4 parked FA4's first half
# (benchmarks/rounds/2026-12-01_x2_callC1.sh, carry [".fa4a"]); this call carries [".fa4b", ".whl"]. It runs the GPU
# tests again after call 2's three failures (the pinned pool's registrations outliving its memory; PYTHONPATH dropped
# by the trainer-run tests), now with tests/test_fused_kernels.py on CUDA too, then 131k profiled (the per-kernel
# breakdown at 131k, which call 3 did not take).
set -u
bash benchmarks/fa4_install.sh
export SKIP_INSTALL=1 R=/tmp/r5 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD; mkdir -p $R
(while sleep 20; do tar czf /tmp/r5.tgz -C $R . && mv /tmp/r5.tgz $OUT/r5.tgz; done) & W=$!
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
bash benchmarks/gpu_round.sh "TESTS='tests/test_gpu.py tests/test_fused_kernels.py'" "TEST_TIMEOUT=240" tests \
  "BENCH_TIMEOUT=220" "BENCH_ARGS='--profile_step 3'" "bench:s6_ours131p:131072:3:$S" > /dev/null 2>&1
grep -E "^(FAILED|ERROR)" $R/gpu_tests.log; cat $R/summary.log
kill $W; tar czf /tmp/r5f.tgz -C $R . && mv /tmp/r5f.tgz $OUT/r5.tgz && cp $R/summary.log $OUT/
