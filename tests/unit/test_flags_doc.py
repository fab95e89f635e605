"""docs/flags.md is generated from the trainer's parser (ulysses_train/tools/flags_doc.py): it must equal what the
generator writes today, so a flag, alias, default or help text changed in the code without regenerating the page
fails here. The rendering itself is checked on a parser with titled argument groups, as --help groups the flags."""

import argparse
import os

from ulysses_train.tools import flags_doc
from ulysses_train.train.config.aliases import ALIASES, BY_NAME
from ulysses_train.train.config.flag_parser import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def test_docs_flags_md_is_the_generators_output():
    page = open(os.path.join(ROOT, "docs", "flags.md"), encoding="utf-8").read()
    assert page == flags_doc.render(), f"docs/flags.md is stale: regenerate it with {flags_doc.COMMAND}"


def test_docs_field_keys_md_is_the_generators_output():
    page = open(os.path.join(ROOT, "docs", "field-keys.md"), encoding="utf-8").read()
    assert page == flags_doc.render_field_keys(), f"docs/field-keys.md is stale: regenerate it with {flags_doc.COMMAND}"


def test_every_flag_and_alias_of_the_parser_is_on_the_page():
    page = flags_doc.render()
    for action in build_parser()._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings or action.dest == "help":
            continue
        for name in action.option_strings:
            assert f"`{name}`" in page, name
    for alias in ALIASES:
        assert f"| `--{alias.name}` | {alias.origin} | `--{alias.flag}` |" in page


def test_a_section_per_argument_group_with_aliases_types_defaults_and_help():
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    model = parser.add_argument_group("model", "What is trained.")
    model.add_argument("--model", "--model_name_or_path", type=str, help="A hub id. (default: None)")
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--lr", "--learning_rate", type=float, help="Peak rate | per step. (default: 0.001)")
    optim.add_argument("--lr_scheduler_type", choices=("cosine", "linear"), help="Schedule. (default: cosine)")
    optim.add_argument("--warmup_steps", type=int, help="Warmup. Default: 10%% of --steps. (default: None)")
    optim.add_argument("--hidden", help=argparse.SUPPRESS)
    page = flags_doc.render(parser)
    assert page.index("## Model\n\nWhat is trained.") < page.index("## Optimisation")
    assert "| `--model` | `--model_name_or_path` | str | none | A hub id. |" in page
    assert "| `--lr` | `--learning_rate` | float | 0.001 | Peak rate \\| per step. |" in page
    assert "| `--lr_scheduler_type` |  | `cosine`, `linear` | cosine | Schedule. |" in page
    assert "| `--warmup_steps` |  | int | 10% of --steps | Warmup. |" in page  # a default said in words
    assert "--hidden" not in page and "## Options" not in page  # argparse's own, empty, group is left out
    assert "bf16" in BY_NAME and "| `--bf16` | transformers, axolotl | `--dtype` |" in page  # the aliases table


def test_defaults_and_bounds_live_in_the_fields_not_in_help_texts():
    """What --help and the page say of a default the run decides and of a number's bounds comes from the field
    (train/config/groups.py's `_f`: default_text, gt/ge/lt/le), so the two cannot say different things."""
    from ulysses_train.train.config.groups import FLAGS

    for name, flag in FLAGS.items():
        assert "Default:" not in flag.field.metadata["help"], f"--{name}: give the default as _f(default_text=...)"
    page = flags_doc.render()
    assert "| `--verify_seq_len` |  | int, positive | min(--seq_len, 4096) | Tokens per sequence of the --verify " \
           "step. |" in page
    assert "(default: min(--seq_len, 4096); positive)" in " ".join(build_parser().format_help().split())
