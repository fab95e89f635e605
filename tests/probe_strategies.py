"""Hypothesis strategies for the probe suite (tests/unit/test_probes.py): what a new user might give the trainer.

Settings (flags on the command line and keys of a --config YAML file: right and wrong types, values at and past
their bounds, huge and non-finite numbers, unknown keys, the aliases of transformers/TRL/axolotl), dataset rows
(every supported format, with wrong types, nulls, empty values, long values and control characters) and model
configs (sizes, rotary parameters, layer types, as a config.json holds them). Each is drawn from what the package
itself declares (its flags' types, bounds and choices; its families), so that a new flag or family is probed too.
"""

from __future__ import annotations

from hypothesis import strategies as st

from ulysses_train.sp.support import FAMILIES
from ulysses_train.train.config import aliases
from ulysses_train.train.config.groups import FLAGS

# flags that name files, folders or hub ids: probed with values that cannot touch the user's files (a missing path,
# a name that is no hub id), never with a real folder to write into
PATH_FLAGS = ("output_dir", "data_cache_dir", "model", "model_config", "tokenizer", "dataset", "eval_dataset",
              "ds_config", "chat_template", "ref_model", "config", "resume")
# text as a user types it, with what a shell lets through (spaces, quotes, unicode), no line breaks
TYPED = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
# text with control characters: what a file (YAML, JSONL) can hold
CONTROL = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
NON_FINITE = st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity", "1e400", "-1e400"])
HUGE_INTS = st.sampled_from([2**31, 2**63, 10**12, 10**30, -(2**63)])


def _number_words(kind: type) -> st.SearchStrategy[str]:
    """Values of an int or float flag as words: in range, out of range, huge, non-finite, or not numbers."""
    ints = st.one_of(st.integers(-3, 5000), HUGE_INTS).map(str)
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), NON_FINITE,
                       st.floats(-2.0, 2.0).map(repr))
    others = st.one_of(TYPED, st.sampled_from(["", "1.5", "0x10", "1_000", "true", "None", "-0"]))
    return st.one_of(ints, floats, others) if kind is int else st.one_of(floats, ints, others)


def flag_value(name: str) -> st.SearchStrategy[str]:
    """One value of `name` as typed after `--name`."""
    flag = FLAGS[name]
    if name in PATH_FLAGS:
        return st.one_of(st.just("/nonexistent/probe"), st.just("no-such-org/no-such-model-probe"), TYPED)
    if flag.choices:
        return st.one_of(st.sampled_from([str(c) for c in flag.choices]), TYPED)
    if flag.type is bool:
        return st.one_of(st.sampled_from(["true", "false", "yes", "0", "on"]), TYPED)
    if flag.type in (int, float):
        return _number_words(flag.type)
    return TYPED


# an unknown key: a misspelt flag, another trainer's setting, or any word
UNKNOWN = st.one_of(st.sampled_from(["learning-rates", "max_seq_len", "seqlen", "fp16", "optim", "lora_rank",
                                     "deepspeed", "eval_strategy", "micro_batch"]),
                    st.from_regex(r"[a-z][a-z_]{1,14}", fullmatch=True).filter(
                        lambda n: n not in FLAGS and n not in aliases.BY_NAME))
NAMES = sorted(n for n in FLAGS if n not in ("config", "resume", "overwrite_output_dir", "output_dir"))


@st.composite
def flag_words(draw) -> list[str]:
    """A command line: a few flags (ours or an alias), each with a value; at times an unknown flag."""
    words = []
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True)):
        spelled = draw(st.sampled_from([name] + [a.name for a in aliases.ALIASES if a.flag == name]))
        words.append(f"--{spelled}={draw(flag_value(name))}")
    if draw(st.integers(0, 5)) == 0:
        words.append(f"--{draw(UNKNOWN)}=1")
    return words


def _yaml_value(name: str) -> st.SearchStrategy:
    """A YAML value for a key: a word as a flag takes it, or a number, bool, null, list or mapping."""
    plain = st.one_of(st.integers(-10, 10**6), HUGE_INTS, st.floats(allow_nan=True, allow_infinity=True),
                      st.booleans(), st.none(), CONTROL)
    return st.one_of(flag_value(name) if name in FLAGS else TYPED, plain, st.lists(plain, max_size=3),
                     st.dictionaries(TYPED, plain, max_size=2))


