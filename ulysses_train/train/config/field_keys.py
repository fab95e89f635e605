"""The field's config files read whole: every key of TRL's `SFTConfig` / `DPOConfig` (transformers'
`TrainingArguments` included, and TRL's `ModelConfig` and `ScriptArguments` of its scripts) and of axolotl's YAML
that has a meaning here is read with that meaning; every other one is refused, all of them in one message, each with
what to do instead.

Three kinds of key live here (the one-name-for-one-flag aliases are in aliases.py, and work on the command line too):

    a translation   `adapter: qlora` is `use_peft: true` and `load_in_4bit: true`; `datasets:` entries of
                    `type: chat_template` are --dataset entries of `data_format: messages`; `save_strategy: "no"`
                    is `save_steps: 0, save_final: false` ...
    what happens    `fp16: false`, `push_to_hub: false`, `optimizer: adamw_torch_fused`: accepted at the values
                    that say what this trainer does anyway; any other value is refused with its reason
    no counterpart  `fsdp`, `plugins`, `neftune_noise_alpha`: refused with what to use instead

A key whose value is null is not set (axolotl's examples list `wandb_project:` and the like empty). Keys whose
meaning depends on the run are read with it: TRL's `max_length` is --seq_len in SFT and a pair's longest side in
preference training (config_file.py resolves it after parsing, for the command line too); SFT's `loss_type: nll` is the
next-token loss. `python -m ulysses_train.tools.flags_doc` writes docs/field-keys.md from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ...errors import ConfigError


class NoCounterpart(Exception):
    """A key's value that has no meaning here; the message says what to use instead."""


@dataclass(frozen=True)
class FieldKey:
    name: str
    origin: str  # whose key it is
    meaning: str  # what it is here (docs/field-keys.md)
    read: Callable[[object], dict]  # its value -> our settings (flag -> value); NoCounterpart when it has none


def _as_bool(value) -> Optional[bool]:
    if isinstance(value, bool):
        return value
    return {"true": True, "false": False, "1": True, "0": False}.get(str(value).strip().lower())


def _same(value, accepted: tuple) -> bool:
    for a in accepted:
        if isinstance(a, bool) and _as_bool(value) is a:
            return True
        if not isinstance(a, bool) and value == a:
            return True
    return False


def what_happens(name: str, origin: str, accepted: tuple, reason: str) -> FieldKey:
    """A key accepted at `accepted` (what happens here anyway), refused at any other value with `reason`."""
    shown = ", ".join("(empty)" if a in ("", [], {}) else str(a).lower() if isinstance(a, bool) else str(a)
                      for a in accepted if a is not None)  # null is unset, for every key

    def read(value):
        if _same(value, accepted):
            return {}
        raise NoCounterpart(reason)
    return FieldKey(name, origin, f"accepted as {shown}; otherwise refused: {reason}" if shown else
                    f"refused: {reason}", read)


def no_counterpart(name: str, origin: str, reason: str) -> FieldKey:
    def read(value):
        raise NoCounterpart(reason)
    return FieldKey(name, origin, f"refused: {reason}", read)


def always(name: str, origin: str, meaning: str) -> FieldKey:
    """A key any value of which describes what happens here."""
    return FieldKey(name, origin, f"accepted, any value: {meaning}", lambda value: {})


def choice(name: str, origin: str, meaning: str, by_value: dict, reason: str) -> FieldKey:
    """A key whose values each set our flags (`by_value`: value -> settings); any other value is refused."""
    def read(value):
        key = value if isinstance(value, str) else ("true" if _as_bool(value) else "false") \
            if isinstance(value, bool) else value
        if key in by_value:
            return dict(by_value[key])
        raise NoCounterpart(f"{value!r}: {reason}")
    return FieldKey(name, origin, meaning, read)


def _warmup_steps(value) -> dict:
    """transformers 5's warmup_steps: a float under 1 is a ratio of the steps."""
    if isinstance(value, float) and 0 < value < 1:
        return {"warmup_ratio": value}
    return {"warmup_steps": value}


def _own(flag: str, by_value: dict):
    """One of our flags whose field spelling of some values differs (`dtype: bfloat16`): those translated, the
    others left for the flag's parser to take or name."""
    def read(value):
        key = ("true" if value else "false") if isinstance(value, bool) else value
        return dict(by_value[key]) if isinstance(key, str) and key in by_value else {flag: value}
    return read


