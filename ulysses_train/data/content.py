"""What a local dataset holds, by the bytes of its files: the digest that keys the caches and the resume check.

A file's size and modification time say nothing once an edit keeps the size and restores the time (`touch -r`,
a copy with `cp -p`, a tool that preserves times): datasets' own Arrow cache is keyed by them and served the old
rows, and so was our token store. So every local file is hashed (SHA-256 of its bytes). A digest is computed once
per version of a file and kept beside datasets' cache (`ulysses_digests.json`), keyed by the file's path, size,
modification and change times and inode: the change time (ctime) moves on every write and every time-restoring
call, and no user call sets it back, so a stored digest is reused only for the same bytes.

The same pass checks a JSON Lines file's rows: every line must hold a JSON object. pyarrow's JSON reader (which
datasets hands the file to, block by block) kills the process with a segmentation fault on a block that starts
with a `null` line, and other values (a number, a string, a list) fail inside datasets without saying where. A line
that does not start with `{` is named, by file and line, before datasets reads the file; only a file that passed
has its digest stored, so an unchanged file is not read twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Optional

from ..errors import ConfigError

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
            h, lines = hashlib.sha256(), _LineCheck(path) if _is_json_lines(path) else None
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(_CHUNK), b""):
                    h.update(block)
                    if lines is not None:
                        lines.feed(block)
            if lines is not None:
                lines.feed(b"", last=True)
            stored[version], changed = h.hexdigest(), True
        digests[path] = stored[version]
    if changed:
        _write_store(store, stored)
    return digests


# a line whose first character (after spaces) starts no JSON object; blank lines are skipped, as datasets does
_NOT_AN_OBJECT = re.compile(rb"^[ \t]*([^{\s])", re.MULTILINE)


def _is_json_lines(path: str) -> bool:
    """A .jsonl file, or a .json file laid out as JSON Lines (its first line one whole object); a .json file with
    one array or one object over many lines is read whole by datasets, not line by line."""
    extension = os.path.splitext(path)[1]
    if extension == ".jsonl":
        return True
    if extension != ".json":
        return False
    with open(path, "rb") as f:
        first = f.readline(1 << 20).strip().removeprefix(b"\xef\xbb\xbf")
    try:
        return isinstance(json.loads(first), dict) if first.startswith(b"{") else False
    except ValueError:
        return False


class _LineCheck:
    """Fed a JSON Lines file's bytes block by block: a ConfigError naming the first line that holds no object."""

    def __init__(self, path: str):
        self.path, self.line, self.pending, self.start = path, 1, b"", True

    def feed(self, block: bytes, last: bool = False) -> None:
        data = self.pending + block
        if self.start and data.startswith(b"\xef\xbb\xbf"):  # a byte-order mark, which datasets strips
            data = data[3:]
        self.start = False
        whole = len(data) if last else data.rfind(b"\n") + 1  # whole lines only; the rest waits for the next block
        found = _NOT_AN_OBJECT.search(data, 0, whole)
        if found:
            line = self.line + data.count(b"\n", 0, found.start())
            end = data.find(b"\n", found.start())
            text = data[found.start(1):end if end >= 0 else len(data)][:40].decode("utf-8", "replace")
            raise ConfigError(f"--dataset {self.path}: line {line} holds {text!r}, not a JSON object: each line of a "
                              f"JSON Lines file is one row, an object of its columns (remove or fix the line)")
        self.line += data.count(b"\n", 0, whole)
        self.pending = data[whole:]


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
