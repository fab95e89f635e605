"""The field's names for our flags: transformers' `TrainingArguments`, TRL's `SFTConfig` and axolotl's keys, accepted
on the command line (`--learning_rate 1e-5`) and in YAML (`learning_rate: 1e-5`) beside ours. Each flag has one
canonical name (ours: what `--help`, `config.yaml` and the checkpoints use); an alias is another spelling of it, and
the few whose values differ are translated (`bf16: true` is `dtype: bf16`). Names the field and we share (`seed`,
`output_dir`, `warmup_ratio`, `lr_scheduler_type`, `adam_beta1`, ...) are flags of their own and need no alias.

A YAML file, a dict given to the Python API or its keyword arguments are read by name first: the field's other keys
are translated or refused (field_keys.py, field_files.py), every key that is neither a flag nor an alias is named at
once with them, each with the nearest flag (or why the field's setting has no counterpart here), and two keys that
name one flag are an error.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ...errors import ConfigError


def _as_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {value!r}")


def _steps(value) -> Optional[str]:
    """transformers' max_steps: -1 (its default) means not set, so the epochs decide."""
    return None if int(value) < 0 else str(value)


def _resume(value) -> Optional[str]:
    """transformers' resume_from_checkpoint: true is the newest checkpoint (auto), false none, else a path."""
    if isinstance(value, bool) or str(value).strip().lower() in ("true", "false"):
        return "auto" if _as_bool(value) else None
    return str(value)


@dataclass(frozen=True)
class Alias:
    name: str  # as the field spells it
    flag: str  # ours (canonical)
    origin: str  # whose name it is
    convert: Optional[Callable[[object], Optional[str]]] = None  # its value -> ours (None: leave ours unset)
    values: str = ""  # how its values read as ours (the docs' table), when they differ


def _bf16(value) -> str:
    """transformers' bf16 (true/false) and axolotl's (also auto: bf16 where the device has it)."""
    return "auto" if str(value).strip().lower() == "auto" else "bf16" if _as_bool(value) else "fp32"


def _truncation(value) -> str:
    """TRL's truncation_mode: keep_start cuts the end (ours: right), keep_end the start (left)."""
    modes = {"keep_start": "right", "keep_end": "left"}
    if value not in modes:
        raise ConfigError(f"expected keep_start or keep_end, got {value!r}")
    return modes[value]


ALIASES = (
    Alias("learning_rate", "lr", "transformers"),
    Alias("max_seq_length", "seq_len", "TRL (before 0.20)"),
    Alias("sequence_len", "seq_len", "axolotl"),
    Alias("per_device_train_batch_size", "micro_batch_size", "transformers",
          values="sequences per SP group: the ranks of a group each hold a shard of the same sequences"),
    Alias("gradient_accumulation_steps", "grad_accum", "transformers"),
    Alias("max_steps", "steps", "transformers", _steps, "-1 (transformers' default): not set"),
    Alias("num_train_epochs", "epochs", "transformers"),
    Alias("num_epochs", "epochs", "axolotl"),
    Alias("logging_steps", "log_every", "transformers"),
    Alias("bf16", "dtype", "transformers, axolotl", _bf16,
          "true: `--dtype bf16`; false: `--dtype fp32`; auto (axolotl's): `--dtype auto`"),
    Alias("dataset_text_field", "text_column", "TRL"),
    Alias("assistant_only_loss", "loss_on", "TRL", lambda v: "assistant" if _as_bool(v) else "auto",
          "true: `--loss_on assistant`; false: `--loss_on auto` (which trains assistant turns of messages: TRL's "
          "false trains every token, `--loss_on all` here)"),
    Alias("completion_only_loss", "loss_on", "TRL", lambda v: "completion" if _as_bool(v) else "all",
          "true: `--loss_on completion`; false: `--loss_on all`"),
    Alias("resume_from_checkpoint", "resume", "transformers", _resume,
          "true: `--resume auto`; false: none; a path: that checkpoint"),
    Alias("model_name_or_path", "model", "TRL"),
    Alias("base_model", "model", "axolotl"),
    Alias("tokenizer_config", "tokenizer", "axolotl"),
    Alias("dataset_name", "dataset", "TRL"),
    Alias("datasets", "dataset", "axolotl", values="a list of datasets: a mixture (see \"Mixtures\"); in a YAML "
                                                   "file, axolotl's entries (docs/field-keys.md)"),
    Alias("dataset_train_split", "dataset_split", "TRL"),
    Alias("dataset_streaming", "streaming", "TRL"),
    Alias("dataset_num_proc", "num_proc", "TRL"),
    Alias("dataset_prepared_path", "data_cache_dir", "axolotl"),
    Alias("field_messages", "messages_field", "axolotl"),
    Alias("chat_template_path", "chat_template", "TRL"),
    Alias("truncation_mode", "truncation", "TRL", _truncation, "keep_start: `--truncation right`; keep_end: "
                                                               "`--truncation left`"),
    Alias("sample_packing", "packing", "axolotl"),
    Alias("lr_scheduler", "lr_scheduler_type", "axolotl"),
    Alias("cosine_min_lr_ratio", "min_lr_ratio", "axolotl"),
    Alias("sequence_parallel_degree", "sp_size", "axolotl (before 0.12)"),
    Alias("context_parallel_size", "sp_size", "axolotl"),
    Alias("deepspeed", "ds_config", "transformers"),
    Alias("ddp_timeout", "dist_timeout", "transformers"),
    Alias("activation_checkpointing", "gradient_checkpointing", "transformers"),
    Alias("activation_offloading", "offload_activations", "TRL, axolotl"),
    Alias("use_tensorboard", "tensorboard", "axolotl"),
    Alias("rl_beta", "beta", "axolotl"),
    Alias("orpo_alpha", "beta", "axolotl", values="ORPO's odds-ratio weight (TRL's beta)"),
)
BY_NAME = {alias.name: alias for alias in ALIASES}


