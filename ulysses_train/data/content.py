"""What a local dataset holds, by the bytes of its files: the digest that keys the caches and the resume check.

A file's size and modification time say nothing once an edit keeps the size and restores the time (`touch -r`,
a copy with `cp -p`, a tool that preserves times): datasets' own Arrow cache is keyed by them and served the old
rows, and so was our token store. So every local file is hashed (SHA-256 of its bytes). A digest is computed once
per version of a file and kept beside datasets' cache (`ulysses_digests.json`), keyed by the file's path, size,
modification and change times and inode: the change time (ctime) moves on every write and every time-restoring
call, and no user call sets it back, so a stored digest is reused only for the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

DIGESTS = "ulysses_digests.json"
_CHUNK = 16 << 20


def local_files(path: str) -> list[str]:
    """The files behind a local --dataset path (itself, or every file under the folder), sorted."""
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)


def _version(path: str) -> str:
    st = os.stat(path)
    return f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"


def _store_path() -> str:
    import datasets

    return os.path.join(str(datasets.config.HF_DATASETS_CACHE), DIGESTS)


def _read_store(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def file_digests(paths: list[str]) -> dict[str, str]:
    """{path: SHA-256 of its bytes}, from the stored digests where a file's version is unchanged."""
    store = _store_path()
    stored, digests, changed = _read_store(store), {}, False
    for path in paths:
        version = _version(path)
        if version not in stored:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(_CHUNK), b""):
                    h.update(block)
            stored[version], changed = h.hexdigest(), True
        digests[path] = stored[version]
    if changed:
        _write_store(store, stored)
    return digests


def _write_store(path: str, stored: dict) -> None:
    """Atomically (a run beside this one reads it); a store that cannot be written only costs a rehash."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(stored, f)
        os.replace(tmp, path)
    except OSError:
        pass


def dataset_digest(path: str) -> Optional[str]:
    """One digest of a local dataset's files (their paths relative to it and their bytes); None for a hub id."""
    if not os.path.exists(path):
        return None
    digests = file_digests(local_files(path))
    h = hashlib.sha256()
    for file, digest in digests.items():
        h.update(f"{os.path.relpath(file, path)}\0{digest}\0".encode())
    return h.hexdigest()


def dataset_paths(spec) -> list[str]:
    """The local paths a --dataset value names (a path, a mixture entry {path, ...}, or a list of them)."""
    if isinstance(spec, (list, tuple)):
        return [p for entry in spec for p in dataset_paths(entry)]
    if isinstance(spec, dict):
        return dataset_paths(spec.get("path"))
    return [spec] if isinstance(spec, str) and os.path.exists(spec) else []


def dataset_content(spec) -> dict[str, str]:
    """{local path: its digest} for every local path of a --dataset value (the resume check compares it)."""
    return {os.path.abspath(p): dataset_digest(p) for p in dataset_paths(spec)}
