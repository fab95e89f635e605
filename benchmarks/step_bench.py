"""Step benchmark of the real trainer (the code path of launch/train.py) on a preset model and length.

    python benchmarks/step_bench.py --json OUT.json [--label NAME] -- <train.py flags>

Reports the median step time after the first (warm-up) step, tokens/s, model TFLOP/s and MFU against a bf16
matmul ceiling measured in the same process, peak GPU and host memory. Model FLOPs only (no recomputation):
linear 6 x matmul-params x tokens; causal attention 2 x T^2 x heads x head_dim per layer forward, 2.5x that backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def matmul_ceiling_tflops(n: int = 8192, reps: int = 20) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def model_flops(model_config, linear_params: int, tokens: int) -> dict:
    layers, heads = model_config.num_hidden_layers, model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    linear = 6 * linear_params * tokens
    attn_fwd = 2 * tokens**2 * heads * head_dim * layers
    return {"linear": linear, "attention": attn_fwd * 3.5, "total": linear + attn_fwd * 3.5}


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--label", default="ours")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)  # appended by the deepspeed launcher
    args = parser.parse_args(argv[:split])

    from ulysses_train.config import parse_args
    from ulysses_train.launcher import normalise_launcher_env
    from ulysses_train.metrics import host_peak_gib
    from ulysses_train.trainer import Trainer

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg, explicit = parse_args(argv[split + 1:])
    normalise_launcher_env()
    ceiling = matmul_ceiling_tflops() if torch.cuda.is_available() else float("nan")
    trainer = Trainer(cfg, explicit)
    history = trainer.train()
    model = trainer.module.model
    linear_params = sum(getattr(m.weight, "ds_numel", m.weight.numel()) for m in model.modules()
                        if isinstance(m, torch.nn.Linear))
    tokens = cfg.seq_len * trainer.micro * trainer.accum * trainer.groups.dp_size
    flops = model_flops(trainer.model_config, linear_params, tokens)
    times = [r["step_time_s"] for r in history]
    median = statistics.median(times[1:] if len(times) > 1 else times)
    world = trainer.world
    result = {
        "label": args.label, "argv": argv[split + 1:], "world": world, "sp": trainer.groups.sp_size,
        "seq_len": cfg.seq_len, "layers": trainer.model_config.num_hidden_layers, "step_times_s": times,
        "median_step_s": median, "tokens_per_s": tokens / median,
        "model_tflops_per_gpu": flops["total"] / median / world / 1e12, "matmul_ceiling_tflops": ceiling,
        "mfu": flops["total"] / median / world / 1e12 / ceiling, "flops": flops,
        "peak_gpu_gib": max(r["peak_mem_gib"] for r in history), "host_peak_gib": host_peak_gib(),
        "host_offload_gib": trainer.host_offload_gib, "losses": [r["loss"] for r in history],
        "keep_attention": trainer.keep_attention, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
        else "cpu",
    }
    if trainer.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print("BENCH " + json.dumps({k: result[k] for k in ("label", "seq_len", "layers", "median_step_s",
                                                            "tokens_per_s", "model_tflops_per_gpu", "mfu",
                                                            "peak_gpu_gib", "host_peak_gib")}), flush=True)


if __name__ == "__main__":
    main()
    from ulysses_train.trainer import exit_now

    exit_now(0)  # see exit_now: no process-group teardown
