"""The planner on a command: `python -m ulysses_train.plan [--gpus N ...] -- <flags of launch/train.py>`.

The flags go through the trainer's own parser (train/config/flag_parser.py), DeepSpeed config reconciliation
(train/config/ds_config.py) and lever resolution (train/run/trainer.py: run_levers, the policy of levers/policy.py), for
the planned machine, so the plan is of the run those flags start. It prints that run's memory (tools/plan.py) and step
time (levers/time_model.py). With `--fastest` it searches, on the same GPUs (and nodes, 8 GPUs a node), the SP size,
the levers (kept attention, the offload, the tiled MLP, the optimizer on the GPU or the CPU), how many layers to
checkpoint and the micro-batch (micro x accumulation held at what the flags give), for the least time per sequence
among the plans that fit. What it keeps as given: the model, the length, the kernel, the loss, the optimizer states'
precision (a search never changes what is trained beyond the batch that the SP size's data parallelism implies).
The layout (SP and ring sizes, kernel, support check) is sp/layout.py's, resolved for CUDA GPUs of an H200's
capability with the kernels installed: `auto` kernels are planned as FlashAttention-4 where the trainer picks it
there (bf16, heads up to 256 wide); give `--attn_kernel sdpa` to plan cuDNN.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from ..levers.memory import estimate, fits, fits_on
from ..levers.policy import DeviceInfo, GiB, Levers, resolve_levers
from ..levers.time_model import Constants, Run, seconds_on, step_time
from ..model.build import load_model_config
from ..sp import dims
from ..sp.layout import Layout, Target, resolve_layout
from .preference_plan import pair_documents, preference_step_time, report_lines

TOP = 5  # plans --fastest prints


@dataclass(frozen=True)
class Machine:
    gpus: int
    gpu_mem: float  # bytes per GPU
    host_mem: float  # bytes per node
    gpus_per_node: int = 8

    def device(self) -> DeviceInfo:
        return DeviceInfo.gpu(self.gpu_mem / GiB, self.host_mem / GiB, local_ranks=min(self.gpus, self.gpus_per_node))

    def target(self) -> Target:
        """The machine as the layout sees it (sp/layout.py): CUDA GPUs of an H200's capability, the kernels
        installed, whatever this machine has."""
        return Target.planned(self.gpus, self.gpus_per_node)


@dataclass(frozen=True)
class Command:
    """A run's flags as the trainer resolves them on a planned machine."""

    cfg: object  # train/config/train_config.py TrainConfig
    g: dict
    layout: Layout  # sp/layout.py: the sizes, the kernel, the layers, as the trainer resolves them on the machine
    levers: Levers
    micro: int
    accum: int
    zero_stage: int
    act_bytes: int
    ds_choices: dict
    ds_config: Optional[str]  # the --ds_config typed, if one was

    @property
    def sp(self) -> int:
        return self.layout.sp_size

    @property
    def ring(self) -> int:  # --ring_size as resolved for `sp`
        return self.layout.ring_size

    @property
    def kernel(self) -> str:
        return self.layout.kernel


@dataclass(frozen=True)
class Plan:
    """One candidate: its layout, levers, memory and time."""

    sp: int
    micro: int
    accum: int
    levers: Levers
    memory: dict  # tools/plan.py estimate
    time: dict  # levers/time_model.py step_time
    fits: bool
    per_sequence: float  # step seconds per sequence trained


def command(train_argv: list[str], machine: Machine) -> Command:
    """The run of `train_argv` on `machine`, resolved by the trainer's own code."""
    from ..train.config.config_file import parse_args
    from ..train.config.ds_config import lever_choices, resolve_ds_config
    from ..train.config.ds_file import load_ds_config
    from ..train.preference.pairs import resolve_preference
    from ..train.run.trainer import run_geometry, run_levers

    cfg, explicit = parse_args(train_argv)
    resolve_preference(cfg, explicit)
    cfg.validate()
    config = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers)
    # the trainer's layout on the planned GPUs; what the trainer refuses, refused here
    layout = resolve_layout(cfg.layout_flags(), config, machine.target())
    ds = resolve_ds_config(load_ds_config(cfg.parallel.ds_config), cfg, explicit, layout.dp_size, layout.sp_size,
                           config.hidden_size, use_bf16=layout.bf16, random_init=cfg.base.model is None)
    g = run_geometry(cfg, config)  # with --use_peft, what the adapters change
    levers = run_levers(cfg, config, ds, layout, machine.device(), g)
    choices = lever_choices(ds)
    return Command(cfg, g, layout, levers, ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
                   choices["zero_stage"], 2 if layout.bf16 else 4, choices,
                   cfg.parallel.ds_config if "ds_config" in explicit else None)


