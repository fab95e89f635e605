"""Planner: will this run fit, which levers does it need, how many GPUs, how long will a step take?

    python -m ulysses_train.plan --model_config qwen3-8b --seq_len 1048576 --gpus 8 [--sp_size N] [--ring_size R]
        [--ds_config F]
    python -m ulysses_train.plan --model_config qwen3-4b --gpus 1 --longest    # how long can one GPU go?
    python -m ulysses_train.plan --model_config qwen3-8b --gpus 1 --longest --use_peft [--load_in_4bit]   # LoRA
    python -m ulysses_train.plan --gpus 8 [--fastest] -- <flags of launch/train.py>   # that run (tools/plan_command.py)
    python -m ulysses_train.plan --gpus 1 --longest -- <flags without --seq_len>      # its longest --seq_len
    python -m ulysses_train.plan --calibrate FILE        # measure this machine's time constants (tools/calibrate.py)

The memory of a run, per GPU and for the host, is levers/memory.py's estimate (the trainer's `--checkpoint_layers
auto` asks the same one). It first says what the default flags do (the levers come from the same policy as the
trainer's, levers/policy.py), then the cheapest levers that fit. Where the heads forbid a pure Ulysses split of an
SP size, it plans that size with the ring `--ring_size auto` would choose. The formulas are in docs/memory.md with a
comparison against the peaks measured on the H200."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Optional

from ..errors import ConfigError
from ..levers.memory import CUDA_OVERHEAD, estimate, fits, fits_on
from ..levers.policy import DeviceInfo, GiB, LeverRequest, Levers, resolve_levers
from ..levers.time_model import seconds_on
from ..model.geometry import geometry
from ..sp.layout import Layout, LayoutFlags, Target, layout_or_refusal, resolve_layout
from ..train.config.ds_config import lever_choices
from ..train.config.ds_file import load_ds_config
from ..train.config.train_config import ring_size_number
from .plan_command import launch_command
from .plan_command import main as plan_command_main

# cheapest first: what each costs in step time, as measured (docs/benchmarks.md); (flags, optimizer-state choices).
# With the offload the checkpoints the GPU holds are placed by --gpu_checkpoints auto on every rung; segments
# (--checkpoint_every auto: a layer forward more per extra layer of a segment) come only after every other lever
# but the optimizer's offload, which would move 18 bytes a parameter onto a host that is already full. The Gated
# DeltaNet layers' outputs (--linear_recompute) are kept where auto finds room on the rungs that keep attention's
_OFFLOAD = dict(offload_activations=True, checkpoint_every="1")
_RECOMPUTE = dict(attn_recompute="always", linear_recompute="always", tiled_mlp="on")
LEVER_LADDER = [
    (LeverRequest(attn_recompute="never", tiled_mlp="off"), {}),  # kept attention: fastest
    (LeverRequest(attn_recompute="never", tiled_mlp="off", **_OFFLOAD), {}),  # copies overlap compute
    (LeverRequest(attn_recompute="never", tiled_mlp="on", **_OFFLOAD), {}),  # one more MLP forward
    (LeverRequest(attn_recompute="never", tiled_mlp="on", **_OFFLOAD),
     {"bf16_states": True}),  # TRL's precision for optimizer states
    (LeverRequest(**_RECOMPUTE, **_OFFLOAD), {"bf16_states": True}),  # ~15% slower
    (LeverRequest(**_RECOMPUTE, offload_activations=True), {"bf16_states": True}),  # checkpoints every K layers
    (LeverRequest(**_RECOMPUTE, **_OFFLOAD), {"offload_optimizer": True}),
    (LeverRequest(**_RECOMPUTE, offload_activations=True), {"offload_optimizer": True}),
]


def ds_config_choices(path: str) -> dict:
    """What a DeepSpeed JSON fixes for the planner: ZeRO stage, bf16 optimizer states, optimizer on the CPU."""
    return lever_choices(load_ds_config(path))


def planned_device(gpus: int, gpu_mem: float, host_mem: float) -> DeviceInfo:
    return DeviceInfo.gpu(gpu_mem / GiB, host_mem / GiB, local_ranks=min(gpus, 8))


def levers_for(request: LeverRequest, g: dict, seq_len: int, gpus: int, sp: int, gpu_mem: float, host_mem: float,
               ds_choices: Optional[dict] = None, micro: int = 1) -> Levers:
    """What the trainer would resolve for these flags on the planned machine (the same policy call)."""
    zero_stage = (ds_choices or {}).get("zero_stage", 3)
    return resolve_levers(request, g, micro * math.ceil(seq_len / sp), 2, planned_device(gpus, gpu_mem, host_mem),
                          ds_choices, fits_on(g, seq_len, gpus, sp, gpu_mem, host_mem, zero_stage, micro),
                          seconds_on(g, seq_len, gpus, sp, zero_stage, micro))


def _ladder(g: dict, seq_len: int, gpus: int, sp: int, gpu_mem: float, host_mem: float,
            fixed: Optional[dict]) -> list[Levers]:
    """The lever ladder, resolved; with a DeepSpeed config its optimizer choices replace the ladder's, duplicates
    dropped."""
    rungs = []
    for request, states in LEVER_LADDER:
        choices = {**states, **{k: v for k, v in (fixed or {}).items() if k in ("bf16_states", "offload_optimizer")}}
        rung = levers_for(request, g, seq_len, gpus, sp, gpu_mem, host_mem, choices)
        if rung not in rungs:
            rungs.append(rung)
    return rungs


def _divisors(n: int) -> list[int]:
    """The divisors of n, smallest first, in sqrt(n) steps (a count of a billion GPUs is planned, not looped over)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def sp_plans(config, gpus: int, sp: Optional[int] = None, ring: Optional[int] = None) -> list[tuple[int, int]]:
    """(sp, ring) for each SP size the planner may try (only `sp` if given), smallest first: the ring `ring`, or by
    default the one --ring_size auto chooses (none where the heads allow a pure Ulysses split); a size whose layout
    the trainer refuses (the heads, or layers the support check refuses under it: sp/layout.py) is left out."""
    plans = []
    for size in [sp] if sp else _divisors(gpus):  # an SP group divides the GPUs (sp/dims.py)
        layout, _ = layout_or_refusal(LayoutFlags(size, ring), config, Target.planned(gpus))
        if layout is not None:
            plans.append((size, layout.ring_size))
    return plans


