"""Durable writes: fsync by path, fsync a whole tree, replace a file atomically."""

from __future__ import annotations

import os
import shutil


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


def undo_create(path: str, created: bool) -> None:
    """Undo a failed write of a new directory: remove it if it was made for the write, else empty it
    again (it was empty), so nothing half-written stays behind."""
    if created:
        shutil.rmtree(path, ignore_errors=True)
        return
    for n in os.listdir(path):
        p = os.path.join(path, n)
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
