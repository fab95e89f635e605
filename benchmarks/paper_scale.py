"""The planner's projections at paper scale (the tables of docs/time.md): the fastest plan that fits for Qwen3-8B at
1M tokens on 8 H200, 2M on 16, 4M on 32, and Qwen3-30B-A3B at 1M on 8; then, for one sequence over all GPUs,
where the step becomes communication-bound.

    python benchmarks/paper_scale.py [--constants FILE] [--host_mem_gib 560]

Every plan is `python -m ulysses_train.plan --gpus G --host_mem_gib H --fastest -- --model_config M --seq_len S
--ds_config ds_configs/zero3_bf16_states.json` (8 GPUs a node; H200 constants unless --constants)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ulysses_train.levers.machine_constants import Constants  # noqa: E402
from ulysses_train.levers.policy import GiB  # noqa: E402
from ulysses_train.tools.plan_command import Machine, command, evaluate, fastest  # noqa: E402

CASES = [("qwen3-8b", 1 << 20, 8), ("qwen3-8b", 1 << 21, 16), ("qwen3-8b", 1 << 22, 32),
         ("qwen3-30b-a3b", 1 << 20, 8)]
SWEEP_GPUS = (8, 16, 32)
SWEEP_LENGTHS = [1 << k for k in range(15, 23)]  # 32k .. 4M


def flags(model: str, seq_len: int, sp: int | None = None) -> list[str]:
    return (["--model_config", model, "--seq_len", str(seq_len), "--ds_config", "ds_configs/zero3_bf16_states.json"]
            + (["--sp_size", str(sp)] if sp else []))


def plan_text(plan, layers: int) -> str:
    lv = plan.levers
    parts = [f"sp {plan.sp}", f"{lv.checkpointed(layers)}/{layers} layers checkpointed",
             "attention kept" if lv.keep_attention else "attention recomputed",
             "offload" if lv.offload_activations else "no offload", "tiled MLP" if lv.tiled_mlp else "MLP untiled"]
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--constants", default=None)
    parser.add_argument("--host_mem_gib", type=float, default=560.0, help="per node of 8 GPUs")
    a = parser.parse_args()
    constants = Constants.load(a.constants)
    print("| model | tokens | GPUs (nodes) | step s | attention s | all-to-all s | GPU GiB | host GiB per node | "
          "plan | every layer checkpointed |\n|---|---|---|---|---|---|---|---|---|---|")
    for model, seq_len, gpus in CASES:
        machine = Machine(gpus, 139.7 * GiB, a.host_mem_gib * GiB)
        c = command(flags(model, seq_len), machine)
        plans = fastest(c, machine, constants)
        if not plans:
            print(f"| {model} | {seq_len:,} | {gpus} ({gpus // 8}) | nothing fits | | | | | |")
            continue
        p = plans[0]
        full = evaluate(c, machine, constants, p.sp, dataclasses.replace(p.levers, checkpoint_layers=None), p.micro)
        print(f"| {model} | {seq_len:,} | {gpus} ({max(1, gpus // 8)}) | {p.time['total']:.0f} | "
              f"{p.time['parts']['attention']:.0f} | {p.time['parts']['all-to-all']:.1f} | "
              f"{p.memory['gpu_total'] / GiB:.1f} | {p.memory['host_total'] / GiB:.0f} | "
              f"{plan_text(p, c.g['layers'])} | {full.time['total']:.0f} s, {full.memory['gpu_total'] / GiB:.1f} GiB, "
              f"{full.memory['host_total'] / GiB:.0f} GiB host |")
    print("\nQwen3-8B, one sequence over all the GPUs (sp = GPUs), the fastest levers at that SP size: step seconds "
          "and the share of communication (all-to-all, and copies and collectives beyond the compute they overlap)")
    print("| tokens | " + " | ".join(f"{g} GPUs" for g in SWEEP_GPUS) + " |\n|---|" + "---|" * len(SWEEP_GPUS))
    for seq_len in SWEEP_LENGTHS:
        cells = []
        for gpus in SWEEP_GPUS:
            machine = Machine(gpus, 139.7 * GiB, a.host_mem_gib * GiB)
            plans = fastest(command(flags("qwen3-8b", seq_len, gpus), machine), machine, constants, [gpus])
            cells.append(f"{plans[0].time['total']:.1f} s, {100 * plans[0].time['communication_share']:.0f}%"
                         if plans else "does not fit")
        print(f"| {seq_len:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
