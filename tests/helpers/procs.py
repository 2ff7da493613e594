"""Environment for the child processes tests start (CLI runs, crash writers, servers)."""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH: a child imports
    this checkout, and still finds whatever the parent's PYTHONPATH provides (packages installed
    beside the interpreter's own, say)."""
    path = [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def serving_port(proc: subprocess.Popen) -> tuple[int, list[str]]:
    """The port a `semoe serve` child (stderr piped, text) says it serves on, once it says so, and the
    stderr lines up to that one; an AssertionError with its stderr where it exits first."""
    lines: list[str] = []
    while not lines or "serving" not in lines[-1]:
        line = proc.stderr.readline()
        assert line, f"semoe serve exited {proc.wait()}: {''.join(lines)}"
        lines.append(line)
    return int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", lines[-1]).group(1)), lines
