"""The probe suite: generated settings, dataset rows and model configs (tests/probe_strategies.py) against one
property. Either the input is taken (parsed, loaded, trained: a run exits 0 having trained the tokens it says), or it
is refused by one line that names the flag, the file and row, or the field to change (exit 2); never another
exception, a traceback, exit 3, a hang, or a changed input file.

The in-process probes run the code the command line runs before any process group (the parser and
`TrainConfig.validate`, the data loader, the model config's checks); the `slow` ones start launch/train.py on the
tiny model on CPU. How many examples each draws is the Hypothesis profile's (tests/conftest.py: "quick" by
default, "ci" under CI=true or HYPOTHESIS_PROFILE=ci); docs/testing.md says how to run the long one.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import probe_strategies as probe
from tests.sft_fixtures import CHATML_QWEN
from tests.trainer_runs import ROOT, TRAIN, child_env
from ulysses_train.errors import ConfigError

# a refusal names what to change: a flag (--seq_len), a file given by one (--dataset x.jsonl), a row or a field
NAMES_SOMETHING = re.compile(r"--[a-z][a-z0-9_-]*|\brow \d+|`[^`]+`")
RUNS = {"quick": 2, "ci": 10}.get(settings.get_current_profile_name(), 2)  # subprocess runs per slow probe


def one_line_naming(message: str, *expected: str) -> None:
    """A refusal as the command line prints it: one line, naming what to change (and each of `expected`)."""
    assert "\n" not in message and "\r" not in message, f"more than one line: {message!r}"
    assert NAMES_SOMETHING.search(message), f"names no flag, row or field: {message!r}"
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"
    assert "Traceback" not in message


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---------------------------------------------------------------- settings


def settle(argv: list[str]):
    """What the command line does with `argv` before any process group: its message if it refuses them."""
    from ulysses_train.train.config.config_file import parse_args

    try:
        cfg, _ = parse_args(argv)
        cfg.validate()
    except ConfigError as e:
        return str(e)
    return None


@given(probe.flag_words())
def test_generated_flags_are_taken_or_refused_in_one_line(words):
    message = settle(words + ["--output_dir", "/nonexistent/probe-out"])
    if message is not None:
        one_line_naming(message)


@given(probe.yaml_settings())
def test_generated_config_files_are_taken_or_refused_naming_the_file(values):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "run.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(values, f, allow_unicode=True)
        before = digest(path)
        message = settle(["--config", path, "--output_dir", os.path.join(folder, "out")])
        assert digest(path) == before
    if message is not None:
        one_line_naming(message)


# ---------------------------------------------------------------- dataset rows

FORMATS = sorted(probe.ROWS)


def write_jsonl(path: str, rows: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, allow_nan=True) + "\n")


def load_rows(folder: str, fmt: str, rows: list):
    """The data loader of a run (byte tokenizer, 64-token samples, the tiny model's vocabulary) on `rows` as a JSONL
    file: (its path, the log, the loaded source or the refusal's message)."""
    from ulysses_train.data.load import _Loader
    from ulysses_train.data.mixture import dataset_entries
    from ulysses_train.train.config.train_config import TrainConfig

    path = os.path.join(folder, f"{fmt}.jsonl")
    write_jsonl(path, rows)
    template = os.path.join(folder, "chatml.jinja")
    with open(template, "w") as f:
        f.write(CHATML_QWEN)
    flags = {"tokenizer": "bytes", "data_cache_dir": os.path.join(folder, "cache"), "dataset": path}
    if fmt in ("messages", "conversations", "prompt_completion", "preference"):
        flags["chat_template"] = template
    if fmt == "preference":
        flags["method"] = "dpo"
    log = []
    result = _Loader(TrainConfig.from_flags(flags).data_settings(), dataset_entries(path, "dataset"), "train", 64,
                     259, log.append, "dataset").load()
    return path, log, result


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_generated_rows_are_loaded_or_refused_naming_the_file(fmt, data):
    rows = data.draw(probe.dataset_rows(fmt))
    with tempfile.TemporaryDirectory() as folder:
        path, log, result = load_rows(folder, fmt, rows)
        with open(path, "rb") as f:
            written = f.read()
        write_jsonl(path + ".again", rows)
        assert open(path + ".again", "rb").read() == written  # the loader left the file as it was
    if isinstance(result, str):
        one_line_naming(result)
    else:
        assert result[1].num_samples > 0, log


@pytest.mark.slow
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(probe.well_formed_text_rows())
def test_text_rows_train_the_tokens_the_log_says(rows):
    """The byte tokenizer's count is known: one id per UTF-8 byte and an EOS per document."""
    with tempfile.TemporaryDirectory() as folder:
        _, log, result = load_rows(folder, "text", rows)
    expected = sum(len(row["text"].encode("utf-8")) + 1 for row in rows)
    if expected < 64:
        assert result == (f"the dataset has {expected} tokens, fewer than one sample of --seq_len 64: lower "
                          f"--seq_len, add data, or pass --last_sample pad")
        return
    assert not isinstance(result, str), result
    said = re.search(r"data: ([\d,]+) tokens in ([\d,]+) documents -> ([\d,]+) samples", log[0])
    assert said, log
    assert int(said[1].replace(",", "")) == expected and int(said[2].replace(",", "")) == len(rows)
    assert int(said[3].replace(",", "")) == result[1].num_samples == expected // 64


# ---------------------------------------------------------------- model configs


def model_checks(path: str):
    """What the trainer does with --model_config before building anything (train/run/trainer.py's order): load and check
    it, set the rotary positions, check the heads against one process, count its geometry, check every layer is
    supported. Its message if it refuses."""
    from ulysses_train.levers.rope import configure_rope
    from ulysses_train.model.build import load_model_config
    from ulysses_train.model.geometry import geometry
    from ulysses_train.sp import dims
    from ulysses_train.sp.layout import attention_heads
    from ulysses_train.sp.support import check_support

    try:
        config = load_model_config(None, path)
        configure_rope(config, "none", 64)
        dims.validate(1, 1, *attention_heads(config), {"seq_len": 64})
        geometry(config)
        check_support(config)
    except ConfigError as e:
        return str(e)
    return None


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(probe.model_configs())
def test_generated_model_configs_are_taken_or_refused_naming_the_field(values):
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "config.json")
        with open(path, "w") as f:
            json.dump(values, f)
        before = digest(path)
        message = model_checks(path)
        assert digest(path) == before
    if message is not None:
        assert message.startswith(f"--model_config {path}"), message
        one_line_naming(message)
        assert len(message) < 1000, f"a refusal of {len(message)} characters: {message[:300]}..."


# ---------------------------------------------------------------- whole runs (slow)

HANG_GUARD_S = 600  # a hang detector, not a speed requirement
RUN_FORMATS = ("text", "messages", "prompt_completion", "tokens", "preference")


def train(folder: str, args: list[str]) -> subprocess.CompletedProcess:
    """launch/train.py on the tiny model, two steps of 64 tokens on CPU, into `folder`/out."""
    command = [sys.executable, TRAIN, "--output_dir", os.path.join(folder, "out"), "--steps", "2", "--seq_len", "64",
               "--tokenizer", "bytes"] + args
    return subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=HANG_GUARD_S)


