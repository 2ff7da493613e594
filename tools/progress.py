"""Progress bars for long work: on stderr, and only when stderr is a terminal."""

from __future__ import annotations

import sys

from tqdm import tqdm


def byte_bar(total: int, desc: str) -> tqdm:
    """A bytes progress bar; its `update(n)` is the progress callback the library takes."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


def count_bar(total: int, desc: str, unit: str) -> tqdm:
    """A progress bar counting `unit`s (tokens, steps); `update(n)` adds n."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
