"""The field's names for our flags: transformers' `TrainingArguments`, TRL's `SFTConfig` and axolotl's keys, accepted
on the command line (`--learning_rate 1e-5`) and in YAML (`learning_rate: 1e-5`) beside ours. Each flag has one
canonical name (ours: what `--help`, `config.yaml` and the checkpoints use); an alias is another spelling of it, and
the few whose values differ are translated (`bf16: true` is `dtype: bf16`). Names the field and we share (`seed`,
`output_dir`, `warmup_ratio`, `lr_scheduler_type`, `adam_beta1`, ...) are flags of their own and need no alias.

A YAML file, a dict given to the Python API or its keyword arguments are read by name first: every key that is
neither a flag nor an alias is named at once, each with the nearest flag (or why the field's setting has no
counterpart here), and two keys that name one flag are an error.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ..errors import ConfigError


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


def _truncation_mode(value) -> str:
    """TRL's truncation_mode: keep_start cuts the end (ours `right`), keep_end the start (`left`)."""
    modes = {"keep_start": "right", "keep_end": "left"}
    if str(value) not in modes:
        raise ConfigError(f"truncation_mode {value!r}: TRL's values are keep_start and keep_end")
    return modes[str(value)]


@dataclass(frozen=True)
class Alias:
    name: str  # as the field spells it
    flag: str  # ours (canonical)
    origin: str  # whose name it is
    convert: Optional[Callable[[object], Optional[str]]] = None  # its value -> ours (None: leave ours unset)
    values: str = ""  # how its values read as ours (the docs' table), when they differ


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
    Alias("bf16", "dtype", "transformers", lambda v: "bf16" if _as_bool(v) else "fp32",
          "true: `--dtype bf16`; false: `--dtype fp32`"),
    Alias("dataset_text_field", "text_column", "TRL"),
    Alias("assistant_only_loss", "loss_on", "TRL", lambda v: "assistant" if _as_bool(v) else "auto",
          "true: `--loss_on assistant`; false: `--loss_on auto` (which trains assistant turns of messages: TRL's "
          "false trains every token, `--loss_on all` here)"),
    Alias("completion_only_loss", "loss_on", "TRL", lambda v: "completion" if _as_bool(v) else "all",
          "true: `--loss_on completion`; false: `--loss_on all`"),
    Alias("resume_from_checkpoint", "resume", "transformers", _resume,
          "true: `--resume auto`; false: none; a path: that checkpoint"),
    Alias("model_name_or_path", "model", "TRL"),
    Alias("dataset_name", "dataset", "TRL"),
    Alias("datasets", "dataset", "axolotl", values="a list of datasets: a mixture (see \"Mixtures\")"),
    Alias("dataset_num_proc", "num_proc", "TRL"),
    Alias("field_messages", "messages_field", "axolotl"),
    Alias("truncation_mode", "truncation", "TRL", _truncation_mode,
          "keep_start: `--truncation right`; keep_end: `--truncation left`"),
)
BY_NAME = {alias.name: alias for alias in ALIASES}

# settings of transformers, TRL or axolotl that have no counterpart here, and what to do instead
NO_COUNTERPART = {
    "fp16": "fp16 is not supported: bf16 (--dtype bf16) or fp32",
    "optim": "the optimizer is AdamW (--adam_beta1, --adam_beta2, --adam_epsilon, --weight_decay) or the "
             "--ds_config JSON's",
    "gradient_checkpointing_kwargs": "--gradient_checkpointing and --checkpoint_layers say what is checkpointed",
    "per_device_eval_batch_size": "evaluation runs --micro_batch_size sequences per SP group",
    "eval_strategy": "--eval_steps N evaluates every N steps (0: after the last step only)",
    "save_strategy": "--save_steps N saves every N steps (0: the final save only)",
    "logging_strategy": "--log_every N prints every N steps; metrics.jsonl gets every step",
    "lr_scheduler_kwargs": "--min_lr_ratio sets where cosine and linear decays end",
    "deepspeed": "--ds_config",
}


def names_of(flags: Iterable[str]) -> list[str]:
    """Every name a key may take: the flags and the aliases."""
    return sorted(set(flags) | set(BY_NAME))


def _nearest(key: str, names: list[str]) -> str:
    if key in NO_COUNTERPART:
        return NO_COUNTERPART[key]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not close:  # a word in common (warmup_ratio_steps -> warmup_ratio) is closer than letters
        words = set(key.split("_"))
        close = sorted(names, key=lambda n: (-len(words & set(n.split("_"))), n))[:1]
        close = close if close and words & set(close[0].split("_")) else []
    return f"nearest flag: --{canonical(close[0])}" if close else "no similar flag"


def canonical(name: str) -> str:
    """Our flag for a name (itself, or the flag an alias names)."""
    return BY_NAME[name].flag if name in BY_NAME else name


def check_keys(mapping: dict, flags: Iterable[str], where: str) -> dict:
    """`mapping` with its keys as written (dashes read as underscores), after checking every one: all the keys
    that are neither flags nor aliases in one ConfigError, each with the nearest flag; two keys that name one
    flag, another."""
    names = names_of(flags)
    written = [(str(key), str(key).replace("-", "_")) for key in mapping]
    unknown = [key for _, key in written if key not in names or key == "config"]
    if unknown:
        listed = "; ".join(f"{key} ({_nearest(key, names)})" for key in unknown)
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
