"""Memory sizes on the command line: `512MiB`, `2GiB`, `1.5GB`, `1048576`, or `25%` of a total."""

from __future__ import annotations

import re

from tools.cli_output import UsageError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str, *, flag: str, percent_of: int | None = None) -> int:
    """Bytes for a size; a percentage needs `percent_of` (e.g. the model's expert bytes)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|[a-zA-Z]*)\s*", text or "")
    if not m:
        raise UsageError(f"{flag}: expected a size like 512MiB, 2GiB or 25%, got {text!r}")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        if percent_of is None:
            raise UsageError(f"{flag}: a percentage is not allowed here, give bytes (e.g. 2GiB)")
        if not 0 < value <= 100:
            raise UsageError(f"{flag}: a percentage must be in (0, 100], got {text!r}")
        return max(1, int(percent_of * value / 100))
    if unit not in _UNITS:
        raise UsageError(f"{flag}: unknown unit {m.group(2)!r} in {text!r} (use B, KiB, MiB, GiB, KB, MB, GB)")
    n = int(value * _UNITS[unit])
    if n < 1:
        raise UsageError(f"{flag}: size must be at least 1 byte, got {text!r}")
    return n


def format_size(n: int) -> str:
    """A byte count for people: 512 B, 1.5 KiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"
