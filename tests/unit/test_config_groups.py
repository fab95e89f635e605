"""The configuration grouped by concern (train/config/groups.py, train_config.py, flag_parser.py, config_file.py):
YAML flat or grouped, config.yaml grouped and read back, --help in one section per group, every bound checked and
named by its flag, the parser's types read from the annotations, and TrainConfig built from its groups (no
processes)."""

import argparse
import os
import re
import typing

import pytest
import yaml

from ulysses_train.errors import ConfigError
from ulysses_train.train.config.config_file import config_from, parse_args, write_resolved_config
from ulysses_train.train.config.flag_parser import build_parser
from ulysses_train.train.config.train_config import (
    FLAGS,
    GROUPS,
    AdapterConfig,
    DataConfig,
    OptimConfig,
    TrainConfig,
)

FLAT = {"seq_len": 256, "packing": True, "learning_rate": 3e-4, "steps": 7, "sp_size": 2, "use_peft": True,
        "lora_r": 8, "tiled_mlp": "on", "log_every": 2, "method": "sft", "verify_seq_len": 128}
GROUPED = {"data": {"seq_len": 256, "packing": True}, "optim": {"learning_rate": 3e-4, "steps": 7},
           "parallel": {"sp_size": 2}, "adapters": {"use_peft": True, "lora_r": 8}, "levers": {"tiled_mlp": "on"},
           "log": {"log_every": 2}, "pref": {"method": "sft"}, "check": {"verify_seq_len": 128}}


def _yaml(tmp_path, name: str, values: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(values))
    return str(path)


def test_a_grouped_and_a_flat_yaml_give_the_same_config(tmp_path):
    flat, flat_given = parse_args(["--config", _yaml(tmp_path, "flat.yaml", FLAT)])
    grouped, grouped_given = parse_args(["--config", _yaml(tmp_path, "grouped.yaml", GROUPED)])
    assert flat.with_flags(config=None) == grouped.with_flags(config=None) and flat_given == grouped_given
    assert (grouped.data.seq_len, grouped.optim.lr, grouped.adapters.lora_r, grouped.levers.tiled_mlp) == (
        256, 3e-4, 8, "on")
    assert "lr" in grouped_given and "learning_rate" not in grouped_given  # an alias inside a group is our flag
    mixed = {"seq_len": 256, "optim": {"steps": 7}}
    assert config_from(mixed)[0] == config_from({"seq_len": 256, "steps": 7})[0]  # the Python API's dicts too


@pytest.mark.parametrize("values, message", [
    ({"data": {"lr": 1e-4}}, "data: lr belongs to the group optim, not data"),
    ({"seq_len": 64, "data": {"seq_len": 128}}, "seq_len is given both at the top level and in data: keep one"),
    ({"data": 5}, "data is a group of settings: give it a mapping of its flags to values"),
    ({"data": {"seq_lenn": 64}}, "1 unsupported key: seq_lenn (nearest flag: --seq_len)"),
    ({"optim": "adamw_8bit"}, "1 unsupported key: optim (the optimizer is torch's AdamW"),  # transformers' optim
])
def test_a_grouped_file_is_read_strictly(tmp_path, values, message):
    path = _yaml(tmp_path, "run.yaml", values)
    with pytest.raises(ConfigError, match="^" + re.escape(f"--config {path}: {message}")):
        parse_args(["--config", path])


def test_config_yaml_is_grouped_and_reads_back_to_the_same_run(tmp_path):
    cfg, _ = parse_args(["--config", _yaml(tmp_path, "run.yaml", GROUPED), "--output_dir", str(tmp_path / "out")])
    written = yaml.safe_load(open(write_resolved_config(cfg)))
    assert list(written) == list(GROUPS)  # every group, in order, each with its own flags
    for group, values in written.items():
        assert set(values) == {name for name, flag in FLAGS.items() if flag.group == group} - {
            "config", "resume", "overwrite_output_dir"}
    assert written["data"]["seq_len"] == 256 and written["optim"]["lr"] == 3e-4
    again, _ = parse_args(["--config", os.path.join(cfg.output.output_dir, "config.yaml")])
    assert again.with_flags(config=None) == cfg.with_flags(config=None)
    assert set(cfg.to_dict()) == set(FLAGS)  # checkpoints keep the flat settings (the resume comparison's)


