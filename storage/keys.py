"""The key of one expert's tensors of one kind, from the router to the store read."""

from __future__ import annotations

from typing import NamedTuple


class ExpertKey(NamedTuple):
    """(layer, expert, kind): a plain tuple to the cache and the manifest, named for readers."""

    layer: int
    expert: int
    kind: str = "weight"
