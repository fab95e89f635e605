"""The DeepSpeed JSON file, checked when it is read: valid JSON, no key twice (json keeps the last silently; DeepSpeed
refuses), and only top-level keys DeepSpeed reads, since it ignores any other: a misspelt `optimzer` would train
with the default optimizer and say nothing. (ds_config.py reconciles what it holds with the flags.)"""

from __future__ import annotations

import difflib
import json

from ...errors import ConfigError

# Every top-level key DeepSpeed 0.19 reads: those DeepSpeedConfig (deepspeed/runtime/config.py and the sub-configs it
# builds) looks up, recorded by tests/unit/test_config.py, which fails naming any key a DeepSpeed upgrade starts to
# read; and sequence_parallel_size / data_parallel_size, read by deepspeed.initialize and by DeepSpeedConfig without an
# mpu.
DEEPSPEED_TOP_LEVEL_KEYS = (
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_parallel_size", "data_types", "dataloader_drop_last",
    "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity",
    "expert_parallel", "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op",
    "gradient_clipping", "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer", "pipeline", "prescale_gradients",
    "progressive_layer_drop", "quantize_training", "scheduler", "seq_parallel_communication_data_type",
    "sequence_parallel_size", "sparse_attention", "sparse_gradients", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
)
_SECTIONS = ("bf16", "fp16", "optimizer", "scheduler", "zero_optimization")  # read as objects here or by the planner


class _RepeatedKey(ValueError):
    pass


def _refuse_repeated_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _RepeatedKey(key)
        seen[key] = value
    return seen


def load_ds_config(path: str) -> dict:
    """The DeepSpeed JSON at `path`, checked (see the module's docstring); a ConfigError naming --ds_config."""
    try:
        with open(path) as f:
            raw = json.load(f, object_pairs_hook=_refuse_repeated_keys)
    except FileNotFoundError:
        raise ConfigError(f"--ds_config {path}: no such file") from None
    except _RepeatedKey as e:
        raise ConfigError(f"--ds_config {path}: key '{e}' appears twice in one object: keep one") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--ds_config {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--ds_config {path} must hold a JSON object (DeepSpeed's config), not {type(raw).__name__}")
    _check_keys(raw, path)
    return raw


def _check_keys(raw: dict, path: str) -> None:
    unknown = [key for key in raw if key not in DEEPSPEED_TOP_LEVEL_KEYS]
    if unknown:
        problems = []
        for key in unknown:
            close = difflib.get_close_matches(key, DEEPSPEED_TOP_LEVEL_KEYS, n=1)
            problems.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ConfigError(f"--ds_config {path}: unknown top-level key {', '.join(problems)}; DeepSpeed reads only "
                          f"the keys in DEEPSPEED_TOP_LEVEL_KEYS (ulysses_train/train/config/ds_config.py) and would "
                          f"ignore it without a word: fix or remove it")
    for section in _SECTIONS:
        if not isinstance(raw.get(section, {}), dict):
            raise ConfigError(f"--ds_config {path}: \"{section}\" must be an object, got {raw[section]!r}")
    stage = raw.get("zero_optimization", {}).get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"--ds_config {path}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
