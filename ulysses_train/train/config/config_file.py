"""A run's settings from where they are given, and written back: a --config YAML file (flat or grouped, read as
strictly as the DeepSpeed JSON), the Python API's dict or TrainConfig, each read as command-line words through the
flags' parser (flag_parser.py), so that a file, a dict and typed flags pass the same checks; `parse_args` (the command
line, its --config file first) and `config_from` (the Python API) layer them into a TrainConfig; the resolved
`config.yaml`. Apart from the parser, which knows the flags but no file, and from TrainConfig (train_config.py), which
holds and checks the settings however they were given."""

import argparse
import dataclasses
import os
import re
import sys
from typing import Optional

from ...errors import ConfigError
from . import aliases, field_files, field_keys
from .flag_parser import _Parser, build_parser
from .groups import FLAGS, GROUPS
from .train_config import TrainConfig


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
