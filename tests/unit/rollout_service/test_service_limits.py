"""Limits on what sizes the service's memory: runs, consumers per run, queued prompts."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest

from rollout_service.delivery.consumer import ConsumerSession
from rollout_service.errors import FailedPrecondition, ResourceExhausted
from rollout_service.generation.prompts import SUBMIT_CHUNK, PromptSpec, RenderedPrompt, SubmittedPromptSource
from rollout_service.types import PromptItem
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.scripted import ScriptedEngine, ScriptedTokenizer, make_service


async def test_runs_beyond_the_limit_are_refused_until_one_is_deleted() -> None:
    service = make_service(ScriptedEngine(), max_runs=2)
    runs = [await service.create_run(spec()) for _ in range(2)]
    with pytest.raises(ResourceExhausted, match="holds 2 runs, its limit"):
        await service.create_run(spec())
    await service.delete_run(runs[0].run_id)
    runs.append(await service.create_run(spec()))
    for run in runs[1:]:
        await service.delete_run(run.run_id)


async def test_consumers_beyond_the_limit_are_refused() -> None:
    service = make_service(ScriptedEngine(), max_consumers_per_run=1)
    run = await service.create_run(spec())
    ConsumerSession(service, run.run_id, "first", 1).check_limits()
    run.broker.subscribe("first", 1)
    with pytest.raises(ResourceExhausted, match="has 1 consumers, the limit"):
        ConsumerSession(service, run.run_id, "second", 1).check_limits()
    await service.delete_run(run.run_id)


class BlockingTokenizer(ScriptedTokenizer):
    """Tokenizing waits until the test releases it, as a huge prompt keeps a tokenizer busy."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.entered.set()
        if not self.release.wait(5):
            raise TimeoutError("never released: rendering blocked the event loop")
        return super().encode(text)


async def submitting_while_rendering_blocks():  # type: ignore[no-untyped-def]
    """A service, a submitted-prompts run, and a SubmitPrompts whose rendering has begun and
    waits for ``tokenizer.release``."""
    service = make_service(ScriptedEngine())
    tokenizer = service.renderer.tokenizer = BlockingTokenizer()
    run = await service.create_run(replace(spec(), source_kind="submitted", prompts=()))
    submitting = asyncio.ensure_future(service.submit_prompts(run.run_id, [PromptSpec(text="1 2 3")]))
    await asyncio.wait_for(asyncio.to_thread(tokenizer.entered.wait, 5), 10)
    return service, tokenizer, run, submitting


async def test_prompts_render_off_the_event_loop() -> None:
    """Rendering a 20 MB prompt on the event loop froze every RPC for 36 s."""
    service, tokenizer, run, submitting = await submitting_while_rendering_blocks()
    assert service.stats().uptime_seconds >= 0  # rendering has begun, and the loop still serves other calls
    tokenizer.release.set()
    assert await asyncio.wait_for(submitting, 10) == (1, 1)
    await service.delete_run(run.run_id)


async def test_prompts_submitted_to_a_run_deleted_while_they_render_are_refused() -> None:
    service, tokenizer, run, submitting = await submitting_while_rendering_blocks()
    await service.delete_run(run.run_id)
    tokenizer.release.set()
    with pytest.raises(FailedPrecondition, match="is stopped; submit to a running run"):
        await asyncio.wait_for(submitting, 10)


async def test_the_prompt_queue_is_bounded_by_bytes() -> None:
    """The queue counts bytes (prompts of 64 KiB metadata each here), refuses a whole submit
    that passes them, and takes prompts again as the run consumes them."""
    source = SubmittedPromptSource(max_bytes=1 << 20)
    prompt = RenderedPrompt(token_ids=[1, 2, 3], text="abc", metadata={"answer": "x" * (60 << 10)})
    stored: list[int] = []

    async def store(items: list[PromptItem]) -> None:
        stored.extend(item.index for item in items)

    await source.submit([prompt] * 16, store)
    assert stored == list(range(16)) and source.queued == 16
    with pytest.raises(ResourceExhausted, match=r"scheduler\.max_queued_prompt_bytes"):
        await source.submit([prompt] * 2, store)
    assert source.queued_bytes == 16 * prompt.approx_bytes() and len(stored) == 16
    await asyncio.wait_for(source.next(), 5)
    await source.submit([prompt], store)
    assert stored[-1] == 16 and source.queued == 16
    source.discard()
    assert source.queued_bytes == 0


async def test_a_large_submit_is_queued_and_stored_in_chunks_with_the_loop_free_between() -> None:
    """Other RPCs run between the chunks; each chunk is stored in the step that queues it."""
    source = SubmittedPromptSource()
    prompt = RenderedPrompt(token_ids=[1, 2, 3], text="abc")
    chunks: list[tuple[int, int, int]] = []  # (first index, size, ticks of another task so far)
    ticks = 0

    async def other_rpcs() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def store(items: list[PromptItem]) -> None:  # the memory store: it never waits
        assert source.queued == items[-1].index + 1  # queued in the same step
        chunks.append((items[0].index, len(items), ticks))

    ticking = asyncio.ensure_future(other_rpcs())
    await source.submit([prompt] * (3 * SUBMIT_CHUNK + 5), store)
    ticking.cancel()
    assert [(first, size) for first, size, _ in chunks] == [
        (0, SUBMIT_CHUNK), (SUBMIT_CHUNK, SUBMIT_CHUNK), (2 * SUBMIT_CHUNK, SUBMIT_CHUNK), (3 * SUBMIT_CHUNK, 5),
    ]  # fmt: skip
    seen = [ticked for _, _, ticked in chunks]
    assert len(set(seen)) == len(seen)  # the other task ran between every two chunks


async def test_submitted_runs_take_the_queue_limits_from_settings() -> None:
    service = make_service(ScriptedEngine(), max_queued_prompt_bytes=1 << 20)
    run = await service.create_run(replace(spec(), source_kind="submitted", prompts=()))
    assert isinstance(run.source, SubmittedPromptSource)
    assert run.source.max_bytes == 1 << 20
    large = PromptSpec(token_ids=[1], metadata={"answer": "x" * (60 << 10)})
    with pytest.raises(ResourceExhausted, match=r"scheduler\.max_queued_prompt_bytes"):
        await service.submit_prompts(run.run_id, [large] * 18)  # 1080 KiB: refused whole
    await service.delete_run(run.run_id)
