#!/usr/bin/env bash
# Session 3 (2026-11-30), call 2 on nvidia-h200-x2: the two-GPU issue's runs (GPU tests over NCCL, 131k SP=2
# ours and TRL's ALST side by side, 1M tokens x 2 layers with the memory profile of its first step). Call 1 ran
# this same script before the torch 2.11 fix of the kept-output offload, and its runs of ours failed on it.
# Carries .whl and .fa4a (FA4's first half, for call 3).
set -u
mkdir -p /tmp/fa4 && cp .fa4a/* /tmp/fa4/ 2>/dev/null
export R=/tmp/r2; mkdir -p $R
(sleep 555; tar czf $OUT/r2.tgz -C $R .) &
S="--ds_config ds_configs/zero3_bf16_states.json --offload_activations"
bash benchmarks/gpu_round.sh env tests "LAUNCH='torchrun --nproc_per_node 2'" \
  "bench:sp2_131k:131072:3:--sp_size 2 $S" \
  "peersp:trl131_sp2:131072:2:2" \
  "BENCH_TIMEOUT=200" "bench:sp2_1M_2l:1048576:2:--sp_size 2 --num_layers 2 --profile_memory 1 $S"
cp /tmp/run_sp2_1M_2l/memory/memory.png $OUT/memory_1M_2l.png 2>/dev/null
cp /tmp/run_sp2_1M_2l/memory/memory.json $R/memory_1M_2l.json 2>/dev/null
gzip -c /tmp/run_sp2_1M_2l/memory/snapshot.pickle > $OUT/snapshot_1M_2l.pickle.gz 2>/dev/null
tar czf $OUT/r2.tgz -C $R . ; ls -la $OUT
