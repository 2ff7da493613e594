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


def _answers(engine, k: int, sampled: bool = False) -> tuple[list[DoneEvent], BatchScheduler]:
    scheduler = BatchScheduler(engine, ServerMetrics(), ServeConfig(max_batch=4, speculative=k))
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


def test_a_model_whose_state_does_not_roll_back_serves_without_drafts(tmp_path):
    qn = import_checkpoint(str(make_hf_checkpoint("qwen3_next", tmp_path / "hf")), str(tmp_path / "store"))
    assert not rolls_back(store_model_config(StoreReader.open(qn.root)))
    with pytest.raises(ValueError, match="--speculative must be >= 0"):
        ServeConfig(speculative=-1)
