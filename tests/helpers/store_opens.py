"""Counting how often code under test opens a store (the "open once, hand down" checks)."""

from __future__ import annotations

from storage.store import Store


def record_store_opens(monkeypatch) -> list[str]:
    """From now until the test ends, append the root of every `Store.open` to the list returned."""
    opened: list[str] = []
    real_open = Store.open.__func__

    def counting(cls, root):
        opened.append(root)
        return real_open(cls, root)

    monkeypatch.setattr(Store, "open", classmethod(counting))
    return opened
