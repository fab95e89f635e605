"""The checks of the flags that belong to one feature (--report_to's trackers, the preference flags), kept with the
config so that TrainConfig.validate needs nothing of the code that runs the feature."""

from __future__ import annotations

import importlib.util

from ...errors import ConfigError

TRACKERS = ("none", "tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def parse_report_to(value: str, tensorboard_flag: bool = False) -> list[str]:
    """`--report_to` as a list (comma-separated, `none` for nothing); `--tensorboard` adds tensorboard. Raises a
    ConfigError for an unknown name or a tracker whose package is missing."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"--report_to {value}: unknown tracker {', '.join(unknown)}; choose from "
                          f"{', '.join(TRACKERS)} (several with commas)")
    chosen = [n for n in names if n != "none"] + (["tensorboard"] if tensorboard_flag else [])
    chosen = list(dict.fromkeys(chosen))
    missing = [n for n in chosen if importlib.util.find_spec(PACKAGES[n]) is None]
    if missing:
        raise ConfigError(f"--report_to {','.join(missing)}: the {' and '.join(PACKAGES[n] for n in missing)} "
                          f"package is not installed: pip install -e \".[track]\", or leave it out of --report_to")
    return chosen


def check_preference_flags(cfg) -> None:
    """The preference flags against each other and the rest (TrainConfig.validate calls it, after their bounds)."""
    pref, data = cfg.pref, cfg.data
    defaults = {"beta": 0.1, "loss_type": "sigmoid", "simpo_gamma": 0.5, "max_length": None,
                "max_prompt_length": None, "ref_model": None}
    if pref.method == "sft":
        given = [f"--{k}" for k, v in defaults.items() if getattr(pref, k) != v]
        if given:
            raise ConfigError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to preference training: "
                              f"give --method dpo, simpo or orpo")
        return
    if not data.dataset:
        raise ConfigError(f"--method {pref.method} trains on preference pairs: give --dataset with `prompt`, `chosen` "
                          f"and `rejected` columns (or `chosen` and `rejected` sharing the prompt)")
    if pref.loss_type != "sigmoid" and pref.method != "dpo":
        raise ConfigError(f"--loss_type {pref.loss_type} applies to --method dpo ({pref.method} has its own loss)")
    if pref.simpo_gamma != defaults["simpo_gamma"] and pref.method != "simpo":
        raise ConfigError("--simpo_gamma applies to --method simpo")
    if pref.ref_model and pref.method != "dpo":
        raise ConfigError(f"--ref_model is DPO's reference: --method {pref.method} has none")
    if pref.ref_model and cfg.adapters.use_peft:
        raise ConfigError("--ref_model with --use_peft: a LoRA run's reference is its base model with the adapters "
                          "off; leave --ref_model unset, or train every weight without --use_peft")
    if data.data_format != "auto" or cfg.sft.loss_on not in ("auto", "completion") or data.text_column:
        raise ConfigError(f"--method {pref.method} reads preference pairs (prompt/chosen/rejected) and scores their "
                          f"completions: leave --data_format, --loss_on and --text_column unset")
    if pref.max_prompt_length is not None and pref.max_length is not None and \
            pref.max_prompt_length >= pref.max_length:
        raise ConfigError(f"--max_prompt_length {pref.max_prompt_length} leaves no token of completion in a side of "
                          f"--max_length {pref.max_length}: lower it below --max_length")
    if pref.max_length is not None and 2 * pref.max_length > data.seq_len:
        raise ConfigError(f"--seq_len {data.seq_len} holds both sides of a pair: it must be at least 2 x --max_length "
                          f"({pref.max_length})")
