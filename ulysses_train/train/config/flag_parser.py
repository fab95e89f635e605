"""The flags' parser: every flag of TrainConfig, flat and with its aliases (aliases.py), in one `--help` section per
group; each flag's help with its default and bounds in words; the actions for a flag given several times (--dataset)
and for an alias whose values differ from ours. It knows the flags and their values but no file and no TrainConfig:
config_file.py reads the command line, YAML files and the Python API's settings through it, and tools/flags_doc.py
writes docs/flags.md from it, so the settings (train_config.py) stay apart from how they are typed."""

import argparse
import dataclasses
import json
import re

from ...data.mixture import dataset_entries
from ...errors import ConfigError
from . import aliases
from .groups import FLAGS, GROUPS
from .train_config import _describe


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
