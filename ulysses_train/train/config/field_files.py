"""A TRL or axolotl config as our settings: each key of field_keys.py's table translated, the keys whose meaning
depends on the rest of the file resolved with it (an eval set, SFT's loss_type, axolotl's `datasets:` entries), and
every refusal collected, so that config_file.py names all of them in one message with the unknown keys.

    translate({"adapter": "qlora", "sample_packing": True, ...}) -> ({"use_peft": True, "load_in_4bit": True,
                                                                       "sample_packing": True, ...}, [])

Keys that are flags or aliases (aliases.py) pass through as written; check_keys reads them next.
"""

from __future__ import annotations

from typing import Optional

from ...levers.preference_loss import LOSS_TYPES
from . import aliases
from .field_keys import BY_NAME, CONTEXT_KEYS, NoCounterpart, _as_bool, read_key

# axolotl's dataset types -> our data formats (what the rows hold)
DATASET_TYPES = {"chat_template": "messages", "sharegpt": "messages", "completion": "text"}
# axolotl's message_property_mappings: the message keys read here (data/messages.py)
MESSAGE_KEYS = {"role": ("role", "from"), "content": ("content", "value")}
TRL_TEST_SPLIT = "test"  # TRL's ScriptArguments.dataset_test_split default


def _equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return _as_bool(a) is _as_bool(b)
    return str(a) == str(b)


def _as_ours(name: str, value):
    """A value as our flag reads it (a translating alias's converted), to compare two keys reaching one flag."""
    alias = aliases.BY_NAME.get(name)
    if alias is None or alias.convert is None:
        return value
    try:
        return alias.convert(value)
    except Exception:  # the parser names a bad value
        return value


class _Settings:
    """The translated mapping, with where each flag came from (to name a conflict) and the refusals."""

    def __init__(self):
        self.values: dict = {}
        self.source: dict[str, tuple] = {}  # canonical flag -> (the key written, its value, translated)
        self.refused: list[tuple[str, str]] = []

    def put(self, name: str, value, written: str, translated: bool = True) -> None:
        """Sets `name`; a second key reaching a flag that a translation set (or that one reaching a flag a key set)
        must give the same value. Two keys written for one flag are left for check_keys to name."""
        name_ = name.replace("-", "_")
        flag, ours = aliases.canonical(name_), _as_ours(name_, value)
        if flag in self.source and (translated or self.source[flag][2]):
            other, before, _ = self.source[flag]
            if not _equal(before, ours):
                self.refused.append((written, f"gives --{flag} {ours}, but {other} gives {before}: keep one"))
            return
        self.source.setdefault(flag, (written, ours, translated))
        self.values[name] = value

    def read(self, written: str, name: str, value) -> None:
        try:
            settings = read_key(name, value)
        except NoCounterpart as e:
            self.refused.append((written, str(e)))
            return
        for flag, setting in settings.items():
            self.put(flag, setting, f"{written}: {value}")

    def get(self, flag: str, default=None):
        return self.source.get(flag, (None, default, False))[1]


