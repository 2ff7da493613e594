"""SSD expert states: the bookkeeping with exact orders (spills, moment read-ahead, write-back), and
the copy-stream path a GPU runs, checked on CPU through a stream with CUDA's hazards against the
in-memory backends, bit for bit, with its host syncs counted."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers.training import store_tensors, tiny_config

import semoe.train.trainer
from semoe.train.expert_states import AdamWConfig, adamw_, init_expert
from semoe.train.expert_grads import GradAccumulator
from semoe.train.expert_states import STATE_KINDS, ChunkFormat
from semoe.train.ssd_states import SSDExpertStates, SSDStatesConfig, read_ahead
from semoe.train.trainer import Trainer
from semoe.train.config import TrainConfig
from storage.keys import ExpertKey
from storage.store import Store, chunk_meta
from storage.streams import (COMPLETE, CopyHandle, CopyStream, FakeCudaCopyStream, StreamEvent, ThreadCopyStream,
                             copy_stream_factory)
from storage.host_sync_counter import HostSyncCounter

CONFIG = tiny_config()
FMT = ChunkFormat(CONFIG)
GRAD_BYTES = 3 * 96 * 64 * 4  # one expert's (gate, up, down) gradient in float32
SEED = 0


def fake_stream(device: torch.device) -> FakeCudaCopyStream:
    return FakeCudaCopyStream(device, seed=7)


def grads_of(layer: int, expert: int, i: int) -> tuple[torch.Tensor, ...]:
    """A deterministic weight gradient, distinct per (layer, expert, micro-batch)."""
    g = torch.Generator().manual_seed(1000 * layer + 10 * expert + i)
    return tuple(torch.randn(s, generator=g) for s in FMT.shapes)


# -- bookkeeping --------------------------------------------------------------------------------


def test_read_ahead_starts_each_moment_read_once_depth_tiles_early():
    keys = [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert read_ahead(keys, 1) == [[(0, 0), (0, 2)], [(1, 1)], [(1, 3)], []]
    assert read_ahead(keys, 2) == [[(0, 0), (0, 2), (1, 1)], [(1, 3)], [], []]
    assert read_ahead(keys, 0) == [[k] for k in keys]
    assert read_ahead(keys, 9) == [keys, [], [], []]
    assert read_ahead([], 1) == []


def test_gradients_beyond_the_budget_spill_and_sum_in_arrival_order(tmp_path):
    acc = GradAccumulator(FMT, budget_bytes=GRAD_BYTES + GRAD_BYTES // 2, folder=str(tmp_path / "spill"))
    a, b, c = (0, 1), (0, 3), (1, 0)
    acc.add(b, list(grads_of(*b, 0)))  # fits
    acc.add(a, list(grads_of(*a, 0)))  # would pass the budget: spilled
    acc.add(b, list(grads_of(*b, 1)))  # summed in memory
    acc.add(a, list(grads_of(*a, 1)))  # summed into its spill file
    acc.add(c, list(grads_of(*c, 0)))  # spilled
    assert acc.keys() == [a, b, c]
    assert set(acc.held) == {b} and acc.spilled == {a, c} and acc.nbytes == GRAD_BYTES
    assert sorted(os.listdir(tmp_path / "spill")) == ["L0000.E00001.grad", "L0001.E00000.grad"]
    for key, n in ((a, 2), (b, 2), (c, 1)):
        want = list(grads_of(*key, 0))
        for i in range(1, n):
            want = [w + g for w, g in zip(want, grads_of(*key, i))]
        for got, w in zip(acc.grads(key), want):
            assert torch.equal(got, w), key  # the same float additions in the same order: exact
    acc.discard()
    assert os.listdir(tmp_path / "spill") == [] and acc.keys() == []


# -- the backend on its own ---------------------------------------------------------------------


class _ScriptedCopy(CopyHandle):
    def __init__(self, stream: "ScriptedCopyStream", src: torch.Tensor, dst: torch.Tensor,
                 after: StreamEvent | None) -> None:
        self.stream, self.src, self.tensor, self.after = stream, src, dst, after
        self.ran = self.waited = False

    def wait(self) -> torch.Tensor:
        self.waited = True  # orders compute after the copy; the host goes on
        return self.tensor

    def done(self) -> bool:
        return self.ran

    def synchronize(self) -> None:
        self.stream.host_syncs += 1
        self.run()

    def run(self) -> None:
        if not self.ran:
            self.tensor.copy_(self.src)
            self.ran = True


class ScriptedCopyStream(CopyStream):
    """A copy engine the test drives, as slow as it likes: copies run only at `run()` (or a host
    sync), and `wait()` never blocks the host, as on a GPU."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.issued: list[_ScriptedCopy] = []
        self.events: list[StreamEvent] = []
        self.host_syncs = 0

    def record_compute(self) -> StreamEvent:
        # the scripted device runs compute at once: an event of COMPLETE's kind, one per record so
        # that a test can tell which one a copy waits for
        self.events.append(type(COMPLETE)())
        return self.events[-1]

    def _issue(self, src, dst, after) -> CopyHandle:
        self.issued.append(_ScriptedCopy(self, src, torch.empty_like(src) if dst is None else dst, after))
        return self.issued[-1]

    def run(self) -> None:
        for copy in self.issued:
            copy.run()

    def close(self) -> None:
        self.run()




