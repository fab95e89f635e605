#!/usr/bin/env bash
# Session 3 (2026-11-30), call 5 on nvidia-h200-x2, right after call 4: FA4 joined from its two halves and measured
# against cuDNN; 131k tokens on one GPU (ours on GPU 0 beside TRL on GPU 1, side by side); 64k again on GPU 1.
set -u
cp .fa4b/* /tmp/fa4/ && cat /tmp/fa4/part_* > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
  && rm /tmp/fa4/part_*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/fa4/*.whl
# the cutlass DSL finds its packages through a .pth file, which --target installs do not run
export SKIP_INSTALL=1 R=/tmp/r5 PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
mkdir -p $R; (sleep 520; tar czf $OUT/r5.tgz -C $R .) &
PM=$([ -f /tmp/pm_ok ] && echo "--profile_memory 1")
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
GPU=0 SUMMARY=gpu0 bash benchmarks/gpu_round.sh "attn:attn:65536,131072" \
  "bench:ours131:131072:3:$PM $S" > /dev/null 2>&1 &
GPU=1 SUMMARY=gpu1 bash benchmarks/gpu_round.sh "peer:trl131:131072:2" "bench:ours64:65536:3:$S" > /dev/null 2>&1 &
wait %2 %3
cat $R/gpu0.log $R/gpu1.log
tar czf $OUT/r5.tgz -C $R . && cp $R/gpu0.log $R/gpu1.log $OUT/
cp /tmp/run_ours131/memory/memory.png $OUT/memory_131k.png; cp /tmp/run_ours131/memory/memory.json $OUT/memory_131k.json
gzip -c /tmp/run_ours131/memory/snapshot.pickle > $OUT/snapshot_131k.pickle.gz; ls -la $OUT
