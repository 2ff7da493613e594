"""The ring's bookkeeping alone: slots, the needed set, victims, guesses, counters, in exact orders."""

from __future__ import annotations

import pytest

from inference.offload.ring_bookkeeping import GuessTracker, RingBook, SlotState
from storage.keys import ExpertKey as K

LAYERS = [1, 3, 5]  # MoE layers (dense layers 0, 2, 4 between them)


def load(book: RingBook, key: K, *, copy: bool = False) -> int:
    """take + (issued) + landed; returns the slot index."""
    record, _ = book.take(key)
    if copy:
        book.issued(key)
        assert book.get(key).state is SlotState.ISSUED and book.get(key).usable
    book.landed(key)
    return record.index


def test_slots_are_handed_out_in_order_and_a_key_is_taken_once():
    book = RingBook(3, LAYERS)
    assert [load(book, K(1, e)) for e in (4, 2, 0)] == [0, 1, 2]
    assert book.take(K(1, 4)) is None  # already has a slot
    assert book.get(K(1, 4)).state is SlotState.READY


def test_a_loading_slot_is_not_usable_and_never_a_victim():
    book = RingBook(2, LAYERS)
    book.take(K(1, 0))
    book.take(K(1, 1))
    assert not book.get(K(1, 0)).usable
    assert book.victim() is None and book.take(K(3, 0)) is None
    book.issued(K(1, 0))  # copy in flight: usable by compute, still not evictable
    assert book.get(K(1, 0)).usable and book.victim() is None
    book.landed(K(1, 0))
    assert book.victim().key == K(1, 0)


def test_victim_is_the_slot_whose_layer_runs_furthest_ahead():
    book = RingBook(4, LAYERS)
    for key in (K(1, 0), K(3, 0), K(5, 0), K(5, 1)):
        load(book, key)
    book.begin_layer(3, [K(3, 0)])  # now at layer 3: layer 5 is next, then 1
    # layer 1 runs furthest ahead (distance 2); layer 3's expert is needed now
    assert book.victim().key == K(1, 0)
    record, evicted = book.take(K(3, 7))
    assert evicted.key == K(1, 0) and record.index == 0  # the evicted slot's buffer is reused
    # among equally distant slots the least recently used goes first
    book.landed(K(3, 7))
    book.begin_layer(5, [K(5, 1)])
    book.hand_out(K(5, 1))
    book.give_back(K(5, 1))
    book.begin_layer(1, [])
    # distances from layer 1: layer 3 -> 1, layer 5 -> 2; K(5, 0) is older than K(5, 1)
    assert book.victim().key == K(5, 0)


def test_needed_and_pinned_slots_are_kept_until_handed_out_and_given_back():
    book = RingBook(2, LAYERS)
    load(book, K(1, 0))
    load(book, K(1, 1))
    book.begin_layer(1, [K(1, 0), K(1, 1)])
    assert book.victim() is None  # both needed
    assert book.hand_out(K(1, 0)) is True  # nobody counted this use yet
    assert book.victim() is None  # handed out: pinned
    book.give_back(K(1, 0))
    assert book.victim().key == K(1, 0)
    assert K(1, 1) in book.needed and K(1, 0) not in book.needed


def test_a_guess_for_the_next_layer_is_the_last_victim():
    book = RingBook(3, LAYERS)
    for key in (K(3, 0), K(3, 1), K(5, 0)):
        load(book, key)
    book.get(K(3, 0)).prefetched = True
    book.begin_layer(1, [])
    # from layer 1, layer 3 is next (distance 1) and layer 5 after it (distance 2)
    assert book.victim().key == K(5, 0)
    book.drop(K(5, 0))
    assert book.victim().key == K(3, 1)  # the unguessed one before the guess
    book.drop(K(3, 1))
    assert book.victim().key == K(3, 0)


def test_hand_out_reports_a_use_the_cpu_tier_has_not_seen_once():
    book = RingBook(2, LAYERS)
    record, _ = book.take(K(1, 0))
    record.use_seen = True  # a demand read: the tier's lookup counted the use
    book.landed(K(1, 0))
    book.begin_layer(1, [K(1, 0)])
    assert book.hand_out(K(1, 0)) is False
    book.give_back(K(1, 0))
    book.begin_layer(1, [K(1, 0)])  # the next token: a ring hit the tier never saw
    assert book.hand_out(K(1, 0)) is True


def test_drop_frees_the_slot_and_evict_all_idle_keeps_pinned():
    book = RingBook(3, LAYERS)
    load(book, K(1, 0))
    book.take(K(1, 1))  # still loading
    load(book, K(1, 2))
    assert book.drop(K(1, 1)).index == 1 and book.free == [1]
    book.begin_layer(1, [K(1, 2)])
    book.hand_out(K(1, 2))
    assert [r.key for r in book.evict_all_idle()] == [K(1, 0)]
    assert K(1, 2) in book


def test_ring_needs_two_slots():
    with pytest.raises(ValueError, match="ring_slots must be >= 2"):
        RingBook(1, LAYERS)


def test_guess_tracker_counts_and_judges_precision_after_eight_visits():
    g = GuessTracker(min_precision=0.8)
    assert not g.speculate(known=False) and g.speculate(known=True)
    nbytes = {e: 100 for e in range(8)}
    for visit in range(8):
        g.predicted(3, {0: True, 1: False})
        assert g.guesses(3) == {0: True, 1: False}
        # one of two guesses right: precision 0.5
        g.account(3, [0, 2], in_ring={0}, cached={0: True, 2: False}, nbytes=nbytes)
        assert (g.precision is None) == (visit < 7)
    assert g.precision == pytest.approx(0.5)
    assert not g.speculate(known=False)
    c = g.counters
    assert (c.uses, c.ring_hits, c.predicted, c.predicted_used, c.routed, c.routed_predicted) == (16, 8, 16, 8, 16, 8)
    # expert 0 was cached when guessed, expert 2 was not and is not cached: 8 reads of 100 bytes
    assert c.ssd_ideal_bytes == 800


def test_a_read_ahead_counts_as_an_ideal_read_once():
    g = GuessTracker(min_precision=0.0)
    g.read_ahead.add(K(1, 4))
    g.account(1, [4], in_ring=set(), cached={4: True}, nbytes={4: 64})
    g.account(1, [4], in_ring={4}, cached={4: True}, nbytes={4: 64})
    assert g.counters.ssd_ideal_bytes == 64
