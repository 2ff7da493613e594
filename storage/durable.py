"""Durable writes: fsync by path, fsync a whole tree, replace a file atomically."""

from __future__ import annotations

import os


def fsync_path(path: str) -> None:
    """fsync one file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(top: str) -> None:
    """fsync every file and directory below `top` (directories after their contents), then top."""
    for dirpath, _dirs, files in os.walk(top, topdown=False):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def write_atomic(path: str, data: bytes) -> None:
    """Write a file so that readers see either the old or the new content, durably."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path) or ".")