def _checkpointing_kwargs(value) -> dict:
    if isinstance(value, dict) and set(value) <= {"use_reentrant"} and _as_bool(value.get("use_reentrant", False)) \
            is False:
        return {}
    raise NoCounterpart("checkpointing here is non-reentrant (use_reentrant: false) and takes no other argument; "
                        "--checkpoint_layers says which layers are checkpointed")


def _scheduler_kwargs(value) -> dict:
    if value in ({}, None):
        return {}
    if isinstance(value, dict) and set(value) == {"min_lr_rate"}:
        return {"min_lr_ratio": float(value["min_lr_rate"])}
    raise NoCounterpart("the schedules take --min_lr_ratio (transformers' min_lr_rate) and nothing else")


ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")
NOT_ADAMW = ("the optimizer is torch's AdamW, fused on CUDA (--adam_beta1, --adam_beta2, --adam_epsilon, "
             "--weight_decay), or the --ds_config JSON's optimizer block")
ZERO3 = "ZeRO-3 (--ds_config) shards the weights, gradients and optimizer states here; --sp_size splits sequences"
NO_HUB = "checkpoints stay in --output_dir; python -m ulysses_train.export writes a folder to push to the hub"
TRACKERS = ("--report_to tensorboard, wandb or mlflow; wandb's project, entity and run name come from WANDB_PROJECT, "
            "WANDB_ENTITY and WANDB_NAME in the environment")
DATA_IN_PROCESS = "batches are built in the training process from the cached tokens: there is no DataLoader to tune"
NO_BEST = "every checkpoint is kept (up to --save_total_limit) and metrics.jsonl holds each eval_loss"
DPO_LOSSES = "DPO's losses here are --loss_type sigmoid, ipo and hinge (docs/preference.md)"
DTYPE = {"bfloat16": {"dtype": "bf16"}, "bf16": {"dtype": "bf16"}, "float32": {"dtype": "fp32"},
         "fp32": {"dtype": "fp32"}, "auto": {"dtype": "auto"}}
KERNEL = {"flash_attention_2": {"attn_kernel": "flash_attn"}, "sdpa": {"attn_kernel": "sdpa"},
          "flash_attention_3": {"attn_kernel": "flash_attn_4"}}
ATTENTION = ("the attention runs inside the Ulysses all-to-all with --attn_kernel sdpa, flash_attn or flash_attn_4 "
             "(auto picks)")