def translate(values: dict) -> tuple[dict, list[tuple[str, str]]]:
    """(our mapping, the refused keys with why) of a flat mapping of flags, aliases and the field's keys."""
    out, context = _Settings(), {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name in CONTEXT_KEYS:
            context[name] = (key, value)
        elif name in BY_NAME:
            out.read(str(key), name, value)
        else:
            out.put(str(key), value, str(key), translated=False)
    _resolve_context(out, context)
    return out.values, out.refused


def _resolve_context(out: _Settings, context: dict) -> None:
    """The keys that depend on others: the data first (datasets, the eval set), then what reads it."""
    if "datasets" in context:
        key, value = context.pop("datasets")
        if value is not None:
            out.put("dataset", _dataset_entries(key, value, out), key)
    for name in ("model_config", "chat_template", "max_length", "loss_type"):
        if name in context:
            key, value = context.pop(name)
            _one_of_the_run(out, name, key, value)
    _eval_set(out, context)
    for name in ("eval_packing", "eval_sample_packing"):
        if name in context:
            key, value = context.pop(name)
            if value is not None and not _equal(value, out.get("packing", False)):
                out.refused.append((key, "evaluation packs as --packing does: give the same value"))


def _one_of_the_run(out: _Settings, name: str, key, value) -> None:
    if value is None:
        return
    if name == "model_config" and isinstance(value, dict):
        out.refused.append((key, "axolotl's overrides of the model's config: write a config.json and give it as "
                                 "--model_config (a random initialisation), or edit the --model folder's"))
    elif name == "chat_template" and value == "tokenizer_default":
        return  # the tokenizer's own: the default
    elif name == "chat_template" and isinstance(value, str) and "/" not in value and "." not in value:
        out.refused.append((key, f"{value!r} names one of axolotl's built-in templates: give the template as a "
                                 f"Jinja file (--chat_template FILE), or leave it unset for the tokenizer's own"))
    elif name == "loss_type" and out.get("method", "sft") == "sft" and value not in LOSS_TYPES:
        if value != "nll":  # TRL's SFT default: the next-token loss
            out.refused.append((key, f"{value!r}: SFT's loss here is the next-token loss (TRL's nll)"))
    else:
        out.put(name, value, str(key), translated=False)


def _eval_set(out: _Settings, context: dict) -> None:
    """TRL's eval_strategy with dataset_test_split (its scripts evaluate that split of the dataset), and axolotl's
    evals_per_epoch (nothing is evaluated without an eval set, as in axolotl)."""
    strategy_key, strategy = context.pop("eval_strategy", None) or context.pop("evaluation_strategy", (None, None))
    context.pop("evaluation_strategy", None)
    split_key, split = context.pop("dataset_test_split", (None, None))
    has_set = bool(out.get("eval_dataset")) or bool(out.get("val_set_size"))
    if strategy in ("steps", "epoch") and not has_set:
        dataset = out.get("dataset")
        if not isinstance(dataset, str):
            out.refused.append((strategy_key, "evaluation needs an eval set: --eval_dataset, --val_set_size, or "
                                              "dataset_test_split with a single dataset"))
            return
        out.put("eval_dataset", dataset, f"{split_key or strategy_key}")
        out.put("eval_split", split or TRL_TEST_SPLIT, f"{split_key or strategy_key}")
        has_set = True
    if strategy == "epoch":
        out.put("evals_per_epoch", 1, strategy_key)
    elif strategy not in (None, "no", "steps"):
        out.refused.append((strategy_key, f"{strategy!r}: no, steps or epoch"))
    if "evals_per_epoch" in context:
        key, value = context.pop("evals_per_epoch")
        if value is not None and has_set:
            out.put("evals_per_epoch", value, key)


def _dataset_entries(key, value, out: _Settings) -> list:
    """axolotl's `datasets:` as --dataset entries: a path stays a path; a mapping's keys become our entry keys."""
    entries = []
    for i, entry in enumerate(value if isinstance(value, list) else [value]):
        if not isinstance(entry, dict):
            entries.append(entry)
            continue
        ours, refused = _dataset_entry(entry)
        out.refused += [(f"{key}[{i}].{k}", why) for k, why in refused]
        entries.append(ours)
    return entries


def _dataset_entry(entry: dict) -> tuple[dict, list[tuple[str, str]]]:
    ours, refused = {}, []
    for k, v in entry.items():
        if v is None:
            continue
        if k in ("path", "split", "data_format", "text_column", "messages_field", "role_map", "weight", "samples"):
            ours[k] = v
        elif k == "field_messages":
            ours["messages_field"] = v
        elif k == "field":
            ours["text_column"] = v
        elif k == "type":
            fmt = DATASET_TYPES.get(v)
            if fmt is None:
                refused.append((k, f"{v!r}: the formats read here are chat_template and sharegpt (messages), "
                                   f"completion (text), and prompt/completion columns (docs/data.md)"))
            else:
                ours["data_format"] = fmt
        elif k == "roles":
            ours["role_map"] = _role_map(v)
        elif k in ("message_property_mappings", "message_field_role", "message_field_content"):
            problem = _message_keys(k, v)
            if problem:
                refused.append((k, problem))
        elif k == "data_files" and "path" in entry:
            refused.append((k, "give the file itself as path"))
        elif k == "data_files":
            ours["path"] = v[0] if isinstance(v, list) and len(v) == 1 else v
        else:
            refused.append((k, "an entry takes path, split, type, field_messages, field, roles, "
                               "message_property_mappings, weight, samples"))
    return ours, refused


def _role_map(roles) -> Optional[dict]:
    """axolotl's roles ({ours: [theirs, ...]}) as --role_map (theirs -> ours)."""
    if not isinstance(roles, dict):
        return None
    return {theirs: ours for ours, names in roles.items() for theirs in (names if isinstance(names, list) else
                                                                          [names])}


def _message_keys(key: str, value) -> Optional[str]:
    """The message keys axolotl maps: accepted when they are the ones read here."""
    pairs = value.items() if isinstance(value, dict) else [("role" if key.endswith("role") else "content", value)]
    for part, field in pairs:
        if part not in MESSAGE_KEYS or field not in MESSAGE_KEYS[part]:
            return (f"messages are read from role/from and content/value: rename the data's {field!r} key "
                    f"(docs/data.md)")
    return None
