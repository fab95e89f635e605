"""The run configuration: `TrainConfig`, composed of the groups of train/config/groups.py (`cfg.data.seq_len`,
`cfg.optim.lr`, ...), and everything that reads it: every check that can be made before any process group exists
(`TrainConfig.validate`, so that bad settings fail on every rank the same way, before any work, with a message that
names the flag to change), the parser (flat flags, each group a section of `--help`), YAML files (flat or grouped),
the resolved `config.yaml` (grouped) and the Python API's dicts and TrainConfigs, all read alike."""

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

from ...data.load import DataSettings
from ...data.messages import parse_role_map
from ...data.mixture import dataset_entries
from ...errors import ConfigError
from ...levers.policy import LeverRequest
from ...sp.layout import LayoutFlags
from . import aliases, field_files, field_keys
from .ds_file import load_ds_config
from .flag_checks import check_preference_flags, parse_report_to
from .groups import (
    FLAGS,
    GROUPS,
    AdapterConfig,
    DataConfig,
    EvalConfig,
    LeverConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    OutputConfig,
    ParallelConfig,
    PreferenceConfig,
    Settings,
    SFTConfig,
    VerifyConfig,
)


@dataclass
class TrainConfig(Settings):
    """Every setting of a run, by concern. Construct it with the groups you change, e.g.
    `TrainConfig(optim=OptimConfig(lr=1e-4), data=DataConfig(seq_len=4096))`, or from flat flag names with
    `TrainConfig.from_flags({"lr": 1e-4})`. `to_dict()` is flat (flag -> value: checkpoints' trainer_state.json and
    the resume comparison); `grouped()` is nested (group -> flag -> value: `<output_dir>/config.yaml`)."""

    base: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    pref: PreferenceConfig = field(default_factory=PreferenceConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    levers: LeverConfig = field(default_factory=LeverConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    check: VerifyConfig = field(default_factory=VerifyConfig)

    def __post_init__(self):
        for name, cls in GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainConfig.{name} must be {cls.__name__}, not {type(getattr(self, name)).__name__}")

    @classmethod
    def from_flags(cls, values: dict) -> "TrainConfig":
        """A config from flat flag names or their aliases (`learning_rate`, `bf16=True`: aliases.py), the defaults
        for the others. A name that is neither is a TypeError naming the nearest flag."""
        groups: dict[str, dict] = {name: {} for name in GROUPS}
        for name, value in _flags_of(values).items():
            groups[FLAGS[name].group][name] = value
        return cls(**{name: GROUPS[name](**given) for name, given in groups.items()})

    def with_flags(self, **flags) -> "TrainConfig":
        """A copy with these flags (flat names) changed."""
        return TrainConfig.from_flags({**self.to_dict(), **flags})

    def get(self, flag: str):
        """A flag's value by its flat name (ds_config.py reconciles flags by name)."""
        return getattr(getattr(self, FLAGS[flag].group), flag)

    def to_dict(self) -> dict:
        return {name: copy.deepcopy(self.get(name)) for name in FLAGS}

    def grouped(self) -> dict:
        return {name: dataclasses.asdict(getattr(self, name)) for name in GROUPS}

    def data_settings(self):
        """What data/ reads of this config (data/load.py DataSettings)."""
        return DataSettings(self.data, self.sft, self.pref, self.base.model,
                            "--verify_seq_len" if self.check.verify else "--seq_len")

    def lever_request(self) -> LeverRequest:
        """What levers/ reads of this config: the levers group, and the adapters' dropout (random masks that a
        recompute must repeat)."""
        return LeverRequest.from_config(self.levers, self.adapters.lora_dropout if self.adapters.use_peft else 0.0)

    def layout_flags(self) -> LayoutFlags:
        """What sp/layout.py reads of this config: the sizes, the kernel, the dtype, the lengths cut into shards
        (--seq_len, and with --verify the length it runs) and whether rows hold several documents (packing, or
        preference pairs: a pair's two sides are two documents)."""
        data, verify = self.data, self.check.verify
        lengths = {"seq_len": data.seq_len, **({"verify_seq_len": verify_seq_len(self)} if verify else {})}
        return LayoutFlags(self.parallel.sp_size, ring_size_number(self.parallel.ring_size), self.levers.attn_kernel,
                           self.base.dtype, data.packing, self.pref.method != "sft", lengths, data.pad_to_sp)

    def overrides(self) -> set[str]:
        """The settings --resume_override names."""
        return {name.strip() for name in (self.output.resume_override or "").split(",") if name.strip()}

    def validate(self) -> None:
        """All checks that need neither a model nor a process group."""
        base, data, sft, optim = self.base, self.data, self.sft, self.optim
        check_bounds(self)
        if base.model and base.model_config:
            raise ConfigError("--model and --model_config are mutually exclusive: give one of them")
        ring_size_number(self.parallel.ring_size)
        parse_report_to(self.log.report_to, self.log.tensorboard)  # an unknown tracker or a missing package
        self._validate_evaluation()
        self._validate_resume()
        self._validate_adapters()
        self._validate_checkpoint_layers()
        if data.streaming and not data.dataset:
            raise ConfigError("--streaming needs --dataset")
        for group, name, default in ((data, "data_format", "auto"), (sft, "chat_template", None),
                                     (sft, "loss_on", "auto"), (sft, "truncation", "error"),
                                     (data, "messages_field", None), (data, "role_map", None)):
            if getattr(group, name) != default and not data.dataset:
                raise ConfigError(f"--{name} needs --dataset (generated tokens train every token)")
        if data.dataset:
            dataset_entries(data.dataset)  # a mixture's entries: their keys and shares
        parse_role_map(data.role_map)
        check_preference_flags(self)  # --method, --beta, --loss_type, --simpo_gamma, --max_length
        if optim.epochs is not None and not data.dataset:
            raise ConfigError("--epochs needs --dataset (generated tokens never end: give --steps)")
        if optim.epochs is None:  # else the trainer checks once the data has said how many steps they are
            self.check_steps()
        load_ds_config(self.parallel.ds_config)  # exists, is JSON, and every top-level key is one DeepSpeed reads

    def check_steps(self) -> None:
        """The checks against --steps (given, or made from --epochs)."""
        steps, warmup, profile = self.optim.steps, self.optim.warmup_steps, self.log.profile_memory
        if warmup is not None and not 0 <= warmup <= steps:
            raise ConfigError(f"--warmup_steps must be in [0, --steps={steps}], got {warmup}")
        if profile > steps:
            raise ConfigError(f"--profile_memory must be in [0, --steps={steps}], got {profile}")

    def _validate_evaluation(self) -> None:
        """An eval set is --eval_dataset or a share of --dataset (--val_set_size), not both."""
        ev, output = self.eval, self.output
        held_out = ev.val_set_size > 0
        if held_out and ev.eval_dataset:
            raise ConfigError("--val_set_size holds out part of --dataset as the eval set: leave --eval_dataset unset, "
                              "or --val_set_size 0")
        if held_out and self.pref.method != "sft":
            raise ConfigError(f"--val_set_size is evaluated with the SFT loss; with --method {self.pref.method} leave "
                              f"it unset")
        if held_out and not self.data.dataset:
            raise ConfigError("--val_set_size holds out part of --dataset: give --dataset")
        if held_out and ev.val_set_size >= 1 and ev.val_set_size != int(ev.val_set_size):
            raise ConfigError(f"--val_set_size must be a fraction under 1 or a whole number of samples, got "
                              f"{ev.val_set_size}")
        if ev.eval_split and not ev.eval_dataset:
            raise ConfigError("--eval_split needs --eval_dataset")
        if not (ev.eval_dataset or held_out) and (ev.eval_steps or ev.eval_samples or ev.evals_per_epoch):
            raise ConfigError("--eval_steps, --evals_per_epoch and --eval_samples need an eval set: --eval_dataset or "
                              "--val_set_size")
        if ev.evals_per_epoch and ev.eval_steps:
            raise ConfigError("--evals_per_epoch sets --eval_steps from the epoch's steps: give one of them")
        if output.saves_per_epoch and output.save_steps:
            raise ConfigError("--saves_per_epoch sets --save_steps from the epoch's steps: give one of them")
        if (ev.evals_per_epoch or output.saves_per_epoch) and not self.data.dataset:
            raise ConfigError("--evals_per_epoch and --saves_per_epoch count passes over --dataset: give --dataset")

    def _validate_checkpoint_layers(self) -> None:
        value = self.levers.checkpoint_layers
        if value not in ("all", "auto") and not (value.isdigit()):
            raise ConfigError(f"--checkpoint_layers must be all, auto or a number of layers >= 0, got {value!r}")
        if not self.levers.gradient_checkpointing and value not in ("all", "0"):
            raise ConfigError(f"--checkpoint_layers {value} needs --gradient_checkpointing true (false checkpoints "
                              f"no layer)")

    def _validate_adapters(self) -> None:
        """The adapter flags (model/adapters.py checks the module names against the model, and the device)."""
        adapters = self.adapters
        if not adapters.use_peft:
            given = [f.name for f in dataclasses.fields(adapters)
                     if getattr(adapters, f.name) != getattr(AdapterConfig(), f.name)]
            if given:
                raise ConfigError(f"--{given[0]} configures adapters: add --use_peft")
            return
        if adapters.load_in_4bit and not self.base.model:
            raise ConfigError("--load_in_4bit quantizes pretrained weights: give --model (a random initialisation "
                              "has none)")
        if adapters.load_in_4bit and self.base.dtype == "fp32":
            raise ConfigError("--load_in_4bit computes in bf16: drop --dtype fp32")
        if self.check.verify and adapters.lora_dropout:
            raise ConfigError("--verify compares one step with a reference on the same tokens: dropout draws other "
                              "masks there; verify with --lora_dropout 0")

    def _validate_resume(self) -> None:
        output = self.output
        if output.resume_override and not output.resume:
            raise ConfigError("--resume_override needs --resume (auto or a checkpoint path)")
        if output.overwrite_output_dir and output.resume:
            raise ConfigError("--overwrite_output_dir starts afresh: it cannot be combined with --resume")
        for name in sorted(self.overrides()):
            if name not in FLAGS:
                raise ConfigError(f"--resume_override {name}: no such setting (give flag names without --, "
                                  f"e.g. lr,steps)")
            if name in FREE_SETTINGS:
                raise ConfigError(f"--resume_override {name}: {name} never needs an override (it does not change "
                                  f"what is trained)")
            if name in SHAPE_SETTINGS:
                raise ConfigError(f"--resume_override {name}: {name} decides which tensors are trained and their "
                                  f"shapes, and a checkpoint holds only those it trained: it cannot change on "
                                  f"resume; keep the checkpoint's value, or start a new --output_dir (from its "
                                  f"exported weights as --model)")


def _flags_of(values: dict) -> dict:
    """Flat flags and aliases as flags with their values (a translating alias's value read as ours)."""
    flags, unknown = {}, []
    for name, value in values.items():
        alias = aliases.BY_NAME.get(name)
        if alias is not None and alias.convert is not None:
            value = alias.convert(value)
            if value is None:
                continue
            value = FLAGS[alias.flag].type(value)
        flag = aliases.canonical(name)
        if flag not in FLAGS:
            unknown.append(f"{name!r} ({aliases._nearest(name, aliases.names_of(FLAGS))})")
        elif flag in flags:
            raise TypeError(f"TrainConfig: two names of the flag {flag!r}: keep one")
        else:
            flags[flag] = value
    if unknown:
        raise TypeError(f"TrainConfig has no flag {', '.join(unknown)}")
    return flags


def check_bounds(cfg: TrainConfig) -> None:
    """Every number against its field's bounds (`_f`'s gt/ge/lt/le), after refusing nan and inf everywhere (nan
    passes every comparison); None is an unset default and passes."""
    values = [(name, cfg.get(name), flag) for name, flag in FLAGS.items()]
    for name, value, _ in values:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{name} must be a finite number, got {value}")
    for name, value, flag in values:
        bounds = flag.field.metadata["bounds"]
        if value is None or not bounds:
            continue
        gt, ge, lt, le = (bounds.get(k) for k in ("gt", "ge", "lt", "le"))
        if ((gt is None or value > gt) and (ge is None or value >= ge) and (lt is None or value < lt)
                and (le is None or value <= le)):
            continue
        why = flag.field.metadata["why"]
        raise ConfigError(f"--{name} must be {_describe(bounds)}, got {value}" + (f": {why}" if why else ""))


_SIGNS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _describe(bounds: dict) -> str:
    """gt=0: positive; ge=0: >= 0; both ends: an interval, [ or ( as the end is included or not."""
    if bounds == {"gt": 0}:
        return "positive"
    if len(bounds) == 1:
        (kind, limit), = bounds.items()
        return f"{_SIGNS[kind]} {limit}"
    low = f"[{bounds['ge']}" if "ge" in bounds else f"({bounds['gt']}"
    high = f"{bounds['le']}]" if "le" in bounds else f"{bounds['lt']})"
    return f"in {low}, {high}"


# Settings that do not change what is trained: a resumed run may change them freely. Every other flag alters the
# weights, the data or the schedule, so changing it on resume needs --resume_override (train/checkpoints/resume.py); a
# new flag belongs here only if that is clearly not so. sp_size is checked apart (the ZeRO shards are per
# data-parallel rank).
FREE_SETTINGS = frozenset({
    "output_dir", "save_steps", "save_final", "save_total_limit", "resume", "resume_override",
    "overwrite_output_dir", "log_every", "progress", "tensorboard", "profile_memory", "num_proc", "data_cache_dir",
    "verify", "verify_seq_len", "skip_nonfinite", "sp_size", "pad_to_sp", "dist_timeout", "debug", "report_to",
    "config",
    "eval_dataset", "eval_split", "eval_steps", "eval_samples", "evals_per_epoch", "saves_per_epoch",
    "ring_size",  # the same attention, split another way
    # kernels and memory levers compute the same thing (docs/verify.md checks them against transformers)
    "attn_kernel", "gradient_checkpointing", "checkpoint_layers", "attn_recompute", "linear_recompute", "tiled_mlp",
    "mlp_tile_tokens", "share_master_weights", "lean_norm", "fused_kernels", "offload_activations",
    "gpu_checkpoints", "checkpoint_every", "loss_chunk_size", "loss_kernel", "linear_kernel"})


# Settings that decide which tensors are trained and their shapes: LoRA or every weight, the adapters' rank, the
# modules that take adapters or are trained whole. A checkpoint holds exactly the tensors its run trained (under
# --use_peft, no frozen weight) and their optimizer states, so no override can change them on resume
# (train/checkpoints/resume.py refuses). --lora_alpha, --lora_dropout and --load_in_4bit change no trained tensor: they
# may be overridden.
SHAPE_SETTINGS = ("use_peft", "lora_r", "lora_target_modules", "lora_modules_to_save")


def verify_seq_len(cfg: TrainConfig) -> int:
    """Tokens per sequence this process runs: --seq_len, or with --verify the shorter check (the levers are still
    chosen for --seq_len, so the check sees the run as configured)."""
    return (cfg.check.verify_seq_len or min(cfg.data.seq_len, 4096)) if cfg.check.verify else cfg.data.seq_len


def ring_size_number(value: str) -> Optional[int]:
    """--ring_size as typed: a positive number, or None for auto (resolved against the heads: sp/dims.py)."""
    if str(value) == "auto":
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"--ring_size must be a positive number or auto, got {value}")
    return number


def _str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


class _Parser(argparse.ArgumentParser):
    """The flags' parser; with `raise_errors` (the Python API) a bad flag or value is a ConfigError, not an exit."""

    hint = ""  # said after an error's message (the command line's: where the flags are listed)

    def __init__(self, *args, raise_errors: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.raise_errors = raise_errors

    def error(self, message: str):
        message = re.sub(r"^argument (--\w+)(/--[\w-]+)+:", r"argument \1:", message)  # the flag, not its aliases
        if self.raise_errors:
            raise ConfigError(message + self.hint)
        super().error(message)

    def parse_sources(self, sources: list[list[str]]) -> argparse.Namespace:
        """Each source's words in turn (a config file, then the command line): later ones win, and a repeated flag
        (--dataset) given by a later source replaces the earlier source's list instead of adding to it."""
        namespace = argparse.Namespace()
        for words in sources:
            for action in self._actions:
                if isinstance(action, _Repeated):
                    action.fresh = True
            namespace = self.parse_args(words, namespace)
        return namespace


class _Repeated(argparse.Action):
    """A flag that may be given several times (--dataset): one value stays a value, several become a list."""

    fresh = True

    def __call__(self, parser, namespace, values, option_string=None):
        before = None if self.fresh else getattr(namespace, self.dest, None)
        self.fresh = False
        if before is None:
            setattr(namespace, self.dest, values)
        else:
            setattr(namespace, self.dest, (before if isinstance(before, list) else [before]) + [values])


class _Alias(argparse.Action):
    """A name of the field whose values differ from ours (aliases.py): translated, then set on our flag."""

    def __init__(self, option_strings, dest, alias=None, target=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.alias, self.target = alias, target

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.alias.convert(values)
            if value is not None:
                value = self.target.type(value) if self.target.type else value
        except (ConfigError, ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentError(self, f"{values!r}: {e}") from None
        if value is not None and self.target.choices and value not in self.target.choices:
            raise argparse.ArgumentError(self, f"{values!r} gives --{self.target.dest} {value}, not one of "
                                               f"{', '.join(map(str, self.target.choices))}")
        if value is not None:
            setattr(namespace, self.target.dest, value)


def dataset_entry(text: str):
    """One --dataset value: a path or hub id, or a JSON object (a mixture's entry with its own settings)."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object ({e}): {text}") from None
    try:
        dataset_entries(entry)  # its keys and share
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return entry


def default_text(f: dataclasses.Field) -> str:
    """A flag's default as --help and docs/flags.md say it: the words of an unset default the run decides (`_f`'s
    default_text), else the value."""
    return f.metadata["default_text"] or str(f.default)


def bounds_text(f: dataclasses.Field) -> str:
    """A flag's bounds in words ("positive", "in [0, 1]"), or "" for none."""
    return _describe(f.metadata["bounds"]) if f.metadata["bounds"] else ""


def flag_help(f: dataclasses.Field) -> str:
    """A flag's help: its field's, its aliases, its default and its bounds."""
    names = [a.name for a in aliases.ALIASES if a.flag == f.name and a.convert is None]
    also = f" Also --{', --'.join(names)}." if names else ""
    bounds = f"; {bounds_text(f)}" if f.metadata["bounds"] else ""
    return f"{f.metadata['help']}{also} (default: {default_text(f)}{bounds})"


def build_parser(raise_errors: bool = False) -> _Parser:
    """Every flag of TrainConfig, with its aliases (aliases.py), in one section of --help per group (its title from
    the group's docstring). No flag has a default in the parser: what was given is what the namespace holds
    (_parse adds the defaults), so a file and the command line can be layered."""
    parser = _Parser(prog="launch/train.py", raise_errors=raise_errors, argument_default=argparse.SUPPRESS,
                     usage="%(prog)s [--config FILE] [--FLAG VALUE ...]  (the flags by group below; docs/flags.md)",
                     description="Long-context fine-tuning with Ulysses sequence parallelism on the DeepSpeed engine. "
                                 "A --config YAML file takes these flags flat (seq_len: 4096) or under their "
                                 "group's key, in brackets below (data: {seq_len: 4096}).")
    sections = {name: parser.add_argument_group(*_section(name, cls)) for name, cls in GROUPS.items()}
    actions = {}
    for name, flag in FLAGS.items():
        kw = dict(help=flag_help(flag.field), dest=name)
        if flag.choices:
            kw["choices"] = flag.choices
        if flag.type is bool:
            kw.update(type=_str2bool, nargs="?", const=True, metavar="BOOL")
        else:
            kw["type"] = flag.type
        if flag.field.metadata["repeated"]:
            kw.update(action=_Repeated, type=dataset_entry)
        names = [a.name for a in aliases.ALIASES if a.flag == name and a.convert is None]
        actions[name] = sections[flag.group].add_argument(f"--{name}", *(f"--{n}" for n in names), **kw)
    for alias in (a for a in aliases.ALIASES if a.convert is not None):
        target = actions[alias.flag]
        sections[FLAGS[alias.flag].group].add_argument(
            f"--{alias.name}", action=_Alias, alias=alias, target=target, dest=f"alias:{alias.name}", nargs="?",
            const="true", metavar="VALUE", help=f"{alias.origin}'s name for --{alias.flag}: {alias.values}.")
    # launchers (deepspeed, older torch.distributed.launch) append --local_rank; the rank comes from the environment
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser


def _section(name: str, cls: type) -> tuple[str, str]:
    """A group's --help title and description: its docstring's first line, split at the colon."""
    title, _, description = cls.__doc__.splitlines()[0].partition(": ")
    return f"{title} [{name}]", description[:1].upper() + description[1:]


def write_resolved_config(cfg: TrainConfig, folder: Optional[str] = None) -> str:
    """Every setting of the run, defaults included, by its canonical name under its group's key, as a file `--config`
    reads back: `<folder>/config.yaml`, by default `<output_dir>/config.yaml` (checkpoints hold the same settings,
    flat, in trainer_state.json)."""
    import yaml

    folder = folder or cfg.output.output_dir
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.yaml")
    values = {group: {k: v for k, v in flags.items() if k not in ("config", "resume", "overwrite_output_dir")}
              for group, flags in cfg.grouped().items()}
    with open(path, "w") as f:
        yaml.safe_dump(values, f, sort_keys=False)
    return path


# keys a file or a dict cannot set: they are not training settings
NOT_SETTINGS = ("config", "help", "h", "local_rank")


def mapping_words(values: dict, where: str) -> list[str]:
    """A mapping of flags (or their aliases) to values as command-line words, every key checked first (all the
    unknown ones named at once: aliases.check_keys) and then each value as its flag's parser takes it, so that a
    wrong value is named by `where` and its key. Flags may be given flat or under their group's key
    (`data: {seq_len: 4096}`), or both ways in one mapping."""
    values = _ungrouped(values, where)
    for key in values:
        if str(key).replace("-", "_") in NOT_SETTINGS:
            raise ConfigError(f"{where}: {key!r} cannot be set in a config file (it holds training settings; "
                              f"python launch/train.py --help prints them)")
    values, refused = field_files.translate(values)
    repeated = {name for name, flag in FLAGS.items() if flag.field.metadata["repeated"]}
    checker = build_parser(raise_errors=True)
    words = []
    for key, value in aliases.check_keys(values, list(FLAGS), where, refused).items():
        many = aliases.canonical(key) in repeated
        value = _on_off(aliases.canonical(key), value)
        _refuse_nesting(where, key, value, many)
        these = aliases.value_words(key, value, repeated=many)
        try:
            checker.parse_args(these, argparse.Namespace())
        except ConfigError as e:
            raise ConfigError(f"{where}: {key}: {re.sub(r'^argument [^:]+: ', '', str(e))}") from None
        words += these
    return words


def _on_off(flag: str, value):
    """true/false for an auto/on/off flag (axolotl's `tiled_mlp: true`) is on/off."""
    choices = FLAGS[flag].choices if flag in FLAGS else None
    if isinstance(value, bool) and choices and "on" in choices and "true" not in choices:
        return "on" if value else "off"
    return value


def _ungrouped(values: dict, where: str) -> dict:
    """A mapping with its groups' mappings (`data: {seq_len: 4096}`) opened into flat keys. A group's key holds a
    mapping whose keys are its own flags (or their aliases); a flag given both flat and in its group is refused."""
    flat = {}
    for key, value in values.items():
        if key not in GROUPS or (not isinstance(value, dict) and field_keys.is_field_key(key)):
            flat.setdefault(key, value)  # (transformers' `optim: adamw_torch` is theirs, named as such)
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} is a group of settings: give it a mapping of its flags to values "
                              f"(e.g. {key}: {{{next(iter(dataclasses.fields(GROUPS[key]))).name}: ...}})")
        for inner, setting in value.items():
            name = aliases.canonical(str(inner).replace("-", "_"))
            if name in FLAGS and FLAGS[name].group != key:
                raise ConfigError(f"{where}: {key}: {inner} belongs to the group {FLAGS[name].group}, not {key}")
            if inner in flat or inner in values:
                raise ConfigError(f"{where}: {inner} is given both at the top level and in {key}: keep one")
            flat[inner] = setting
    return flat


def _refuse_nesting(where: str, key: str, value, repeated: bool) -> None:
    """A value is a scalar or a list of scalars; a mixture's entries (--dataset, `repeated`) may also be mappings."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (list, tuple)) or (isinstance(item, dict) and not repeated):
            raise ConfigError(f"{where}: {key}: give a value or a list of values, not a nested "
                              f"{'mapping' if isinstance(item, dict) else 'list'}")


def config_file_words(path: str) -> list[str]:
    """The flags of a YAML file (`--config FILE`) as command-line words: every value passes the same parsing and
    checks as a typed flag, and counts as given explicitly. The file is read as strictly as the DeepSpeed JSON: a
    key given twice, a YAML alias (`*name`: a few hundred bytes of them expand to gigabytes), a nested value, a key
    that is no flag (all of them named at once), or a value its flag does not take is a ConfigError naming the file
    and the key."""
    return mapping_words(_read_config_file(path), f"--config {path}")


def _parse(parser: _Parser, sources: list[list[str]]) -> tuple[TrainConfig, set[str]]:
    given = vars(parser.parse_sources(sources))
    given = {name: given[name] for name in given if name in FLAGS}
    resolve_run_keys(given)
    return TrainConfig.from_flags(given), set(given)


def resolve_run_keys(given: dict) -> None:
    """The flags whose meaning depends on the run, as TRL reads them: `max_length` is the sequence length of an SFT
    run (SFTConfig's, --seq_len) and the longest side of a pair in preference training (DPOConfig's)."""
    if "max_length" in given and given.get("method", "sft") == "sft":
        length = given.pop("max_length")
        if given.setdefault("seq_len", length) != length:
            raise ConfigError(f"--max_length {length} is the sequence length of an SFT run (TRL's SFTConfig), but "
                              f"--seq_len is {given['seq_len']}: keep one")


def _read_config_file(path: str) -> dict:
    """The mapping of a --config YAML file, refusing what safe_load lets through: a key given twice, an alias."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise ConfigError(f"--config {path}: line {event.start_mark.line + 1}: the alias *{event.anchor} is "
                                  f"not allowed (write the value out)")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise ConfigError(f"--config {path}: the key {key!r} appears twice (lines {seen[key]} and "
                                      f"{key_node.start_mark.line + 1}); keep one")
                seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep)

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.load(f, Loader=StrictLoader)  # noqa: S506 - a SafeLoader, stricter
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path} must hold a mapping of flag names to values")
    return values


