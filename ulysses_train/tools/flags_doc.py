"""`python -m ulysses_train.tools.flags_doc`: writes docs/flags.md, the reference of every flag of launch/train.py,
from the trainer's own parser (`build_parser()` in train/config/flag_parser.py) and the field's names
(train/config/aliases.py), and docs/field-keys.md, what each key of a TRL or axolotl config means here
(train/config/field_keys.py).

The page has one section per argument group of the parser, in the parser's order, and in it one row per flag: its
canonical name, the other names that reach it, what it takes (a type or the choices), its default and its help. The
field's names whose values are translated (`--bf16 true` is `--dtype bf16`) are flags of the parser too; they are
listed once, in the aliases table, not among the flags. `--check` compares instead of writing (exit 1 when the page
is stale); tests/unit/test_flags_doc.py does the same, so the pages cannot drift from the code.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from ..train.config import aliases, field_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "flags.md")
KEYS_PAGE = os.path.join(ROOT, "docs", "field-keys.md")
COMMAND = "python -m ulysses_train.tools.flags_doc"
_DEFAULT = re.compile(r"\s*\(default: (.*)\)\s*$", re.S)
_TOLD = re.compile(r"\s*Default: (.+?)\.(?=\s|$)")
_ALSO = re.compile(r"\s*Also --[\w, -]+\.(?=\s*(\(default:|$))")  # the aliases, which have their own column


def _cell(text: str) -> str:
    """Text that stays inside one cell of a Markdown table."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _field_of(action: argparse.Action):
    """The trainer's config field behind a flag of its parser (train/config/groups.py), or None for another parser."""
    from ..train.config.flag_parser import flag_help
    from ..train.config.groups import FLAGS

    flag = FLAGS.get(action.dest)
    return flag.field if flag is not None and action.help == flag_help(flag.field) else None


def _as_written(stated: str) -> str:
    """A default as YAML and the page say it, the same on every machine."""
    if stated in (None, "None"):
        return "none"
    stated = re.sub(r"^(True|False|None)\b", lambda m: m.group(1).lower(), stated)
    stated = stated.replace(ROOT + os.sep, "").replace("%%", "%")  # the repository's files relative
    home = os.path.expanduser("~")
    return stated.replace(home, "~") if len(home) > 1 else stated  # the home folder as ~


def _default_and_help(action: argparse.Action) -> tuple[str, str]:
    """A flag's default and meaning: for the trainer's flags their field's (its help, default or default_text:
    train/config/groups.py's `_f`, the one place --help reads too); for another parser, read back from its help
    (the parser keeps no defaults: argument_default=SUPPRESS), `(default: X)` at its end or "Default: X." in it."""
    field = _field_of(action)
    if field is not None:
        from ..train.config.flag_parser import default_text

        return _as_written(default_text(field)), field.metadata["help"].replace("%%", "%")
    help_text = _ALSO.sub("", action.help or "")
    match = _DEFAULT.search(help_text)
    stated = match.group(1) if match else None
    if match:
        help_text = help_text[:match.start()]
    held = action.default
    if held is not argparse.SUPPRESS and held is not None:
        stated = str(held)
    help_text = help_text.replace("%%", "%")  # argparse's escape, printed as % by --help
    told = _TOLD.search(help_text)
    if stated in (None, "None") and told:  # a default that depends on the run, said in words: "Default: X."
        stated, help_text = told.group(1), (help_text[:told.start()] + help_text[told.end():]).strip()
    return _as_written(stated), help_text


def _takes(action: argparse.Action) -> str:
    """What a flag takes: its choices, or its type (and, for the trainer's numbers, their bounds)."""
    field = _field_of(action)
    if field is not None and field.metadata["bounds"]:
        from ..train.config.flag_parser import bounds_text

        return f"{_kind(action)}, {bounds_text(field)}"
    return _kind(action)


def _kind(action: argparse.Action) -> str:
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    if action.metavar == "BOOL" or (action.nargs == "?" and action.const is True):
        return "true/false (alone: true)"
    kind = getattr(action.type, "__name__", "str") if action.type else "str"
    kind = {"dataset_entry": "path or JSON object"}.get(kind, kind.lstrip("_"))
    if "Repeat" in type(action).__name__ or action.nargs in ("*", "+"):
        kind += ", repeatable"
    return kind


def _is_listed_flag(action: argparse.Action) -> bool:
    """A flag of the page: not --help, not hidden, not a translating alias (those are in the aliases table)."""
    if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return False
    return action.option_strings[0].lstrip("-") not in aliases.BY_NAME


