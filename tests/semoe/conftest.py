"""Fixtures shared by the trainer's tests: text corpora made of the standard library's source."""

from __future__ import annotations

import argparse
import dataclasses
import json.decoder
import json.encoder

import pytest


def _corpus(tmp_path_factory, modules) -> str:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    with open(path, "w", encoding="utf-8") as out:
        for mod in modules:
            with open(mod.__file__, encoding="utf-8") as f:
                out.write(f.read())
    return str(path)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> str:
    """Two modules' source: enough tokens for a few tiny steps."""
    return _corpus(tmp_path_factory, (argparse, dataclasses))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    """Four modules' source: a small varied corpus for runs of a dozen steps whose loss must fall."""
    return _corpus(tmp_path_factory, (argparse, dataclasses, json.decoder, json.encoder))
