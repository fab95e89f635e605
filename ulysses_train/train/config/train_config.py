"""The run configuration: `TrainConfig`, composed of the groups of train/config/groups.py (`cfg.data.seq_len`,
`cfg.optim.lr`, ...), and every check that can be made before any process group exists (`TrainConfig.validate`, so
that bad settings fail on every rank the same way, before any work, with a message that names the flag to change).
The parser is flag_parser.py; YAML files, the resolved `config.yaml` and the Python API's dicts and TrainConfigs are
read in config_file.py."""

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from ...data.load import DataSettings
from ...data.messages import parse_role_map
from ...data.mixture import dataset_entries
from ...errors import ConfigError
from ...levers.policy import LeverRequest
from ...sp.layout import LayoutFlags
from . import aliases
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
    "gpu_checkpoints", "checkpoint_every", "keep_projections", "loss_chunk_size", "loss_kernel", "linear_kernel"})


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
