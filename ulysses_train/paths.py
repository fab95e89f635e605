"""Whether a --model, --tokenizer or --dataset names a local path or a Hugging Face hub id.

A name that is on disk is local. One that is not goes to the hub only when it has a hub id's form ('name' or
'org/name', no file suffix such as .jsonl); anything else is a mistyped path, and the message says that the path
does not exist instead of the hub client's "Repo id must be in the form ...".
"""

from __future__ import annotations

import os
import re

from .errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
_FILE_SUFFIXES = (".json", ".jsonl", ".txt", ".parquet", ".arrow", ".csv", ".gz", ".zst", ".safetensors", ".bin",
                  ".pt", ".model")


def looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and ".." not in spec and "--" not in spec and \
        not spec.lower().endswith(_FILE_SUFFIXES)


def local_or_hub(flag: str, spec: str) -> str:
    """'local' for an existing path, 'hub' for a name of the hub's form; a ConfigError for a path that is not there."""
    if os.path.exists(spec):
        return "local"
    if looks_like_hub_id(spec):
        return "hub"
    raise ConfigError(f"--{flag} {spec}: no such file or folder (a hub id has the form 'name' or 'org/name')")
