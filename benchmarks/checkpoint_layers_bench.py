"""`--checkpoint_layers` on one GPU: the planner's choice at 64k and 131k tokens (Qwen3-4B), measured by the step
benchmark, next to what the planner predicts for exactly those flags (time and peak memory).

    python benchmarks/checkpoint_layers_bench.py --out DIR [--budget_s 570] [--dry_run]

Runs `benchmarks/step_bench.py` once per setting, in order, each in its own process (JSON in DIR/<label>.json),
skipping a setting when what is left of the budget would not cover its model build, first step and timed steps;
prints a table last. `--dry_run` prints the plans without running anything (it needs no GPU).
Settings, most important first:

    ckpt_64k_auto            64k, --checkpoint_layers auto (the planner's choice; --offload_activations)
    ckpt_131k_auto_untiled   131k, --checkpoint_layers auto --tiled_mlp off (the planner's fastest at 131k)
    ckpt_131k_auto           131k, --checkpoint_layers auto (tiled MLP as `auto` decides: on)
    ckpt_64k_auto_no_offload 64k, --checkpoint_layers auto without the offload (kept outputs on the GPU)

Compare with the all-layers runs of docs/benchmarks.md: 10.78 s at 64k, 36.61 s at 131k (35.93 untiled, our loss);
the measured table is in docs/benchmarks.md, "Partial checkpointing"."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

COMMON = ["--model_config", "qwen3-4b", "--lr", "1e-5", "--ds_config", "ds_configs/zero3_bf16_states.json"]
SETTINGS = [  # label, tokens, steps, flags
    ("ckpt_64k_auto", 65536, 4, ["--offload_activations", "--checkpoint_layers", "auto"]),
    ("ckpt_131k_auto_untiled", 131072, 3, ["--offload_activations", "--checkpoint_layers", "auto", "--tiled_mlp",
                                           "off"]),
    ("ckpt_131k_auto", 131072, 3, ["--offload_activations", "--checkpoint_layers", "auto"]),
    ("ckpt_64k_auto_no_offload", 65536, 4, ["--checkpoint_layers", "auto"]),
]
# seconds a run takes besides its timed steps: process and model build (~45 s), the first step (FlashAttention-4
# compiles its kernels: 33 s at 64k, 65 s at 131k in docs/results)
START_S = {65536: 85, 131072: 120}


def flags_of(tokens: int, steps: int, extra: list[str]) -> list[str]:
    return COMMON + ["--seq_len", str(tokens), "--steps", str(steps)] + extra


def predicted(flags: list[str]) -> tuple[float, float, int]:
    """The planner's step seconds, peak GPU GiB and checkpointed layers for these flags on one H200."""
    from ulysses_train.levers.machine_constants import Constants
    from ulysses_train.levers.policy import GiB
    from ulysses_train.tools.plan_command import Machine, command, evaluate

    machine = Machine(1, 139.7 * GiB, 125 * GiB)
    c = command(flags, machine)
    plan = evaluate(c, machine, Constants())
    return plan.time["total"], plan.memory["gpu_total"] / GiB, plan.levers.checkpointed(c.g["layers"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON of each run")
    parser.add_argument("--budget_s", type=float, default=570.0, help="stop starting runs past this")
    parser.add_argument("--dry_run", action="store_true", help="print the planned settings, run nothing")
    a = parser.parse_args()
    os.makedirs(a.out, exist_ok=True)
    start, rows = time.time(), []
    for label, tokens, steps, extra in SETTINGS:
        flags = flags_of(tokens, steps, extra)
        seconds, gib, layers = predicted(flags)
        need = START_S[tokens] + (steps - 1) * seconds * 1.1
        left = a.budget_s - (time.time() - start)
        if need > left:
            print(f"{label}: skipped, needs ~{need:.0f} s and {left:.0f} s are left", flush=True)
            rows.append((label, layers, seconds, gib, "skipped"))
            continue
        path = os.path.join(a.out, f"{label}.json")
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "step_bench.py"), "--json", path, "--label", label,
               "--"] + flags + ["--output_dir", os.path.join(a.out, "runs", label)]
        print(f"{label}: {' '.join(flags)} (planned: {layers} layers checkpointed, {seconds:.2f} s, {gib:.1f} GiB, "
              f"~{need:.0f} s to run)", flush=True)
        if a.dry_run:
            rows.append((label, layers, seconds, gib, "not run"))
            continue
        done = subprocess.run(cmd, cwd=ROOT)
        ok = done.returncode == 0 and os.path.exists(path)
        rows.append((label, layers, seconds, gib, json.load(open(path)) if ok else f"failed (exit {done.returncode})"))
        print(f"{label}: done at {time.time() - start:.0f} s: " + (_row(*rows[-1]) if ok else rows[-1][-1]), flush=True)
    print("\n| run | checkpointed | measured s/step | predicted s | peak GPU GiB | planner GiB | host peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(_row(*row))


def _row(label: str, layers: int, seconds: float, gib: float, r) -> str:
    """A table row: the run's checkpointed layers (as the trainer resolved them), measured and predicted."""
    if isinstance(r, str):
        return f"| {label} | {layers}/36 (planned) | {r} | {seconds:.2f} | | {gib:.1f} | |"
    ran = r["levers"].get("checkpoint_layers") or 36
    return (f"| {label} | {ran}/36 | {r['median_step_s']:.2f} | {seconds:.2f} | {r['peak_gpu_gib']:.2f} | "
            f"{gib:.1f} | {r['host_peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