def assert_ran_or_refused(proc: subprocess.CompletedProcess, folder: str) -> None:
    """Exit 0 with every step's trained tokens in metrics.jsonl, or exit 2 with one error line; nothing else."""
    text = proc.stdout + proc.stderr
    assert proc.returncode in (0, 2), f"exit {proc.returncode}:\n{text[-4000:]}"
    assert "Traceback" not in text, text[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    if proc.returncode == 2:
        assert len(errors) == 1, proc.stderr[-4000:]
        one_line_naming(errors[0])
        return
    assert not errors, proc.stderr[-4000:]
    with open(os.path.join(folder, "out", "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2], records
    for r in records:  # what the loss was averaged over: real targets, among the positions it ran
        assert 0 <= r["num_tokens"] <= r["num_positions"] and r["num_positions"] % 64 == 0, r
    assert sum(r["num_tokens"] for r in records) > 0 and "done: 2 steps" in proc.stdout, proc.stdout[-2000:]


def data_args(folder: str, fmt: str, rows: list) -> tuple[str, list[str]]:
    """The rows written as --dataset, with the flags their format needs (a chat template, --method dpo)."""
    path = os.path.join(folder, f"{fmt}.jsonl")
    write_jsonl(path, rows)
    args = ["--dataset", path]
    if fmt in ("messages", "prompt_completion", "preference"):
        template = os.path.join(folder, "chatml.jinja")
        with open(template, "w") as f:
            f.write(CHATML_QWEN)
        args += ["--chat_template", template]
    return path, args + (["--method", "dpo"] if fmt == "preference" else [])


@pytest.mark.slow
@settings(max_examples=RUNS, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(RUN_FORMATS).flatmap(lambda fmt: st.tuples(st.just(fmt), probe.run_rows(fmt))),
       probe.run_flags())
@pytest.mark.slow
def test_generated_runs_train_or_exit_2_with_one_line(fmt_rows, flags):
    fmt, rows = fmt_rows
    with tempfile.TemporaryDirectory() as folder:
        path, args = data_args(folder, fmt, rows)
        before = digest(path)
        proc = train(folder, args + flags)
        assert digest(path) == before, "the run changed its --dataset file"
        assert_ran_or_refused(proc, folder)


@pytest.mark.slow
@settings(max_examples=RUNS, suppress_health_check=list(HealthCheck))
@given(st.lists(probe.FILLED["text"], min_size=4, max_size=8), probe.model_configs(sizes=probe.BUILDABLE_SIZE),
       probe.run_flags())
@pytest.mark.slow
def test_generated_model_configs_train_or_exit_2_with_one_line(rows, values, flags):
    """Text that fills the steps, and a generated --model_config (small sizes: it is built)."""
    with tempfile.TemporaryDirectory() as folder:
        path, args = data_args(folder, "text", rows)
        config = os.path.join(folder, "config.json")
        with open(config, "w") as f:
            json.dump(values, f)
        before = digest(path), digest(config)
        proc = train(folder, args + ["--model_config", config] + flags)
        assert (digest(path), digest(config)) == before, "the run changed its input files"
        assert_ran_or_refused(proc, folder)
