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


def peaks():
    """(name, run's result, measured peak GiB, the planner's GiB, kind) for every step_bench result in docs/results
    and every summary row; kind: "fitted", "earlier kernels" or "not fitted"."""
    for path in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "results", "*.json"))):
        r = json.load(open(path))
        if "argv" not in r or r["levers"]["loss"] == "plain":  # not step_bench's; the planner models the fused loss
            continue
        levers = Levers(**{"loss_kernel": "ours", **r["levers"]})  # runs from before --loss_kernel had ours
        config = config_of(r)
        est = estimate(geometry(config), r["seq_len"], r["world"], r["sp"], levers)["gpu_total"] / GiB
        kind = "earlier kernels" if earlier_kernels(r) else "fitted" if config.model_type in FITTED else "not fitted"
        yield os.path.basename(path)[:-5], r, r["peak_gpu_gib"], est, kind
    for label, row, _, measured, plan in summary_rows(Constants()):
        yield f"{label} (summary)", dict(row, sp=1), measured, plan.memory["gpu_total"] / GiB, "fitted"


def main():
    print("| run | tokens | sp | layers | measured peak GiB | planner GiB | error |\n|---|---|---|---|---|---|---|")
    errors = {"fitted": [], "earlier kernels": [], "not fitted": []}
    for name, r, measured, est, kind in peaks():
        errors[kind].append(est / measured - 1)
        note = "" if kind == "fitted" else f" ({kind})"
        print(f"| {name} | {r['seq_len']:,} | {r['sp']} | {r['layers']} | {measured:.1f} | {est:.1f} | "
              f"{100 * errors[kind][-1]:+.1f}%{note} |")
    print(f"\n{len(errors['fitted'])} runs of the fitted families, largest error "
          f"{100 * max(map(abs, errors['fitted'])):.1f}%; {len(errors['earlier kernels'])} runs of earlier kernels; "
          f"{len(errors['not fitted'])} runs of other families")


if __name__ == "__main__":
    main()
