#!/usr/bin/env bash
# Session 3 (2026-11-30), call 3 on nvidia-h200-x2, right after call 2 (FA4's second half joins the first): two
# queues of one-GPU runs at once, ours on GPU 0 and the TRL peer on GPU 1 at the same lengths, side by side.
set -u
cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm /tmp/fa4/part_*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl .whl/*.whl
export SKIP_INSTALL=1 R=/tmp/r3
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations --attn_kernel sdpa"  # FA4 is installed here: measured apart
GPU=0 SUMMARY=gpu0 bash benchmarks/gpu_round.sh "attn:attn:65536,131072" \
  "BENCH_ARGS='--profile_step 3'" "bench:ours64:65536:4:$S" "BENCH_ARGS=" \
  "bench:ours131:131072:3:--profile_memory 1 $S" > /dev/null 2>&1 &
GPU=1 SUMMARY=gpu1 bash benchmarks/gpu_round.sh "peer:trl64:65536:3" "peer:trl131:131072:2" \
  "bench:ours64_cpuadam:65536:3:--ds_config ds_configs/zero3_offload.json --offload_activations --attn_kernel sdpa" > /dev/null 2>&1 &
(sleep 540; tar czf $OUT/r3.tgz -C $R .) &
wait %1 %2
cat $R/gpu0.log $R/gpu1.log
tar czf $OUT/r3.tgz -C $R . && cp $R/gpu0.log $R/gpu1.log $OUT/
cp /tmp/run_ours131/memory/memory.png $OUT/memory_131k.png; cp /tmp/run_ours131/memory/memory.json $OUT/memory_131k.json
gzip -c /tmp/run_ours131/memory/snapshot.pickle > $OUT/snapshot_131k.pickle.gz; ls -la $OUT
