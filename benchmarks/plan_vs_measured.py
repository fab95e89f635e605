"""Prints the planner's estimate next to every measured peak in docs/results/*.json (the table in docs/memory.md)."""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_train.models import load_model_config  # noqa: E402
from ulysses_train.plan import GiB, Levers, estimate, geometry  # noqa: E402

print("| run | tokens | sp | layers | measured peak GiB | planner GiB | error |\n|---|---|---|---|---|---|---|")
for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "results", "*.json"))):
    r = json.load(open(path))
    if "argv" not in r:  # not a step_bench result
        continue
    argv, t = r["argv"], r["seq_len"] // r["sp"]
    if "plain" in argv:  # the planner models the fused loss only
        continue
    config = load_model_config(None, "qwen3-4b", r["layers"])
    levers = Levers(keep_attention=r["keep_attention"], offload_activations="--offload_activations" in argv,
                    tiled_mlp=r.get("tiled_mlp", "on" in argv or ("off" not in argv and
                                                              t * config.intermediate_size * 2 > 2 * GiB)),
                    bf16_states="ds_configs/zero3_bf16_states.json" in argv,
                    offload_optimizer="ds_configs/zero3_offload.json" in argv,
                    # k and v were expanded before 2026-11-30 (session 3); every session-4 run (s4_*) is bf16 with
                    # GQA-native SDPA or FA4 and step_bench records it since
                    gqa_native=r.get("gqa_native", os.path.basename(path).startswith("s4_")),
                    share_master=r.get("master_shared", False),  # DeepSpeed's separate master copy before then
                    offload_kept=r.get("kept_offloaded", False),  # results before the change kept them on the GPU
                    lean_norm=r.get("lean_norm", False),  # and had transformers' norms
                    fused_kernels=r.get("fused_kernels", False))  # recorded since session 6
    est = estimate(geometry(config), r["seq_len"], r["world"], r["sp"], levers)["gpu_total"] / GiB
    print(f"| {os.path.basename(path)[:-5]} | {r['seq_len']:,} | {r['sp']} | {r['layers']} | {r['peak_gpu_gib']:.1f} | {est:.1f} | "
          f"{100 * (est / r['peak_gpu_gib'] - 1):+.1f}% |")
