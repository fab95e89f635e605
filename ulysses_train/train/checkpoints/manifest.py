"""A checkpoint's manifest: every file with its size and a hash, written when the checkpoint is saved and checked
before it is loaded, so that a missing, truncated or overwritten file is named instead of failing deep inside
DeepSpeed (a missing rank shard is a bare AssertionError there) or, worse, loading.

    MANIFEST.json   {"version": 1, "hash": "blake2b-sampled-v1", "files": {"ds/...pt": {"size": N, "blake2b": H}}}

Files up to FULL_HASH_BYTES are hashed whole (blake2b). Larger ones, the ZeRO shards, are hashed in samples: their
first and last EDGE_BYTES and SAMPLES blocks of SAMPLE_BYTES spread evenly between, with the size. Why not whole:
the shards of an 8B model's ZeRO-3 checkpoint hold about 130 GB (weights, fp32 master copy, two Adam moments);
rank 0 hashing all of it at ~1 GB/s would add minutes to every save and every resume. The samples read 3 MiB per
file whatever its size and catch what breaks checkpoints in practice: a missing file, a truncated one (the size),
a torn write at its start or end (a header, the tail), a zero-filled stretch left by a crash (the samples: one
every 1/64 of the file). A bit flip in an unsampled byte of a large shard is not caught; that is the
filesystem's job (its checksums), not the trainer's.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from ...errors import CheckpointError

MANIFEST = "MANIFEST.json"
FULL_HASH_BYTES = 64 << 20
EDGE_BYTES = 1 << 20
SAMPLES = 64
SAMPLE_BYTES = 16 << 10
HASH_SCHEME = "blake2b-sampled-v1"  # names the constants above: change them, change this
NOT_LISTED = ("COMPLETE", MANIFEST)  # written after the manifest


def file_digest(path: str) -> str:
    """blake2b of the whole file, or of its edges and evenly spaced samples when it is large (module docstring)."""
    size = os.path.getsize(path)
    digest = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: f.read(8 << 20), b""):
                digest.update(block)
            return digest.hexdigest()
        middle = size - 2 * EDGE_BYTES
        offsets = [0] + [EDGE_BYTES + middle * i // SAMPLES for i in range(SAMPLES)] + [size - EDGE_BYTES]
        lengths = [EDGE_BYTES] + [SAMPLE_BYTES] * SAMPLES + [EDGE_BYTES]
        for offset, length in zip(offsets, lengths):
            f.seek(offset)
            digest.update(f.read(length))
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    found = []
    for directory, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(directory, n), folder) for n in names]
    return sorted(f for f in found if f not in NOT_LISTED)


def write_manifest(folder: str) -> dict:
    """Lists every file under `folder` (written last, before COMPLETE); returns the manifest."""
    files = {name: {"size": os.path.getsize(os.path.join(folder, name)),
                    "blake2b": file_digest(os.path.join(folder, name))} for name in _files(folder)}
    content = {"version": 1, "hash": HASH_SCHEME, "files": files}
    path = os.path.join(folder, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(content, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return content


def has_manifest(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, MANIFEST))


def complete_marker(step: int) -> str:
    """The text of a checkpoint's COMPLETE marker: it names the manifest, so that a lost manifest is noticed."""
    return f"{step}\n{MANIFEST}\n"


def _expects_manifest(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "COMPLETE")) as f:
            return MANIFEST in f.read()
    except OSError:
        return False


def damage(folder: str) -> Optional[str]:
    """What is wrong with the checkpoint in `folder`, naming the file, or None if every file matches its manifest
    (a checkpoint saved before manifests existed has none and is taken as it is)."""
    if not has_manifest(folder):
        return f"{MANIFEST} is missing" if _expects_manifest(folder) else None
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            content = json.load(f)
        files = content["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{MANIFEST} cannot be read ({e})"
    same_scheme = content.get("hash") == HASH_SCHEME  # another version's hashes: sizes are still checked
    for name, expected in files.items():
        path = os.path.join(folder, name)
        outside = _outside(folder, name)
        if outside:
            return outside
        if not os.path.isfile(path):
            return f"{name} is missing"
        size = os.path.getsize(path)
        if size != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']} (truncated or overwritten)"
        if same_scheme and file_digest(path) != expected["blake2b"]:
            return f"{name} does not match its hash in the manifest"
    return None


def _outside(folder: str, name: str) -> Optional[str]:
    """Why the manifest entry `name` is not a file inside the checkpoint `folder`, or None. A manifest names files
    by their paths under the folder; an absolute path, a `..`, or a file that is a link out of the folder would have
    the check read (and hash) files anywhere."""
    if not isinstance(name, str) or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        return f"{MANIFEST} names {name!r}, a path outside the checkpoint folder"
    root = os.path.realpath(folder)
    if os.path.commonpath([root, os.path.realpath(os.path.join(folder, name))]) != root:
        return f"{name} is a link to {os.path.realpath(os.path.join(folder, name))}, outside the checkpoint folder"
    return None


def verify_checkpoint(folder: str) -> None:
    """Raises CheckpointError naming the damaged file."""
    problem = damage(folder)
    if problem:
        raise CheckpointError(f"{folder} is damaged: {problem}")
