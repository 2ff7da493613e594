"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    """A text file of two standard-library modules' source: enough tokens for a few tiny steps."""
    import argparse
    import dataclasses

    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    with open(path, "w", encoding="utf-8") as out:
        for mod in (argparse, dataclasses):
            with open(mod.__file__, encoding="utf-8") as f:
                out.write(f.read())
    return str(path)