def names_of(flags: Iterable[str]) -> list[str]:
    """Every name a key may take: the flags and the aliases."""
    return sorted(set(flags) | set(BY_NAME))


def _nearest(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    if not close:  # a word in common (warmup_ratio_steps -> warmup_ratio) is closer than letters
        words = set(key.split("_")) - {"use", "max", "num", "enable", "steps", "size"}  # too common to tell apart
        close = sorted(names, key=lambda n: (-len(words & set(n.split("_"))), n))[:1]
        close = close if close and words & set(close[0].split("_")) else []
    return f"nearest flag: --{canonical(close[0])}" if close else "no similar flag"


def canonical(name: str) -> str:
    """Our flag for a name (itself, or the flag an alias names)."""
    return BY_NAME[name].flag if name in BY_NAME else name


def check_keys(mapping: dict, flags: Iterable[str], where: str, refused: Iterable[tuple[str, str]] = ()) -> dict:
    """`mapping` with its keys as written (dashes read as underscores), after checking every one: all the keys
    that are neither flags nor aliases, and the `refused` ones (the field's keys without a counterpart:
    field_files.py), in one ConfigError, each with the nearest flag or what to do instead; two keys that name one
    flag, another."""
    names = names_of(flags)
    written = [(str(key), str(key).replace("-", "_")) for key in mapping]
    unknown = list(refused) + [(key, _nearest(key, names)) for _, key in written if key not in names or
                               key == "config"]
    if unknown:
        listed = "; ".join(f"{key} ({why})" for key, why in unknown)
        raise ConfigError(f"{where}: {len(unknown)} unsupported key{'s' * (len(unknown) > 1)}: {listed}")
    by_flag: dict[str, list[str]] = {}
    for original, key in written:  # seq-len and seq_len, steps and max_steps: one flag
        by_flag.setdefault(canonical(key), []).append(original)
    twice = [names for names in by_flag.values() if len(names) > 1]
    if twice:
        same = [f"{' and '.join(n)} name the same flag --{canonical(n[0].replace('-', '_'))}" for n in twice]
        raise ConfigError(f"{where}: " + "; ".join(same) + ": keep one")
    return {key: value for (_, key), value in zip(written, mapping.values())}


def value_words(name: str, value, repeated: bool = False) -> list[str]:
    """A key and its value as command-line words, so that a file or a dict is parsed and checked as typed flags:
    true/false for booleans, a mapping as JSON, a list as one word per item for a flag given several times
    (`repeated`: --dataset) or joined with commas (--report_to). None: nothing (the default)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)) and repeated:
        return [word for item in value for word in value_words(name, item)]
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    elif isinstance(value, dict):
        value = json.dumps(value)
    elif isinstance(value, bool):
        value = str(value).lower()
    return [f"--{name}={value}"]  # one word: a value starting with - is not taken for a flag
