"""The training loop, driven by the DeepSpeed engine (not HF Trainer).

    deepspeed launch/train.py --ds_config ds_configs/zero3.json [flags]

Every rank of an SP group receives the same whole sequence, keeps its `seq/sp` shard, and runs the model with
Ulysses attention; the loss is normalised over the whole SP group. The true gradient of a sequence is the
*sum* of its SP ranks' contributions; `sp_backward_scale` says how much each rank must scale its share for
DeepSpeed's gradient averaging to produce exactly that, so gradients equal the single-process gradients.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .attention import register_ulysses_attention, resolve_kernel
from .buffers import restore_fp32_buffers
from .checkpointing import HostOffload, enable_checkpointing
from .fused_patch import install_fused_mlp, install_fused_rotary, resolve_fused_kernels
from .lean_norm import install_lean_norms
from .memory_profile import MemoryProfiler
from .zero_master import share_master_weights
from .rope import configure_rope
from .tiled_mlp import enable_tiled_mlp, should_tile
from .checkpoint import CheckpointError, load_checkpoint, resolve_resume, save_checkpoint
from .config import ConfigError, TrainConfig, parse_args
from .faults import NonFiniteError, StopFlag, any_rank, inject_at_step, inject_nan
from .data import CorpusSource, SyntheticSource, build_batch, global_sample_index, sample_order
from .ds_config import load_ds_config, resolve_ds_config, resolved_lr
from .launcher import normalise_launcher_env
from .loss import global_token_count, install_loss_head, sp_backward_scale
from .metrics import MetricsLogger, device_peak_gib, host_memory_bytes, host_peak_gib
from .models import attention_heads, build_model, load_model_config
from .parallel import SequenceParallelGroups, init_distributed, validate_heads, validate_sp_size
from .sharding import shard_sequence


class CausalLMWithSPLoss(nn.Module):
    """One module whose forward is backbone + loss head, so the DeepSpeed engine's forward drives both."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, labels, normalizer):
        # (b, s/sp) -> hidden (b, s/sp, H) -> scalar: this rank's share of the SP group's mean loss
        hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)[0]
        return self.model.get_output_embeddings()(hidden, labels=labels, normalizer=normalizer)


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def _local_world_size() -> int:
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts.count(socket.gethostname())


