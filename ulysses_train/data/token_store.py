"""The tokenized corpus on disk: one flat uint32 array of token ids (EOS after each document) and the documents'
start offsets, memory-mapped, under a folder named by a hash of everything that decides those tokens.

    <cache_dir>/<key>/tokens.npy, doc_starts.npy, settings.json (the key's inputs, and the array sizes)
                      trained.npy (conversations only: uint8 per token, 1 where the model is trained to write it)

Conversations (data/sft.py) are stored the same way, one document each, with no EOS added (the chat template
writes the end of each turn) and the trained mask beside the tokens; their key adds the data format, the chat
template's text and --loss_on.

The key (`cache_settings`) covers the data (the tokenized dataset's fingerprint, and the local files' sizes and
the digests of their bytes), the split, the text column, --max_tokens, and the tokenizer's identity (its whole
serialised vocabulary, normaliser and pre-tokeniser where it has them, else its vocabulary and settings), so a run never
reads tokens that another setting produced. A store is built in a private temporary folder and published by one atomic
rename, so runs that build the same store at the same time cannot interleave their files: the first rename wins and the
others read the winner's store (the same tokens). A store that fails its checks (a truncated array, a size that
disagrees with settings.json) is reported by path and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .content import file_digests, local_files

CACHE_FORMAT = 3  # bump when the files or what goes into the key change
_TMP = ".tmp"


@dataclass
class TokenStore:
    """The corpus as one flat token array (EOS after each document) and each document's start offset."""

    tokens: np.ndarray  # (n_tokens,) uint32, memory-mapped
    doc_starts: np.ndarray  # (n_docs,) int64
    cache_hit: bool = False
    folder: Optional[str] = None
    trained: Optional[np.ndarray] = None  # (n_tokens,) uint8, memory-mapped: 1 = a target (conversations only)


class DamagedStore(Exception):
    """A cached store that cannot be trusted; the message says why."""


# ---------------------------------------------------------------- the key

def tokenizer_identity(tokenizer) -> str:
    """A digest of what decides the ids a tokenizer gives: for a fast (tokenizers-backed) tokenizer its whole
    serialisation (vocabulary, merges, normaliser, pre-tokeniser, added tokens); otherwise its vocabulary and the
    settings it was made with. Its path alone is not enough: a folder can be rewritten in place."""
    identity = getattr(tokenizer, "identity", None)  # our ByteTokenizer names itself
    if identity is None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            identity = backend.to_str()
        else:
            vocab = sorted(tokenizer.get_vocab().items())
            settings = getattr(tokenizer, "init_kwargs", {})
            identity = json.dumps([vocab, settings], sort_keys=True, default=str)
    return f"{type(tokenizer).__name__}:{hashlib.sha1(identity.encode()).hexdigest()}"


def source_identity(dataset: str) -> list:
    """The local files behind --dataset with their sizes and the digests of their bytes (data/content.py: a size and
    a modification time do not tell an edit that kept both); a hub id is itself."""
    if not os.path.exists(dataset):
        return [dataset]
    digests = file_digests(local_files(dataset))
    return [os.path.abspath(dataset)] + [[os.path.relpath(p, dataset), os.stat(p).st_size, digest]
                                         for p, digest in digests.items()]


def cache_settings(fingerprint: str, tokenizer, dataset: str, split: str, text_column: str,
                   max_tokens: Optional[int], extra: Optional[dict] = None) -> dict:
    """Every setting that changes the stored tokens; the cache key is its hash. `extra`: the conversation settings
    (data format, chat template text, --loss_on), absent for text."""
    return {"format": CACHE_FORMAT, "fingerprint": fingerprint, "source": source_identity(dataset), "split": split,
            "text_column": text_column, "max_tokens": max_tokens, "tokenizer": tokenizer_identity(tokenizer),
            "eos": tokenizer.eos_token_id, **(extra or {})}


