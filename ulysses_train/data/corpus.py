"""Book-length training data: a text corpus joined end to end into samples of exactly `seq_len` tokens.

Pipeline: `datasets` loads the corpus (a hub id, or local txt / jsonl / json / parquet / arrow files or folders, or a
`save_to_disk` folder), tokenizes it with `Dataset.map` (batched, `num_proc`, progress bars, cached by fingerprint),
and we write the token ids once into a flat memory-mapped array, EOS between documents, plus the document start
offsets. A sample is then a slice of that array: a 1M-token sample loads without any Python list. The arrays are
cached under a key made of the tokenized dataset's fingerprint and the tokenizer, so a second run starts in seconds.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..errors import ConfigError

_EXT_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class ByteTokenizer:
    """Byte-level tokenizer for offline use and tests: ids 0..2 are pad/eos/unk, byte b is id b + 3 (vocab 259)."""

    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2
    vocab_size = 259
    name_or_path = "bytes"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) + 3 for t in texts]

    def __len__(self):
        return self.vocab_size


def load_tokenizer(name: Optional[str], model: Optional[str]):
    """--tokenizer: 'bytes', a path/hub id, or (default) the model's own tokenizer; bytes without a model."""
    if name == "bytes" or (name is None and model is None):
        return ByteTokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name or model)
    if tokenizer.eos_token_id is None:
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
    kwargs = {"data_files": files}
    if builder == "text":
        # one file = one document (a book), not one line; undecodable bytes become U+FFFD instead of failing
        kwargs.update(sample_by="document", encoding_errors="replace")
    return builder, kwargs


def load_corpus(spec: str, split: str = "train", streaming: bool = False):
    import datasets

    if os.path.isdir(spec) and (os.path.exists(os.path.join(spec, "dataset_info.json"))
                                or os.path.exists(os.path.join(spec, "state.json"))):
        loaded = datasets.load_from_disk(spec)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(f"--dataset_split {split}: {spec} has splits {list(loaded)}")
            loaded = loaded[split]
        return loaded
    if os.path.exists(spec):
        builder, kwargs = _local_builder(spec)
        return datasets.load_dataset(builder, split=split, streaming=streaming, **kwargs)
    return datasets.load_dataset(spec, split=split, streaming=streaming)


def pick_text_column(column_names, requested: Optional[str]) -> str:
    names = list(column_names or [])
    if requested:
        if requested not in names:
            raise ConfigError(f"--text_column {requested} is not in the dataset; its columns are {names}")
        return requested
    if "text" in names:
        return "text"
    raise ConfigError(f"no 'text' column in the dataset (columns: {names}): name one with --text_column")


@dataclass
class TokenStore:
    """The corpus as one flat token array (EOS after each document) and each document's start offset."""

    tokens: np.ndarray  # (n_tokens,) uint32, memory-mapped
    doc_starts: np.ndarray  # (n_docs,) int64
    cache_hit: bool = False


def store_key(fingerprint: str, tokenizer) -> str:
    tok = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
    return hashlib.sha1(json.dumps([fingerprint, str(tok), len(tokenizer)]).encode()).hexdigest()[:16]


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


def build_token_store(tokenized, eos_id: int, cache_dir: str, key: str, max_tokens: Optional[int] = None) -> TokenStore:
    """Writes (or reuses) tokens.npy and doc_starts.npy under cache_dir/key."""
    folder = os.path.join(cache_dir, key)
    tokens_path, docs_path = os.path.join(folder, "tokens.npy"), os.path.join(folder, "doc_starts.npy")
    if os.path.exists(docs_path):  # written last: its presence means the store is complete
        return TokenStore(np.load(tokens_path, mmap_mode="r"), np.load(docs_path), cache_hit=True)
    os.makedirs(folder, exist_ok=True)
    tmp_tokens = tokens_path + ".tmp"
    starts, total = [], 0
    with open(tmp_tokens, "wb") as out:
        for ids in _iter_token_arrays(tokenized):
            if len(ids) == 0:
                continue  # empty documents add nothing, not even an EOS
            starts.append(total)
            out.write(np.append(ids, eos_id).astype(np.uint32).tobytes())
            total += len(ids) + 1
            if max_tokens is not None and total >= max_tokens:
                break
    flat = np.memmap(tmp_tokens, dtype=np.uint32, mode="r", shape=(total,)) if total else np.zeros(0, np.uint32)
    np.save(tokens_path, flat)  # .npy header + data; small next to tokenizing
    del flat
    os.remove(tmp_tokens)
    np.save(docs_path + ".tmp.npy", np.asarray(starts, dtype=np.int64))
    os.replace(docs_path + ".tmp.npy", docs_path)
    return TokenStore(np.load(tokens_path, mmap_mode="r"), np.load(docs_path))


def _iter_token_arrays(tokenized):
    """Each document's token ids as a numpy array, straight from Arrow where the dataset has a table."""
    table = getattr(tokenized, "data", None)
    if table is not None and hasattr(table, "column"):
        for chunk in table.column("input_ids").chunks:
            offsets, values = chunk.offsets.to_numpy(), chunk.values.to_numpy(zero_copy_only=False)
            for i in range(len(offsets) - 1):
                yield values[offsets[i]:offsets[i + 1]]
    else:  # streaming
        for row in tokenized:
            yield np.asarray(row["input_ids"], dtype=np.int64)


class TokenSamples:
    """Samples of exactly seq_len tokens cut from a TokenStore; with pad_last the last partial sample is padded
    (its padding is ignored by the loss), otherwise it is dropped."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int, pad_last: bool):
        self.store, self.seq_len, self.pad_id = store, seq_len, pad_id
        n_tokens = len(store.tokens)
        self.num_samples = -(-n_tokens // seq_len) if pad_last else n_tokens // seq_len
        if self.num_samples == 0:
            raise ConfigError(f"the dataset has {n_tokens} tokens, fewer than one sample of --seq_len {seq_len}: "
                              f"lower --seq_len, add data, or pass --last_sample pad")

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
        starts = self.store.doc_starts
        inside = starts[(starts > start) & (starts < start + valid)] - start
        cuts = [0, *inside.tolist(), valid]
        lengths = [b - a for a, b in zip(cuts, cuts[1:]) if b > a]
        if valid < self.seq_len:
            lengths.append(self.seq_len - valid)
        return lengths


def corpus_samples(dataset: str, split: str, text_column: Optional[str], tokenizer, seq_len: int, cache_dir: str,
                   streaming: bool = False, num_proc: Optional[int] = None, max_tokens: Optional[int] = None,
                   pad_last: bool = False) -> tuple[TokenSamples, TokenStore]:
    """The whole pipeline: load, pick the text column, tokenize, store (or reuse the cached store), cut into samples
    of `seq_len` tokens. Errors that name the flag to change are ConfigErrors."""
    corpus = load_corpus(dataset, split, streaming)
    column = pick_text_column(corpus.column_names, text_column)
    tokenized = tokenize_corpus(corpus, tokenizer, column, num_proc)
    fingerprint = getattr(tokenized, "_fingerprint", None) or f"{dataset}:{split}:stream"
    store = build_token_store(tokenized, tokenizer.eos_token_id, cache_dir, store_key(fingerprint, tokenizer),
                              max_tokens)
    if len(store.tokens) == 0:
        raise ConfigError(f"--dataset {dataset}: no text in column {column!r} (empty dataset or column)")
    return TokenSamples(store, seq_len, tokenizer.pad_token_id or 0, pad_last), store
