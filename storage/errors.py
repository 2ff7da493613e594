"""Exceptions of the storage layer: each carries one line that names the file or tensor at fault."""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every error the storage layer raises on bad input or failed I/O."""


class BadInputError(StorageError):
    """A file, flag or argument given by the user is not what was expected."""


class NotAStoreError(StorageError):
    """A directory is not a semoe store (no readable manifest)."""


class StoreLockedError(StorageError):
    """Another writer holds the store's write lock."""


class CorruptTensorError(StorageError):
    """A tensor's bytes do not match the checksum recorded in the manifest, or its file is short."""

    def __init__(self, message: str, *, tensor: str = "", path: str = "") -> None:
        super().__init__(message)
        self.tensor = tensor
        self.path = path


class CacheFullError(StorageError):
    """The cache cannot make room because every resident entry is pinned."""