def store_key(settings: dict) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- reading, checking, building

def open_store(folder: str) -> TokenStore:
    """The store in `folder`, checked against its settings.json; DamagedStore if it cannot be trusted."""
    try:
        with open(os.path.join(folder, "settings.json")) as f:
            sizes = json.load(f)["sizes"]
        tokens = np.load(os.path.join(folder, "tokens.npy"), mmap_mode="r")
        doc_starts = np.load(os.path.join(folder, "doc_starts.npy"))
    except (OSError, ValueError, EOFError, KeyError, TypeError) as e:  # truncated or missing files end up here
        raise DamagedStore(f"{type(e).__name__}: {e}") from None
    if tokens.ndim != 1 or tokens.dtype != np.uint32 or len(tokens) != sizes.get("tokens"):
        raise DamagedStore(f"tokens.npy holds {tokens.shape} {tokens.dtype}, settings.json says "
                           f"{sizes.get('tokens')} uint32")
    if doc_starts.ndim != 1 or len(doc_starts) != sizes.get("docs") or (
            len(doc_starts) and (doc_starts[0] != 0 or doc_starts[-1] >= len(tokens)
                                 or np.any(np.diff(doc_starts) <= 0))):
        raise DamagedStore("doc_starts.npy does not fit tokens.npy")
    trained = None
    if "trained" in sizes:
        try:
            trained = np.load(os.path.join(folder, "trained.npy"), mmap_mode="r")
        except (OSError, ValueError, EOFError) as e:
            raise DamagedStore(f"{type(e).__name__}: {e}") from None
        if trained.shape != tokens.shape or trained.dtype != np.uint8:
            raise DamagedStore(f"trained.npy holds {trained.shape} {trained.dtype}, tokens.npy {tokens.shape}")
    return TokenStore(tokens, doc_starts, cache_hit=True, folder=folder, trained=trained)


