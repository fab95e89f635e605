"""Book-length training data: a text corpus joined end to end into samples of exactly `seq_len` tokens.

Pipeline: `datasets` loads the corpus (a hub id, or local txt / jsonl / json / parquet / arrow files or folders, or a
`save_to_disk` folder), tokenizes it with `Dataset.map` (batched, `num_proc`, progress bars, cached by fingerprint),
and we write the token ids once into a flat memory-mapped array, EOS between documents, plus the document start
offsets. A sample is then a slice of that array: a 1M-token sample loads without any Python list. The arrays are
cached (token_store.py) under a key made of every setting that decides them, so a second run starts in seconds.
A dataset that cannot be read (a corrupt parquet or JSON file) is a ConfigError naming --dataset.
"""

from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError
from ..paths import local_or_hub
from .content import dataset_digest
from .token_store import TokenStore, build_token_store, cache_settings, store_key, tokenizer_identity  # noqa: F401

_EXT_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class ByteTokenizer:
    """Byte-level tokenizer for offline use and tests: ids 0..2 are pad/eos/unk, byte b is id b + 3 (vocab 259).
    It has no chat template of its own (give one with --chat_template) and no special-token strings: a template's
    `<|im_end|>` is its bytes."""

    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2
    vocab_size = 259
    name_or_path = "bytes"
    identity = "utf-8 bytes + 3, pad 0, eos 1, unk 2"  # what the token cache's key records for it
    chat_template = None
    special_tokens_map: dict = {}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) + 3 for t in texts]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_batch([text])[0].tolist()

    def decode(self, ids) -> str:
        """Text of byte ids; pad/eos/unk (and bytes cut mid-character) decode to nothing / U+FFFD."""
        return bytes(int(i) - 3 for i in ids if int(i) >= 3).decode("utf-8", errors="replace")

    def __len__(self):
        return self.vocab_size


def load_tokenizer(name: Optional[str], model: Optional[str], need_eos: bool = True):
    """--tokenizer: 'bytes', a path/hub id, or (default) the model's own tokenizer; bytes without a model. A
    tokenizer that does not load, or (when documents are joined) has no EOS, is a ConfigError naming the flag."""
    if name == "bytes" or (name is None and model is None):
        return ByteTokenizer()
    from transformers import AutoTokenizer

    flag = f"--tokenizer {name}" if name else f"--model {model}"
    local_or_hub("tokenizer" if name else "model", name or model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name or model)
    except (OSError, ValueError) as e:  # missing or unreadable files; transformers' messages say which
        hint = "" if name else " (give another with --tokenizer)"
        raise ConfigError(f"{flag}: the tokenizer does not load{hint}: {str(e).strip()}") from None
    if need_eos and tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {name or model} has no EOS token, which joins documents: "
                          f"give one with --tokenizer, or use --tokenizer bytes")
    return tokenizer


def _local_builder(path: str) -> tuple[str, dict]:
    """(builder name, load_dataset kwargs) for a local file or folder of one format."""
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.splitext(f)[1] in _EXT_BUILDERS)
    else:
        files = [path]
    if not files:
        raise ConfigError(f"--dataset {path}: no .txt, .jsonl, .json, .parquet or .arrow files found")
    builders = {_EXT_BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in builders or len(builders) != 1:
        raise ConfigError(f"--dataset {path}: mixed or unsupported file types ({sorted(map(str, builders))}); "
                          f"use one of .txt, .jsonl/.json, .parquet, .arrow")
    builder = builders.pop()
    if builder != "text" and all(os.path.getsize(f) == 0 for f in files):  # datasets fails on them with a bare
        empty = f"{path} is" if files == [path] else f"{path}: its {len(files)} file(s) are"  # StopIteration
        raise ConfigError(f"--dataset {empty} empty (0 bytes): nothing to read; give a file with rows")
    kwargs = {"data_files": files}
    if builder == "text":
        # one file = one document (a book), not one line; undecodable bytes become U+FFFD instead of failing
        kwargs.update(sample_by="document", encoding_errors="replace")
    return builder, kwargs


def _saved_dataset(path: str) -> bool:
    """A folder written by save_to_disk: one Dataset, or a DatasetDict of splits."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, marker)) for marker in
                                       ("dataset_info.json", "state.json", "dataset_dict.json"))


def load_corpus(spec: str, split: str = "train", streaming: bool = False):
    import datasets

    if _saved_dataset(spec):
        loaded = datasets.load_from_disk(spec)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"--dataset_split {split}: {spec} has splits {list(loaded)}")
            loaded = loaded[split]
        return loaded
    try:
        if os.path.exists(spec):
            builder, kwargs = _local_builder(spec)
            # datasets keys its Arrow cache by the files' sizes and times: the content digest in the config's name
            # makes an edit that kept both a new cache, not the old rows (data/content.py)
            return datasets.load_dataset(builder, split=split, streaming=streaming,
                                         name=f"content-{dataset_digest(spec)[:16]}", **kwargs)
        local_or_hub("dataset", spec)
        return datasets.load_dataset(spec, split=split, streaming=streaming)
    except ValueError as e:  # datasets' words: 'Unknown split "x". Should be one of [...]'
        if "corresponds to no data" in str(e):  # rows without a column ({} on every line): no table at all
            raise ConfigError(f"--dataset {spec} holds no columns (every row empty?): give rows with the columns of "
                              f"a format of docs/data.md") from None
        if "Unknown split" not in str(e):
            raise
        raise ConfigError(f"--dataset_split {split}: {spec} has no such split ({e})") from None


@contextmanager
def unreadable_dataset_is_a_config_error(spec: str):
    """Reading --dataset (loading, tokenizing, and for a streamed dataset storing) fails on a corrupt file with
    datasets' or Arrow's exception; it is the user's file to fix: one message naming it, no traceback."""
    import datasets
    import pyarrow

    try:
        yield
    except (datasets.exceptions.DatasetsError, pyarrow.ArrowException, json.JSONDecodeError) as e:
        cause = e.__cause__ if isinstance(e, datasets.exceptions.DatasetGenerationError) and e.__cause__ else e
        raise ConfigError(f"--dataset {spec} cannot be read: {type(cause).__name__}: {str(cause).strip()}") from None


def dataset_columns(corpus) -> list[str]:
    """The column names of a loaded dataset, streamed or not."""
    return list(corpus.column_names or _first_row_columns(corpus))


def peek_columns(spec: str, split: str) -> Optional[list[str]]:
    """The columns of a dataset, from its first row read as a stream (nothing converted or cached), before the
    run loads it; None where they cannot be read now (loading the data then says why)."""
    try:
        with unreadable_dataset_is_a_config_error(spec):
            return dataset_columns(load_corpus(spec, split, streaming=True))
    except (ConfigError, OSError, ValueError):
        return None


def _first_row_columns(corpus) -> list[str]:
    """The columns of a streamed dataset whose features datasets could not infer up front: reading its first row
    names them, or raises the error that kept them unknown (a corrupt file) instead of a missing-column message."""
    first = next(iter(corpus), None)
    return list(first) if first else []


def pick_text_column(column_names, requested: Optional[str]) -> str:
    names = list(column_names or [])
    if requested:
        if requested not in names:
            raise ConfigError(f"--text_column {requested} is not in the dataset; its columns are {names}")
        return requested
    if "text" in names:
        return "text"
    raise ConfigError(f"no 'text' column in the dataset (columns: {names}): name one with --text_column")


def tokenize_corpus(ds, tokenizer, text_column: str, num_proc: Optional[int]):
    def encode(batch):
        texts = [t if isinstance(t, str) else "" for t in batch[text_column]]
        if isinstance(tokenizer, ByteTokenizer):
            ids = tokenizer.encode_batch(texts)
        else:
            ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids}

    kwargs = {"batched": True, "remove_columns": list(ds.column_names or [])}
    if not getattr(ds, "_ex_iterable", None):  # a map-style dataset: multiprocess, progress bar, disk cache
        kwargs.update(num_proc=num_proc, desc="tokenizing")
    return ds.map(encode, **kwargs)


