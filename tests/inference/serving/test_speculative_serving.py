"""Speculative decoding in the server (`BatchScheduler._drafts`, `--speculative K`): each greedy decoding
request's row carries up to K tokens drafted by lookup, verified in the same step as the other requests'
rows; every request's tokens are those it gets without drafts, over the runner's engine (experts read
into its cache) and the resident engine, with requests that draft right (a prompt that repeats), wrong,
and sample (no drafts). Log-probs within LOGPROB_ATOL: a drafted row is computed in a wider pass."""

from __future__ import annotations

import asyncio

import pytest
from helpers.hf_models import make_hf_checkpoint

from inference.serving.batch_scheduler import BatchScheduler, Job, rolls_back
from inference.serving.http_server import ServerMetrics
from inference.serving.openai_protocol import GenRequest
from inference.serving.scheduler_events import DoneEvent, ErrorEvent
from inference.serving.serve_config import ServeConfig
from semoe.checkpoints.hf_convert import import_checkpoint
from semoe.checkpoints.hf_config import store_model_config
from semoe.decode.loop import SamplingConfig
from storage.reader import StoreReader

LOGPROB_ATOL = 1e-4
REPEATS = [5, 9, 13, 5, 9, 13, 5, 9, 13, 5, 9]  # drafts by lookup find what follows
PROMPTS = [REPEATS, [3, 17, 29, 11], [40, 8, 19, 23, 2, 6]]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    return import_checkpoint(str(make_hf_checkpoint("mixtral", root / "hf", seed=3)), str(root / "store")).root


def _answers(engine, k: int, sampled: bool = False, max_batch_tokens: int = 256, paying: bool = False
             ) -> tuple[list[DoneEvent], BatchScheduler]:
    scheduler = BatchScheduler(engine, ServerMetrics(), ServeConfig(max_batch=4, speculative=k, paying=paying,
                                                                    max_batch_tokens=max_batch_tokens))
    reqs = [GenRequest(chat=False, prompt_ids=p, sampling=SamplingConfig(max_new_tokens=18)) for p in PROMPTS]
    if sampled:
        reqs.append(GenRequest(chat=False, prompt_ids=REPEATS, sampling=SamplingConfig(
            max_new_tokens=10, greedy=False, temperature=0.9, seed=4)))

    async def go() -> list[DoneEvent]:
        loop = asyncio.get_running_loop()
        jobs = [Job(request=r, loop=loop, id=str(i)) for i, r in enumerate(reqs)]
        scheduler.start()
        scheduler.submit(*jobs)
        done = []
        for job in jobs:
            while not isinstance(ev := await asyncio.wait_for(job.events.get(), 120), DoneEvent):
                assert not isinstance(ev, ErrorEvent), ev.message
            done.append(ev)
        return done

    try:
        return asyncio.run(go()), scheduler
    finally:
        scheduler.stop()


@pytest.mark.parametrize("kind", ["runner", "resident"])
def test_drafted_rows_give_each_request_its_tokens_without_drafts(store, kind):
    if kind == "runner":
        from inference.serving.torch_free_engine import LeanEngine
        from inference.torch_free.runner import LeanConfig, LeanModel

        make = lambda: LeanEngine(LeanModel(store, LeanConfig(cache_bytes=0, kv_cache="f32")), name="lean")  # noqa: E731
    else:
        from inference.engine import Engine
        from inference.engine_config import EngineConfig

        make = lambda: Engine.load(store, EngineConfig())  # noqa: E731
    engine = make()
    try:
        want, _ = _answers(engine, 0)
        got, scheduler = _answers(engine, 3, sampled=True)
    finally:
        engine.close()
    for w, g in zip(want, got):
        assert g.tokens == w.tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=LOGPROB_ATOL)
    assert len(got[-1].tokens) == 10  # the sampled request, which drafts nothing, answered too
    assert scheduler.speculative == 3 and scheduler.drafted > 0 and 0 < scheduler.accepted <= scheduler.drafted


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_the_checkpoints_mtp_layer_drafts_in_the_server(arch, tmp_path):
    """Over the runner's engine, a store with a multi-token-prediction layer drafts with it: each request's
    drafter is fed every row of its steps (its prompt spread over several steps by a small step budget,
    its drafted rows up to the tokens kept), and the tokens are those without drafts."""
    from helpers.mtp_checkpoints import make_mtp_checkpoint

    from inference.serving.torch_free_engine import LeanEngine
    from inference.torch_free.mtp import Drafter
    from inference.torch_free.runner import LeanConfig, LeanModel

    store = import_checkpoint(str(make_mtp_checkpoint(arch, tmp_path / "hf")), str(tmp_path / "store")).root
    engine = LeanEngine(LeanModel(store, LeanConfig(cache_bytes=0, kv_cache="f32")), name="lean")
    try:
        want, _ = _answers(engine, 0, max_batch_tokens=8)
        assert engine.rows is None  # kept only where a drafter reads them
        seen = []
        drafter = engine.drafter
        engine.drafter = lambda *a: seen.append(drafter(*a)) or seen[-1]
        got, scheduler = _answers(engine, 2, max_batch_tokens=8)
    finally:
        engine.close()
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert len(seen) == len(PROMPTS) and all(isinstance(d, Drafter) for d in seen)
    assert sum(d.drafted for d in seen) == scheduler.drafted > 0


