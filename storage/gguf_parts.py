"""Which paths are GGUF files, and the parts of a split one, without torch (the command line asks before
anything heavy loads)."""

from __future__ import annotations

import os
import re

from storage.errors import BadInputError

_SPLIT_RE = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def is_gguf(path: str) -> bool:
    """Whether `path` names a GGUF file (by its name: a directory never is)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


def split_parts(path: str) -> list[str]:
    """The files of a split GGUF (`NAME-00001-of-0000N.gguf`, any of them named), else [path]; BadInputError
    for a missing file or part."""
    if not os.path.isfile(path):
        raise BadInputError(f"{path}: no such file")
    m = _SPLIT_RE.match(path)
    if not m:
        return [path]
    n = int(m.group(3))
    parts = [f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [p for p in parts if not os.path.isfile(p)]
    if missing:
        raise BadInputError(f"{missing[0]}: missing (part of the split GGUF {path})")
    return parts