T, A, S = "transformers", "axolotl", "TRL"
KEYS = (
    # transformers' TrainingArguments, as TRL's SFTConfig and DPOConfig hold them
    no_counterpart("accelerator_config", T, "the engine is DeepSpeed's (--ds_config), not accelerate's"),
    FieldKey("activation_checkpointing_kwargs", T, "accepted as {use_reentrant: false} (what checkpointing here "
             "is); otherwise refused", _checkpointing_kwargs),
    FieldKey("gradient_checkpointing_kwargs", T, "accepted as {use_reentrant: false} (what checkpointing here is); "
             "otherwise refused", _checkpointing_kwargs),
    what_happens("auto_find_batch_size", T, (False,), "python -m ulysses_train.plan -- <flags> says what fits"),
    what_happens("average_tokens_across_devices", T, (True,), "the loss is always the mean over the whole step's "
                 "tokens, across every rank"),
    what_happens("batch_eval_metrics", T, (False,), "evaluation reports eval_loss"),
    what_happens("bf16_full_eval", T, (False,), "evaluation runs in --dtype"),
    what_happens("fp16_full_eval", T, (False,), "evaluation runs in --dtype"),
    what_happens("data_seed", T, (None,), "--seed orders the data too"),
    what_happens("dataloader_drop_last", T, (False,), DATA_IN_PROCESS),
    what_happens("dataloader_in_order", T, (True,), DATA_IN_PROCESS),
    what_happens("dataloader_multiprocessing_context", T, (None,), DATA_IN_PROCESS),
    what_happens("dataloader_num_workers", T, (0,), DATA_IN_PROCESS),
    what_happens("dataloader_persistent_workers", T, (False,), DATA_IN_PROCESS),
    what_happens("dataloader_pin_memory", T, (True,), DATA_IN_PROCESS),
    what_happens("dataloader_prefetch_factor", T, (None,), DATA_IN_PROCESS),
    no_counterpart("ddp_backend", T, "the backend is the accelerator's: nccl on CUDA, gloo on the CPU"),
    what_happens("ddp_broadcast_buffers", T, (None, False), ZERO3),
    what_happens("ddp_bucket_cap_mb", T, (None,), ZERO3 + "; its bucket sizes are in the --ds_config JSON"),
    what_happens("ddp_find_unused_parameters", T, (None, False), ZERO3),
    what_happens("ddp_static_graph", T, (None, False), ZERO3),
    always("do_eval", T, "informational in transformers too: evaluation runs when there is an eval set "
           "(--eval_dataset or --val_set_size)"),
    what_happens("do_predict", T, (False,), "there is no prediction step: export the weights (python -m "
                 "ulysses_train.export) and generate with them"),
    what_happens("do_train", T, (True,), "the trainer trains; --verify checks a step instead"),
    what_happens("enable_jit_checkpoint", T, (True,), "SIGTERM always saves the last finished step here "
                 "(docs/reliability.md)"),
    what_happens("eval_accumulation_steps", T, (None,), "evaluation accumulates the loss only"),
    what_happens("eval_delay", T, (0, None), "--eval_steps N evaluates every N steps"),
    what_happens("eval_do_concat_batches", T, (True,), "evaluation accumulates the loss only"),
    what_happens("eval_on_start", T, (False,), "evaluation runs every --eval_steps and after the last step"),
    what_happens("eval_use_gather_object", T, (False,), "evaluation accumulates the loss only"),
    what_happens("fp16", T, (False,), "fp16 is not supported: bf16 (--dtype bf16) or fp32"),
    what_happens("fsdp", T, ("", [], False), ZERO3),
    what_happens("fsdp_config", T, ({},), ZERO3),
    what_happens("full_determinism", T, (False,), "runs are repeatable from --seed on the same layout; there is no "
                 "deterministic-algorithms mode"),
    what_happens("greater_is_better", T, (None,), NO_BEST),
    what_happens("load_best_model_at_end", T, (False,), NO_BEST),
    what_happens("metric_for_best_model", T, (None,), NO_BEST),
    what_happens("push_to_hub", T, (False,), NO_HUB),
    what_happens("hub_always_push", T, (False,), NO_HUB),
    no_counterpart("hub_model_id", T, NO_HUB),
    what_happens("hub_private_repo", T, (None, False), NO_HUB),
    no_counterpart("hub_revision", T, NO_HUB),
    what_happens("hub_strategy", T, ("every_save",), NO_HUB),
    no_counterpart("hub_token", T, NO_HUB + " (HF_TOKEN in the environment reads private models)"),
    what_happens("ignore_data_skip", T, (False,), "a resumed run continues the data where it stopped"),
    what_happens("include_for_metrics", T, ([],), "evaluation reports eval_loss"),
    always("include_num_input_tokens_seen", T, "num_tokens is always in metrics.jsonl"),
    what_happens("label_names", T, (None,), "the labels are the next tokens that --loss_on trains"),
    what_happens("label_smoothing_factor", T, (0, 0.0), "the loss is plain cross-entropy"),
    what_happens("length_column_name", T, ("length",), "samples are --seq_len rows: there is no length grouping"),
    what_happens("liger_kernel_config", T, (None,), "--loss_kernel liger runs Liger's fused loss; --fused_kernels "
                 "ours for the norms, rotary and SwiGLU"),
    choice("use_liger_kernel", T, "true: `--loss_kernel liger`; false: `--loss_kernel ours`",
           {"true": {"loss_kernel": "liger"}, "false": {"loss_kernel": "ours"}}, "true or false"),
    what_happens("log_level", T, ("passive", "info", "warning"), "rank 0 prints the run's lines; --debug prints "
                 "tracebacks"),
    what_happens("log_level_replica", T, ("warning", "passive"), "only rank 0 prints"),
    what_happens("log_on_each_node", T, (True,), "only rank 0 prints"),
    no_counterpart("logging_dir", T, "the trackers write under <output_dir> (tensorboard/, wandb/, mlruns/)"),
    what_happens("logging_first_step", T, (False,), "--log_every N prints every N steps; metrics.jsonl gets every "
                 "step"),
    what_happens("logging_nan_inf_filter", T, (True,), "a non-finite loss stops the run (or is skipped with "
                 "--skip_nonfinite)"),
    what_happens("logging_strategy", T, ("steps",), "--log_every N prints every N steps; metrics.jsonl gets every "
                 "step"),
    FieldKey("lr_scheduler_kwargs", T, "{min_lr_rate: r} is `--min_lr_ratio r`; otherwise refused",
             _scheduler_kwargs),
    FieldKey("warmup_steps", T, "a number of steps is --warmup_steps; a fraction under 1 (transformers 5) is "
             "--warmup_ratio", _warmup_steps),
    what_happens("neftune_noise_alpha", T, (None,), "no noise is added to the embeddings"),
    what_happens("optim", T, ADAMW, NOT_ADAMW),
    what_happens("optim_args", T, (None,), NOT_ADAMW),
    what_happens("optim_target_modules", T, (None,), NOT_ADAMW),
    what_happens("parallelism_config", T, (None,), "--sp_size and --ring_size set the sequence parallelism"),
    no_counterpart("per_device_eval_batch_size", T, "evaluation runs --micro_batch_size sequences per SP group"),
    what_happens("prediction_loss_only", T, (True,), "evaluation reports eval_loss"),
    no_counterpart("project", T, TRACKERS),
    always("remove_unused_columns", T, "only the columns the data's format reads are read"),
    what_happens("restore_callback_states_from_checkpoint", T, (False,), "there are no callbacks"),
    no_counterpart("run_name", T, TRACKERS),
    what_happens("save_on_each_node", T, (False,), "rank 0 writes a checkpoint's shared files, every rank its "
                 "shards"),
    what_happens("save_only_model", T, (False,), "a checkpoint holds the optimizer states to resume from; python -m "
                 "ulysses_train.export writes the weights alone"),
    choice("save_strategy", T, "steps: every --save_steps; no: `--save_steps 0 --save_final false`",
           {"steps": {}, "no": {"save_steps": 0, "save_final": False}}, "--save_steps N saves every N steps "
           "(0: the final save only)"),
    always("skip_memory_metrics", T, "peak_mem_gib is always in metrics.jsonl"),
    what_happens("torch_compile", T, (False,), "the model is not compiled; --fused_kernels are written by hand"),
    what_happens("torch_compile_backend", T, (None,), "the model is not compiled"),
    what_happens("torch_compile_mode", T, (None,), "the model is not compiled"),
    what_happens("torch_empty_cache_steps", T, (None,), "the memory levers (--offload_activations, --tiled_mlp) "
                 "keep the peak down"),
    what_happens("trackio_bucket_id", T, (None,), TRACKERS),
    what_happens("trackio_space_id", T, (None, "trackio"), TRACKERS),
    what_happens("trackio_static_space_id", T, (None,), TRACKERS),
    what_happens("train_sampling_strategy", T, ("random",), "the samples are shuffled each epoch (--seed)"),
    always("use_cache", T, "the KV cache is off in training"),
    what_happens("use_cpu", T, (False,), "the CPU trains when there is no GPU (gloo)"),
    choice("disable_tqdm", T, "true: `--progress lines`; false: `--progress auto`",
           {"true": {"progress": "lines"}, "false": {"progress": "auto"}}, "true or false"),
    # TRL's SFTConfig and DPOConfig
    what_happens("dataset_kwargs", S, ({},), "the data's format is detected (--data_format) and tokenized here"),
    what_happens("eos_token", S, (None,), "the tokenizer's end-of-turn token (or the --chat_template's) ends turns"),
    what_happens("model_init_kwargs", S, ({},), "--model loads in --dtype with transformers' own classes"),
    always("packing_strategy", S, "--packing packs conversations whole (first-fit decreasing) and keeps text "
           "documents apart inside each row"),
    what_happens("pad_to_multiple_of", S, (None,), "rows hold --seq_len tokens; --pad_to_sp pads to --sp_size"),
    what_happens("pad_token", S, (None,), "padding is never trained; the tokenizer's pad token, else its eos"),
    always("padding_free", S, "rows are never padded past --seq_len; --packing keeps documents apart"),
    what_happens("router_aux_loss_coef", S, (None, 0, 0.0), "the loss is the language-model loss alone"),
    what_happens("shuffle_dataset", S, (True, False), "the samples are shuffled each epoch (--seed)"),
    what_happens("trust_remote_code", S, (False,), "models load with transformers' own classes"),
    what_happens("disable_dropout", S, (False,), "dropout is the model's (0 in most configs; --lora_dropout for "
                 "adapters)"),
    what_happens("discopop_tau", S, (0.05,), DPO_LOSSES),
    what_happens("f_alpha_divergence_coef", S, (0.5,), DPO_LOSSES),
    what_happens("f_divergence_type", S, ("reverse_kl",), DPO_LOSSES),
    what_happens("label_smoothing", S, (0, 0.0), DPO_LOSSES),
    what_happens("ld_alpha", S, (None,), DPO_LOSSES),
    what_happens("loss_weights", S, (None,), DPO_LOSSES),
    what_happens("use_weighting", S, (False,), DPO_LOSSES),
    always("precompute_ref_log_probs", S, "the reference's log-probs are always computed once per dataset and "
           "cached (the same numbers)"),
    always("precompute_ref_batch_size", S, "the reference runs --micro_batch_size rows at a time"),
    what_happens("sync_ref_model", S, (False,), "the reference is the initial weights (or --ref_model), fixed"),
    what_happens("ref_model_mixup_alpha", S, (0.6,), "the reference is fixed"),
    what_happens("ref_model_sync_steps", S, (512,), "the reference is fixed"),
    # TRL's ModelConfig and ScriptArguments (trl/scripts)
    FieldKey("dtype", S, "bfloat16: `--dtype bf16`; float32: `--dtype fp32`; ours (auto, bf16, fp32)",
             _own("dtype", DTYPE)),
    choice("torch_dtype", S, "bfloat16: `--dtype bf16`; float32: `--dtype fp32`; auto", DTYPE,
           "bfloat16, float32 or auto"),
    choice("attn_implementation", S, "flash_attention_2: `--attn_kernel flash_attn`; flash_attention_3: "
           "flash_attn_4; sdpa", KERNEL, ATTENTION),
    what_happens("bnb_4bit_quant_type", S, ("nf4",), "--load_in_4bit quantizes to NF4"),
    what_happens("bnb_4bit_quant_storage", S, (None,), "--load_in_4bit stores bitsandbytes' default"),
    what_happens("use_bnb_nested_quant", S, (False,), "--load_in_4bit quantizes once"),
    what_happens("load_in_8bit", S, (False,), "--load_in_4bit (QLoRA) is the quantized base here"),
    what_happens("lora_target_parameters", S, (None,), "--lora_target_modules names modules"),
    what_happens("lora_task_type", S, ("CAUSAL_LM",), "adapters are for causal language models"),
    what_happens("model_revision", S, ("main", None), "download the revision into a folder and give it as --model"),
    what_happens("use_dora", S, (False,), "the adapters are plain LoRA"),
    what_happens("use_rslora", S, (False,), "the adapters are plain LoRA (scaled by alpha / r)"),
    what_happens("dataset_config", S, (None,), "give --dataset the configuration's files (or its hub folder)"),
    what_happens("ignore_bias_buffers", S, (False,), "buffers are restored to fp32 after the engine casts them"),
    # axolotl
    choice("adapter", A, "lora: `--use_peft`; qlora: `--use_peft --load_in_4bit`",
           {"lora": {"use_peft": True}, "qlora": {"use_peft": True, "load_in_4bit": True}, "": {}},
           "the adapters here are lora and qlora"),
    choice("lora_target_linear", A, "true: `--lora_target_modules all-linear`",
           {"true": {"lora_target_modules": "all-linear"}, "false": {}}, "true or false"),
    FieldKey("gradient_checkpointing", A, "true/false: --gradient_checkpointing; offload: with "
             "`--offload_activations`", _own("gradient_checkpointing", {
                 "offload": {"gradient_checkpointing": True, "offload_activations": True}})),
    choice("flash_attention", A, "true: `--attn_kernel flash_attn`", {"true": {"attn_kernel": "flash_attn"},
                                                                      "false": {}}, ATTENTION),
    choice("sdp_attention", A, "true: `--attn_kernel sdpa`", {"true": {"attn_kernel": "sdpa"}, "false": {}},
           ATTENTION),
    choice("train_on_inputs", A, "false: `--loss_on auto` (assistant turns, completions); true: `--loss_on all`",
           {"false": {}, "true": {"loss_on": "all"}}, "true or false"),
    choice("rl", A, "dpo, simpo, orpo: --method", {"dpo": {"method": "dpo"}, "simpo": {"method": "simpo"},
                                                   "orpo": {"method": "orpo"}},
           "the preference methods here are dpo, simpo and orpo"),
    choice("auto_resume_from_checkpoints", A, "true: `--resume auto`", {"true": {"resume": "auto"}, "false": {}},
           "true or false"),
    choice("liger_fused_linear_cross_entropy", A, "true: `--loss_kernel liger`",
           {"true": {"loss_kernel": "liger"}, "false": {}}, "true or false"),
    *(choice(name, A, "true: `--fused_kernels on` (ours: RMSNorm, rotary, SwiGLU)",
             {"true": {"fused_kernels": "on"}, "false": {}}, "true or false")
      for name in ("liger_rms_norm", "liger_glu_activation", "liger_rope")),
    what_happens("liger_layer_norm", A, (False,), "--fused_kernels covers RMSNorms, not LayerNorms"),
    what_happens("cut_cross_entropy", A, (False,), "the fused loss (--loss fused) never builds the logits"),
    what_happens("optimizer", A, ADAMW, NOT_ADAMW),
    what_happens("strict", A, (False,), "the command line's flags override the file's"),
    what_happens("lora_model_dir", A, (None,), "--resume continues a run's adapters; an exported folder is --model"),
    what_happens("lora_fan_in_fan_out", A, (False,), "PEFT's default layers"),
    *(what_happens(name, A, (False,), "the adapters run as PEFT's layers")
      for name in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")),
    what_happens("peft_use_dora", A, (False,), "the adapters are plain LoRA"),
    what_happens("peft_use_rslora", A, (False,), "the adapters are plain LoRA (scaled by alpha / r)"),
    *(what_happens(name, A, (None,), TRACKERS)
      for name in ("wandb_project", "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "wandb_run_id",
                   "mlflow_tracking_uri", "mlflow_experiment_name", "trackio_project_name", "trackio_run_name")),
    what_happens("use_wandb", A, (False,), TRACKERS),
    what_happens("special_tokens", A, ({},), "the tokenizer's tokens (--tokenizer)"),
    what_happens("tokens", A, ([],), "the tokenizer's tokens (--tokenizer)"),
    what_happens("eot_tokens", A, ([],), "the chat template's end-of-turn tokens end turns"),
    what_happens("tokenizer_type", A, ("AutoTokenizer",), "the tokenizer loads with AutoTokenizer"),
    what_happens("tokenizer_use_fast", A, (True,), "the tokenizer loads fast"),
    what_happens("tokenizer_legacy", A, (False,), "the tokenizer loads as transformers does"),
    what_happens("model_type", A, ("AutoModelForCausalLM",), "the model loads with AutoModelForCausalLM"),
    what_happens("processor_type", A, (None,), "text models only"),
    what_happens("plugins", A, ([],), "the fused loss (--loss_kernel) and kernels (--fused_kernels) are built in"),
    what_happens("skip_prepare_dataset", A, (False,), "the data is tokenized once and cached (--data_cache_dir)"),
    what_happens("fsdp_version", A, (None,), ZERO3),
    what_happens("dp_shard_size", A, (None,), ZERO3),
    what_happens("tensor_parallel_size", A, (None, 1), ZERO3),
    what_happens("loss_watchdog_threshold", A, (None,), "a non-finite loss stops the run (or is skipped with "
                 "--skip_nonfinite)"),
    what_happens("loss_watchdog_patience", A, (None,), "a non-finite loss stops the run"),
    what_happens("use_kernels", A, (False,), "--fused_kernels are ours"),
    what_happens("torchdistx_path", A, (None,), "ZeRO-3 builds the model sharded"),
    what_happens("push_dataset_to_hub", A, (None,), NO_HUB),
    what_happens("hf_use_auth_token", A, (None, False), "HF_TOKEN in the environment reads private models"),
    no_counterpart("max_packed_sequence_len", A, "--seq_len is the row's length (with --packing)"),
    what_happens("unfrozen_parameters", A, (None,), "every weight trains (or, with --use_peft, the adapters and "
                 "--lora_modules_to_save)"),
    what_happens("group_by_length", A, (False,), "samples are --seq_len rows: there is no length grouping"),
    what_happens("early_stopping_patience", A, (None,), "every checkpoint's eval_loss is in metrics.jsonl"),
    no_counterpart("eval_batch_size", A, "evaluation runs --micro_batch_size sequences per SP group"),
    no_counterpart("batch_size", A, "the batch is --micro_batch_size x --grad_accum per SP group"),
    what_happens("cosine_constant_lr_ratio", A, (None,), "--lr_scheduler_type cosine decays to --min_lr_ratio"),
    always("low_cpu_mem_usage", A, "ZeRO-3 loads the weights sharded"),
    what_happens("device_map", A, (None,), "each rank takes its own GPU (LOCAL_RANK)"),
    always("shuffle_merged_datasets", A, "a mixture's samples are shuffled together (--seed)"),
    always("pad_to_sequence_len", A, "rows always hold --seq_len tokens (padding is never trained)"),
    what_happens("pretraining_dataset", A, (None,), "text files are pretraining data: --dataset (with --streaming "
                 "for a hub dataset)"),
    what_happens("dataset_exact_deduplication", A, (False,), "the rows are read as they are"),
    what_happens("chat_template_jinja", A, (None,), "write the template to a file and give it as --chat_template"),
    what_happens("total_num_tokens", A, (None,), "--epochs counts the samples"),
    what_happens("sample_packing_eff_est", A, (None,), "--epochs counts the samples"),
    what_happens("eval_table_size", A, (None, 0), "evaluation reports eval_loss"),
    what_happens("save_first_step", A, (False,), "--save_steps N saves every N steps"),
    what_happens("eval_causal_lm_metrics", A, (None,), "evaluation reports eval_loss"),
)
BY_NAME = {key.name: key for key in KEYS}
# keys whose meaning depends on others of the same file (resolved in translate / config_file.resolve_run_keys)
CONTEXT_KEYS = {"max_length": "SFT: `--seq_len`; preference training (--method dpo, simpo, orpo): the longest side "
                              "of a pair",
                "loss_type": "SFT: nll (the next-token loss) is accepted; preference training: DPO's --loss_type",
                "eval_strategy": "no: no evaluation; steps: every --eval_steps on the eval set (--eval_dataset, "
                                 "--val_set_size, or TRL's dataset_test_split of --dataset); epoch: once an epoch",
                "evaluation_strategy": "transformers' older name of eval_strategy",
                "dataset_test_split": "with eval_strategy steps or epoch: the eval set is this split of --dataset "
                                      "(--eval_dataset, --eval_split)",
                "eval_packing": "accepted when it equals --packing (evaluation packs as training does)",
                "eval_sample_packing": "accepted when it equals --packing (evaluation packs as training does)",
                "evals_per_epoch": "--evals_per_epoch; without an eval set (val_set_size 0) nothing is evaluated",
                "chat_template": "a Jinja file: --chat_template; tokenizer_default: the tokenizer's own (the "
                                 "default); another name of axolotl's templates is refused",
                "model_config": "a preset, config.json or folder: --model_config; a mapping (axolotl's overrides "
                                "of the model's config) is refused",
                "datasets": "a list of entries {path, type, split, field_messages, message_property_mappings, "
                            "roles, field}: --dataset entries (see below)"}


def is_field_key(name: str) -> bool:
    return name in BY_NAME or name in CONTEXT_KEYS


def read_key(name: str, value) -> dict:
    """Our settings for one of the table's keys (NoCounterpart when its value has none); null sets nothing."""
    if value is None:
        return {}
    try:
        return BY_NAME[name].read(value)
    except (TypeError, ValueError) as e:
        raise NoCounterpart(f"{value!r}: {e}") from None


def refusal_message(where: str, refused: list[tuple[str, str]]) -> ConfigError:
    listed = "; ".join(f"{key} ({why})" for key, why in refused)
    return ConfigError(f"{where}: {len(refused)} unsupported key{'s' * (len(refused) > 1)}: {listed}")