def build_token_store(tokenized, eos_id: Optional[int], cache_dir: str, key: str, max_tokens: Optional[int] = None,
                      settings: Optional[dict] = None, trained: bool = False) -> TokenStore:
    """The store under cache_dir/key: reused when present and sound, else written (a damaged one is named on
    stderr and rebuilt). Safe when several processes build the same key at once. `eos_id` None: nothing is added
    after a document; `trained`: the rows also hold a `trained` mask (conversations), stored beside the tokens."""
    folder = os.path.join(cache_dir, key)
    if os.path.exists(folder):
        try:
            return open_store(folder)
        except DamagedStore as e:
            print(f"warning: the token cache {folder} is damaged ({e}): rebuilding it", file=sys.stderr, flush=True)
            _discard(folder)
    os.makedirs(cache_dir, exist_ok=True)
    _remove_abandoned_builds(cache_dir, key)
    tmp = os.path.join(cache_dir, f".{key}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}{_TMP}")
    try:
        _write_store(tmp, tokenized, eos_id, max_tokens, settings or {}, trained)
        return _publish(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a publish there is nothing left to remove


def _write_store(folder: str, tokenized, eos_id: Optional[int], max_tokens: Optional[int], settings: dict,
                 with_trained: bool = False) -> None:
    os.makedirs(folder)
    starts, total = [], 0
    with open(os.path.join(folder, "tokens.raw"), "wb") as out, \
            (open(os.path.join(folder, "trained.raw"), "wb") if with_trained else contextlib.nullcontext()) as mask:
        for ids, trained in _iter_token_arrays(tokenized, with_trained):
            if len(ids) == 0:
                continue  # empty documents add nothing, not even an EOS
            starts.append(total)
            ids = ids if eos_id is None else np.append(ids, eos_id)
            out.write(ids.astype(np.uint32).tobytes())
            if mask is not None:
                mask.write(np.asarray(trained, dtype=np.uint8).tobytes())
            total += len(ids)
            if max_tokens is not None and total >= max_tokens:
                break
    _raw_to_npy(folder, "tokens", np.uint32, total)
    sizes = {"tokens": total, "docs": len(starts)}
    if with_trained:
        _raw_to_npy(folder, "trained", np.uint8, total)
        sizes["trained"] = total
    np.save(os.path.join(folder, "doc_starts.npy"), np.asarray(starts, dtype=np.int64))
    with open(os.path.join(folder, "settings.json"), "w") as f:
        json.dump({**settings, "sizes": sizes}, f, indent=1)


def _raw_to_npy(folder: str, name: str, dtype, total: int) -> None:
    raw = os.path.join(folder, f"{name}.raw")
    flat = np.memmap(raw, dtype=dtype, mode="r", shape=(total,)) if total else np.zeros(0, dtype)
    np.save(os.path.join(folder, f"{name}.npy"), flat)  # .npy header + data; small next to tokenizing
    del flat
    os.remove(raw)


def _publish(tmp: str, folder: str) -> TokenStore:
    """Moves a finished build into place. A rename onto a folder that another build published meanwhile fails; then
    that store (the same key, so the same tokens) is used, unless it is damaged, in which case it is replaced."""
    for _ in range(2):
        try:
            os.rename(tmp, folder)
            store = open_store(folder)
            store.cache_hit = False
            return store
        except OSError:
            if not os.path.isdir(folder):
                raise
        try:
            store = open_store(folder)  # another build won the race
            store.cache_hit = False
            return store
        except DamagedStore:
            _discard(folder)
    raise OSError(f"could not publish the token cache {folder}: another process keeps replacing it")


def _discard(folder: str) -> None:
    """Removes a store without a moment where a half-deleted folder sits under its name: rename, then delete.
    Processes that already map its files keep reading them (POSIX keeps unlinked files alive)."""
    parent, name = os.path.split(folder)
    trash = os.path.join(parent, f".{name}.discarded.{uuid.uuid4().hex}{_TMP}")  # see _remove_abandoned_builds
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return  # another process discarded it first
    shutil.rmtree(trash, ignore_errors=True)


def _remove_abandoned_builds(cache_dir: str, key: str) -> None:
    """Temporary folders of builds on this host whose process is gone (killed mid-build), and discarded stores
    whose deletion was cut short, only take disk space."""
    host = socket.gethostname()
    for name in os.listdir(cache_dir):
        if not (name.startswith(f".{key}.") and name.endswith(_TMP)):
            continue
        middle = name[len(key) + 2:-len(_TMP)]  # host.pid.uuid (the host name may hold dots) or discarded.uuid
        owner = middle.rsplit(".", 2)
        abandoned = middle.startswith("discarded.") or (
            len(owner) == 3 and owner[0] == host and owner[1].isdigit() and not process_alive(int(owner[1])))
        if abandoned:
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)


def process_alive(pid: int) -> bool:
    """Whether a process of this machine runs under `pid` (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _iter_token_arrays(tokenized, with_trained: bool = False):
    """Each document's token ids (and, with_trained, its trained mask) as numpy arrays, straight from Arrow where
    the dataset has a table."""
    table = getattr(tokenized, "data", None)
    if table is not None and hasattr(table, "column"):
        columns = ["input_ids"] + (["trained"] if with_trained else [])
        for batch in table.to_batches():  # the columns of a record batch line up
            arrays = [batch.column(c) for c in columns]
            arrays = [(a.offsets.to_numpy(), a.values.to_numpy(zero_copy_only=False)) for a in arrays]
            for i in range(len(arrays[0][0]) - 1):
                pieces = tuple(values[o[i]:o[i + 1]] for o, values in arrays)
                yield pieces if with_trained else (pieces[0], None)
    else:  # streaming
        for row in tokenized:
            yield (np.asarray(row["input_ids"], dtype=np.int64),
                   np.asarray(row["trained"], dtype=np.uint8) if with_trained else None)