def _flag_rows(actions) -> list[str]:
    rows = ["| flag | also | takes | default | meaning |", "|---|---|---|---|---|"]
    for action in actions:
        canonical, *others = action.option_strings
        also = ", ".join(f"`{name}`" for name in others)
        default, help_text = _default_and_help(action)
        rows.append(f"| `{canonical}` | {also} | {_cell(_takes(action))} | {_cell(default)} | {_cell(help_text)} |")
    return rows


def _group_sections(parser: argparse.ArgumentParser) -> list[str]:
    """A section per argument group that holds a listed flag, titled as the group is, in the parser's order."""
    lines = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _is_listed_flag(a)]
        if not actions:
            continue
        title = group.title or "Flags"
        lines += ["", f"## {title[0].upper()}{title[1:]}", ""]
        if group.description:
            lines += [" ".join(group.description.split()), ""]
        lines += _flag_rows(actions)
    return lines


def _alias_sections() -> list[str]:
    lines = ["", "## The field's names", "",
             "Names of transformers' `TrainingArguments`, TRL's `SFTConfig` and axolotl's keys, accepted as flags and "
             "as YAML keys beside ours (`train/config/aliases.py`). Each setting has one canonical name, ours, which "
             "`--help`, `config.yaml` and the checkpoints use.", "",
             "| name | origin | ours | values |", "|---|---|---|---|"]
    for alias in aliases.ALIASES:
        lines.append(f"| `--{alias.name}` | {_cell(alias.origin)} | `--{alias.flag}` | "
                     f"{_cell(alias.values or 'the same')} |")
    lines += ["", "The other keys of TRL's and axolotl's configs, translated or refused with what to use instead, are "
                  "listed in [field-keys.md](field-keys.md)."]
    return lines


def render_field_keys() -> str:
    """docs/field-keys.md: every key of the field's configs that this trainer reads, and what it means here."""
    lines = ["# TRL and axolotl keys", "",
             f"Generated from `ulysses_train/train/config/field_keys.py` by `{COMMAND}`; do not edit by hand. "
             "A YAML file (`--config`) or a dict given to `train()` may hold the keys of TRL's `SFTConfig` and "
             "`DPOConfig` (transformers' `TrainingArguments` with them, and the `ModelConfig` and `ScriptArguments` of "
             "TRL's scripts) and of axolotl's configs. Each is read with its meaning here: the flags of the same name "
             "and the aliases of [flags.md](flags.md#the-fields-names), and the keys below. A key set to null is not "
             "set. Every key that has no meaning here is refused, all of them in one message, each with what to use "
             "instead.", "",
             "## Keys read with the rest of the file", "", "| key | meaning here |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(meaning)} |" for name, meaning in field_keys.CONTEXT_KEYS.items()]
    lines += ["", "An axolotl `datasets:` entry is a `--dataset` entry: `path` and `split` as they are, `type` "
                  "chat_template or sharegpt is `data_format: messages` and completion `data_format: text` (with "
                  "`field` its text column), `field_messages` is `messages_field`, `roles` is `role_map`, and "
                  "`message_property_mappings` is accepted when it names the keys read here (role or from, content "
                  "or value).", "",
              "## Keys", "", "| key | origin | meaning here |", "|---|---|---|"]
    lines += [f"| `{key.name}` | {_cell(key.origin)} | {_cell(key.meaning)} |" for key in field_keys.KEYS]
    return "\n".join(lines) + "\n"


def render(parser: argparse.ArgumentParser | None = None) -> str:
    """The page, for `parser` (default: the trainer's)."""
    if parser is None:
        from ..train.config.flag_parser import build_parser

        parser = build_parser()
    head = ["# Flags", "",
            f"Generated from the trainer's parser by `{COMMAND}`; do not edit by hand (a test fails when this page "
            "differs from the code). `python launch/train.py --help` prints the same. Every flag is also a key of a "
            "`--config` YAML file (the name without `--`), and a keyword of the Python API's `train()` "
            "([python-api.md](python-api.md))."]
    return "\n".join(head + _group_sections(parser) + _alias_sections()) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=PAGE, help="where to write (default: docs/flags.md of this repository)")
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when the page is stale")
    p.add_argument("--keys_out", default=KEYS_PAGE, help="where to write the field's keys (default: "
                                                          "docs/field-keys.md)")
    a = p.parse_args(argv)
    stale = 0
    for path, text in ((a.out, render()), (a.keys_out, render_field_keys())):
        if a.check:
            current = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
            if current != text:
                print(f"{path} is stale: regenerate it with {COMMAND}", file=sys.stderr)
                stale = 1
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {path}")
    return stale


if __name__ == "__main__":
    sys.exit(main())