class TokenSamples:
    """Samples of exactly seq_len tokens cut from a TokenStore; with pad_last the last partial sample is padded
    (its padding is ignored by the loss), otherwise it is dropped."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int, pad_last: bool, can_pad: bool = True):
        self.store, self.seq_len, self.pad_id = store, seq_len, pad_id
        n_tokens = len(store.tokens)
        self.num_samples = -(-n_tokens // seq_len) if pad_last else n_tokens // seq_len
        if self.num_samples == 0:
            remedies = ", add data, or pass --last_sample pad" if can_pad else " or add data"  # only where it exists
            raise ConfigError(f"the dataset has {n_tokens} tokens, fewer than one sample of --seq_len {seq_len}: "
                              f"lower --seq_len{remedies}")

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, i: int) -> tuple[torch.Tensor, int]:
        """(seq_len,) token ids and the number of real (unpadded) tokens."""
        start = i * self.seq_len
        piece = np.asarray(self.store.tokens[start:start + self.seq_len], dtype=np.int64)
        ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        ids[:len(piece)] = torch.from_numpy(piece)
        return ids, len(piece)

    def document_lengths(self, i: int, valid: int) -> list[int]:
        """Lengths of the document pieces in sample i (the padding, if any, is one more piece)."""
        start = i * self.seq_len
        starts = self.store.doc_starts  # sorted: the documents starting inside the sample, found in O(log n)
        inside = starts[np.searchsorted(starts, start, "right"):np.searchsorted(starts, start + valid, "left")] - start
        cuts = [0, *inside.tolist(), valid]
        lengths = [b - a for a, b in zip(cuts, cuts[1:]) if b > a]
        if valid < self.seq_len:
            lengths.append(self.seq_len - valid)
        return lengths


def corpus_samples(dataset: str, split: str, text_column: Optional[str], tokenizer, seq_len: int, cache_dir: str,
                   streaming: bool = False, num_proc: Optional[int] = None, max_tokens: Optional[int] = None,
                   pad_last: bool = False, can_pad: bool = True, corpus=None) -> tuple[TokenSamples, TokenStore]:
    """The whole pipeline: load (unless the caller passes the loaded `corpus`), pick the text column, tokenize,
    store (or reuse the cached store), cut into samples of `seq_len` tokens. Errors that name the flag to change are
    ConfigErrors; `can_pad`: the caller has --last_sample, so messages may suggest it."""
    with unreadable_dataset_is_a_config_error(dataset):
        corpus = load_corpus(dataset, split, streaming) if corpus is None else corpus
        column = pick_text_column(dataset_columns(corpus), text_column)
        tokenized = tokenize_corpus(corpus, tokenizer, column, num_proc)
        fingerprint = getattr(tokenized, "_fingerprint", None) or f"{dataset}:{split}:stream"
        settings = cache_settings(fingerprint, tokenizer, dataset, split, column, max_tokens)
        store = build_token_store(tokenized, tokenizer.eos_token_id, cache_dir, store_key(settings), max_tokens,
                                  settings)
    if len(store.tokens) == 0:
        raise ConfigError(f"--dataset {dataset}: no text in column {column!r} (empty dataset or column)")
    return TokenSamples(store, seq_len, tokenizer.pad_token_id or 0, pad_last, can_pad), store