class Trainer:
    def __init__(self, cfg: TrainConfig, explicit: set[str]):
        from deepspeed.accelerator import get_accelerator
        from transformers.integrations import HfDeepSpeedConfig

        cfg.validate()
        self.cfg = cfg
        # tokens per sequence this process runs: --seq_len, or with --verify the shorter check (the levers are still
        # chosen for --seq_len, so the check sees the run as configured)
        self.seq_len = (cfg.verify_seq_len or min(cfg.seq_len, 4096)) if cfg.verify else cfg.seq_len
        self.model_config = load_model_config(cfg.model, cfg.model_config, cfg.num_layers)
        self.model_config.use_cache = False
        self.rope = configure_rope(self.model_config, cfg.rope_scaling, cfg.seq_len, cfg.rope_factor, cfg.rope_theta,
                                   cfg.rope_original_max_positions)
        accel = get_accelerator()
        init_distributed(accel.communication_backend_name())
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        sp_size = cfg.sp_size or math.gcd(_local_world_size(), self.world)
        dp_size = validate_sp_size(sp_size, self.world)
        validate_heads(sp_size, *attention_heads(self.model_config))
        lengths = {"seq_len": cfg.seq_len, "verify_seq_len": self.seq_len} if cfg.verify else {"seq_len": cfg.seq_len}
        for flag, length in lengths.items():
            if length % sp_size and not cfg.pad_to_sp:
                raise ConfigError(f"--{flag} {length} is not a multiple of --sp_size {sp_size}: change it, or "
                                  f"pass --pad_to_sp to pad each sequence (padding is not trained on)")
        self.device = torch.device(accel.device_name(int(os.environ.get("LOCAL_RANK", 0))))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        use_bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        capability = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0)
        self.kernel = kernel = resolve_kernel(cfg.attn_kernel, self.device.type, use_bf16, capability)
        self.dtype = torch.bfloat16 if use_bf16 else torch.float32
        random_init = cfg.model is None
        self.ds = resolve_ds_config(load_ds_config(cfg.ds_config), cfg, explicit, dp_size, sp_size,
                                    self.model_config.hidden_size, use_bf16, random_init)
        self.micro, self.accum = self.ds["train_micro_batch_size_per_gpu"], self.ds["gradient_accumulation_steps"]
        if cfg.skip_nonfinite and self.accum > 1:
            raise ConfigError("--skip_nonfinite needs --grad_accum 1 (a step is skipped whole)")

        self.groups = SequenceParallelGroups(sp_size)
        self.tokenizer, self.source = self._prepare_data()
        self.attention = register_ulysses_attention(self.groups.sp_group, kernel)
        # must outlive model construction: transformers reads it to build the model inside zero.Init
        self._hf_ds = HfDeepSpeedConfig(self.ds) if self.ds["zero_optimization"].get("stage") == 3 else None
        model = self._build_model(sp_size)
        self.module = CausalLMWithSPLoss(model)
        self.engine = self._init_engine(random_init)
        after_engine = restore_fp32_buffers(self.module, self.dtype)  # an engine that casts buffers is undone too
        if after_engine.restored:
            self.log(f"buffers after deepspeed.initialize: {after_engine.describe()}")
        self.backward_scale = sp_backward_scale(self.ds, sp_size)
        self.start_step = 0
        self.resume_from = resolve_resume(cfg.resume, cfg.output_dir)
        if self.resume_from:
            state = load_checkpoint(self.engine, self.resume_from, self.rank)
            if state["dp_size"] != dp_size or state["sp_size"] != sp_size:
                raise ConfigError(f"{self.resume_from} was saved with dp {state['dp_size']} x sp {state['sp_size']}; "
                                  f"resume with the same world size and --sp_size")
            self.start_step = state["step"]
            self.log(f"resumed from {self.resume_from} at step {self.start_step}")
        self.host_offload_gib = 0.0
        self.log(f"world {self.world} = dp {dp_size} x sp {sp_size} | kernel {kernel} | dtype {self.dtype} | "
                 f"micro {self.micro} x accum {self.accum} | seq_len {cfg.seq_len} | "
                 f"{sum(p.ds_numel if hasattr(p, 'ds_numel') else p.numel() for p in model.parameters()) / 1e6:.1f}M "
                 f"params | {self.model_config.num_hidden_layers} layers | loss {cfg.loss} | "
                 f"checkpointing {cfg.gradient_checkpointing} (attention kept: {self.keep_attention}, "
                 f"offload: {self.offload is not None}) | tiled MLP: {bool(self.tiled_mlp)} | lean norms: {self.lean_norms} | "
                 f"fused kernels: {self._fused_summary()}"
                 f" | rope {self.rope} | "
                 f"tokenizer {type(self.tokenizer).__name__ if self.tokenizer else 'none (generated tokens)'}")

    def describe_setup(self) -> str:
        """One line naming what makes this run's numbers: parallel sizes, ZeRO stage, kernel and levers."""
        zero = self.ds["zero_optimization"].get("stage", 0)
        return (f"ZeRO-{zero}, sp {self.groups.sp_size} x dp {self.groups.dp_size}, kernel {self.kernel}, loss "
                f"{self.cfg.loss}, checkpointing {self.cfg.gradient_checkpointing} (attention kept "
                f"{self.keep_attention}, offload {self.offload is not None}), tiled MLP {bool(self.tiled_mlp)}, "
                f"fused kernels {self._fused_summary()}")

    def _fused_summary(self) -> str:
        if not self.fused_kernels:
            return self.fused_note
        return f"{self.lean_norms} norms, {self.fused_rotary} rotary, {self.fused_mlps} SwiGLU"

    def _build_model(self, sp_size: int):
        """The HF model with the levers applied: checkpointing (kept attention, offload), loss head, lean norms, tiled
        MLP."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        model = build_model(self.model_config, cfg.model, self.dtype, log=self.log)
        self.keep_attention = self._keep_attention(sp_size)
        self.offload = HostOffload() if cfg.offload_activations and self.device.type == "cuda" else None
        if cfg.gradient_checkpointing:
            enable_checkpointing(model, self.keep_attention, self.offload)
        install_loss_head(model, fused=cfg.loss == "fused", chunk_size=cfg.loss_chunk_size)
        # fused kernels: our Triton RMSNorm (lean, like --lean_norm), rotary and SwiGLU; else the lean norm in PyTorch
        self.fused_kernels, self.fused_note = resolve_fused_kernels(cfg.fused_kernels, self.device, self.dtype)
        self.lean_norms = install_lean_norms(model, fused=self.fused_kernels) if cfg.lean_norm or \
            self.fused_kernels else 0
        self.fused_rotary = install_fused_rotary(model) if self.fused_kernels else 0
        self.fused_mlps = install_fused_mlp(model) if self.fused_kernels else 0
        local_tokens = cfg.seq_len // sp_size * self.micro
        intermediate = getattr(self.model_config, "intermediate_size", 0)
        self.tiled_mlp = should_tile(cfg.tiled_mlp, local_tokens, intermediate, self.dtype.itemsize) and \
            enable_tiled_mlp(model, cfg.mlp_tile_tokens)
        return model

    def _prepare_data(self):
        """Tokenizer and sample source. Rank 0 tokenizes and caches first; the others then read the cache. Rank 0's
        outcome is broadcast, so a bad dataset stops every rank with its message instead of leaving them waiting."""
        cfg = self.cfg
        if not cfg.dataset:
            tokenizer = None
            if cfg.model:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(cfg.model)
            return tokenizer, SyntheticSource(self.model_config.vocab_size, self.seq_len, cfg.seed)
        result = self._try_load_corpus() if self.rank == 0 else None
        error = [result if isinstance(result, str) else None]  # only rank 0's error message crosses ranks
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise ConfigError(error[0])
        if self.rank != 0:
            result = self._try_load_corpus()  # reads what rank 0 cached
        if isinstance(result, str):
            raise ConfigError(result)
        return result

    def _try_load_corpus(self):
        from .corpus import (TokenSamples, build_token_store, load_corpus, load_tokenizer, pick_text_column, store_key,
                             tokenize_corpus)

        cfg = self.cfg
        try:
            tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
            if len(tokenizer) > self.model_config.vocab_size:
                raise ConfigError(f"the tokenizer has {len(tokenizer)} ids but the model's vocabulary is "
                                  f"{self.model_config.vocab_size}: use a matching --tokenizer or --model_config")
            corpus = load_corpus(cfg.dataset, cfg.dataset_split, cfg.streaming)
            column = pick_text_column(corpus.column_names, cfg.text_column)
            tokenized = tokenize_corpus(corpus, tokenizer, column, cfg.num_proc)
            fingerprint = getattr(tokenized, "_fingerprint", None) or f"{cfg.dataset}:{cfg.dataset_split}:stream"
            store = build_token_store(tokenized, tokenizer.eos_token_id, cfg.data_cache_dir,
                                      store_key(fingerprint, tokenizer), cfg.max_tokens)
            if len(store.tokens) == 0:
                raise ConfigError(f"--dataset {cfg.dataset}: no text in column {column!r} (empty dataset or column)")
            samples = TokenSamples(store, self.seq_len, tokenizer.pad_token_id or 0, cfg.last_sample == "pad")
            self.log(f"data: {len(store.tokens):,} tokens in {len(store.doc_starts):,} documents -> {len(samples):,} "
                     f"samples of {self.seq_len:,} (cache {'hit' if store.cache_hit else 'written'}, packing "
                     f"{cfg.packing})")
            return tokenizer, CorpusSource(samples, cfg.packing)
        except ConfigError as e:
            return str(e)

    def _keep_attention(self, sp_size: int) -> bool:
        """Whether checkpointed layers keep their attention outputs (see --attn_recompute)."""
        mode = self.cfg.attn_recompute
        if mode != "auto":
            return mode == "never"
        if self.device.type != "cuda":
            return False
        cfg, mc = self.cfg, self.model_config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        per_layer_token = self.micro * cfg.seq_len // sp_size * self.dtype.itemsize
        kept = mc.num_hidden_layers * per_layer_token * mc.num_attention_heads * head_dim
        if cfg.offload_activations:  # kept outputs go to the host with the checkpoints, from every local rank
            checkpoints = mc.num_hidden_layers * per_layer_token * mc.hidden_size
            local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            return (kept + checkpoints) * local_ranks < 0.5 * host_memory_bytes()
        return kept < 0.15 * torch.cuda.get_device_properties(self.device).total_memory

    def _init_engine(self, random_init: bool):
        import deepspeed

        cfg = self.cfg
        optimizer = None
        if "optimizer" not in self.ds:
            optimizer = torch.optim.AdamW(self.module.parameters(), lr=resolved_lr(self.ds, cfg, random_init),
                                          betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay,
                                          fused=self.device.type == "cuda")
        scheduler = None
        if "scheduler" not in self.ds:
            warmup = cfg.warmup_steps if cfg.warmup_steps is not None else cfg.steps // 10
            factor = warmup_cosine(cfg.steps, warmup, cfg.min_lr_ratio)
            scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)  # noqa: E731
        engine, *_ = deepspeed.initialize(model=self.module, model_parameters=None if optimizer else
                                          self.module.parameters(), optimizer=optimizer, lr_scheduler=scheduler,
                                          config=self.ds, mpu=self.groups)
        self.master_freed_bytes = share_master_weights(engine.optimizer) if cfg.share_master_weights else 0
        if self.master_freed_bytes:
            self.log(f"master weights share the model's partition: {self.master_freed_bytes / 2**30:.2f} GiB freed "
                     f"per rank")
        return engine

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(message, flush=True)

    def micro_batch(self, step: int, micro_step: int, dp_rank: Optional[int] = None) -> dict:
        """This SP group's whole sequences for one micro-step (the same on every rank of the group); or those of
        the SP groups of another `dp_rank`."""
        g = self.groups
        dp_rank = g.dp_rank if dp_rank is None else dp_rank
        rows = []
        for r in range(self.micro):
            index = global_sample_index(step, micro_step, self.accum, dp_rank, g.dp_size, self.micro, r)
            rows.append(self.source.get(sample_order(index, self.source.num_samples, self.cfg.seed)))
        return build_batch(rows, self.cfg.packing)

    def train_micro_step(self, batch: dict, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Forward, backward and the engine's step on one batch of whole sequences; returns (loss, valid tokens,
        skipped)."""
        loss, normalizer, skipped = self.forward_backward(batch, step)
        if not skipped:
            self.engine.step()
        return loss, normalizer, skipped

    def forward_backward(self, batch: dict, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Forward + backward on one batch of whole sequences; returns (the SP group's loss, valid tokens, skipped).
        A non-finite loss on any rank stops every rank together (or, with --skip_nonfinite, skips the step on every
        rank)."""
        groups = self.groups
        pad_id = getattr(self.tokenizer, "pad_token_id", None) or 0
        shard = {k: v.to(self.device) for k, v in
                 shard_sequence(batch["input_ids"], groups.sp_size, groups.sp_rank, labels=batch["labels"],
                                position_ids=batch["position_ids"], pad_token_id=pad_id).items()}
        docs = batch["docs"]
        padded = shard["input_ids"].shape[1] * groups.sp_size - batch["input_ids"].shape[1]
        if docs is not None and padded:
            docs = [row + [padded] for row in docs]  # the padding added for sp is one more (ignored) piece
        self.attention.doc_lengths = docs
        normalizer = global_token_count(shard["labels"], groups.sp_group)
        loss = self.engine(shard["input_ids"], shard["position_ids"], shard["labels"], normalizer)
        if inject_nan(step):
            loss = loss * float("nan")
        if any_rank(not torch.isfinite(loss).item(), self.device):
            if not self.cfg.skip_nonfinite:
                raise NonFiniteError(f"non-finite loss at step {step}: stopping (pass --skip_nonfinite to skip such "
                                     f"steps; lower --lr or check the data)")
            return loss.detach(), normalizer, True
        self.engine.backward(loss * self.backward_scale)
        if self.offload is not None:
            self.host_offload_gib = max(self.host_offload_gib, self.offload.host_bytes / 2**30)
            self.offload.reset()
        total = loss.detach().float()
        if groups.sp_size > 1:
            dist.all_reduce(total, group=groups.sp_group)
        return total, normalizer, False

    def save(self, step: int) -> str:
        state = {"step": step, "data_position": step * self.accum * self.groups.dp_size * self.micro,
                 "seed": self.cfg.seed, "dp_size": self.groups.dp_size, "sp_size": self.groups.sp_size,
                 "config": self.cfg.to_dict()}
        path = save_checkpoint(self.engine, self.cfg.output_dir, step, state, self.model_config, self.tokenizer,
                               self.rank, self.cfg.save_total_limit)
        self.log(f"saved checkpoint {path}")
        return path

    def train(self) -> list[dict]:
        from deepspeed.accelerator import get_accelerator

        cfg, accel, groups = self.cfg, get_accelerator(), self.groups
        logger = MetricsLogger(cfg.output_dir, cfg.steps, self.rank == 0, cfg.tensorboard, cfg.log_every,
                               self.start_step)
        stop = StopFlag()
        history = []
        profiler = None
        try:
            for step in range(self.start_step + 1, cfg.steps + 1):  # 1-based: step N is the N-th optimizer step
                inject_at_step(step, self.rank)
                if cfg.profile_memory and step == self.start_step + 1:
                    profiler = MemoryProfiler(self, cfg.profile_memory, os.path.join(cfg.output_dir, "memory"))
                    profiler.start()
                accel.synchronize()
                start = time.perf_counter()
                loss_sum = torch.zeros((), device=self.device)
                tokens = torch.zeros((), device=self.device)
                skipped = False
                for micro_step in range(self.accum):
                    loss, count, skipped = self.train_micro_step(self.micro_batch(step - 1, micro_step), step)
                    loss_sum += loss
                    tokens += count
                stats = torch.stack([loss_sum / self.accum, tokens])
                if groups.dp_size > 1:
                    dist.all_reduce(stats, group=groups.dp_group)
                accel.synchronize()
                elapsed = time.perf_counter() - start
                grad_norm = float(self.engine.get_global_grad_norm() or 0.0)
                if not skipped and not math.isfinite(grad_norm) and not cfg.skip_nonfinite:
                    raise NonFiniteError(f"non-finite gradient norm at step {step}: stopping (pass --skip_nonfinite "
                                         f"to continue; DeepSpeed skips bf16 updates with overflowing gradients)")
                record = {
                    "step": step,
                    "loss": stats[0].item() / groups.dp_size,
                    "grad_norm": grad_norm,
                    "num_tokens": int(stats[1].item()),
                    "tokens_per_s": self.seq_len * self.micro * self.accum * groups.dp_size / elapsed,
                    "step_time_s": elapsed,
                    "peak_mem_gib": device_peak_gib(self.device),
                    "lr": self.engine.get_lr()[0],
                }
                history.append(record)
                if profiler is not None and step == self.start_step + cfg.profile_memory:
                    finished, profiler = profiler, None  # not again in `finally` if writing the picture fails
                    self._finish_memory_profile(finished, logger)
                logger.log(record, {"host_peak_gib": host_peak_gib(), "host_offload_gib": self.host_offload_gib,
                                    "skipped": skipped})
                if skipped:
                    logger.write(f"step {step}: non-finite loss, step skipped (--skip_nonfinite)")
                if cfg.save_steps and (step % cfg.save_steps == 0 or step == cfg.steps):
                    self.save(step)
                if stop.agreed(self.device):
                    if not (cfg.save_steps and step % cfg.save_steps == 0):
                        self.save(step)
                    logger.write(f"{stop.signal_name or 'SIGTERM'} received: saved step {step}, exiting; "
                                 f"relaunch with --resume auto to continue")
                    break
        finally:
            if profiler is not None:  # stopped early: still leave the recording
                self._finish_memory_profile(profiler, logger)
            logger.close()
        return history

    def _finish_memory_profile(self, profiler, logger) -> None:
        summary = profiler.stop(write=self.rank == 0)
        if summary:
            top = sorted(summary["peak_gib"].items(), key=lambda kv: -kv[1])[:4]
            logger.write(f"memory profile: peak {summary['peak_total_gib']:.2f} GiB of tensors ("
                         + ", ".join(f"{k} {v:.2f}" for k, v in top) + f") -> {profiler.out_dir}")


def _quiet_libraries() -> None:
    import logging
    import warnings

    # torch renamed these collectives; DeepSpeed still calls the old names once per bucket, every step
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def exit_now(code: int) -> None:
    """Ends the process without the interpreter's teardown of the process groups: gloo's teardown of sub-groups now
    and then aborts a process that has finished its work ("terminate called without an active exception"), which
    would turn a clean exit into SIGABRT. Everything we write is closed and flushed before this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv=None) -> int:
    """Runs the trainer; never returns (exits with 0, 2 for settings, 3 for non-finite/checkpoint errors, 1 else)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _quiet_libraries()
    cfg, explicit = parse_args(argv)
    normalise_launcher_env()
    rank = int(os.environ.get("RANK", 0))
    try:
        trainer = Trainer(cfg, explicit)
        if cfg.verify:
            from .verify import verify

            code = verify(trainer)
            dist.barrier()
            exit_now(code)
        history = trainer.train()
        if rank == 0 and history:
            print(f"done: {history[-1]['step']} steps, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, "
                  f"metrics in {os.path.join(cfg.output_dir, 'metrics.jsonl')}", flush=True)
        dist.barrier()  # no rank leaves while another still talks to it
        code = 0
    except ConfigError as e:
        # every rank hits the same check; one message is enough, every rank exits non-zero
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except (NonFiniteError, CheckpointError) as e:  # raised on every rank together
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        code = 3
    except BaseException:
        # do not wait in collectives on the other ranks: the launcher tears them down
        print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        code = 1
    exit_now(code)