def test_a_model_whose_state_does_not_roll_back_serves_without_drafts(tmp_path):
    qn = import_checkpoint(str(make_hf_checkpoint("qwen3_next", tmp_path / "hf")), str(tmp_path / "store"))
    assert not rolls_back(store_model_config(StoreReader.open(qn.root)))
    with pytest.raises(ValueError, match="--speculative must be >= 0"):
        ServeConfig(speculative=-1)


def test_a_served_requests_drafts_are_the_runners(tmp_path, monkeypatch):
    """One request through the server and through `LeanModel.generate`, both drafting 2 tokens a step with the
    layer: the same drafts at the same points (the server fed its drafter the rows the runner keeps)."""
    from helpers.mtp_checkpoints import make_mtp_checkpoint

    from inference.serving.torch_free_engine import LeanEngine
    from inference.torch_free.mtp import Drafter
    from inference.torch_free.runner import LeanConfig, LeanModel

    calls: list[tuple] = []
    real = Drafter.__call__

    def recorded(self, generated, n):
        out = real(self, generated, n)
        calls.append((len(generated), n, tuple(out)))
        return out

    monkeypatch.setattr(Drafter, "__call__", recorded)
    store = import_checkpoint(str(make_mtp_checkpoint("deepseek_v3", tmp_path / "hf")), str(tmp_path / "store")).root
    with LeanModel(store, LeanConfig(cache_bytes=None)) as lean:
        alone = lean.generate(PROMPTS[1], SamplingConfig(max_new_tokens=18), speculative=2)
    runner, calls[:] = list(calls), []
    engine = LeanEngine(LeanModel(store, LeanConfig(cache_bytes=None, kv_cache="f32")), name="lean")
    try:
        scheduler = BatchScheduler(engine, ServerMetrics(), ServeConfig(max_batch=1, speculative=2))

        async def go():
            job = Job(request=GenRequest(chat=False, prompt_ids=PROMPTS[1], sampling=SamplingConfig(max_new_tokens=18)),
                      loop=asyncio.get_running_loop(), id="0")
            scheduler.start()
            scheduler.submit(job)
            while not isinstance(ev := await asyncio.wait_for(job.events.get(), 120), DoneEvent):
                pass
            return ev

        served = asyncio.run(go())
        scheduler.stop()
    finally:
        engine.close()
    asked = [c for c in runner if c[1] > 0]  # (the runner asks for none where no row is left: the server does not)
    assert served.tokens == alone.tokens and calls == asked and any(out for _, _, out in asked)


def test_serve_auto_drafts_with_the_layer_while_it_pays(store, tmp_path, capsys):
    """`semoe serve --speculative auto` (the default) over the runner's engine: 3 tokens drafted with the
    layer, in steps while drafting pays (`Paying` deciding steps, timed by all requests' tokens; the
    tokens are the same either way), said on stderr; a store without the layer serves without drafts."""
    from helpers.mtp_checkpoints import make_mtp_checkpoint

    from inference.serving.torch_free_engine import LeanEngine
    from inference.torch_free.runner import LeanConfig, LeanModel
    from tools.serve_cmd import _auto_speculative

    with_layer = import_checkpoint(str(make_mtp_checkpoint("glm4_moe", tmp_path / "hf")), str(tmp_path / "s")).root
    for path, k in ((store, 0), (with_layer, 3)):
        engine = LeanEngine(LeanModel(path, LeanConfig(cache_bytes=0, kv_cache="f32")), name="lean")
        try:
            config = _auto_speculative(engine, ServeConfig(max_batch=4))
            assert (config.speculative, config.paying) == (k, k > 0)
            said = capsys.readouterr().err
            assert ("drafting 3 tokens a step" in said) == (k > 0)
            if k:
                want, _ = _answers(engine, 0)
                scheduler = BatchScheduler(engine, ServerMetrics(), config)
                assert scheduler.paying is not None and scheduler.speculative == 3
                got, scheduler = _answers(engine, 3, paying=True)
                assert [g.tokens for g in got] == [w.tokens for w in want]
                assert scheduler.paying.passes["draft"] > 0 and scheduler.paying.passes["plain"] > 0
        finally:
            engine.close()
