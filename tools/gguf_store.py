"""`--model FILE.gguf`: the store a GGUF file is imported into on first use, kept for the next run.

The store lies under `$SEMOE_CACHE_DIR/gguf` (default `~/.cache/semoe/gguf`), named by the file's name and
a hash of its path, size and modification time (every part's, for a split file), so a changed file is
imported again. The import goes to a sibling directory renamed into place when complete: a run killed
midway leaves no store that looks finished."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys


def cache_root() -> str:
    return os.path.join(os.environ.get("SEMOE_CACHE_DIR") or os.path.expanduser("~/.cache/semoe"), "gguf")


def gguf_store(path: str, flag: str = "--model") -> str:
    """`path` itself where it is not a .gguf file; else the store it is imported into (importing it now,
    with progress on stderr, where it has not been)."""
    from storage.gguf_parts import is_gguf, split_parts
    from storage.errors import BadInputError
    from storage.reader import is_store
    from tools.cli_output import UsageError

    if not is_gguf(path):
        return path
    try:
        parts = split_parts(path)
    except BadInputError as e:
        raise UsageError(f"{flag} {e}") from None
    key = hashlib.sha256()
    for p in parts:
        st = os.stat(p)
        key.update(f"{os.path.realpath(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    stem = os.path.basename(parts[0]).removesuffix(".gguf")
    dest = os.path.join(cache_root(), f"{stem}-{key.hexdigest()[:12]}")
    if is_store(dest):
        print(f"semoe: {path}: the store imported from it on first use, {dest}", file=sys.stderr, flush=True)
        return dest
    from semoe.checkpoints.hf_convert import import_checkpoint, open_checkpoint
    from tools.progress import byte_bar

    os.makedirs(cache_root(), exist_ok=True)
    print(f"semoe: {path}: importing it into {dest} (first use; later runs open that store)", file=sys.stderr,
          flush=True)
    staging = f"{dest}.part-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        ck = open_checkpoint(path)
        with byte_bar(sum(r.nbytes for r in ck.tensors.values()), "import") as bar:
            import_checkpoint(path, staging, progress=bar.update)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