@pytest.fixture
def make_states(tmp_path):
    """Build SSDExpertStates over a fresh store of the tiny model's initial experts, with a staged
    version for the optimizer's writes; everything is closed at the end."""
    made = []

    def make(**kw) -> SSDExpertStates:
        root = str(tmp_path / "store")
        Store.create(root)
        with Store.open(root).writer() as w:
            for layer in CONFIG.moe_layer_ids:
                for e in range(CONFIG.num_experts):
                    buf = FMT.pack(list(init_expert(CONFIG, SEED, layer, e)))
                    w.put_expert_chunk(layer, e, FMT.meta(layer, e), buf, FMT.offsets, num_experts=CONFIG.num_experts)
            w.commit()
        kw.setdefault("cpu_cache_bytes", 64 * FMT.nbytes)
        states = SSDExpertStates(CONFIG, range(CONFIG.num_experts), torch.device("cpu"), store=Store.open(root),
                                 settings=SSDStatesConfig(spill_dir=str(tmp_path / "spill"), copy_on_cpu=True, **kw))
        writer = Store.open(root).writer()
        for layer in CONFIG.moe_layer_ids:
            for kind in STATE_KINDS:
                writer.expert_array(layer, kind, num_experts=CONFIG.num_experts, chunk_bytes=FMT.nbytes,
                                    layout=chunk_meta(FMT.meta(layer, 0), FMT.offsets))
        states.begin_version(writer.version)
        made.append((states, writer))
        return states

    yield make
    for states, writer in made:
        states.close()
        writer.abort()


def test_states_spill_gradients_past_the_budget_and_step_them_exactly(make_states, tmp_path):
    """Gradients arrive through asynchronous copies; the first expert fits the budget, the others
    spill; the step applies exactly the AdamW of the summed gradients and removes the spills."""
    with copy_stream_factory(fake_stream) as streams:
        states = make_states(grad_budget_bytes=GRAD_BYTES)
        layer = CONFIG.moe_layer_ids[0]
        order = [(layer, 2), (layer, 0), (layer, 2), (layer, 3), (layer, 0)]
        for i, (l, e) in enumerate(order):
            states.add_grad(l, e, grads_of(l, e, i))
        assert states.touched() == [(layer, 0), (layer, 2), (layer, 3)]
        assert set(states.gradients.held) == {(layer, 2)}  # the first to arrive fits
        assert states.gradients.spilled == {(layer, 0), (layer, 3)}
        spill = tmp_path / "spill" / "step0"
        assert sorted(os.listdir(spill)) == [f"L{layer:04d}.E00000.grad", f"L{layer:04d}.E00003.grad"]
        # the sum kept in memory lives in its staging buffer; the others' went back to the pool
        assert states.stats()["grad_staging_bytes"] == FMT.nbytes

        cfg = AdamWConfig()
        states.step(1e-2, cfg)
        states.wait_idle()
        assert os.listdir(spill) == [] and states.stats()["grad_staging_bytes"] == 0
        for e in (0, 2, 3):
            sums = None
            for i, key in enumerate(order):
                if key == (layer, e):
                    g = grads_of(layer, e, i)
                    sums = list(g) if sums is None else [s + x for s, x in zip(sums, g)]
            want = [w.clone() for w in init_expert(CONFIG, SEED, layer, e)]
            ms, vs = [torch.zeros_like(w) for w in want], [torch.zeros_like(w) for w in want]
            for w, g, m, v in zip(want, sums, ms, vs):
                adamw_([w], [g], [m], [v], step=1, lr=1e-2, cfg=cfg)
            written = {kind: states.view.read_expert(layer, e, kind) for kind in STATE_KINDS}
            for kind, ref in (("weight", want), ("adam_m", ms), ("adam_v", vs)):
                for name, r in zip(FMT.names(layer, e), ref):
                    assert torch.equal(written[kind][name], r), (e, kind, name)
        assert streams[0].violations == [] and streams[0].copies == 3 * len(order)