def plan(g: dict, seq_len: int, gpus: int, sp_sizes, gpu_mem: float, host_mem: float,
         ds_choices: Optional[dict] = None) -> tuple:
    """The smallest SP size and the cheapest rung of the ladder that fit: (sp, levers, estimate, everything tried).
    `sp_sizes`: SP sizes, or (sp, ring) pairs (sp_plans); the estimate holds the ring as `ring_size`."""
    tried = []
    zero_stage = (ds_choices or {}).get("zero_stage", 3)
    for entry in sp_sizes:
        sp, ring = entry if isinstance(entry, tuple) else (entry, 1)
        for levers in _ladder(g, seq_len, gpus, sp, gpu_mem, host_mem, ds_choices):
            est = estimate(g, seq_len, gpus, sp, levers, zero_stage=zero_stage, ring=ring)
            tried.append((sp, levers, est, fits(est, gpu_mem, host_mem)))
            if tried[-1][3]:
                return sp, levers, est, tried
    return None, None, None, tried


def longest_fit(g: dict, gpus: int, sp_sizes, gpu_mem: float, host_mem: float, ds_choices: Optional[dict] = None,
                step: int = 8192) -> int:
    """The longest sequence (a multiple of `step`) for which some rung of the ladder fits, 0 if none does. Every
    component grows with the length, so whether anything fits is monotone in it: double, then bisect."""
    def fits(n: int) -> bool:
        return plan(g, n * step, gpus, sp_sizes, gpu_mem, host_mem, ds_choices)[0] is not None

    if not fits(1):
        return 0
    hi = 2
    while fits(hi):
        hi *= 2
    lo = hi // 2  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def default_sp_size(gpus: int) -> int:
    """The trainer's default --sp_size: the ranks of one node (8 GPUs a node here)."""
    return math.gcd(min(gpus, 8), gpus)


