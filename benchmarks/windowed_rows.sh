#!/usr/bin/env bash
# The windowed families' rows of docs/time.md and docs/memory.md measured again on one GPU, each a full step
# benchmark (per-step times, phases and the kernel profile of step 3) into docs/results, where
# benchmarks/time_vs_measured.py and benchmarks/plan_vs_measured.py pick them up:
#
#     bash benchmarks/windowed_rows.sh [OUT_DIR]        # default: docs/results
#
# The flags are those of docs/results/windowed_current.json, the summary these runs replace, without its rows' pins
# (`--keep_projections 0`, `--tiled_mlp on` at 131k: the defaults of its date): these measure the current defaults,
# and each result records the levers it resolved, which the two scripts plan.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results}
common=(--lr 1e-5 --ds_config ds_configs/zero3_bf16_states.json --offload_activations --save_final false
        --output_dir /tmp/windowed_rows)
run() {  # label model_config seq_len steps
    python benchmarks/step_bench.py --json "$out/$1.json" --label "$1" --profile_step 3 -- \
        --model_config "$2" "${common[@]}" --seq_len "$3" --steps "$4"
}
run gemma3_4b_1gpu_64k_current gemma3-4b 65536 4
run gemma3_4b_1gpu_131k_current gemma3-4b 131072 3
run olmo3_7b_1gpu_64k_current olmo3-7b 65536 4
