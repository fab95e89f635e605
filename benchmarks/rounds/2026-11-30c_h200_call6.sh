#!/usr/bin/env bash
# Session 3 (2026-11-30), call 6 on nvidia-h200: the kept-offload GPU test after the fp32 GQA fix, and the memory
# profile (--profile_memory 1) of a full-depth Qwen3-4B step at 64k tokens with the default levers.
set -u
export R=/tmp/r6; mkdir -p $R
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD SKIP_INSTALL=1
timeout 60 python3 -m pytest -q -rs tests/test_gpu.py -k "offload_and_kept" > $R/gpu_tests.log 2>&1; tail -n 2 $R/gpu_tests.log
bash benchmarks/gpu_round.sh "BENCH_TIMEOUT=110" \
  "bench:pm64:65536:2:--profile_memory 1 --ds_config ds_configs/zero3_bf16_states.json --offload_activations"
cp /tmp/run_pm64/memory/memory.png $OUT/memory_64k.png; cp /tmp/run_pm64/memory/memory.json $R/memory_64k.json
gzip -c /tmp/run_pm64/memory/snapshot.pickle > $OUT/snapshot_64k.pickle.gz; tar czf $OUT/r6.tgz -C $R .; ls -la $OUT