def default_flags(g: dict, seq_len: int, gpus: int, layout: Optional[Layout], gpu_mem: float, host_mem: float,
                  ds_choices: Optional[dict], refusal: Optional[str] = None) -> str:
    """What the trainer does with the default lever flags at `layout` (the command line's --sp_size and
    --ring_size, by default the node and --ring_size auto), and whether that fits; or, where the trainer refuses
    that layout, why (`refusal`)."""
    if layout is None:
        return f"with the default flags (--sp_size {default_sp_size(gpus)}): the trainer refuses them: {refusal}"
    sp, ring = layout.sp_size, layout.ring_size
    levers = levers_for(LeverRequest(), g, seq_len, gpus, sp, gpu_mem, host_mem, ds_choices)
    est = estimate(g, seq_len, gpus, sp, levers, zero_stage=(ds_choices or {}).get("zero_stage", 3), ring=ring)
    verdict = "fits" if fits(est, gpu_mem, host_mem) else "does not fit"
    return (f"with the default flags (--sp_size {sp}{ring_flag(ring)}): {levers.flags()}, fused kernels "
            f"{levers.fused_kernels}: {est['gpu_total'] / GiB:.1f} GiB per GPU, {est['host_total'] / GiB:.1f} GiB "
            f"host: {verdict}")


def ring_flag(ring: int) -> str:
    return f" --ring_size {ring}" if ring > 1 else ""


def predicted_time(g: dict, seq_len: int, gpus: int, sp: int, levers: Levers, ds_choices: Optional[dict],
                   constants: Optional[str]) -> str:
    """One line: the time model's step time for this plan (levers/time_model.py; FlashAttention-4)."""
    from ..levers.time_model import Constants, Run, step_time

    run = Run(g, seq_len, gpus, sp, levers, zero_stage=(ds_choices or {}).get("zero_stage", 3))
    t = step_time(run, Constants.load(constants))
    return (f"predicted step time {t['total']:.1f} s with FlashAttention-4 (attention {t['parts']['attention']:.1f} "
            f"s, communication {100 * t['communication_share']:.1f}%; the fastest plan: add -- <train flags> "
            f"--fastest)")


# what each line of the breakdown holds, for a reader new to the planner (levers/memory.py computes them)
LABELS = {
    "model states": "this GPU's ZeRO-3 shard of the weights, gradients and optimizer states, and the gathered layer",
    "checkpoints": "each checkpointed layer's input, kept for its recompute in the backward",
    "kept outputs": "attention outputs and log-sum-exp (--attn_recompute never), the gated delta rule's "
                    "(--linear_recompute never) and input projections' (--keep_projections) kept for the backward",
    "layer working set": "one layer's activations while its forward and backward run",
    "loss": "the fused loss's chunk of logits and its gradient",
    "all-to-all buffers": "Ulysses' received q, k and v (none at --sp_size 1)",
    "NCCL buffers": "NCCL's communicator and collective workspaces of an SP group (none at --sp_size 1)",
    "ring buffers": "the ring's K/V blocks in flight and their gradients",
    "uncheckpointed layers": "the activations of the layers --checkpoint_layers leaves whole",
    "CUDA overhead": "the CUDA context, allocator and library workspaces",
    "total (peak)": "the most in use at once (the loss and the layer working set never overlap)",
    "optimizer offload": "optimizer states moved to the host by the DeepSpeed JSON (offload_optimizer)",
    "offloaded checkpoints": "checkpoints and kept outputs moved to the host (--offload_activations)",
    "regenerated inputs": "a segment's layer inputs, regenerated at once in the backward (--checkpoint_every)",
    "total": "with 4 GiB per rank for the process itself",
    "all-to-all": "Ulysses' all-to-all traffic of one sequence, every layer, forward and backward",
    "ring point-to-point": "the ring's K/V sends of one sequence (none without a ring)",
}