def test_sources_stay_pinned_until_copied_and_gradients_copy_after_their_compute(make_states):
    """With a copy engine that runs only when told: compute is ordered after each weight copy
    without blocking the host; the cache entry a copy reads stays pinned (unevictable) until that
    copy ran, whatever compute did; a device slot is refilled only after the compute that read it
    last; gradients are copied after the compute that makes them and summed only once copied,
    the step boundary waiting for the copies still in flight (one host sync each)."""
    with copy_stream_factory(ScriptedCopyStream):
        states = make_states()
    stream, cache = states.stream, states.tier.cache
    layer = CONFIG.moe_layer_ids[0]
    gate, _, _ = init_expert(CONFIG, SEED, layer, 1)

    first = states.fetch(layer, 1)
    (copy,) = stream.issued
    assert copy.waited and not copy.ran and copy.after is COMPLETE  # a new slot has no reader yet
    entry = cache.lookup((layer, 1, "weight"))
    first.release()  # compute is done with the weights; the copy has still not run
    states.end_backward()
    assert entry.pin_count == 1
    stream.run()
    assert torch.equal(first.parts[0], gate)
    states.end_backward()  # any later call unpins the sources of finished copies
    assert entry.pin_count == 0

    second = states.fetch(layer, 2)  # the second slot
    third = states.fetch(layer, 3)  # the first slot again, once its last reader has run
    assert stream.issued[1].after is COMPLETE and stream.issued[1].tensor is not copy.tensor
    assert stream.issued[2].tensor is copy.tensor and stream.issued[2].after is stream.events[0]
    second.release()
    third.release()
    stream.run()

    grads = grads_of(layer, 1, 0)
    states.add_grad(layer, 1, grads)
    copies = stream.issued[3:]
    assert len(copies) == 3 and all(c.after is stream.events[-1] and not c.ran for c in copies)
    states.end_backward()
    assert states.gradients.keys() == [] and stream.host_syncs == 0  # nothing summed before it arrived
    assert states.touched() == [(layer, 1)] and stream.host_syncs == 3
    assert all(torch.equal(a, b) for a, b in zip(states.gradients.grads((layer, 1)), grads))


