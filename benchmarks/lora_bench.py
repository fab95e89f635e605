"""LoRA side by side on one GPU: our trainer with --use_peft against TRL + PEFT, the same model, length and adapters
(r 16, alpha 32, dropout 0, every linear layer), one after the other in one call, so the ratio is measured on the
same machine; and, with --longest, a step at the longest sequence the planner says fits.

    python benchmarks/lora_bench.py --seq_lens 65536 131072 --out OUT [--steps 3] [--preset qwen3-8b]
        [--layers N] [--trl_attn flash_attention_4] [--trl_liger] [--ours_flags "--checkpoint_layers auto"]
        [--skip_trl] [--longest [--load_in_4bit --model PATH]]

Ours runs benchmarks/step_bench.py (the trainer's own code path) under torchrun with one process; TRL runs
benchmarks/peers/trl_sft_lora.py (needs `pip install trl==1.16.0 peft`). Each writes its JSON into OUT; this script
prints one table (median step after the first, peak GPU memory, host peak) and the ratio, and writes
OUT/lora_summary.json. A run that fails (out of memory: TRL's longest) is reported as such, with its last lines.
--longest asks `python -m ulysses_train.plan --longest --use_peft` for the length and the levers, then measures
our step there (at --layers depth if given: the planner's projection for full depth is printed beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd: list[str], env: dict, log: str) -> tuple[int, str]:
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    with open(log) as f:
        tail = f.read()[-3000:]
    return proc.returncode, tail


def ours(args, seq_len: int, extra: list[str], label: str) -> dict:
    out = os.path.join(args.out, f"ours_{label}_{seq_len}.json")
    flags = ["--seq_len", str(seq_len), "--steps", str(args.steps), "--use_peft", "--lora_r", "16",
             "--lora_alpha", "32", "--lr", "1e-4", "--output_dir", os.path.join(args.out, f"run_{label}_{seq_len}"),
             "--overwrite_output_dir", "--save_final", "false"]
    # generated tokens either way; a bare --model folder has no tokenizer for the trainer to check them against
    flags += (["--model", args.model, "--tokenizer", "bytes"] if args.model else ["--model_config", args.preset])
    flags += ["--rope_scaling", "yarn"]
    if args.layers:
        flags += ["--num_layers", str(args.layers)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29533",
           os.path.join(ROOT, "benchmarks", "step_bench.py"), "--json", out, "--label", f"ours-{label}", "--"]
    code, tail = _run(cmd + flags + extra, dict(os.environ), out.replace(".json", ".log"))
    if code or not os.path.exists(out):
        return {"tool": f"ours-{label}", "seq_len": seq_len, "failed": tail}
    with open(out) as f:
        r = json.load(f)
    return {"tool": f"ours-{label}", "seq_len": seq_len, "median_step_s": r["median_step_s"],
            "peak_gpu_gib": r["peak_gpu_gib"], "host_peak_gib": r["host_peak_gib"], "layers": r["layers"],
            "flags": flags + extra}


def trl(args, seq_len: int) -> dict:
    env = dict(os.environ, PRESET=args.preset, ATTN=args.trl_attn, OUT=args.out)
    if args.layers:
        env["LAYERS"] = str(args.layers)
    if args.trl_liger:
        env["LIGER"] = "1"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "peers", "trl_sft_lora.py"), str(seq_len),
           str(args.steps)]
    code, tail = _run(cmd, env, os.path.join(args.out, f"trl_lora_{seq_len}.log"))
    path = os.path.join(args.out, f"trl_lora_{args.preset}_{seq_len}.json")
    if code or not os.path.exists(path):
        return {"tool": "trl+peft", "seq_len": seq_len, "failed": tail}
    with open(path) as f:
        r = json.load(f)
    return {"tool": "trl+peft", "seq_len": seq_len, "median_step_s": r["median_s"], "peak_gpu_gib": r["peak_gib"],
            "host_peak_gib": r["host_maxrss_gib"], "layers": r["layers"], "attn": r["attn"], "liger": r["liger"]}


def longest(args) -> tuple[int, list[str], str]:
    """The planner's longest LoRA sequence on one GPU and its levers (as flags), and its report."""
    cmd = [sys.executable, "-m", "ulysses_train.plan", "--gpus", "1", "--longest", "--use_peft", "--json"]
    # a --model folder cut to --layers plans as the full-depth --preset it is a cut of
    cmd += ["--model", args.model] if args.model and not args.layers else ["--model_config", args.preset]
    cmd += ["--load_in_4bit"] if args.load_in_4bit else []
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the planner found nothing that fits:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    lines = proc.stdout.strip().splitlines()
    plan = json.loads(lines[-1])
    seq_len = int(lines[0].split(": ")[1].split(" tokens")[0].replace(",", ""))
    return seq_len, plan["levers"].split(), proc.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_lens", type=int, nargs="*", default=[65536, 131072])
    p.add_argument("--steps", type=int, default=3, help="steps per run; the first is warm-up")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--model", default=None, help="a pretrained folder instead of --preset (needed for 4-bit); with "
                   "--layers, a folder of --preset's shape (it may hold only those layers), planned as the full preset")
    p.add_argument("--layers", type=int, default=None, help="reduced depth, for both tools")
    p.add_argument("--trl_attn", default="flash_attention_4", help="TRL's attention (sdpa or flash_attention_4)")
    p.add_argument("--trl_liger", action="store_true", help="TRL with use_liger_kernel")
    p.add_argument("--ours_flags", default="", help="more flags for our runs, e.g. \"--checkpoint_layers auto\"")
    p.add_argument("--skip_trl", action="store_true")
    p.add_argument("--longest", action="store_true", help="also a step at the planner's longest LoRA sequence")
    p.add_argument("--load_in_4bit", action="store_true", help="with --longest and --model: QLoRA")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for seq_len in args.seq_lens:
        rows.append(ours(args, seq_len, args.ours_flags.split(), "lora"))
        if not args.skip_trl:
            rows.append(trl(args, seq_len))
    if args.longest:
        seq_len, levers, report = longest(args)
        print(report, flush=True)
        extra = levers + (["--load_in_4bit"] if args.load_in_4bit else [])
        rows.append(ours(args, seq_len, extra, "qlora-longest" if args.load_in_4bit else "lora-longest"))
    print(f"\n{'tool':<22}{'tokens':>10}{'layers':>8}{'step s':>10}{'peak GiB':>10}{'host GiB':>10}")
    for r in rows:
        if "failed" in r:
            print(f"{r['tool']:<22}{r['seq_len']:>10,}  failed: {r['failed'].strip().splitlines()[-1][:100]}")
            continue
        print(f"{r['tool']:<22}{r['seq_len']:>10,}{r['layers']:>8}{r['median_step_s']:>10.2f}{r['peak_gpu_gib']:>10.1f}"
              f"{r['host_peak_gib']:>10.1f}")
    for seq_len in args.seq_lens:
        pair = {r["tool"]: r for r in rows if r["seq_len"] == seq_len and "failed" not in r}
        if "ours-lora" in pair and "trl+peft" in pair:
            print(f"{seq_len:,} tokens: {pair['trl+peft']['median_step_s'] / pair['ours-lora']['median_step_s']:.2f}x "
                  f"TRL + PEFT's speed")
    with open(os.path.join(args.out, "lora_summary.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
