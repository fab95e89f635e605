"""Prints the time model's step time next to every step measured in docs/results/*.json (the table in docs/time.md).

    python benchmarks/time_vs_measured.py [--constants FILE] [--sft_data DIR]

Each result of benchmarks/step_bench.py records its flags (`argv`), the levers its run resolved, its attention
kernel (none recorded: SDPA, the runs from before FlashAttention-4), GPUs and SP size; the model predicts exactly
that run. The median step after the first is compared (preference runs: a row of two sides, as the planner takes it,
tools/preference_plan.py), except for packed runs, whose steps differ with the documents
they hold: those are compared step by step, with each step's document lengths recomputed through the trainer's own
data path from the data the run used (`benchmarks/sft_data.py` is seeded: the script makes it again in a temporary
folder unless --sft_data names one)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.dpo_data import COMPLETION as DPO_COMPLETION  # noqa: E402
from ulysses_train.levers.policy import Levers  # noqa: E402
from ulysses_train.levers.time_model import Constants, Run, step_time  # noqa: E402
from ulysses_train.model.build import load_model_config  # noqa: E402
from ulysses_train.model.geometry import geometry  # noqa: E402
from ulysses_train.tools.preference_plan import pair_documents, preference_step_time  # noqa: E402

# the data of the packed runs (docs/benchmarks.md, "SFT on packed conversations")
SFT_DATA_ARGS = ["--count", "12", "--min_chars", "30000", "--max_chars", "120000"]


def packed_docs(argv: list[str], data_dir: str, steps: int) -> list[tuple]:
    """Per step (1-based, in order) the document lengths of its sample, padding last, as the trainer packs them:
    its config parser and data loader (data/load.py), without a model or a process group."""
    from ulysses_train.data.load import load_source
    from ulysses_train.data.sources import build_batch, global_sample_index, sample_order
    from ulysses_train.train.config.config_file import parse_args

    argv = list(argv)
    i = argv.index("--dataset")
    argv[i + 1] = os.path.join(data_dir, os.path.basename(argv[i + 1]))
    cfg, _ = parse_args(argv + ["--data_cache_dir", os.path.join(data_dir, "cache")])
    vocab = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers).vocab_size
    _, source = load_source(cfg.data_settings(), cfg.data.dataset, cfg.data.dataset_split, cfg.data.seq_len, vocab,
                            rank=0, log=lambda message: None)
    docs = []
    for step in range(steps):
        index = sample_order(global_sample_index(step, 0, 1, 0, 1, 1, 0), source.num_samples, cfg.data.seed)
        docs.append(tuple(build_batch([source.get(index)], True)["docs"][0]))
    return docs


# the families the constants are fitted on; the others' rows are shown apart
FITTED = {"qwen3", "qwen3_moe", "qwen3_5_text", "gemma3_text", "olmo3"}
# the summary of the windowed families' steps with the current kernels (no full step_bench result kept)
SUMMARY = os.path.join(ROOT, "docs", "results", "windowed_current.json")
# the machine the summary's rows ran on, as the planner takes it (tools/plan_command.py)
SUMMARY_GPU_GIB, SUMMARY_HOST_GIB = 139.7, 125.0


def earlier_kernels(r: dict) -> bool:
    """A result measured before our fused kernels covered its model's layers: fused kernels on, yet none of its
    RMSNorms and none of its gated MLPs replaced (the trainer's surgery counts), or DeltaNet mixers without the
    gated-norm count (the trainer before that kernel and FLA's conv), or DeltaNet mixers from before the mixer
    stopped copying q, k and v twice a layer and pass (their levers predate `keep_projections`, the lever that came
    right after: 3-4% slower than the model, which times the mixer without those copies). The model times them
    fused, so these rows describe an earlier trainer and are shown apart (Gemma 3's first rows, eager `1 + weight`
    norms and GeGLU: docs/results/windowed_current.json has its rows with the kernels; Qwen3.5's first rows:
    qwen3.5-9b_16layers_h100_64k_*.json)."""
    surgery = r.get("surgery", {})
    if not r.get("levers", {}).get("fused_kernels"):
        return False
    if "DeltaNet mixer" in surgery and ("gated RMSNorm" not in surgery or "keep_projections" not in r["levers"]):
        return True
    unfused = [surgery[k][0] == 0 < surgery[k][1] for k in ("RMSNorm", "SwiGLU") if k in surgery]
    return len(unfused) == 2 and all(unfused)


def summary_rows(constants: Constants):
    """(label, summary row, measured seconds, measured GiB, the planner's Plan) for each row of SUMMARY: the
    planner's own resolution of the row's flags on its machine (`python -m ulysses_train.plan -- <flags>`), the
    summary's and the row's own (which pin a lever whose default has changed since the run)."""
    from ulysses_train.levers.policy import GiB
    from ulysses_train.tools.plan_command import Machine, command, evaluate

    summary = json.load(open(SUMMARY))
    machine = Machine(summary["gpus"], SUMMARY_GPU_GIB * GiB, SUMMARY_HOST_GIB * GiB, constants.gpus_per_node)
    for row in summary["rows"]:
        argv = ["--model_config", row["model_config"], *summary["flags"], *row.get("flags", []), "--seq_len",
                str(row["seq_len"]), "--steps", str(row["steps"])]
        c = command(argv, machine)
        yield row["label"], dict(row, layers=c.g["layers"]), row["median_step_s"], row["peak_gpu_gib"], \
            evaluate(c, machine, constants)


def config_of(r: dict):
    """The model config of a step_bench result: its --model_config (the runs before the flag was kept: qwen3-4b)."""
    argv = r["argv"]
    name = argv[argv.index("--model_config") + 1] if "--model_config" in argv else "qwen3-4b"
    return load_model_config(None, name, r["layers"])


def run_of(r: dict, docs=None) -> Run:
    return Run(geometry(config_of(r)), r["seq_len"], r["world"], r["sp"], Levers(**r["levers"]),
               kernel=r.get("attn_kernel") or "sdpa", docs=docs)


def pair_row(r: dict) -> tuple:
    """The documents of a preference run's row as the planner takes them: two sides of --max_length (default half
    the row; benchmarks/dpo_data.py makes every side that long), then the padding."""
    argv = r["argv"]
    max_length = int(argv[argv.index("--max_length") + 1]) if "--max_length" in argv else r["seq_len"] // 2
    return pair_documents(r["seq_len"], max_length, 1)


def scored_tokens(r: dict):
    """The completion tokens of a preference run's row, the only ones its head runs on: both sides' completions as
    benchmarks/dpo_data.py makes them (its pairs_<side>.jsonl, --completion at its default, EOS included); None
    (every token) for other data."""
    dataset = os.path.basename(r["argv"][r["argv"].index("--dataset") + 1])
    return 2 * DPO_COMPLETION if dataset.startswith("pairs_") else None


def rows(constants: Constants, sft_data: str):
    """(name, run's result, step label, measured seconds, predicted result) for every measured step; `sft_data`:
    where benchmarks/sft_data.py wrote (or is to write) the packed runs' data."""
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json"))):
        r = json.load(open(path))
        if "argv" not in r:  # not a step_bench result
            continue
        name = os.path.basename(path)[:-5]
        if "--method" in r["argv"] and r["argv"][r["argv"].index("--method") + 1] != "sft":
            yield name, r, "median", r["median_step_s"], preference_step_time(run_of(r, pair_row(r)), constants,
                                                                              scored_tokens(r))
            continue
        if "--packing" not in r["argv"]:
            yield name, r, "median", r["median_step_s"], step_time(run_of(r), constants)
            continue
        if "--chat_template" in r["argv"]:
            template = r["argv"][r["argv"].index("--chat_template") + 1]
            if not os.path.exists(os.path.join(ROOT, template)):
                print(f"{name}: left out, its chat template {template} is not in this checkout", file=sys.stderr)
                continue
        if not os.path.exists(os.path.join(sft_data, "chat.jsonl")):
            subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sft_data.py"), "--out", sft_data]
                           + SFT_DATA_ARGS, check=True, capture_output=True)
        cwd = os.getcwd()
        os.chdir(ROOT)  # the run's paths (its chat template) are relative to the repository
        try:
            docs = packed_docs(r["argv"], sft_data, len(r["step_times_s"]))
        finally:
            os.chdir(cwd)
        for step in range(1, len(r["step_times_s"])):  # the first step compiles and warms up
            yield name, r, f"step {step + 1}", r["step_times_s"][step], step_time(run_of(r, (docs[step],)),
                                                                                  constants)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--constants", default=None, help="a JSON of constants (python -m ulysses_train.plan "
                                                          "--calibrate FILE); default: the H200's")
    parser.add_argument("--sft_data", default=None, help="the folder benchmarks/sft_data.py wrote for the packed "
                                                         "runs; default: made again in a temporary folder")
    a = parser.parse_args()
    constants = Constants.load(a.constants)
    print("| run | step | tokens | sp | layers | kernel | measured s | predicted s | error | attention | matmul | "
          "other |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors, unfitted, earlier_rows = [], [], []
    with tempfile.TemporaryDirectory(prefix="sftd_") as tmp:
        for name, r, label, measured, predicted in rows(constants, a.sft_data or tmp):
            total, parts = predicted["total"], predicted["parts"]
            error = total / measured - 1
            earlier = earlier_kernels(r)
            fitted = config_of(r).model_type in FITTED and not earlier
            (errors if fitted else earlier_rows if earlier else unfitted).append(error)
            note = " (earlier kernels)" if earlier else "" if fitted else " (not fitted)"
            other = total - parts["attention"] - parts["matmul"]
            print(f"| {name} | {label} | {r['seq_len']:,} | {r['sp']} | {r['layers']} | "
                  f"{r.get('attn_kernel') or 'sdpa'} | {measured:.2f} | {total:.2f} | {100 * error:+.1f}%{note} | "
                  f"{parts['attention']:.2f} | {parts['matmul']:.2f} | {other:.2f} |", flush=True)
    for label, row, measured, _, plan in summary_rows(constants):
        total, parts = plan.time["total"], plan.time["parts"]
        errors.append(total / measured - 1)
        other = total - parts["attention"] - parts["matmul"]
        print(f"| {label} (summary) | median | {row['seq_len']:,} | 1 | {row['layers']} | flash_attn_4 | "
              f"{measured:.2f} | {total:.2f} | {100 * errors[-1]:+.1f}% | {parts['attention']:.2f} | "
              f"{parts['matmul']:.2f} | {other:.2f} |", flush=True)
    worst = max(map(abs, errors))
    print(f"\n{len(errors)} steps of the fitted families, largest error {100 * worst:.1f}%, mean "
          f"{100 * sum(map(abs, errors)) / len(errors):.1f}%; {len(earlier_rows)} steps of earlier kernels; "
          f"{len(unfitted)} steps of other families")



if __name__ == "__main__":
    main()