def checkpoint_line(est: dict, levers: Levers, layers: int) -> str:
    """Where the plan's checkpoints are: how many, on the GPU and on the host, and the segments
    (levers/placement.py)."""
    split, n = est["checkpoint_split"], levers.checkpointed(layers)
    if not n:
        return "checkpoints: none (no layer checkpointed)"
    every = f", one every {levers.checkpoint_every} layers" if levers.checkpoint_every > 1 else ""
    gpu, host = split["gpu checkpoints"] + split["gpu kept"], split["host checkpoints"] + split["host kept"]
    return (f"checkpoints: {split['checkpoints']} for {n} checkpointed layers{every}; the last {split['gpu layers']} "
            f"layers' on the GPU ({gpu / GiB:.1f} GiB), {n - split['gpu layers']} layers' on the host "
            f"({host / GiB:.1f} GiB per rank)")


def _table(rows, unit: str = "GiB") -> str:
    return "\n".join(f"  {k:<22} {v / GiB:8.1f} {unit}  {LABELS.get(k, LABELS.get(k.split(' (')[0], ''))}".rstrip()
                     for k, v in rows)


def _planned_flags(a: argparse.Namespace, sp: int, ring: int, levers: Levers) -> list[str]:
    """launch/train.py's flags for the plan: the model, the length, the layout and the levers that fit."""
    flags = [f"--model {a.model}" if a.model else f"--model_config {a.model_config or 'tiny'}"]
    flags += [f"--num_layers {a.num_layers}"] if a.num_layers else []
    flags += [f"--seq_len {a.seq_len}", f"--sp_size {sp}", f"--ring_size {ring}" if ring > 1 else ""]
    if a.use_peft:
        flags += [f"--use_peft --lora_r {a.lora_r} --lora_target_modules {a.lora_target_modules}"]
        flags += [f"--lora_modules_to_save {a.lora_modules_to_save}"] if a.lora_modules_to_save else []
        flags += ["--load_in_4bit"] if a.load_in_4bit else []
    flags += [levers.flags(a.ds_config)]
    return " ".join(f for f in flags if f).split()


def _gpu_rows(est: dict, levers: Levers) -> list:
    """The per-GPU components, the loss named with its kernel."""
    return [(f"loss ({levers.loss_kernel})" if k == "loss" else k, v) for k, v in est["gpu"].items()]


MAX_GPUS = 65536  # a plan's SP search and ring traffic stay instant up to here; a billion GPUs took a minute


def check_numbers(a: argparse.Namespace) -> None:
    """The planner's own flags, before any model is read: a plan of zero tokens, GPUs or memory is no plan."""
    if not 1 <= a.gpus <= MAX_GPUS:
        raise ConfigError(f"--gpus must be 1 to {MAX_GPUS:,}, got {a.gpus:,} (the planner's models are measured on "
                          f"one node; past that they are projections)")
    for name in ("gpu_mem_gib", "host_mem_gib"):
        value = getattr(a, name)
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name} must be a positive finite number, got {value}")
    if not a.longest and a.seq_len is not None and a.seq_len <= 0:
        raise ConfigError(f"--seq_len must be positive, got {a.seq_len}")
    if a.sp_size is not None:
        if a.sp_size < 1:
            raise ConfigError(f"--sp_size must be >= 1, got {a.sp_size}")
        if a.gpus % a.sp_size:
            raise ConfigError(f"--sp_size {a.sp_size} does not divide --gpus {a.gpus}: choose a divisor of {a.gpus} "
                              f"(the remaining factor is data parallel)")
    if a.ring_size is not None and (a.sp_size is None or a.sp_size % a.ring_size):
        raise ConfigError(f"--ring_size {a.ring_size} needs an --sp_size it divides")


