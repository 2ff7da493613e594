"""PrefetchQueue: priority order, FIFO ties, dedup, cancel, failures, close, concurrency. (Reads
overlapping the caller's compute are tested through the tier that uses the queue, in test_tiered.)"""

import threading
from concurrent.futures import CancelledError, Future

import pytest

from storage.io_queue import PrefetchQueue, PrefetchQueueConfig, QueueClosedError, QueueFullError

TIMEOUT_S = 30  # only ever reached if something is broken


class Gate:
    """A job that holds a worker busy until opened, so jobs queue up behind it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        if not self.opened.wait(TIMEOUT_S):
            raise TimeoutError("gate never opened")
        return "gate"

    def hold(self, queue: PrefetchQueue) -> Future:
        future = queue.submit("gate", self, priority=float("-inf"))
        if not self.started.wait(TIMEOUT_S):
            raise TimeoutError("gate job never started")
        return future


def recorder(order: list, key):
    return lambda: order.append(key) or key


@pytest.fixture
def single():
    queue = PrefetchQueue(PrefetchQueueConfig(workers=1))
    yield queue
    queue.close()


def run_gated(queue: PrefetchQueue, submissions: list[tuple[str, float]], then=None) -> list:
    """Queue ``submissions`` behind a gate, optionally act on the queue, then run them all."""
    order: list = []
    gate = Gate()
    gate.hold(queue)
    futures = [queue.submit(key, recorder(order, key), priority=p) for key, p in submissions]
    if then is not None:
        then(queue)
    gate.opened.set()
    for future in futures:
        if not future.cancelled():
            future.result(TIMEOUT_S)
    return order


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"workers": 0}, "workers"), ({"max_queued": 0}, "max_queued"), ({"workers": 1.5}, "workers")],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"{field}="):
        PrefetchQueueConfig(**kwargs)


def test_lower_priority_value_runs_first(single):
    order = run_gated(single, [("a", 3.0), ("b", 1.0), ("c", 2.0), ("d", 0.5)])
    assert order == ["d", "b", "c", "a"]


def test_equal_priorities_run_in_submission_order(single):
    keys = [f"k{i}" for i in range(8)]
    order = run_gated(single, [(k, 1.0) for k in keys] + [("urgent", 0.0)])
    assert order == ["urgent"] + keys


def test_duplicate_key_returns_the_same_future(single):
    gate = Gate()
    gate_future = gate.hold(single)
    calls = []
    first = single.submit("x", lambda: calls.append(1) or "x", priority=1)
    assert single.submit("x", lambda: calls.append(2) or "y", priority=5) is first
    # A running key deduplicates too.
    assert single.submit("gate", lambda: None, priority=0) is gate_future
    gate.opened.set()
    assert first.result(TIMEOUT_S) == "x"
    assert calls == [1]
    assert single.stats.deduplicated == 2
    assert single.stats.submitted == 2  # the gate and "x"


def test_finished_key_runs_again():
    with PrefetchQueue(PrefetchQueueConfig(workers=1)) as queue:
        assert queue.submit("k", lambda: 1, priority=0).result(TIMEOUT_S) == 1
        assert queue.submit("k", lambda: 2, priority=0).result(TIMEOUT_S) == 2


def test_resubmitting_with_more_urgent_priority_reorders(single):
    def bump(queue):
        queue.submit("late", lambda: None, priority=0.5)  # more urgent: moves up
        queue.submit("early", lambda: None, priority=9.0)  # less urgent: ignored

    order = run_gated(single, [("early", 1.0), ("mid", 2.0), ("late", 3.0)], then=bump)
    assert order == ["late", "early", "mid"]


def test_reprioritize_moves_either_way(single):
    def move(queue):
        assert queue.reprioritize("a", 10.0)
        assert queue.reprioritize("c", -1.0)
        assert not queue.reprioritize("missing", 0.0)

    order = run_gated(single, [("a", 1.0), ("b", 2.0), ("c", 3.0)], then=move)
    assert order == ["c", "b", "a"]


def test_many_reprioritisations_keep_the_order_and_the_heap_small(single):
    def churn(queue):
        for round_ in range(200):
            for key in "abc":
                queue.reprioritize(key, float(round_ + ord(key)))
        queue.reprioritize("b", -1.0)
        assert len(queue._heap) <= 2 * 3 + 64

    order = run_gated(single, [("a", 1.0), ("b", 2.0), ("c", 3.0)], then=churn)
    assert order == ["b", "a", "c"]


def test_cancel_a_queued_job(single):
    futures = {}

    def cancel(queue):
        futures["b"] = queue.submit("b", lambda: None, priority=2.0)  # dedup: its future
        assert queue.cancel("b")
        assert not queue.cancel("b")
        assert not queue.cancel("gate")  # running: cannot be cancelled

    order = run_gated(single, [("a", 1.0), ("b", 2.0), ("c", 3.0)], then=cancel)
    assert order == ["a", "c"]
    assert futures["b"].cancelled()
    with pytest.raises(CancelledError):
        futures["b"].result()
    assert single.stats.cancelled == 1


def test_cancel_all(single):
    gate = Gate()
    gate.hold(single)
    futures = [single.submit(i, lambda: None, priority=i) for i in range(5)]
    assert single.cancel_all() == 5
    gate.opened.set()
    assert all(f.cancelled() for f in futures)
    assert single.queued() == 0


def test_future_cancelled_directly_is_skipped_and_key_can_be_resubmitted(single):
    order: list = []
    gate = Gate()
    gate.hold(single)
    stale = single.submit("a", recorder(order, "a1"), priority=1)
    assert stale.cancel()
    fresh = single.submit("a", recorder(order, "a2"), priority=1)
    assert fresh is not stale
    gate.opened.set()
    assert fresh.result(TIMEOUT_S) == "a2"
    assert order == ["a2"]


def test_failed_job_reaches_its_future_and_the_worker_survives(single):
    def boom():
        raise OSError("disk on fire")

    failed = single.submit("bad", boom, priority=0)
    with pytest.raises(OSError, match="disk on fire"):
        failed.result(TIMEOUT_S)
    assert single.submit("good", lambda: 42, priority=0).result(TIMEOUT_S) == 42
    stats = single.stats
    assert (stats.failed, stats.completed) == (1, 1)


def test_max_queued_rejects_new_keys_but_not_duplicates():
    with PrefetchQueue(PrefetchQueueConfig(workers=1, max_queued=2)) as queue:
        gate = Gate()
        gate.hold(queue)
        a = queue.submit("a", lambda: None, priority=0)
        queue.submit("b", lambda: None, priority=0)
        with pytest.raises(QueueFullError, match="max_queued=2"):
            queue.submit("c", lambda: None, priority=0)
        assert queue.submit("a", lambda: None, priority=0) is a
        assert queue.stats.max_queue_depth == 2
        gate.opened.set()


def test_priority_must_be_a_number(single):
    with pytest.raises(ValueError, match="priority=nan"):
        single.submit("k", lambda: None, priority=float("nan"))


def test_close_cancels_queued_finishes_running_and_refuses_new_jobs():
    queue = PrefetchQueue(PrefetchQueueConfig(workers=1))
    gate = Gate()
    running = gate.hold(queue)
    queued = queue.submit("q", lambda: None, priority=0)
    queue.close(wait=False)
    assert queued.cancelled()
    assert not running.done()
    gate.opened.set()
    queue.close()  # joins the worker, which first finishes the running job
    assert running.result(0) == "gate"
    with pytest.raises(QueueClosedError):
        queue.submit("late", lambda: None, priority=0)


def test_close_without_cancelling_drains_the_queue():
    queue = PrefetchQueue(PrefetchQueueConfig(workers=2))
    gate = Gate()
    gate.hold(queue)
    futures = [queue.submit(i, lambda i=i: i, priority=i) for i in range(4)]
    gate.opened.set()
    queue.close(wait=True, cancel_queued=False)
    assert [f.result(0) for f in futures] == [0, 1, 2, 3]


def test_workers_run_jobs_concurrently():
    workers = 3
    barrier = threading.Barrier(workers, timeout=TIMEOUT_S)
    with PrefetchQueue(PrefetchQueueConfig(workers=workers)) as queue:
        # Each job waits for all the others: only possible if they all run at once.
        futures = [queue.submit(i, barrier.wait, priority=0) for i in range(workers)]
        assert sorted(f.result(TIMEOUT_S) for f in futures) == list(range(workers))


def test_wait_idle_returns_when_the_last_job_ends_not_before(single):
    """No polling: `wait_idle` wakes when the running job ends and the queue is empty; a waiter
    started while a job is held is still waiting when the job is released."""
    gate = Gate()
    gate.hold(single)
    single.submit("a", lambda: None, priority=1.0)
    idle = threading.Event()
    waiter = threading.Thread(target=lambda: single.wait_idle(TIMEOUT_S) and idle.set())
    waiter.start()
    assert not single.wait_idle(timeout=0.05)  # the gate still holds a worker
    assert not idle.is_set()
    gate.opened.set()
    waiter.join(TIMEOUT_S)
    assert idle.is_set() and single.queued() == 0 and single.running() == 0
    assert single.wait_idle(timeout=0)  # idle already: no wait

