"""Step benchmark of the real trainer (the code path of launch/train.py) on a preset model and length.

    python benchmarks/step_bench.py --json OUT.json [--label NAME] -- <train.py flags>

Reports the median step time after the first (warm-up) step, tokens/s, model TFLOP/s and MFU against a bf16
matmul ceiling measured in the same process, peak GPU and host memory. Model FLOPs only (no recomputation):
linear 6 x matmul-params x tokens; causal attention 2 x T^2 x heads x head_dim per layer forward, 2.5x that backward.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.phases import PhaseTimer, profile_one_step  # noqa: E402


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


ATTENTION_TFLOPS = 560  # cuDNN SDPA forward+backward on the H200 (benchmarks/attn_bench.py, docs/benchmarks.md)


def model_flops(model_config, linear_params: int, tokens: int) -> dict:
    layers, heads = model_config.num_hidden_layers, model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    linear = 6 * linear_params * tokens
    attn_fwd = 2 * tokens**2 * heads * head_dim * layers
    # the LM head's share of `linear`: it runs in the loss (profiled as `loss`) and is not recomputed
    head = 6 * model_config.vocab_size * model_config.hidden_size * tokens
    return {"linear": linear, "head": head, "attention": attn_fwd * 3.5, "total": linear + attn_fwd * 3.5}


def median_phases(times: list[dict]) -> dict:
    after_warmup = times[1:] or times
    return {k: statistics.median(t.get(k, 0.0) for t in after_warmup) for k in ("forward", "backward", "step")}


def print_breakdown(result: dict) -> None:
    """Phases and kernel categories against the FLOP model: what each would take at the ceilings."""
    flops, ceiling = result["flops"], result["matmul_ceiling_tflops"] * 1e12
    if result["phases_s"]:
        print("phase seconds (median after warm-up): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                                    result["phases_s"].items()))
    if not result["kernel_s"]:
        return
    attn_fwd = flops["attention"] / 3.5
    head = flops["head"]
    model = {"matmul": ((flops["linear"] - head) * 8 / 6, ceiling),  # the layers, with one recomputed forward
             "loss": (head, ceiling),
             "attention_fwd": (attn_fwd, ATTENTION_TFLOPS * 1e12),
             "attention_bwd": (attn_fwd * 2.5, ATTENTION_TFLOPS * 1e12)}
    print(f"{'kernels':<14}{'GPU s':>8}{'TFLOP/s':>9}{'floor s':>9}")
    for name, secs in sorted(result["kernel_s"].items(), key=lambda kv: -kv[1]):
        work, peak = model.get(name, (0, 0))
        rate = f"{work / secs / 1e12:9.0f}" if work and secs else f"{'':9}"
        floor = f"{work / peak:9.2f}" if work else f"{'':9}"
        print(f"{name:<14}{secs:8.2f}{rate}{floor}")
    print(f"{'sum':<14}{sum(result['kernel_s'].values()):8.2f}  (step {result['median_step_s']:.2f} s)")
    if result.get("gpu_streams"):
        print("GPU busy (s, union of intervals): "
              + ", ".join(f"{k} {v:.2f}" for k, v in result["gpu_streams"].items()))
    for category, name, launches, secs in result.get("kernel_top", [])[:15]:
        print(f"  {secs:7.3f} s {launches:6d}x  {category:<13} {name[:80]}")


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--label", default="ours")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)  # appended by the deepspeed launcher
    parser.add_argument("--profile_step", type=int, default=0,
                        help="profile this step (1-based) with the torch profiler: GPU time per kernel category")
    parser.add_argument("--trace", default=None, help="with --profile_step: write the Chrome trace here")
    args = parser.parse_args(argv[:split])

    from ulysses_train.train.config.config_file import parse_args
    from ulysses_train.train.process.launcher import normalise_launcher_env
    from ulysses_train.train.run.trainer import Trainer
    from ulysses_train.train.step.loop import train
    from ulysses_train.train.step.metrics import host_peak_gib

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cfg, explicit = parse_args(argv[split + 1:])
    if "save_final" not in explicit:  # a benchmark's weights are not worth a save that would take its time
        cfg.output.save_final = False
    normalise_launcher_env()
    if torch.cuda.is_available():  # each rank measures its own GPU (before the trainer sets it, all used GPU 0)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    ceiling = matmul_ceiling_tflops() if torch.cuda.is_available() else float("nan")
    trainer = Trainer(cfg, explicit)
    cuda = torch.cuda.is_available()
    timer = PhaseTimer(trainer.engine, trainer.module.model.get_output_embeddings()) if cuda else None
    with (profile_one_step(trainer, args.profile_step, args.trace) if cuda and args.profile_step
          else contextlib.nullcontext({})) as kernels:
        history = train(trainer)
    model = trainer.module.model
    linear_params = sum(getattr(m.weight, "ds_numel", m.weight.numel()) for m in model.modules()
                        if isinstance(m, torch.nn.Linear))
    tokens = trainer.seq_len * trainer.micro * trainer.accum * trainer.groups.dp_size
    flops = model_flops(trainer.model_config, linear_params, tokens)
    times = [r["step_time_s"] for r in history]
    median = statistics.median(times[1:] if len(times) > 1 else times)
    world = trainer.world
    result = {
        "label": args.label, "argv": argv[split + 1:], "world": world, "sp": trainer.groups.sp_size,
        "seq_len": cfg.data.seq_len, "layers": trainer.model_config.num_hidden_layers, "step_times_s": times,
        "median_step_s": median, "tokens_per_s": tokens / median,
        "model_tflops_per_gpu": flops["total"] / median / world / 1e12, "matmul_ceiling_tflops": ceiling,
        "mfu": flops["total"] / median / world / 1e12 / ceiling, "flops": flops,
        "peak_gpu_gib": max(r["peak_mem_gib"] for r in history), "host_peak_gib": host_peak_gib(),
        "host_offload_gib": trainer.offload.peak_host_bytes / 2**30 if trainer.offload else 0.0,
        "losses": [r["loss"] for r in history], "levers": {k: v for k, v in vars(trainer.levers).items()
                                                          if k != "why"},
        "surgery": trainer.surgery.counts, "attn_kernel": trainer.kernel,
        "phases_s": median_phases(timer.times) if timer else {}, "kernel_s": kernels.get("categories", {}),
        "kernel_top": kernels.get("top", []), "gpu_streams": kernels.get("streams", {}),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    if trainer.rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print_breakdown(result)
        print("BENCH " + json.dumps({k: result[k] for k in ("label", "seq_len", "layers", "median_step_s",
                                                            "tokens_per_s", "model_tflops_per_gpu", "mfu",
                                                            "peak_gpu_gib", "host_peak_gib")}), flush=True)


if __name__ == "__main__":
    main()
    from ulysses_train.train.process.launcher import exit_now

    exit_now(0)  # see exit_now: no process-group teardown