def test_moment_reads_run_ahead_of_the_updates_and_writes_follow_layer_order(make_states):
    """In the optimizer thread: each tile's moment read is started `prefetch_depth` tiles before
    its update; tiles are written in (layer, expert) order; moments never written are not read."""
    states = make_states(prefetch_depth=2, write_threads=1)
    events: list[tuple] = []
    submit = states._readers.submit

    def record_submit(fn, key, into):
        events.append(("read", key))
        return submit(fn, key, into)

    next_step = states.next_adam_step

    def record_update(key):
        events.append(("update", key))
        return next_step(key)

    write = states.format.write

    def record_write(root, version, layer, expert, kind, buf, **kw):
        events.append(("write", (layer, expert), kind))
        return write(root, version, layer, expert, kind, buf, **kw)

    states._readers.submit, states.next_adam_step, states.format.write = record_submit, record_update, record_write
    l0, l1 = CONFIG.moe_layer_ids
    keys = [(l0, 1), (l0, 3), (l1, 0), (l1, 2)]
    for step in range(2):
        for key in reversed(keys):  # arrival order is not update order
            states.add_grad(*key, grads_of(*key, step))
        events.clear()
        before = states.stats()["moment_read_bytes"]
        states.step(1e-3, AdamWConfig())
        states.wait_idle()
        a, b, c, d = keys
        assert [e for e in events if e[0] != "write"] == [
            ("read", a), ("read", b), ("read", c), ("update", a), ("read", d), ("update", b), ("update", c),
            ("update", d)]
        assert [e[1:] for e in events if e[0] == "write"] == [(k, kind) for k in keys for kind in STATE_KINDS]
        # the first step finds no moments (zeros, nothing read); the second reads both of every tile
        assert states.stats()["moment_read_bytes"] - before == step * 2 * len(keys) * FMT.nbytes


# -- whole runs: the GPU's copy path on CPU ------------------------------------------------------


class CopyingSSDExpertStates(SSDExpertStates):
    """The trainer's SSD backend with copies forced on CPU, the path a GPU runs."""

    def __init__(self, *args, settings: SSDStatesConfig, **kw) -> None:
        super().__init__(*args, settings=dataclasses.replace(settings, copy_on_cpu=True), **kw)


def _trainer(tmp_path, name, text_file, **kw) -> Trainer:
    cfg = TrainConfig(out=str(tmp_path / name), data=text_file, steps=kw.pop("steps", 4), batch_size=4,
                      seq_len=32, warmup_steps=2, checkpoint_every=2, micro_batches=kw.pop("micro_batches", 2),
                      grad_clip=0.5, **kw)
    return Trainer(cfg, tiny_config())


def _run(tmp_path, name, text_file, **kw):
    trainer = _trainer(tmp_path, name, text_file, **kw)
    try:
        logs = trainer.run()
    finally:
        trainer.close()
    return trainer, [(x.loss, x.aux_loss, x.grad_norm) for x in logs]


def test_copies_through_a_cuda_like_stream_give_the_in_memory_numbers_bit_for_bit(tmp_path, text_file,
                                                                                  monkeypatch):
    """Copies delayed and reordered at random, destinations poisoned until copied, sources
    checksummed: with a cache too small for the experts and gradients that spill, losses, gradient
    norms and every final weight and moment equal the in-memory backends' exactly, and no copy broke
    the stream contract."""
    device, device_logs = _run(tmp_path, "device", text_file, expert_states="device")
    cpu, cpu_logs = _run(tmp_path, "cpu", text_file, expert_states="cpu")
    monkeypatch.setattr(semoe.train.trainer, "SSDExpertStates", CopyingSSDExpertStates)
    with copy_stream_factory(fake_stream) as streams:
        ssd, ssd_logs = _run(tmp_path, "ssd", text_file, expert_states="ssd",
                             cpu_cache_bytes=SSDExpertStates.min_cache_bytes(CONFIG), grad_budget_bytes=GRAD_BYTES)
    assert ssd_logs == device_logs == cpu_logs
    a, b, c = (store_tensors(t.cfg.store) for t in (device, ssd, cpu))
    assert a.keys() == b.keys() == c.keys() and {k[1] for k in b} == {"weight", "adam_m", "adam_v"}
    for k in a:
        assert torch.equal(a[k], b[k]) and torch.equal(c[k], b[k]), k
    fakes = [s for s in streams if isinstance(s, FakeCudaCopyStream)]
    assert len(fakes) == 1 and fakes[0].violations == []
    assert fakes[0].copies > 0  # the copying path ran, not the in-place one
    stats = ssd.states.stats()
    assert stats["cpu_misses"] > 0  # the cache really was too small