def main(argv=None) -> int:
    """The command line; a setting to change is one line on stderr and exit code 2."""
    try:
        return _main(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ulysses_train.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_config", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--num_layers", type=int, default=None)
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--longest", action="store_true",
                   help="instead of --seq_len: find the longest sequence (a multiple of 8192) that fits, and plan it; "
                        "with a command (-- <flags>), the longest --seq_len of that command")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--sp_size", type=int, default=None)
    p.add_argument("--ring_size", default="auto",
                   help="a number, or auto (default): a ring only where the heads forbid a pure Ulysses split")
    p.add_argument("--gpu_mem_gib", type=float, default=139.7, help="default: an H200")
    p.add_argument("--host_mem_gib", type=float, default=125.0, help="per host")
    p.add_argument("--ds_config", default=None,
                   help="a DeepSpeed JSON: its ZeRO stage and optimizer precision/offload are used as given "
                        "(default: ZeRO-3, and the planner picks the optimizer states)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--fastest", action="store_true",
                   help="with a command (-- <flags>): search SP size, levers, checkpointed layers and micro-batch "
                        "for the least time per sequence that fits on --gpus, and print the fastest plans")
    p.add_argument("--constants", default=None, metavar="FILE",
                   help="the time model's constants (a --calibrate file); default: the H200's")
    p.add_argument("--use_peft", action="store_true",
                   help="plan LoRA (PEFT) on the frozen model: the adapters' flags below as launch/train.py takes them")
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_target_modules", default="all-linear")
    p.add_argument("--lora_modules_to_save", default=None)
    p.add_argument("--load_in_4bit", action="store_true", help="with --use_peft: the frozen base in NF4 (QLoRA)")
    p.add_argument("--calibrate", default=None, metavar="FILE",
                   help="measure this machine's constants (matmul, attention kernel, host copies; all-to-all under "
                        "torchrun) into FILE, and exit")
    return p


def _main(argv=None) -> int:
    from ..model.build import load_model_config

    argv = list(sys.argv[1:] if argv is None else argv)
    train_argv = None
    if "--" in argv:  # a command: the flags of launch/train.py after the planner's own (tools/plan_command.py)
        argv, train_argv = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = _parser()
    a = p.parse_args(argv)
    if a.calibrate:
        from .calibrate import calibrate

        calibrate(a.calibrate)
        return 0
    if train_argv is not None:
        if a.ring_size != "auto":
            p.error("with a command, give --ring_size among its flags (after --)")
        a.seq_len, a.ring_size = a.seq_len or 1, None  # the command gives the length and the ring
        check_numbers(a)
        return plan_command_main(a, train_argv)
    if a.fastest:
        p.error("--fastest plans a command: give the flags of launch/train.py after --")
    if not a.longest and a.seq_len is None:
        p.error("give --seq_len N, or --longest (or a command after --)")
    a.ring_size = None if a.ring_size == "auto" else ring_size_number(a.ring_size)
    check_numbers(a)
    config = load_model_config(a.model, a.model_config, a.num_layers)
    g = geometry(config)
    if a.use_peft or a.load_in_4bit:
        from ..model.adapters import AdapterSpec, _names, adapter_geometry, parse_target_modules

        if not a.use_peft:
            raise ConfigError("--load_in_4bit plans QLoRA: add --use_peft")
        spec = AdapterSpec(r=a.lora_r, modules_to_save=_names(a.lora_modules_to_save), load_in_4bit=a.load_in_4bit,
                           **parse_target_modules(a.lora_target_modules))
        g["adapters"] = adapter_geometry(config, spec)
    # the layout of the command line's sizes (by default the node's, --ring_size auto) on the planned GPUs: given
    # sizes the trainer refuses stop the plan with its message; refused default ones are said in the report
    flags, target = LayoutFlags(a.sp_size, a.ring_size), Target.planned(a.gpus)
    layout, refusal = (resolve_layout(flags, config, target), None) if a.sp_size else \
        layout_or_refusal(flags, config, target)
    sizes = sp_plans(config, a.gpus, a.sp_size, a.ring_size)
    if not sizes:  # not even --sp_size 1: the trainer's refusal of it
        resolve_layout(LayoutFlags(1), config, target)
    ds_choices = ds_config_choices(a.ds_config) if a.ds_config else None
    if a.longest:
        a.seq_len = longest_fit(g, a.gpus, sizes, a.gpu_mem_gib * GiB, a.host_mem_gib * GiB, ds_choices)
        if not a.seq_len:
            print(f"nothing fits even at 8,192 tokens on {a.gpus} GPU(s) of {a.gpu_mem_gib} GiB")
            return 1
        print(f"longest sequence that fits: {a.seq_len:,} tokens")
    sp, levers, est, tried = plan(g, a.seq_len, a.gpus, sizes, a.gpu_mem_gib * GiB, a.host_mem_gib * GiB,
                                  ds_choices)
    return _report(a, g, ds_choices, sp, levers, est, tried, layout, refusal)


