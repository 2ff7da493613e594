"""What every subcommand shares: the usage error and JSON output."""

from __future__ import annotations

import json
import sys


class UsageError(Exception):
    """A flag or argument that the parser could not catch (exit 2)."""


def emit_json(obj: object) -> None:
    """One JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()