# what the model and the trainer call on an expert-state backend
BACKEND_CALLS = ("fetch", "add_grad_factors", "add_grad", "prefetch", "begin_forward_layer", "end_forward_layer",
                 "begin_backward_layer", "end_backward", "touched", "grad_sq_sum", "step", "wait_idle")


def _count_one_step(trainer: Trainer) -> tuple[dict, dict, int]:
    """Host-synchronising calls of one training step (after a warm-up step): in the whole step as a
    torch function mode sees it, and inside the backend's own calls; and how many gradients the
    backend was handed.

    The backend's calls are counted by a mode entered in each of them: autograd runs backward
    without the modes active around `.backward()`, so a mode around the step never sees the
    backend's backward work (its `fetch` and `add_grad`)."""
    states = trainer.states
    inner, depth, grads = HostSyncCounter(), [0], [0]

    def counted(name):
        method = getattr(states, name)

        def call(*args, **kw):
            grads[0] += name == "add_grad"
            if depth[0]:  # a backend call made by another one: counted already
                return method(*args, **kw)
            depth[0] += 1
            try:
                with inner:
                    return method(*args, **kw)
            finally:
                depth[0] -= 1
        return call

    trainer.train_step()  # warm: the first step allocates and starts threads
    states.wait_idle()
    for name in BACKEND_CALLS:
        setattr(states, name, counted(name))
    with HostSyncCounter() as whole:
        trainer.train_step()
        states.wait_idle()
    return dict(whole.counts), dict(inner.counts), grads[0]


def test_ssd_states_add_no_host_syncs_to_a_training_step(tmp_path, text_file, monkeypatch):
    """Counted over one step of two micro-batches: the SSD backend, copying as on a GPU, makes no
    host-synchronising call (the in-memory backend's `.to(cpu)` of each gradient is one), and the
    step as a whole makes exactly the in-memory backend's."""
    device = _trainer(tmp_path, "device", text_file, expert_states="device")
    try:
        device_whole, device_backend, device_grads = _count_one_step(device)
    finally:
        device.close()
    monkeypatch.setattr(semoe.train.trainer, "SSDExpertStates", CopyingSSDExpertStates)
    with copy_stream_factory(ThreadCopyStream):
        ssd = _trainer(tmp_path, "ssd", text_file, expert_states="ssd", cpu_cache_bytes=64 * FMT.nbytes)
        try:
            ssd_whole, ssd_backend, ssd_grads = _count_one_step(ssd)
        finally:
            ssd.close()
    assert ssd_grads == device_grads > 0
    assert ssd_backend == {}
    # on CPU `.to(cpu)` moves nothing, but it is what would copy a GPU's gradient to the host
    assert device_backend == {"to_cpu": 3 * device_grads}
    assert ssd_whole == device_whole


def test_forward_and_backward_never_synchronise_with_the_copy_stream(tmp_path, text_file, monkeypatch):
    """On the CUDA-like stream (whose `synchronize()` calls are counted), fetching weights and
    handing in gradients never blocks the host; only the step boundary (the gradient norm and the
    optimizer thread) waits, at most once per copy still in flight."""
    monkeypatch.setattr(semoe.train.trainer, "SSDExpertStates", CopyingSSDExpertStates)
    with copy_stream_factory(fake_stream):
        fake = _trainer(tmp_path, "fake", text_file, expert_states="ssd", cpu_cache_bytes=64 * FMT.nbytes)
        try:
            stream = fake.states.stream
            fake.train_step()
            fake.states.wait_idle()
            after_backward = []
            end_backward = fake.states.end_backward

            def record() -> None:
                end_backward()
                after_backward.append(stream.host_syncs)

            fake.states.end_backward = record
            start, copies = stream.host_syncs, stream.copies
            fake.train_step()
            fake.states.wait_idle()
            boundary = stream.host_syncs - after_backward[-1]
        finally:
            fake.close()
    assert after_backward == [start, start]  # forward and backward of both micro-batches: none
    assert 0 <= boundary <= stream.copies - copies
    assert stream.violations == []


