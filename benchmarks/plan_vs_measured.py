"""Prints the planner's estimate next to every measured peak in docs/results/*.json (the table in docs/memory.md).

    python benchmarks/plan_vs_measured.py

Each result of benchmarks/step_bench.py records the levers its run resolved (`levers`); the planner estimates the
peak of exactly those levers, for the model, length, GPUs and SP size of the run. Rows measured before our fused
kernels covered their model's norms are marked (earlier kernels); the rows of docs/results/windowed_current.json
(a summary of runs: flags and peaks) are planned from their flags, as `python -m ulysses_train.plan` plans them."""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.time_vs_measured import FITTED, config_of, earlier_kernels, summary_rows  # noqa: E402
from ulysses_train.levers.machine_constants import Constants  # noqa: E402
from ulysses_train.levers.policy import GiB, Levers  # noqa: E402
from ulysses_train.model.geometry import geometry  # noqa: E402
from ulysses_train.tools.plan import estimate  # noqa: E402

print("| run | tokens | sp | layers | measured peak GiB | planner GiB | error |\n|---|---|---|---|---|---|---|")
errors, unfitted, earlier_rows = [], [], []
for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "results", "*.json"))):
    r = json.load(open(path))
    if "argv" not in r or r["levers"]["loss"] == "plain":  # not a step_bench result; the planner models the fused loss
        continue
    levers = Levers(**{"loss_kernel": "ours", **r["levers"]})  # runs from before --loss_kernel had ours
    config = config_of(r)
    est = estimate(geometry(config), r["seq_len"], r["world"], r["sp"], levers)["gpu_total"] / GiB
    error = est / r["peak_gpu_gib"] - 1
    earlier = earlier_kernels(r)
    fitted = config.model_type in FITTED and not earlier
    (errors if fitted else earlier_rows if earlier else unfitted).append(error)
    note = " (earlier kernels)" if earlier else "" if fitted else " (not fitted)"
    print(f"| {os.path.basename(path)[:-5]} | {r['seq_len']:,} | {r['sp']} | {r['layers']} | {r['peak_gpu_gib']:.1f} | "
          f"{est:.1f} | {100 * error:+.1f}%{note} |")
for label, row, _, measured, plan in summary_rows(Constants()):
    errors.append(plan.memory["gpu_total"] / GiB / measured - 1)
    print(f"| {label} (summary) | {row['seq_len']:,} | 1 | {row['layers']} | {measured:.1f} | "
          f"{plan.memory['gpu_total'] / GiB:.1f} | {100 * errors[-1]:+.1f}% |")
print(f"\n{len(errors)} runs of the fitted families, largest error {100 * max(map(abs, errors)):.1f}%; "
      f"{len(earlier_rows)} runs of earlier kernels; {len(unfitted)} runs of other families")