def _estimate_settings(c: Command, sp: int) -> dict:
    """The command's settings the memory estimate takes beside the levers (the ring only at the command's SP)."""
    return {"loss_chunk": c.cfg.levers.loss_chunk_size, "tile_tokens": c.cfg.levers.mlp_tile_tokens,
            "ring": c.ring if sp == c.sp else 1, "pairs": c.cfg.pref.method != "sft"}


def evaluate(c: Command, machine: Machine, constants: Constants, sp: Optional[int] = None,
             levers: Optional[Levers] = None, micro: Optional[int] = None) -> Plan:
    """Memory and time of the command, or of it with another SP size, levers or micro-batch (the accumulation
    keeping micro x accumulation)."""
    sp, levers, micro = sp or c.sp, levers or c.levers, micro or c.micro
    accum = c.micro * c.accum // micro
    cfg = c.cfg
    pairs = cfg.pref.method != "sft"  # preference rows: tools/preference_plan.py
    memory = estimate(c.g, micro * cfg.data.seq_len, machine.gpus, sp, levers, zero_stage=c.zero_stage,
                      act_bytes=c.act_bytes, **_estimate_settings(c, sp))
    docs = pair_documents(cfg.data.seq_len, cfg.pref.max_length or cfg.data.seq_len // 2, micro) if pairs else None
    run = Run(c.g, cfg.data.seq_len, machine.gpus, sp, levers, c.kernel, micro, accum, c.zero_stage, docs=docs,
              act_bytes=c.act_bytes)
    time = preference_step_time(run, constants) if pairs else step_time(run, constants)
    sequences = machine.gpus // sp * micro * accum
    return Plan(sp, micro, accum, levers, memory, time, fits(memory, machine.gpu_mem, machine.host_mem),
                time["total"] / sequences)


def candidates(c: Command, machine: Machine, sp_sizes: Optional[list[int]] = None):
    """(sp, micro, lever request, DeepSpeed choices) of the search: every SP size the model's heads and the length
    allow, micro-batches dividing micro x accumulation, kept attention or not, offload or not, tiled MLP or not (a
    MoE has no dense MLP to tile), the optimizer on the GPU or (fp32 states) on the CPU."""
    heads, kv = c.g["heads"], c.g["kv"]
    batch = c.micro * c.accum
    optimizers = [{"offload_optimizer": False}] + ([] if c.ds_choices["bf16_states"]
                                                   else [{"offload_optimizer": True}])
    # a MoE has no dense MLP to tile; the adapters' dropout forbids tiling (levers/policy.py)
    tiling = ("off",) if c.g["experts"] or c.cfg.lever_request().adapter_dropout else ("off", "on")
    for sp in sp_sizes or dims.valid_sp_sizes(machine.gpus, heads, kv):
        if c.cfg.data.seq_len % sp and not c.cfg.data.pad_to_sp:
            continue
        for micro in (m for m in range(1, batch + 1) if batch % m == 0):
            for keep in ("never", "always"):
                for offload in (False, True):
                    for tiled in tiling:
                        for optimizer in optimizers:
                            request = dataclasses.replace(
                                c.cfg.lever_request(), attn_recompute=keep, offload_activations=offload,
                                tiled_mlp=tiled, gradient_checkpointing=True, checkpoint_layers="auto")
                            yield sp, micro, request, {**c.ds_choices, **optimizer}


def fastest(c: Command, machine: Machine, constants: Constants, sp_sizes: Optional[list[int]] = None) -> list[Plan]:
    """Every candidate (of these SP sizes; default: all) with the fewest checkpointed layers that fit (the fastest
    of its kind: each layer not checkpointed saves its recompute), the ones that fit sorted by time per sequence."""
    plans, seen = [], set()
    for sp, micro, request, choices in candidates(c, machine, sp_sizes):
        fits_here = fits_on(c.g, c.cfg.data.seq_len, machine.gpus, sp, machine.gpu_mem, machine.host_mem, c.zero_stage,
                            micro, c.act_bytes, **_estimate_settings(c, sp))
        seconds = seconds_on(c.g, c.cfg.data.seq_len, machine.gpus, sp, c.zero_stage, micro, c.act_bytes, constants)
        levers = resolve_levers(request, c.g, micro * math.ceil(c.cfg.data.seq_len / sp), c.act_bytes, machine.device(),
                                choices, fits_here, seconds)
        key = (sp, micro, levers)
        if key in seen:
            continue
        seen.add(key)
        plan = evaluate(c, machine, constants, sp, levers, micro)
        if plan.fits:
            plans.append(plan)
    return sorted(plans, key=lambda p: p.per_sequence)


def describe(plan: Plan, c: Command, machine: Machine) -> str:
    """The plan's flags (its SP size, micro-batch and levers) and what it costs."""
    layers = c.g["layers"]
    flags = f"--sp_size {plan.sp} " + plan.levers.flags(None if _optimizer_changed(plan, c) else c.ds_config)
    if plan.micro != c.micro:
        flags += f" --micro_batch_size {plan.micro} --grad_accum {plan.accum}"
    checkpointed = plan.levers.checkpointed(layers)
    return (f"{plan.time['total']:8.1f} s/step {plan.per_sequence:8.2f} s/sequence  "
            f"{plan.memory['gpu_total'] / GiB:6.1f} GiB/GPU {plan.memory['host_total'] / GiB:6.1f} GiB/node  "
            f"comm {100 * plan.time['communication_share']:4.1f}%  checkpointed {checkpointed}/{layers}  {flags}")


def _optimizer_changed(plan: Plan, c: Command) -> bool:
    return plan.levers.offload_optimizer != c.ds_choices.get("offload_optimizer", False)


def report(plan: Plan, c: Command, machine: Machine) -> str:
    """Memory and time of one run, part by part."""
    cfg, g = c.cfg, c.g
    seq_len = cfg.data.seq_len
    lines = [f"{g['params'] / 1e9:.2f}B params, {g['layers']} layers, {seq_len:,} tokens, {machine.gpus} GPU(s) "
             f"(sp {plan.sp} x dp {machine.gpus // plan.sp}), micro {plan.micro} x accum {plan.accum}, kernel "
             f"{c.kernel}",
             f"levers: {plan.levers.flags(c.ds_config)}, fused kernels {plan.levers.fused_kernels}, checkpointed "
             f"layers {plan.levers.checkpointed(g['layers'])} of {g['layers']}",
             f"memory: {plan.memory['gpu_total'] / GiB:.1f} GiB per GPU of {machine.gpu_mem / GiB:.1f}, "
             f"{plan.memory['host_total'] / GiB:.1f} GiB per node of {machine.host_mem / GiB:.1f}: "
             f"{'fits' if plan.fits else 'does not fit'}"]
    lines += [f"  {k:<24}{v / GiB:8.1f} GiB" for k, v in plan.memory["gpu"].items()]
    lines.append(f"time: {plan.time['total']:.2f} s per step ({plan.per_sequence:.2f} s per sequence, "
                 f"{machine.gpus // plan.sp * plan.micro * plan.accum * seq_len / plan.time['total']:,.0f} "
                 f"tokens/s); communication {100 * plan.time['communication_share']:.1f}% of it")
    lines += [f"  {k:<32}{v:8.2f} s" for k, v in plan.time["parts"].items()]
    if c.ring > 1 and plan.sp == c.sp:
        lines.append(f"  (--ring_size {c.ring}: the ring's memory is counted; its point-to-point sends are not in the "
                     f"time model yet)")
    lines.append(f"  {'overlapped copies, collectives':<32}" + ", ".join(
        f"{k} {v:.2f} s" for k, v in plan.time["overlapped"].items()))
    if cfg.pref.method != "sft":
        lines += report_lines(cfg.pref.method, cfg.pref.max_length or seq_len // 2, plan.time, machine.gpus, plan.sp)
    return "\n".join(lines)


def longest(train_argv: list[str], machine: Machine, constants: Constants, any_plan: bool,
            step: int = 8192) -> int:
    """The longest --seq_len (a multiple of `step`) at which the command fits as its flags resolve, or with
    `any_plan` (--fastest) at which some plan of the search fits; 0 if none does even at the shortest. Preference rows
    take sides of half the row unless the command sets --max_length. Whether a run fits only gets harder with the
    length: double, then bisect (as tools/plan.py: longest_fit), from the shortest row that holds a pair's two sides
    of --max_length where the command sets it."""
    from ..train.config.config_file import parse_args

    def fits_at(n: int) -> bool:
        c = command(train_argv + ["--seq_len", str(n * step)], machine)
        return bool(fastest(c, machine, constants)) if any_plan else evaluate(c, machine, constants).fits

    max_length = parse_args(train_argv)[0].pref.max_length
    first = -(-2 * max_length // step) if max_length else 1  # a row holds both sides of --max_length
    if not fits_at(first):
        return 0
    lo, hi = first, 2 * first
    while hi * step < 2**31 and fits_at(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo * step


def launch_command(gpus: int, train_flags: list[str]) -> str:
    """The command that starts the planned run on `gpus` GPUs (8 a node: more take a hostfile), copyable."""
    import shlex

    nodes = "" if gpus <= 8 else f"--num_nodes {math.ceil(gpus / 8)} --hostfile HOSTFILE "
    return f"deepspeed {nodes}--num_gpus {min(gpus, 8)} launch/train.py " + " ".join(shlex.quote(f) for f in
                                                                                     train_flags)


def main(plan_args, train_argv: list[str]) -> int:
    """`plan [--longest] [--fastest] -- <train flags>`: the run's memory and time, or the fastest plans that fit;
    with --longest, at the longest --seq_len that fits."""
    from ..train.config.config_file import parse_args

    constants = Constants.load(plan_args.constants)
    machine = Machine(plan_args.gpus, plan_args.gpu_mem_gib * GiB, plan_args.host_mem_gib * GiB,
                      constants.gpus_per_node)
    if plan_args.longest:
        if "seq_len" in parse_args(train_argv)[1]:
            raise ConfigError("--longest chooses --seq_len: leave it out of the command after --")
        seq_len = longest(train_argv, machine, constants, plan_args.fastest)
        if not seq_len:
            print(f"nothing fits on {machine.gpus} GPU(s) of {plan_args.gpu_mem_gib} GiB even at the shortest "
                  f"--seq_len (8,192 tokens, or a row of two sides of --max_length)")
            return 1
        print(f"longest sequence that fits: {seq_len:,} tokens" + (" (some plan of the search)" if plan_args.fastest
                                                                    else " (the command's levers as they resolve)"))
        train_argv = train_argv + ["--seq_len", str(seq_len)]
    c = command(train_argv, machine)
    print(report(evaluate(c, machine, constants), c, machine))
    if not plan_args.fastest:
        print("run it:\n  " + launch_command(machine.gpus, train_argv))
        return 0
    plans = fastest(c, machine, constants)
    if not plans:
        print(f"\nnothing fits on {machine.gpus} GPU(s): use more GPUs or a shorter --seq_len")
        return 1
    print(f"\nfastest that fit on {machine.gpus} GPU(s) (time per sequence; constants: {constants.name}):")
    for plan in plans[:TOP]:
        print("  " + describe(plan, c, machine))
    print("run the fastest:\n  " + launch_command(machine.gpus, train_argv + describe(plans[0], c, machine).split(
        "  ")[-1].split()))  # its flags last: they win over the command's
    return 0