def test_a_state_waits_for_pins_other_threads_release_without_polling(make_states):
    """A cache full of weights pinned by another thread (a writer's, here the test's): fetching one
    more waits on the cache's condition until a pin goes, then pins its own; no sleep decides it,
    the test releases the pin only once the fetch is seen waiting."""
    import threading

    states = make_states(cpu_cache_bytes=SSDExpertStates.min_cache_bytes(CONFIG))
    layer = CONFIG.moe_layer_ids[0]
    capacity = states.tier.config.cpu_cache_bytes // FMT.nbytes
    held = [states.tier.get(ExpertKey(layer, e)) for e in range(capacity)]
    waiting, waited = threading.Event(), []
    real_wait = states.tier.cache.wait_for_room

    def wait_for_room(nbytes, timeout=None, **kw):
        if kw.get("pins_elsewhere"):  # the fetch's wait (the tier's own, for reads in flight, returns at once)
            waited.append(nbytes)
            waiting.set()
        return real_wait(nbytes, timeout, **kw)

    states.tier.cache.wait_for_room = wait_for_room
    got = []
    fetcher = threading.Thread(target=lambda: got.append(states._get(ExpertKey(layer, capacity))))
    fetcher.start()
    assert waiting.wait(timeout=60), "the fetch never waited for room"
    assert not got  # still waiting: every entry is pinned
    held.pop().release()
    fetcher.join(timeout=60)
    assert not fetcher.is_alive() and len(got) == 1
    assert waited and all(n == FMT.nbytes for n in waited)
    for h in (*held, *got):
        h.release()


def test_the_cache_keeps_the_weights_the_step_needs_next(tmp_path, text_file):
    """A step uses every expert's weights three times, in a known order: forward up the layers,
    backward down them, the update up again. With room for 6 of the 8 experts' weights, any policy
    that ranks by recency or frequency (all experts are used equally often) reads 16 a step (LRU over
    that sequence; LFU measured 16), Belady's optimum about 6; the backend's schedule (evict the
    weight needed furthest ahead) reads 12 (measured), where the tiles being updated and written hold
    two of the six. At most 13 a step over steps 3-6, read-aheads and all."""
    chunk = 3 * 96 * 64 * 4
    trainer = _trainer(tmp_path, "scheduled", text_file, steps=6, micro_batches=1, expert_states="ssd",
                       cpu_cache_bytes=SSDExpertStates.transient_bytes(CONFIG) + 6 * chunk)
    try:
        reads = []
        for i in range(6):
            trainer.states.wait_idle()
            before = trainer.states.tier.stats().ssd_bytes
            trainer.train_step()
            trainer.states.wait_idle()
            if i >= 2:
                reads.append((trainer.states.tier.stats().ssd_bytes - before) / chunk)
    finally:
        trainer.close()
    assert sum(reads) <= 13 * len(reads), reads


def test_the_step_schedule_orders_each_layers_uses_as_a_step_makes_them():
    """Positions: forward up the layers, backward down, the update up, and the next step's forward of a
    layer after that layer's update; a use forecasts the next phase's, the update the next step's forward."""
    from semoe.train.state_schedule import BACKWARD, FORWARD, UPDATE, StepSchedule

    layers = [1, 3, 5]  # a stage's MoE layers need not start at 0 or be contiguous
    s = StepSchedule(layers)
    order = ([(FORWARD, 0, layer) for layer in layers] + [(BACKWARD, 0, layer) for layer in reversed(layers)]
             + [(UPDATE, 0, layer) for layer in layers])
    positions = [s.position(*p) for p in order]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    for i, layer in enumerate(layers):
        assert s.position(UPDATE, 0, layer) < s.position(FORWARD, 1, layer)
        if i + 1 < len(layers):
            assert s.position(FORWARD, 1, layer) <= s.position(UPDATE, 0, layers[i + 1])
    key = ExpertKey(3, 2)
    for phase, step, nxt in ((FORWARD, 4, (BACKWARD, 4)), (BACKWARD, 4, (UPDATE, 4)), (UPDATE, 4, (FORWARD, 5))):
        s.used(key, phase, step)
        assert s.policy.next_use(key) == s.position(*nxt, 3)
