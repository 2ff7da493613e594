"""Environment for the child processes tests start (CLI runs, crash writers, servers)."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH: a child imports
    this checkout, and still finds whatever the parent's PYTHONPATH provides (packages installed
    beside the interpreter's own, say)."""
    path = [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}
