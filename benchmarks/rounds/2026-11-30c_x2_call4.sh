#!/usr/bin/env bash
# Session 3 (2026-11-30), call 4 on nvidia-h200-x2: the GPU tests touched by the torch 2.11 fixes (kept outputs
# offloaded, --profile_memory), then 1M tokens x 2 layers at SP=2 (memory profile of the warm-up step if the test
# passed). Carries .whl and .fa4a (FA4's first half, for call 5, which must follow within 30 s).
set -u
mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ 2>/dev/null
export R=/tmp/r4; mkdir -p $R
(sleep 400; tar czf $OUT/r4.tgz -C $R .) &
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD SKIP_INSTALL=1
timeout 150 python3 -m pytest -q -rs tests/test_gpu.py -k "profile_memory or offload_and_kept" > $R/gpu_tests.log 2>&1 \
  && touch /tmp/pm_ok; tail -n 3 $R/gpu_tests.log
PM=$([ -f /tmp/pm_ok ] && echo "--profile_memory 1")
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
bash benchmarks/gpu_round.sh "LAUNCH='torchrun --nproc_per_node 2'" "BENCH_TIMEOUT=220" \
  "bench:sp2_1M_2l:1048576:2:--sp_size 2 --num_layers 2 $PM $S"
cp /tmp/run_sp2_1M_2l/memory/memory.png $OUT/memory_1M_2l.png 2>/dev/null
cp /tmp/run_sp2_1M_2l/memory/memory.json $R/memory_1M_2l.json 2>/dev/null
gzip -c /tmp/run_sp2_1M_2l/memory/snapshot.pickle > $OUT/snapshot_1M_2l.pickle.gz 2>/dev/null
tar czf $OUT/r4.tgz -C $R . ; ls -la $OUT