def test_help_has_one_titled_section_per_group_holding_its_flags():
    parser = build_parser()
    sections = {group.title: group for group in parser._action_groups}
    for name, cls in GROUPS.items():
        title = f"{cls.__doc__.split(':')[0]} [{name}]"
        assert title in sections, title
        flags = {a.dest for a in sections[title]._group_actions if not a.dest.startswith("alias:")}
        assert flags == {flag for flag, f in FLAGS.items() if f.group == name}
    text = parser.format_help()
    assert text.index("\nData [data]:") < text.index("\n  --seq_len") < text.index("\nOptimisation [optim]:")


def _violating(flag) -> str:
    """A value just outside a flag's bounds."""
    bounds = flag.field.metadata["bounds"]
    low = bounds.get("gt", bounds.get("ge"))
    if low is not None:
        return str(low if "gt" in bounds else low - 1)
    return str(bounds.get("lt", bounds.get("le")) + 1)


BOUNDED = [name for name, flag in FLAGS.items() if flag.field.metadata["bounds"]]


@pytest.mark.parametrize("name", BOUNDED)
def test_every_bound_is_checked_and_names_its_flag(name):
    argv = [f"--{name}={_violating(FLAGS[name])}", "--dataset", "d.jsonl", "--method", "dpo"] + (
        ["--use_peft"] if FLAGS[name].group == "adapters" else [])
    with pytest.raises(ConfigError, match=f"^--{name} must be "):
        parse_args(argv)[0].validate()


def test_bounds_cover_the_counts_and_fractions():
    assert len(BOUNDED) >= 25 and {"seq_len", "steps", "lr", "lora_dropout", "adam_beta2", "eval_steps"} <= set(
        BOUNDED)


def test_the_parser_takes_its_types_and_choices_from_the_annotations():
    """What the parser does comes from each field's type hint (typing.get_type_hints, not eval)."""
    parser = build_parser(raise_errors=True)
    actions = {a.dest: a for a in parser._actions}
    for group, cls in GROUPS.items():
        for name, hint in typing.get_type_hints(cls).items():
            args = typing.get_args(hint)
            literal = next((a for a in [hint, *args] if typing.get_origin(a) is typing.Literal), None)
            assert actions[name].choices == (typing.get_args(literal) if literal else None), name
    assert actions["lr_scheduler_type"].choices == ("cosine", "linear", "constant_with_warmup")
    with pytest.raises(ConfigError, match="--seq_len: invalid int value: '1.5'"):
        parse_args(["--seq_len", "1.5"])
    with pytest.raises(ConfigError, match="--dtype: invalid choice: 'fp16'"):
        parse_args(["--dtype", "fp16"])
    for module in ("train_config.py", "flag_parser.py", "config_file.py", "groups.py"):
        path = os.path.join(os.path.dirname(__file__), "..", "..", "ulysses_train", "train", "config", module)
        assert "eval(" not in open(path).read()


def test_trainconfig_is_built_from_its_groups():
    cfg = TrainConfig(optim=OptimConfig(lr=1e-4), data=DataConfig(seq_len=4096))
    assert (cfg.optim.lr, cfg.data.seq_len, cfg.optim.steps) == (1e-4, 4096, 30)
    assert config_from(cfg)[1] == {"lr", "seq_len"}  # the settings that differ from the defaults
    assert TrainConfig.from_flags({"lr": 1e-4, "seq_len": 4096}) == cfg == cfg.with_flags()
    assert cfg.with_flags(lr=2e-4).optim.lr == 2e-4 and cfg.optim.lr == 1e-4  # a copy
    assert cfg.get("seq_len") == 4096 and cfg.to_dict()["lr"] == 1e-4
    assert TrainConfig.from_flags({"learning_rate": 1e-4, "bf16": True}) == TrainConfig.from_flags(
        {"lr": 1e-4, "dtype": "bf16"})  # the aliases, as the command line takes them
    with pytest.raises(TypeError, match=r"TrainConfig has no flag 'lerning_rate' \(nearest flag: --lr\)"):
        TrainConfig.from_flags({"lerning_rate": 1e-4})
    with pytest.raises(TypeError, match="TrainConfig.optim must be OptimConfig, not AdapterConfig"):
        TrainConfig(optim=AdapterConfig())
    assert not set(GROUPS) & set(FLAGS)  # cfg.<group> and a flag never share a name
    assert isinstance(build_parser(), argparse.ArgumentParser)
    import ulysses_train

    assert all(getattr(ulysses_train, cls.__name__) is cls for cls in GROUPS.values())  # from ulysses_train import ...
