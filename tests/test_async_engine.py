"""The async engine: concurrent streams, cancellation freeing blocks, errors isolated to one request."""

import asyncio

import pytest

from dsaserve import LLM, SamplingParams
from dsaserve.engine.admission import RequestRejected
from dsaserve.engine.async_llm_engine import EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


async def collect(engine, prompt, params, request_id):
    text, ids, last = "", [], None
    async for out in engine.generate(prompt, params, request_id):
        for c in out.outputs:
            text += c.text
            ids += c.token_ids
        last = out
    return ids, text, last


def test_concurrent_streams_equal_offline(engine, tiny_checkpoint):
    prompts = ["hello", "the quick brown fox", "Paris is", "one two three four five"]

    async def main():
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"c{i}") for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    offline = LLM(tiny_checkpoint, dtype="float32", block_size=16, max_model_len=256, progress=False)
    expected = offline.generate(prompts, GREEDY, use_tqdm=False)
    for (ids, text, last), exp in zip(results, expected):
        assert ids == exp.outputs[0].token_ids and text == exp.outputs[0].text
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_cancelled_consumers_free_their_blocks(engine, monkeypatch):
    total = engine.stats().num_blocks
    aborted = []
    original_abort = engine.engine.abort_request

    def record_abort(request_id):
        if request_id in engine.engine.unfinished_request_ids():
            aborted.append(request_id)
        original_abort(request_id)

    monkeypatch.setattr(engine.engine, "abort_request", record_abort)
    long = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True)

    async def consume_two_then_cancel(i):
        async def run():
            n = 0
            async for _ in engine.generate("tell me a long story " * 3, long, f"cancel{i}"):
                n += 1
                if n == 2:
                    await asyncio.sleep(10)  # cancelled while waiting here
        task = asyncio.create_task(run())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        await asyncio.gather(*(consume_two_then_cancel(i) for i in range(5)))
        for _ in range(100):
            if engine.stats().num_free_blocks == total and not engine.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert sorted(aborted) == [f"cancel{i}" for i in range(5)]  # aborted mid-generation, not run to the end
    assert engine.stats().num_free_blocks == total
    assert not engine.engine.unfinished_request_ids()


def test_bad_request_fails_before_queueing(engine):
    async def main():
        with pytest.raises(RequestRejected, match="max_model_len"):
            async for _ in engine.generate("x", SamplingParams(max_tokens=1000), "too-long"):
                pass
        return await collect(engine, "still serving", GREEDY, "after")

    ids, _, last = asyncio.run(main())
    assert last.finished and len(ids) == 10


def fail_once(monkeypatch, owner, name: str, message: str) -> None:
    """Make owner.name raise RuntimeError(message) on its first call, then behave."""
    original, calls = getattr(owner, name), []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(message)
        return original(*args)

    monkeypatch.setattr(owner, name, flaky)


def test_step_exception_fails_running_requests_and_loop_survives(engine, monkeypatch):
    fail_once(monkeypatch, engine.engine.runner, "execute", "simulated device error")

    async def main():
        with pytest.raises(EngineStepError, match="simulated device error"):
            await collect(engine, "doomed", GREEDY, "doomed")
        return await collect(engine, "survivor", GREEDY, "survivor")

    ids, _, last = asyncio.run(main())
    assert last.finished and len(ids) == 10
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_a_step_that_breaks_after_finishing_a_request_still_answers_its_client(engine, monkeypatch):
    """The scheduler has finished and freed a one-token request when output processing raises: its
    client must get an error, not wait forever."""
    fail_once(monkeypatch, engine.engine.output_processor, "process", "simulated bug after the scheduler's update")
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def main():
        with pytest.raises(EngineStepError, match="simulated bug"):
            await asyncio.wait_for(collect(engine, "short", one_token, "short"), timeout=60)
        return await collect(engine, "survivor", GREEDY, "after-bug")

    ids, _, last = asyncio.run(main())
    assert last.finished and len(ids) == 10
    assert not engine.engine.unfinished_request_ids()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