@st.composite
def yaml_settings(draw) -> dict:
    """A --config file's mapping: flat keys, keys under their group's, aliases and at times an unknown key."""
    values = {}
    for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True)):
        spelled = draw(st.sampled_from([name] + [a.name for a in aliases.ALIASES if a.flag == name]))
        value = draw(_yaml_value(name))
        if draw(st.booleans()) and spelled == name:
            values.setdefault(FLAGS[name].group, {})[name] = value
        else:
            values[spelled] = value
    if draw(st.integers(0, 4)) == 0:
        values[draw(UNKNOWN)] = draw(_yaml_value("probe"))
    return values


# ---------------------------------------------------------------- dataset rows

ROLES = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", "bot", "", "Assistant"])
# a value where a string belongs: a string (with control characters, empty or long), or another type
TEXT = st.one_of(CONTROL, st.just(""), st.text(max_size=3).map(lambda s: s * 200), st.just("\x1b[2J\x07\x00"))
WRONG = st.one_of(st.none(), st.integers(-5, 5), st.floats(allow_nan=True), st.booleans(), st.lists(st.integers(0, 9),
                                                                                                    max_size=3),
                  st.dictionaries(st.sampled_from(["text", "type"]), TEXT, max_size=2))


def _maybe_wrong(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the right type, at times a wrong one."""
    return st.one_of(strategy, strategy, strategy, WRONG)


def _message() -> st.SearchStrategy:
    right = st.fixed_dictionaries({"role": ROLES, "content": _maybe_wrong(TEXT)})
    return _maybe_wrong(right)


def _messages() -> st.SearchStrategy:
    return _maybe_wrong(st.lists(_message(), max_size=4))


ROWS = {
    "text": st.fixed_dictionaries({"text": _maybe_wrong(TEXT)}),
    "messages": st.fixed_dictionaries({"messages": _messages()}),
    "conversations": st.fixed_dictionaries({"conversations": _maybe_wrong(st.lists(
        _maybe_wrong(st.fixed_dictionaries({"from": ROLES, "value": _maybe_wrong(TEXT)})), max_size=4))}),
    "prompt_completion": st.fixed_dictionaries({"prompt": st.one_of(_maybe_wrong(TEXT), _messages()),
                                                "completion": st.one_of(_maybe_wrong(TEXT), _messages())}),
    "tokens": st.fixed_dictionaries(
        {"input_ids": _maybe_wrong(st.lists(st.one_of(st.integers(0, 258), st.integers(-3, 2**40),
                                                      st.floats(allow_nan=True)), max_size=40))},
        optional={"labels": _maybe_wrong(st.lists(st.integers(-100, 258), max_size=40)),
                  "assistant_masks": _maybe_wrong(st.lists(st.integers(-1, 2), max_size=40))}),
    "preference": st.fixed_dictionaries({"prompt": _maybe_wrong(TEXT), "chosen": _maybe_wrong(TEXT),
                                         "rejected": _maybe_wrong(TEXT)}),
}


@st.composite
def dataset_rows(draw, fmt: str) -> list:
    """The rows of a JSONL file of one format: mostly well-formed ones, some with wrong types, at times a row that is
    no object at all, or an extra column."""
    rows = draw(st.lists(ROWS[fmt], max_size=6))
    if rows and draw(st.integers(0, 5)) == 0:
        rows[draw(st.integers(0, len(rows) - 1))] = draw(WRONG)
    if rows and draw(st.integers(0, 5)) == 0:
        for row in rows:
            if isinstance(row, dict):
                row["extra"] = draw(WRONG)
    return rows


ANY_TEXT = st.characters(blacklist_categories=("Cs",))  # control characters, escapes, NUL and all


def well_formed_text_rows(min_size: int = 1) -> st.SearchStrategy:
    """Text rows that train: documents of printable text and control characters, each at least `min_size`
    characters."""
    return st.lists(st.fixed_dictionaries({"text": st.text(ANY_TEXT, min_size=min_size, max_size=300)}), min_size=1,
                    max_size=8)


LONG = st.text(ANY_TEXT, min_size=80, max_size=200)  # a side of a row that fills a 64-token sample
FILLED = {
    "text": st.fixed_dictionaries({"text": LONG}),
    "messages": st.fixed_dictionaries({"messages": st.tuples(
        st.fixed_dictionaries({"role": st.just("user"), "content": LONG}),
        st.fixed_dictionaries({"role": st.just("assistant"), "content": LONG})).map(list)}),
    "prompt_completion": st.fixed_dictionaries({"prompt": LONG, "completion": LONG}),
    "tokens": st.fixed_dictionaries({"input_ids": st.lists(st.integers(3, 258), min_size=64, max_size=100)}),
    "preference": st.fixed_dictionaries({"prompt": st.text(ANY_TEXT, max_size=8),
                                         "chosen": st.text(ANY_TEXT, max_size=8),
                                         "rejected": st.text(ANY_TEXT, max_size=8)}),
}


def run_rows(fmt: str) -> st.SearchStrategy:
    """A probe run's dataset: rows as dataset_rows draws them, or rows that fill a few samples (so that some runs
    train, and the property's other half is probed)."""
    return st.one_of(dataset_rows(fmt), st.lists(FILLED[fmt], min_size=4, max_size=8))


# ---------------------------------------------------------------- model configs

# sizes where a config.json has them: small, not positive, not whole numbers, other types; SIZE also huge (the
# in-process checks only: a run would try to build a model of that size)
BUILDABLE_SIZE = st.one_of(st.integers(1, 64), st.integers(-4, 0), st.floats(allow_nan=True, allow_infinity=True),
                           st.none(), st.just("8"), st.booleans())
SIZE = st.one_of(BUILDABLE_SIZE, HUGE_INTS)
ROPE = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**7), st.none(), st.just("1e4"))


