"""Model, tokenizer and dataset paths are checked before any work: a missing or damaged one is a ConfigError that
names the flag and the path (the launch through every rank is in tests/distributed/test_failures.py)."""

import json
import os

import pytest

from ulysses_train.errors import ConfigError
from ulysses_train.paths import local_or_hub
from ulysses_train.train.config.config_file import parse_args
from ulysses_train.train.run.preflight import check_model, preflight


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny saved model with a word-level tokenizer: a healthy folder to damage in copies."""
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from ulysses_train.model.build import load_model_config

    folder = tmp_path_factory.mktemp("models") / "tiny"
    AutoModelForCausalLM.from_config(load_model_config(None, "tiny")).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"t{i}": i for i in range(3, 512)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                            pad_token="<pad>", eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)
    return folder


def _copy(folder, tmp_path, drop=()):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(*drop))
    return copy


def test_hub_ids_and_local_paths():
    for hub in ("Qwen/Qwen3-8B", "gpt2", "deepmind/pg19", "org/name.v2"):
        assert local_or_hub("model", hub) == "hub"
    for path in ("/no/such/model", "./model", "../model", "outputs/run/final", "~/model", "books.jsonl",
                 "data/train.parquet", "models/"):
        with pytest.raises(ConfigError, match=rf"--model {path}: no such file or folder"):
            local_or_hub("model", path)
    assert local_or_hub("model", os.path.dirname(__file__)) == "local"


def test_a_healthy_model_folder_passes(model_folder):
    check_model(str(model_folder), need_tokenizer=True)
    preflight(parse_args(["--model", str(model_folder), "--dataset", str(model_folder / "config.json")])[0])


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage, message", [
    ("no config", "no config.json"),
    ("bad config", "config.json is not valid JSON"),
    ("no weights", "no weights"),
    ("truncated weights", "model.safetensors is damaged"),
    ("bad weights header", "model.safetensors is damaged"),
    ("missing shard", "model-00002-of-00002.safetensors, named in model.safetensors.index.json, is missing"),
    ("no tokenizer", "has no tokenizer"),
    ("a file", "is a file"),
])
def test_a_damaged_model_folder_is_named(model_folder, tmp_path, damage, message):
    drop = {"no config": ["config.json"], "no weights": ["model.safetensors"],
            "no tokenizer": ["tokenizer*"]}.get(damage, [])
    folder = _copy(model_folder, tmp_path, drop)
    if damage == "bad config":
        (folder / "config.json").write_text("{")
    if damage == "truncated weights":
        _truncate(folder / "model.safetensors")
    if damage == "bad weights header":
        (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    if damage == "missing shard":
        index = {"metadata": {}, "weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if damage == "a file":
        folder = folder / "config.json"
    with pytest.raises(ConfigError, match=rf"--model {folder}\b.*{message}"):
        check_model(str(folder), need_tokenizer=True)


def test_a_folder_without_tokenizer_passes_with_tokenizer_flag(model_folder, tmp_path):
    folder = _copy(model_folder, tmp_path, ["tokenizer*"])
    preflight(parse_args(["--model", str(folder), "--tokenizer", "bytes"])[0])
    with pytest.raises(ConfigError, match=r"has no tokenizer .* give one with --tokenizer"):
        preflight(parse_args(["--model", str(folder)])[0])


def test_missing_tokenizer_and_dataset_paths(tmp_path):
    with pytest.raises(ConfigError, match=r"--tokenizer /no/such/tokenizer: no such file or folder"):
        preflight(parse_args(["--tokenizer", "/no/such/tokenizer"])[0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--tokenizer .*empty: no tokenizer files"):
        preflight(parse_args(["--tokenizer", str(tmp_path / "empty")])[0])
    with pytest.raises(ConfigError, match=r"--dataset /no/such/books.jsonl: no such file or folder"):
        preflight(parse_args(["--dataset", "/no/such/books.jsonl"])[0])


def test_model_config_errors_name_the_flag(model_folder, tmp_path):
    from ulysses_train.model.build import load_model_config

    with pytest.raises(ConfigError, match=r"--model /no/such/model: no such file or folder"):
        load_model_config("/no/such/model", None)
    folder = _copy(model_folder, tmp_path)
    (folder / "config.json").write_text("{")
    with pytest.raises(ConfigError, match=rf"--model {folder}: .*not a valid JSON file"):
        load_model_config(str(folder), None)
    # a malformed --model_config was a bare JSONDecodeError (exit 3)
    bad = tmp_path / "model_config.json"
    for text, message in (('{"vocab_size": 259,', "is not a readable JSON file: JSONDecodeError"),
                          ("[1, 2]", "must hold a JSON object \\(a config.json\\), not a list"),
                          ('{"model_type": "no_such_family"}',
                           "model_type 'no_such_family' is not a model type transformers knows .*the trainer trains "
                           ".*qwen3,")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"^--model_config {bad}:? {message}"):
            load_model_config(None, str(bad))


def test_a_damaged_tokenizer_names_the_flag(model_folder, tmp_path):
    from ulysses_train.data.corpus import load_tokenizer

    folder = _copy(model_folder, tmp_path)
    _truncate(folder / "tokenizer.json")
    with pytest.raises(ConfigError, match=rf"--tokenizer {folder}: the tokenizer does not load"):
        load_tokenizer(str(folder), None)
    with pytest.raises(ConfigError, match=rf"--model {folder}: the tokenizer does not load \(give another with"):
        load_tokenizer(None, str(folder))