def _report(a: argparse.Namespace, g: dict, ds_choices: Optional[dict], sp: Optional[int], levers: Optional[Levers],
            est: Optional[dict], tried: list, layout: Optional[Layout], refusal: Optional[str]) -> int:
    """Prints the plan (or why nothing fits) for the command line, as a table or with --json; the exit status."""
    if a.json:
        print(json.dumps({"sp_size": sp, "ring_size": est and est["ring_size"],
                          "levers": levers and levers.flags(a.ds_config), "estimate": est}, default=str))
        return 0 if sp else 1
    adapters = g.get("adapters")
    trained = (f" ({adapters['trainable'] / 1e6:.1f}M trained: LoRA r {adapters['rank']}"
               + (", 4-bit base" if adapters["quantized"] else "") + ")") if adapters else ""
    print(f"{g['params'] / 1e9:.2f}B params{trained}, {g['layers']} layers, {a.seq_len:,} tokens on {a.gpus} GPU(s)")
    print(default_flags(g, a.seq_len, a.gpus, layout, a.gpu_mem_gib * GiB, a.host_mem_gib * GiB, ds_choices,
                        refusal))
    if sp is None:
        sp_last, lev_last, worst, _ = tried[-1]
        print(f"nothing fits: with every lever and --sp_size {sp_last}, {worst['gpu_total'] / GiB:.1f} GiB per GPU "
              f"(limit {a.gpu_mem_gib}) and {worst['host_total'] / GiB:.1f} GiB host (limit {a.host_mem_gib}):")
        print(_table(_gpu_rows(worst, lev_last)))
        print("use more GPUs, a shorter --seq_len, or fewer layers")
        return 1
    print(f"fits with --sp_size {sp}{ring_flag(est['ring_size'])} {levers.flags(a.ds_config)}  "
          f"({est['tokens_per_rank']:,} tokens per rank)")
    print(predicted_time(g, a.seq_len, a.gpus, sp, levers, ds_choices, a.constants))
    print(checkpoint_line(est, levers, g["layers"]))
    print("per GPU:")
    print(_table(_gpu_rows(est, levers) + [("CUDA overhead", CUDA_OVERHEAD), ("total (peak)", est["gpu_total"])]))
    print(f"  of {a.gpu_mem_gib:.0f} GiB\nper host:")
    print(_table(list(est["host"].items()) + [("total", est["host_total"])]))
    print("sent per sequence and rank:")
    print(_table(est["sent_per_sequence"].items()))
    print("run it:\n  " + launch_command(a.gpus, _planned_flags(a, sp, est["ring_size"], levers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