@st.composite
def model_configs(draw, sizes: st.SearchStrategy = SIZE) -> dict:
    """A config.json of a supported family (at times an unknown or unsupported model_type) at a tiny size, with
    some fields drawn from `sizes` (wrong types and bad values among them)."""
    model_type = draw(st.one_of(st.sampled_from(sorted(FAMILIES)),
                                st.sampled_from(["llamaa", "bert", "t5", "", "gpt2"]),
                                st.from_regex(r"[a-z_]{1,10}", fullmatch=True)))
    values = {"model_type": model_type, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 300,
              "max_position_embeddings": 256}
    for name in draw(st.lists(st.sampled_from(sorted(values)[1:] + ["sliding_window", "num_experts"]), max_size=3,
                              unique=True)):
        values[name] = draw(sizes)
    if draw(st.booleans()):
        values["rope_theta"] = draw(ROPE)
    if draw(st.booleans()):
        values["rope_parameters"] = draw(st.one_of(
            st.fixed_dictionaries({"rope_type": st.sampled_from(["default", "yarn", "linear", "nope"]),
                                   "rope_theta": ROPE}, optional={"factor": ROPE}),
            WRONG))
    if draw(st.booleans()):
        layers = values["num_hidden_layers"] if isinstance(values["num_hidden_layers"], int) else 2
        values["layer_types"] = draw(st.one_of(
            st.lists(st.sampled_from(["full_attention", "sliding_attention", "linear_attention", "chunked", ""]),
                     min_size=max(0, min(layers, 4)), max_size=max(0, min(layers, 4))),
            WRONG))
    return values


# ---------------------------------------------------------------- whole runs

# the flags a probe run draws values for: those that change what a few steps of the tiny model do, not how long
# they take (--seq_len, --steps, --micro_batch_size and --grad_accum stay fixed and small)
RUN_FLAGS = ("lr", "min_lr_ratio", "warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm", "adam_beta1",
             "adam_beta2", "adam_epsilon", "lr_scheduler_type", "packing", "last_sample", "loss_on", "truncation",
             "data_format", "seed", "text_column", "messages_field", "dist_timeout", "save_steps",
             "save_total_limit", "log_every", "max_tokens", "skip_nonfinite", "gradient_checkpointing")


def valid_value(name: str) -> st.SearchStrategy[str]:
    """A value `name` takes: one of its choices, a boolean, or a number within its bounds (small, for the ints:
    --save_steps 10**9 is valid and probes nothing a run of two steps shows)."""
    flag = FLAGS[name]
    if flag.choices:
        return st.sampled_from([str(c) for c in flag.choices])
    if flag.type is bool:
        return st.sampled_from(["true", "false"])
    bounds = flag.field.metadata["bounds"]
    low = bounds.get("ge", bounds.get("gt"))
    high = bounds.get("le", bounds.get("lt"))
    if flag.type is int:
        start = 0 if low is None else low + ("gt" in bounds)
        return st.integers(start, start + 5 if high is None else min(high, start + 5)).map(str)
    return st.floats(low, high, exclude_min="gt" in bounds, exclude_max="lt" in bounds, allow_nan=False,
                     allow_infinity=False).map(repr)


@st.composite
def run_flags(draw) -> list[str]:
    """A few of RUN_FLAGS, each with a value it takes, or (one time in three) any drawn value."""
    return [f"--{name}={draw(st.one_of(valid_value(name), valid_value(name), flag_value(name)))}"
            for name in draw(st.lists(st.sampled_from(RUN_FLAGS), max_size=3, unique=True))]
