"""The run, built: distributed setup, data, the model with its levers, the DeepSpeed engine (not HF Trainer).

    deepspeed launch/train.py --ds_config ds_configs/zero3.json [flags]

Every rank of an SP group receives the same whole sequence, keeps its `seq/sp` shard, and runs the model with
Ulysses attention; the loss is normalised over the whole SP group. The true gradient of a sequence is the *sum* of
its SP ranks' contributions; `sp_backward_scale` says how much each rank must scale its share for DeepSpeed's
gradient averaging to produce exactly that, so gradients equal the single-process gradients. The loop that drives
this object is loop.py; the command line, cli.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...data.held_out import split_off
from ...data.load import load_source
from ...data.pair_packing import preference_batch
from ...data.sources import SyntheticSource, build_batch, global_sample_index, sample_order
from ...errors import ConfigError
from ...levers.loss import CausalLMWithSPLoss, sp_backward_scale
from ...levers.master_weights import share_master_weights
from ...levers.memory import estimate_on, fits_with
from ...levers.offload import HostOffload
from ...levers.policy import DeviceInfo, Levers, resolve_levers
from ...levers.preference_loss import PreferenceLMWithSPLoss
from ...levers.rope import configure_rope
from ...levers.time_model import seconds_on
from ...model.adapters import AdapterSpec, adapter_geometry, add_adapters, check_4bit, quantization_config
from ...model.buffers import restore_fp32_buffers
from ...model.build import build_model, load_model_config, model_config_values
from ...model.geometry import geometry
from ...model.surgery import apply_levers, apply_sp_patches
from ...sp.attention import register_ulysses_attention
from ...sp.groups import SequenceParallelGroups, init_distributed, local_world_size
from ...sp.layout import Layout, Target, resolve_layout
from ...sp.support import describe_layers
from ..checkpoints.checkpoint import load_checkpoint, newest_complete, save_checkpoint
from ..checkpoints.disk_space import checkpoint_bytes, estimated_checkpoint_bytes, saved_parameters, too_little_space
from ..checkpoints.resume import (
    apply_optimizer_settings,
    apply_schedule,
    check_trained_shapes,
    dataset_setting,
    plan_run,
    training_settings,
)
from ..checkpoints.run_folder import abandon_newer
from ..checkpoints.run_lock import RunLock
from ..config.config_file import write_resolved_config
from ..config.ds_config import lever_choices, resolve_ds_config, resolved_lr
from ..config.ds_file import load_ds_config
from ..config.train_config import TrainConfig, verify_seq_len
from ..preference.pairs import PAIRS, preference_spec, resolve_preference
from ..preference.reference_logps import check_reference_config, checkpoint_arrays, reference_logps
from ..process.faults import StopFlag
from ..process.launcher import exit_now
from ..process.teardown import destroy_process_groups, release_engine
from ..process.watchdog import Watchdog
from ..step.loop import TOKENS
from ..step.schedule import lr_factor, warmup_steps
from ..step.tracking import start_trackers
from .memory_check import explicit_flags, memory_warning
from .preflight import preflight


def _init_distributed(backend: str) -> bool:
    """init_distributed, with a busy rendezvous port (another run on this host) as a setting to change. Returns
    whether it created the default process group (else the caller's is used, and stays)."""
    created = not dist.is_initialized()
    try:
        init_distributed(backend)
    except Exception as e:  # torch's DistNetworkError, or a RuntimeError from older releases
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        raise ConfigError(f"the rendezvous port {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} is "
                          f"in use (another run on this host?): give the launcher another port (deepspeed "
                          f"--master_port N, torchrun --master_port N) or set MASTER_PORT") from None
    return created


def verify_folder(cfg: TrainConfig) -> str:
    """Where --verify writes (its report and settings): `<output_dir>/verify/`, beside a training run's files."""
    return os.path.join(cfg.output.output_dir, "verify")


def run_geometry(cfg: TrainConfig, model_config) -> dict:
    """The model's geometry (model/geometry.py) with, under --use_peft, what the adapters change (`adapters`:
    model/adapters.py), which the planner's memory and time count."""
    g = geometry(model_config)
    spec = AdapterSpec.from_config(cfg.adapters)
    g["adapters"] = adapter_geometry(model_config, spec) if spec else None
    return g


def run_layout(cfg: TrainConfig, model_config, world: int, device_type: str, capability: tuple[int, int] = (0, 0),
               local_ranks: Callable[[], int] = local_world_size) -> Layout:
    """This run's layout (sp/layout.py) on this machine: `world` ranks of `device_type` (of compute capability
    `capability` on CUDA); `local_ranks` counts the ranks on this host (a collective), asked only for the default
    --sp_size."""
    local = local_ranks() if cfg.parallel.sp_size is None else None
    return resolve_layout(cfg.layout_flags(), model_config, Target(world, local, device_type, tuple(capability)))


def run_estimate(cfg: TrainConfig, model_config, ds: dict, layout: Layout, g: Optional[dict] = None):
    """The planner's memory estimate (levers/memory.py) of this run with given levers: a function of the levers."""
    return estimate_on(g or run_geometry(cfg, model_config), cfg.data.seq_len, layout.world_size, layout.sp_size,
                       lever_choices(ds).get("zero_stage", 3), ds["train_micro_batch_size_per_gpu"],
                       2 if layout.bf16 else 4, loss_chunk=cfg.levers.loss_chunk_size,
                       tile_tokens=cfg.levers.mlp_tile_tokens, ring=layout.ring_size, pairs=cfg.pref.method != "sft")


def run_levers(cfg: TrainConfig, model_config, ds: dict, layout: Layout, device: DeviceInfo,
               g: Optional[dict] = None) -> Levers:
    """The policy's levers for this run, chosen for --seq_len (what the planner computes for the same flags); `g`:
    run_geometry's, computed here if not given."""
    micro = ds["train_micro_batch_size_per_gpu"]
    local_tokens = micro * math.ceil(cfg.data.seq_len / layout.sp_size)
    g, choices = g or run_geometry(cfg, model_config), lever_choices(ds)
    act_bytes = 2 if layout.bf16 else 4  # bf16 or fp32 activations
    # the planner's memory estimate: how many layers `--checkpoint_layers auto` checkpoints, and whether
    # `--attn_recompute auto` can keep the attention outputs
    fits = fits_with(run_estimate(cfg, model_config, ds, layout, g), device.memory_bytes, device.host_memory_bytes)
    # the time model's step: how many layers `--keep_projections auto` keeps their projections in
    seconds = seconds_on(g, cfg.data.seq_len, layout.world_size, layout.sp_size, choices.get("zero_stage", 3), micro,
                         act_bytes)
    return resolve_levers(cfg.lever_request(), g, local_tokens, act_bytes, device, choices, fits, seconds)


class Trainer:
    """Everything one rank needs to train: `groups`, `source`, `engine`, `levers`, the resolved batch sizes."""

    def __init__(self, cfg: TrainConfig, explicit: set[str], process_exits: bool = False):
        # what the run holds in its process (process groups, signal handlers, the watchdog's thread, the output
        # folder's lock, the engine), each released by close() in reverse order, also when building fails.
        # `process_exits` (the command line): the process ends with the run, so the default process group it
        # creates stays, and with it rank 0's rendezvous store, through which every rank's error is reported once
        # (process/report.py) after close(): destroying it in close() would take the store while rank 1 waits on it
        self.process_exits = process_exits
        self.resources = contextlib.ExitStack()
        try:
            self._build(cfg, explicit)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Releases what the run holds, so that the process can go on (the Python API) or train again: the engine,
        transformers' ZeRO-3 setting, our process groups (the default one too if the run created it), the
        watchdog's thread, the lock, the signal handlers. Idempotent."""
        self.resources.close()
        for name in ("engine", "module", "groups", "attention", "_hf_ds", "offload"):
            setattr(self, name, None)  # a traceback that keeps this object must not keep the groups' threads

    def _build(self, cfg: TrainConfig, explicit: set[str]) -> None:
        from deepspeed.accelerator import get_accelerator
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        self.explicit = explicit  # the flags given, which the memory check's planner command repeats
        method_note = resolve_preference(cfg, explicit)  # --method from the data, packed pairs
        cfg.validate()
        preflight(cfg)  # model, tokenizer and dataset paths, before anything is loaded
        self.cfg, self.seq_len = cfg, verify_seq_len(cfg)
        self.model_config = load_model_config(cfg.base.model, cfg.base.model_config, cfg.base.num_layers)
        self.model_config.use_cache = False
        if cfg.pref.ref_model:  # before the data and the model: a reference that cannot stand in stops here
            check_reference_config(cfg.pref.ref_model, self.model_config)
        base = cfg.base
        self.rope = configure_rope(self.model_config, base.rope_scaling, cfg.data.seq_len, base.rope_factor,
                                   base.rope_theta, base.rope_original_max_positions)
        accel = get_accelerator()
        self.owns_process_group = _init_distributed(accel.communication_backend_name())
        if self.owns_process_group and not self.process_exits:
            self.resources.callback(destroy_process_groups)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if method_note:
            self.log(method_note)
        self.stop = StopFlag()
        self.resources.callback(self.stop.restore)
        self.lock = self._lock_output_dir()
        if self.lock is not None:
            self.resources.callback(self.lock.release)
        self.watchdog = Watchdog(self.rank, self.world, cfg.parallel.dist_timeout, self.stop.request, exit_now).start()
        self.resources.callback(self.watchdog.stop)
        self.device = torch.device(accel.device_name(int(os.environ.get("LOCAL_RANK", 0))))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._allow_tf32(cfg.levers.tf32)
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0)
        # before the data and the model: sizes, kernel and every layer checked (sp/layout.py); a layer this run
        # cannot make exact stops it here (sp/support.py)
        self.layout = layout = run_layout(cfg, self.model_config, self.world, self.device.type, capability)
        sp_size, ring_size, self.kernel, self.layers = layout.sp_size, layout.ring_size, layout.kernel, layout.layers
        use_bf16 = layout.bf16
        self.adapter_spec = AdapterSpec.from_config(cfg.adapters)
        if self.adapter_spec and self.adapter_spec.load_in_4bit:
            check_4bit(self.device)
        self.geometry = run_geometry(cfg, self.model_config)  # before zero.Init: adapters counted on the meta device
        self.dtype = torch.bfloat16 if use_bf16 else torch.float32
        raw_ds = load_ds_config(cfg.parallel.ds_config)
        self.ds = resolve_ds_config(raw_ds, cfg, explicit, layout.dp_size, sp_size, self.model_config.hidden_size,
                                    use_bf16, cfg.base.model is None)
        self.micro, self.accum = self.ds["train_micro_batch_size_per_gpu"], self.ds["gradient_accumulation_steps"]
        if cfg.optim.skip_nonfinite and self.accum > 1:
            raise ConfigError("--skip_nonfinite needs --grad_accum 1 (a step is skipped whole)")
        self.lr = resolved_lr(self.ds, cfg, cfg.base.model is None)
        self.checkpoint = None  # the newest of this run: resumed from, then each save
        self.trackers = None
        # --epochs: the steps, a training setting, are known once the data is
        steps_from_epochs = cfg.optim.epochs is not None and "steps" not in explicit

        def plan() -> None:  # before the model: a run that cannot write, or must not start, stops in seconds
            self.settings = self._training_settings(raw_ds, use_bf16)  # (with --epochs, after the data)
            self.plan = plan_run(cfg, self.settings, layout.dp_size, sp_size, "scheduler" not in self.ds,
                                 self.rank, self.log, self.warn)
            # --report_to's trackers started (a server that refuses or does not answer named) before the model
            resuming = self.plan.checkpoint is not None
            self.trackers = None if cfg.check.verify else start_trackers(cfg, resuming, self.rank)
            if self.trackers is not None:
                self.resources.callback(self.trackers.close)  # a run that stops before its logger closes them
        if not steps_from_epochs:
            plan()

        self.groups = SequenceParallelGroups(sp_size, ring_size)
        if not self.owns_process_group:  # the caller's default group stays; ours go
            groups = self.groups
            self.resources.callback(lambda: destroy_process_groups(groups.own_groups()))
        self.tokenizer, self.source = self._prepare_data()
        self.eval_source = None
        if cfg.eval.val_set_size and not cfg.check.verify:
            self.source, self.eval_source = split_off(self.source, cfg.eval.val_set_size, cfg.data.seed)
            self.log(f"val_set_size {cfg.eval.val_set_size:g}: {self.eval_source.num_samples:,} samples held out as "
                     f"the eval set, {self.source.num_samples:,} to train on")
        self._per_epoch(layout.dp_size)
        if steps_from_epochs:
            cfg.optim.steps = self._steps_of_epochs(layout.dp_size)
            cfg.check_steps()
            plan()
        if cfg.eval.eval_dataset and not cfg.check.verify:
            self.eval_source = load_source(cfg.data_settings(), cfg.eval.eval_dataset,
                                           cfg.eval.eval_split or cfg.data.dataset_split, self.seq_len,
                                           self.model_config.vocab_size, self.rank, self.log, "eval_dataset")[1]
        self.attention = register_ulysses_attention(self.groups.ulysses_group, self.kernel, self.groups.ring_group)
        # must outlive model construction: transformers reads it to build the model inside zero.Init
        self._hf_ds = HfDeepSpeedConfig(self.ds) if self.ds["zero_optimization"].get("stage") == 3 else None
        if self._hf_ds is not None:  # models built after this run are plain again
            self.resources.callback(unset_hf_deepspeed_config)
        self.spec = preference_spec(cfg)  # None for SFT
        self.step_kind = TOKENS if self.spec is None else PAIRS  # what the loop's step and evaluation are
        module = CausalLMWithSPLoss if self.spec is None else PreferenceLMWithSPLoss
        self.module = module(self._build_model(), self.groups.sp_group)
        self.engine = self._init_engine()
        self.resources.callback(release_engine, self.engine)
        self.backward_scale = sp_backward_scale(self.ds, sp_size)
        # DPO's reference: the weights before any checkpoint is loaded (train/preference/reference_logps.py)
        self.reference = self.eval_reference = None
        if self.spec is not None and self.spec.uses_reference:
            sources = [self.source] + ([self.eval_source] if self.eval_source is not None else [])
            self.reference, *rest = reference_logps(self, *sources, checkpoint=self.plan.checkpoint)
            self.eval_reference = rest[0] if rest else None
        self.start_step = self._resume()
        # an engine that casts buffers, or a checkpoint that holds rounded ones, is undone too
        after_engine = restore_fp32_buffers(self.module, self.dtype)
        if after_engine.restored:
            self.log(f"buffers after deepspeed.initialize and resume: {after_engine.describe()}")
        self.log(f"world {self.world} = dp {layout.dp_size} x sp {self.describe_sp()} | kernel {self.kernel} | dtype "
                 f"{self.dtype} | micro {self.micro} x accum {self.accum} | seq_len {self.seq_len} | "
                 f"{sum(getattr(p, 'ds_numel', p.numel()) for p in self.module.parameters()) / 1e6:.1f}M params | "
                 f"{self.model_config.num_hidden_layers} layers ({describe_layers(self.layers)}) | "
                 f"{self.describe_levers()} | rope {self.rope} | "
                 f"tokenizer {type(self.tokenizer).__name__ if self.tokenizer else 'none (generated tokens)'}")
        if self.rank == 0 and not cfg.check.verify and (cfg.output.save_steps or cfg.output.save_final):
            self._warn_if_a_checkpoint_does_not_fit()
        if self.rank == 0:  # --verify leaves a training folder's own files alone: its outputs go to verify/
            write_resolved_config(cfg, verify_folder(cfg) if cfg.check.verify else None)

    # ---------------------------------------------------------------- building

    def _training_settings(self, raw_ds: dict, use_bf16: bool) -> dict:
        """What this run trains, as resolved (saved in each checkpoint, compared on resume: resume.py)."""
        return training_settings(self.cfg, {
            "lr": self.lr, "micro_batch_size": self.micro, "grad_accum": self.accum,
            "max_grad_norm": self.ds["gradient_clipping"], "dtype": "bf16" if use_bf16 else "fp32",
            "ds_config": raw_ds, "model_config": model_config_values(self.cfg.base.model_config)
            if self.cfg.base.model_config else None, **dataset_setting(self.cfg.data.dataset)})

    def _per_epoch(self, dp_size: int) -> None:
        """--evals_per_epoch and --saves_per_epoch as --eval_steps and --save_steps, from an epoch's steps."""
        cfg = self.cfg
        counts = [(name, getattr(group, f"{name}s_per_epoch"), group) for name, group in
                  (("eval", cfg.eval), ("save", cfg.output)) if getattr(group, f"{name}s_per_epoch")]
        if not counts:
            return
        epoch = math.ceil(self.source.num_samples / (self.micro * self.accum * dp_size))
        for name, times, group in counts:
            setattr(group, f"{name}_steps", max(1, epoch // times))
            self.log(f"{name}s_per_epoch {times}: every {getattr(group, f'{name}_steps')} steps (an epoch is "
                     f"{epoch} steps)")

    def _steps_of_epochs(self, dp_size: int) -> int:
        """--epochs passes over the training samples, in optimizer steps (the last one may be partial)."""
        cfg, per_step = self.cfg, self.micro * self.accum * dp_size
        steps = max(1, math.ceil(cfg.optim.epochs * self.source.num_samples / per_step))
        self.log(f"epochs: {cfg.optim.epochs:g} x {self.source.num_samples:,} samples / {per_step} a step = {steps} "
                 f"steps")
        return steps

    def _build_model(self):
        """The HF model with the levers the policy resolves for --seq_len, installed by model/surgery.py."""
        cfg = self.cfg
        torch.manual_seed(cfg.data.seed)
        spec = self.adapter_spec
        request = cfg.lever_request()
        device = DeviceInfo.of(self.device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        levers = run_levers(cfg, self.model_config, self.ds, self.layout, device, self.geometry)
        warning = memory_warning(run_estimate(cfg, self.model_config, self.ds, self.layout, self.geometry), levers,
                                 device, explicit_flags(cfg, self.explicit))
        if warning:  # before the model: the build of a run this large takes minutes
            self.warn(warning)
        model = build_model(self.model_config, cfg.base.model, self.dtype, log=self.log,
                            quantization=quantization_config(self.dtype) if spec and spec.load_in_4bit else None)
        # from_pretrained returns the model in eval mode, where transformers' layers skip their checkpointing (and
        # dropout): a --model run trained with every activation kept, the --model_config one did not
        model.train()
        # the adapters go in before the surgery, which then finds (and calls) PEFT's layers where the linears were
        self.adapters = add_adapters(model, spec, input_grads=levers.checkpointing) if spec else None
        if self.adapters:
            self.log(f"adapters: {self.adapters.describe()}")
        self.offload = HostOffload() if levers.offload_activations else None
        self.levers, self.surgery = apply_levers(model, levers, request, self.device, self.dtype,
                                                 cfg.levers.loss_chunk_size, cfg.levers.mlp_tile_tokens, self.offload)
        # the same group as the attention's; with packing the DeltaNet mixers read its documents
        self.linear_kernel = apply_sp_patches(model, self.groups.ulysses_group, self.surgery, self.device,
                                              cfg.levers.linear_kernel, self.attention if cfg.data.packing else None)
        if self.linear_kernel is not None and self.linear_kernel.why:
            self.log(f"linear_kernel {self.linear_kernel.why}")
        if self.levers.keep_linear and self.linear_kernel is not None and self.linear_kernel.name != "fla":
            self.levers = dataclasses.replace(self.levers, keep_linear=False, why={
                **self.levers.why, "keep_linear": "off: the torch rule (--linear_kernel torch) is not a kept op; "
                                                  "its recurrence runs again in the recompute"})
        if self.levers.why:
            self.log("levers: " + "; ".join(f"{lever} {reason}" for lever, reason in self.levers.why.items()))
        return model

    def _init_engine(self):
        import deepspeed

        cfg = self.cfg
        optimizer = scheduler = None
        # only what is trained has optimizer states (everything but frozen base weights under --use_peft)
        trained = [p for p in self.module.parameters() if p.requires_grad]
        if "optimizer" not in self.ds:
            optimizer = torch.optim.AdamW(trained, lr=self.lr, betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
                                          eps=cfg.optim.adam_epsilon, weight_decay=cfg.optim.weight_decay,
                                          fused=self.device.type == "cuda")
        if "scheduler" not in self.ds:
            warmup = warmup_steps(cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.warmup_ratio)
            factor = lr_factor(cfg.optim.lr_scheduler_type, cfg.optim.steps, warmup, cfg.optim.min_lr_ratio)
            scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)  # noqa: E731
        engine, *_ = deepspeed.initialize(model=self.module, model_parameters=None if optimizer else
                                          trained, optimizer=optimizer, lr_scheduler=scheduler,
                                          config=self.ds, mpu=self.groups)
        freed = share_master_weights(engine.optimizer) if self.levers.share_master else 0
        if freed:
            self.log(f"master weights share the model's partition: {freed / 2**30:.2f} GiB freed per rank")
        return engine

    def _allow_tf32(self, allowed: bool) -> None:
        """--tf32 for this run's fp32 matmuls and convolutions; the process's setting comes back after it."""
        matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
        before = (matmul.allow_tf32, cudnn.allow_tf32)
        matmul.allow_tf32 = cudnn.allow_tf32 = allowed

        def restore():
            matmul.allow_tf32, cudnn.allow_tf32 = before
        self.resources.callback(restore)

    def _lock_output_dir(self) -> Optional[RunLock]:
        """Rank 0 holds the output folder's lock; its outcome is broadcast, so a folder in use stops every rank."""
        lock, outcome = None, [None, None]  # (error, note)
        if self.rank == 0:
            lock = RunLock(self.cfg.output.output_dir)
            try:
                outcome[1] = lock.acquire()
            except ConfigError as e:
                outcome[0] = str(e)
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise ConfigError(outcome[0])
        if outcome[1]:
            self.log(f"warning: {outcome[1]}")
        return lock

    def _resume(self) -> int:
        """Loads the checkpoint the plan chose (resume.py), puts the lr schedule on this run's flags, and makes the
        checkpoint's line the current one (newer checkpoints moved aside: run_folder.py)."""
        self.resume_from = self.plan.checkpoint
        if not self.resume_from:
            return 0
        self.checkpoint = self.resume_from
        check_trained_shapes(self.module, self.resume_from, self.rank)  # a clear error, not DeepSpeed's mid-load
        state = load_checkpoint(self.engine, self.resume_from, self.rank, adapters_only=self.adapters is not None)
        if "optimizer" not in self.ds:  # the checkpoint's param groups came back with their betas, eps and decay
            apply_optimizer_settings(self.engine.optimizer, self.cfg)
        if "scheduler" not in self.ds:  # ours (schedule.py); a DS-config scheduler keeps its own state
            apply_schedule(self.engine.lr_scheduler, self.lr)
        if self.rank == 0 and not self.cfg.check.verify:
            abandon_newer(self.cfg.output.output_dir, self.resume_from, self.log)
        dist.barrier()
        overridden = f" with {', '.join(self.plan.overridden)} (--resume_override)" if self.plan.overridden else ""
        self.log(f"resumed from {self.resume_from} at step {state['step']}{overridden}")
        return state["step"]

    def _prepare_data(self):
        """Tokenizer and sample source of --dataset (generated tokens without one), and of --eval_dataset."""
        cfg = self.cfg
        if not cfg.data.dataset:
            from ...data.corpus import load_tokenizer

            # generated tokens need none; a model's tokenizer (or --tokenizer) is saved with its checkpoints
            tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.base.model, need_eos=False) if cfg.base.model else None
            return tokenizer, SyntheticSource(self.model_config.vocab_size, self.seq_len, cfg.data.seed)
        return load_source(cfg.data_settings(), cfg.data.dataset, cfg.data.dataset_split, self.seq_len,
                           self.model_config.vocab_size, self.rank, self.log)

    # ---------------------------------------------------------------- what the loop and --verify use

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def warn(self, message: str) -> None:
        if self.rank == 0:
            print(f"warning: {message}", file=sys.stderr, flush=True)

    def describe_levers(self) -> str:
        lv, counts = self.levers, self.surgery.counts
        gated_norms = counts.get("gated RMSNorm", (0, 0))[0]
        fused = (f"{counts['RMSNorm'][0]} norms, {counts['rotary'][0]} rotary, {counts['gated MLP'][0]} gated MLP"
                 + (f", {gated_norms} gated norms" if gated_norms else "")
                 if lv.fused_kernels else "off" + (f" ({lv.why['fused_kernels']})" if "fused_kernels" in lv.why
                                                   and lv.why["fused_kernels"].startswith("auto: off,") else ""))
        norms = counts.get("RMSNorm", (0, 0))[0] if lv.lean_norm or lv.fused_kernels else 0
        loss = f"{lv.loss} ({lv.loss_kernel})" if lv.loss == "fused" else lv.loss
        layers = self.model_config.num_hidden_layers
        checkpointed = f"{lv.checkpointed(layers)} of {layers} layers" if lv.checkpointing else "off"
        deltanet = (f" | DeltaNet mixers: {counts['DeltaNet mixer'][0]} ({self.linear_kernel.name})"
                    if "DeltaNet mixer" in counts else "")
        kept = f"attention kept: {lv.keep_attention}" + ("" if lv.keep_linear is None else
                                                          f", gated delta rule kept: {lv.keep_linear}")
        kept += f", projections kept in {lv.keep_projections} layers" if lv.keep_projections else ""
        return (f"loss {loss} | checkpointing {checkpointed} ({kept}, offload: "
                f"{lv.offload_activations}) | tiled MLP: {lv.tiled_mlp} | lean norms: {norms} | fused kernels: "
                f"{fused}{deltanet}")

    def describe_sp(self) -> str:
        g = self.groups
        return str(g.sp_size) if g.ring_size == 1 else f"{g.sp_size} (Ulysses {g.ulysses_size} x ring {g.ring_size})"

    def describe_setup(self) -> str:
        """One line naming what makes this run's numbers: parallel sizes, ZeRO stage, kernel and levers."""
        zero = self.ds["zero_optimization"].get("stage", 0)
        return (f"ZeRO-{zero}, sp {self.describe_sp()} x dp {self.groups.dp_size}, kernel {self.kernel}, "
                f"{self.describe_levers().replace(' | ', ', ')}"
                + (f", {self.adapters.describe()}" if self.adapters else ""))

    def micro_batch(self, step: int, micro_step: int, dp_rank: Optional[int] = None) -> dict:
        """This SP group's whole sequences for one micro-step (the same on every rank of the group); or those of
        the SP groups of another `dp_rank`."""
        g = self.groups
        dp_rank = g.dp_rank if dp_rank is None else dp_rank
        rows = []
        for r in range(self.micro):
            index = global_sample_index(step, micro_step, self.accum, dp_rank, g.dp_size, self.micro, r)
            rows.append(self.source.get(sample_order(index, self.source.num_samples, self.cfg.data.seed)))
        return build_batch(rows, self.cfg.data.packing) if self.spec is None else preference_batch(rows, self.reference)

    def save(self, step: int) -> str:
        state = {"step": step, "data_position": step * self.accum * self.groups.dp_size * self.micro,
                 "seed": self.cfg.data.seed, "dp_size": self.groups.dp_size, "sp_size": self.groups.sp_size,
                 "config": self.cfg.to_dict(), "settings": self.settings}
        path = save_checkpoint(self.engine, self.cfg.output.output_dir, step, state, self.model_config, self.tokenizer,
                               self.rank, self.cfg.output.save_total_limit, adapters=self.adapters,
                               base_model=self.cfg.base.model, arrays=checkpoint_arrays(self))
        self.log(f"saved checkpoint {path}")
        self.checkpoint = path
        if self.rank == 0 and step < self.cfg.optim.steps:
            problem = too_little_space(os.path.dirname(path), checkpoint_bytes(path), f"the size of {path}")
            if problem:
                self.warn(f"the next save will fail: {problem}")
        return path

    def barrier(self) -> None:
        dist.barrier()

    def _warn_if_a_checkpoint_does_not_fit(self) -> None:
        """Before training: the first save's room, against the newest checkpoint's size or else an estimate."""
        root = os.path.join(self.cfg.output.output_dir, "checkpoints")
        previous = newest_complete(self.cfg.output.output_dir)
        need, what = checkpoint_bytes(previous), f"the size of {previous}"
        if need is None:  # an adapter run saves only what it trains (disk_space.py)
            adapters = self.adapters is not None
            need = estimated_checkpoint_bytes(saved_parameters(self.module, adapters), self.dtype.itemsize, adapters)
            what = "estimated"
        problem = too_little_space(root, need, what)
        if problem:
            self.warn(f"the first save will fail: {problem}")