def parse_args(argv=None) -> tuple[TrainConfig, set[str]]:
    """The command line (with `--config FILE` read first, so the typed flags win). Returns the config and the set of
    flags given explicitly, typed or in the file (they must then agree with the DS JSON)."""
    parser = build_parser(raise_errors=True)  # a mistyped flag or value: one message, printed once by the CLI
    parser.hint = " (python launch/train.py --help lists the flags)"
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    sources = [config_file_words(path)] if path else []
    return _parse(parser, sources + [argv])


def config_from(config=None, overrides: Optional[dict] = None) -> tuple[TrainConfig, set[str]]:
    """The Python API's settings: `config` (a TrainConfig, a dict of flags or their aliases, or a YAML file's path)
    and keyword `overrides`, read as the command line reads a --config file and typed flags: the same names,
    values and checks, a ConfigError for anything wrong. A TrainConfig's given settings are those that differ from
    the defaults."""
    sources = []
    if isinstance(config, TrainConfig):
        defaults = TrainConfig().to_dict()
        sources.append(mapping_words({k: v for k, v in config.to_dict().items() if defaults[k] != v},
                                     "the TrainConfig"))
    elif isinstance(config, dict):
        sources.append(mapping_words(config, "the settings dict"))
    elif isinstance(config, (str, os.PathLike)):
        sources.append(config_file_words(os.fspath(config)))
    elif config is not None:
        raise TypeError(f"train() takes a TrainConfig, a dict or a YAML file's path, not {type(config).__name__}")
    if overrides:
        sources.append(mapping_words(overrides, "train()'s keyword arguments"))
    return _parse(build_parser(raise_errors=True), sources)
