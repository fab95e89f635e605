"""Paths checked before any work: --model, --ref_model, --tokenizer, --dataset and --chat_template exist, and a local
model folder holds a readable config, intact weights and (when it must provide one) a tokenizer. Each problem is a
ConfigError naming the flag and the path, raised on every rank alike before the process group, the data or the
model exist, instead of a traceback per rank from deep inside transformers or datasets.

Which names are local paths and which hub ids: ../paths.py. Loading errors of hub ids are turned into ConfigErrors
where they are loaded (model/build.py, data/corpus.py).
"""

from __future__ import annotations

import json
import os
import zipfile

from ...data.mixture import dataset_entries
from ...errors import ConfigError
from ...paths import local_or_hub

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model")
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def check_model(spec: str, need_tokenizer: bool, flag: str = "model") -> None:
    """A local --model (or --ref_model) folder: config.json readable, weights present and intact, a tokenizer if it
    must give one."""
    if local_or_hub(flag, spec) == "hub":
        return
    if not os.path.isdir(spec):
        raise ConfigError(f"--{flag} {spec} is a file: give the folder that holds config.json and the weights")
    config = os.path.join(spec, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"--{flag} {spec}: no config.json (a folder written by save_pretrained has one)")
    try:
        with open(config) as f:
            json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--{flag} {spec}: config.json is not valid JSON ({e})") from None
    for name in _weight_files(spec):
        problem = _weight_file_problem(os.path.join(spec, name))
        if problem:
            raise ConfigError(f"--{flag} {spec}: {name} is damaged ({problem}): save or download it again")
    if need_tokenizer and not _has_tokenizer(spec):
        raise ConfigError(f"--{flag} {spec} has no tokenizer ({' or '.join(_TOKENIZER_FILES[:2])}): give one with "
                          f"--tokenizer (a folder, a hub id, or bytes)")


def check_tokenizer(spec) -> None:
    if spec in (None, "bytes") or local_or_hub("tokenizer", spec) == "hub":
        return
    if not os.path.isdir(spec):
        raise ConfigError(f"--tokenizer {spec} is a file: give the folder that holds it (with tokenizer_config.json)")
    if not _has_tokenizer(spec):
        raise ConfigError(f"--tokenizer {spec}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")


def check_dataset(spec, flag: str = "dataset") -> None:
    """Existence only, of each dataset of a mixture too: the files' contents are read (and their errors named) when
    the data is loaded."""
    if spec:
        for entry in dataset_entries(spec, flag):
            local_or_hub(flag, entry.path)


def check_chat_template(path) -> None:
    if path and not os.path.isfile(path):
        raise ConfigError(f"--chat_template {path}: no such file (give a Jinja chat template file)")


def preflight(cfg) -> None:
    """Every path check of a run (a TrainConfig), in the order the run reads them."""
    if cfg.base.model:
        check_model(cfg.base.model, need_tokenizer=cfg.data.tokenizer is None)
    if cfg.pref.ref_model:
        check_model(cfg.pref.ref_model, need_tokenizer=False, flag="ref_model")
    check_tokenizer(cfg.data.tokenizer)
    check_dataset(cfg.data.dataset)
    check_dataset(cfg.eval.eval_dataset, "eval_dataset")
    check_chat_template(cfg.sft.chat_template)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES)


def _weight_files(folder: str) -> list[str]:
    """The weight files transformers would read: a single file, or every shard an index names."""
    for name in _WEIGHTS:
        index = os.path.join(folder, name + ".index.json")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"--model {folder}: {name}.index.json is damaged ({type(e).__name__}: {e})") \
                    from None
            for shard in shards:
                if not os.path.isfile(os.path.join(folder, shard)):
                    raise ConfigError(f"--model {folder}: {shard}, named in {name}.index.json, is missing")
            return shards
        if os.path.isfile(os.path.join(folder, name)):
            return [name]
    raise ConfigError(f"--model {folder}: no weights ({', '.join(_WEIGHTS)} or their .index.json)")


def _weight_file_problem(path: str):
    """Why a weight file cannot be whole, from its header and size alone (cheap at any size), or None."""
    size = os.path.getsize(path)
    if path.endswith(".bin"):
        with open(path, "rb") as f:
            legacy = f.read(1) == b"\x80"  # torch.save before the zip format: a bare pickle, nothing to check
        return None if legacy or zipfile.is_zipfile(path) else "not a zip archive: cut short or overwritten"
    with open(path, "rb") as f:  # safetensors: 8-byte header length, JSON header, then the tensors' bytes
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        if not 0 < header_len <= size - 8:
            return f"its header length {header_len} does not fit the file's {size} bytes"
        try:
            header = json.loads(f.read(header_len))
            end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            return f"unreadable header: {type(e).__name__}: {e}"
    if 8 + header_len + end > size:
        return f"{size} bytes, its header needs {8 + header_len + end}: cut short"
    return None
