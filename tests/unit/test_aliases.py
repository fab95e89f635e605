"""The field's names (transformers, TRL, axolotl) as aliases of our flags, on the command line, in YAML and in the
Python API's dicts; every unsupported key named at once; a TrainConfig's given settings (no processes)."""

import pytest
import yaml

from ulysses_train.errors import ConfigError
from ulysses_train.train.config import aliases
from ulysses_train.train.config.config_file import config_from, parse_args, write_resolved_config
from ulysses_train.train.config.train_config import FLAGS, GROUPS, OptimConfig, TrainConfig

TRL_STYLE = {"learning_rate": 2e-5, "max_seq_length": 4096, "per_device_train_batch_size": 2,
             "gradient_accumulation_steps": 8, "num_train_epochs": 3, "warmup_ratio": 0.03,
             "lr_scheduler_type": "linear", "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999,
             "adam_epsilon": 1e-6, "max_grad_norm": 0.5, "logging_steps": 10, "save_steps": 100, "save_total_limit": 2,
             "eval_steps": 50, "bf16": True, "seed": 7, "output_dir": "out", "report_to": ["tensorboard"],
             "dataset_text_field": "body", "packing": True, "assistant_only_loss": True, "max_steps": -1,
             "resume_from_checkpoint": True, "model_name_or_path": "my/model", "dataset_name": "chats.jsonl"}
CANONICAL = {"lr": 2e-5, "seq_len": 4096, "micro_batch_size": 2, "grad_accum": 8, "epochs": 3.0, "warmup_ratio": 0.03,
             "lr_scheduler_type": "linear", "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999,
             "adam_epsilon": 1e-6, "max_grad_norm": 0.5, "log_every": 10, "save_steps": 100, "save_total_limit": 2,
             "eval_steps": 50, "dtype": "bf16", "seed": 7, "output_dir": "out", "report_to": "tensorboard",
             "text_column": "body", "packing": True, "loss_on": "assistant", "resume": "auto", "model": "my/model",
             "dataset": "chats.jsonl"}


def _values(cfg) -> dict:
    return {name: cfg.get(name) for name in CANONICAL}


def test_a_trl_config_reads_as_our_flags_in_yaml_the_api_and_on_the_command_line(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(TRL_STYLE))
    from_file, explicit = parse_args(["--config", str(path)])
    assert _values(from_file) == CANONICAL
    assert "steps" not in explicit and from_file.optim.steps == 30  # max_steps -1 is transformers' "not set"
    assert _values(config_from(str(path))[0]) == CANONICAL == _values(config_from(TRL_STYLE)[0])
    words = [w for k, v in TRL_STYLE.items() for w in aliases.value_words(k, v)]
    assert _values(parse_args(words)[0]) == CANONICAL
    # config.yaml holds the canonical names only, and reads back to the same settings
    from_file.output.output_dir = str(tmp_path)
    written = yaml.safe_load(open(write_resolved_config(from_file)))
    assert not set(written) & {a.name for a in aliases.ALIASES}
    assert _values(parse_args(["--config", str(tmp_path / "config.yaml")])[0]) == dict(CANONICAL, resume=None,
                                                                                         output_dir=str(tmp_path))


def test_typed_flags_win_over_the_file_in_the_order_given(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("bf16: true\nlearning_rate: 1e-4\ndataset: [a.jsonl, b.jsonl]\n")
    cfg, _ = parse_args(["--config", str(path), "--dtype", "fp32", "--lr", "3e-3", "--dataset", "c.jsonl"])
    # the command line's list replaces the file's
    assert (cfg.base.dtype, cfg.optim.lr, cfg.data.dataset) == ("fp32", 3e-3, "c.jsonl")
    cfg, _ = parse_args(["--dtype", "fp32", "--bf16", "--completion_only_loss", "false"])
    assert (cfg.base.dtype, cfg.sft.loss_on) == ("bf16", "all")
    cfg, _ = config_from({"dataset": ["a.jsonl", {"path": "b.jsonl", "weight": 0.5}]}, {"learning_rate": 1e-3})
    assert cfg.data.dataset == ["a.jsonl", {"path": "b.jsonl", "weight": 0.5}] and cfg.optim.lr == 1e-3


def test_every_unsupported_key_is_named_at_once_with_the_nearest_flag(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(dict(TRL_STYLE, fp16=True, optim="adamw_8bit", warmup_ratioo=0.1,
                                        gradient_checkpointing_kwargs={"use_reentrant": True}, zzz=1)))
    with pytest.raises(ConfigError) as on_the_command_line:
        parse_args(["--config", str(path)])
    with pytest.raises(ConfigError) as error:
        config_from(str(path))
    message = str(error.value)
    assert str(on_the_command_line.value) == message
    assert message.startswith(f"--config {path}: 5 unsupported keys: fp16 (fp16 is not supported")
    for expected in ("optim (the optimizer is torch's AdamW", "warmup_ratioo (nearest flag: --warmup_ratio)",
                     "gradient_checkpointing_kwargs (checkpointing here is non-reentrant", "zzz (no similar flag)"):
        assert expected in message
    with pytest.raises(ConfigError, match="learning_rate and lr name the same flag --lr: keep one"):
        config_from({"learning_rate": 1e-3, "lr": 1e-3})
    with pytest.raises(ConfigError, match=r"train\(\)'s keyword arguments: 1 unsupported key: lerning_rate "
                                          r"\(nearest flag: --lr\)"):
        config_from(None, {"lerning_rate": 1e-3})
    with pytest.raises(ConfigError, match=r"^the settings dict: bf16: 'maybe': expected true or false"):
        config_from({"bf16": "maybe"})
    with pytest.raises(ConfigError, match=r"^the settings dict: max_length: invalid int value: 'many'"):
        config_from({"max_length": "many"})
    with pytest.raises(TypeError, match="not int"):
        config_from(5)


def test_a_trainconfig_gives_the_settings_that_differ_from_the_defaults():
    cfg, explicit = config_from(TrainConfig(optim=OptimConfig(lr=1e-4, steps=5)), {"max_steps": 7})
    assert (cfg.optim.lr, cfg.optim.steps) == (1e-4, 7) and explicit == {"lr", "steps"}
    assert config_from(TrainConfig())[1] == set()


def test_every_alias_names_a_flag_and_no_flag_name_is_an_alias():
    flags = set(FLAGS)
    assert {a.flag for a in aliases.ALIASES} <= flags
    assert not {a.name for a in aliases.ALIASES} & flags
    assert not set(GROUPS) & (flags | set(aliases.BY_NAME))  # a group's key in YAML is never a setting's
