"""Where a run's prompts come from, and how a prompt becomes token ids.

Prompts are rendered to token ids once, here; from then on the service only moves ids
(vLLM gets ids, samples carry ids), so nothing is ever re-tokenized.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_service.errors import InvalidArgument, ResourceExhausted, echo
from rollout_service.types import CHAT_ROLES, PromptItem


@dataclass(frozen=True)
class PromptSpec:
    """A prompt as a client gives it: exactly one of messages, text or token ids."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    metadata: dict[str, str] = field(default_factory=dict)


MAX_METADATA_BYTES = 64 << 10
"""Per prompt: metadata rides along with every group of the prompt."""
MAX_CHARS_PER_TOKEN = 64
"""A prompt longer than this many characters per context token cannot fit, whatever it says."""
_BYTES_PER_TOKEN_ID = 36
"""A token id in a Python list: an 8-byte slot and a 28-byte int object."""


def _user(content: str, **metadata: str) -> PromptSpec:
    return PromptSpec(messages=[{"role": "user", "content": content}], metadata=metadata)


def _letters() -> list[PromptSpec]:
    return [_user(f"Write the letter {c} as many times as you can.", target_char=c) for c in "abcdefghij"]


def _repeat_a() -> list[PromptSpec]:
    """The demo's task: one target letter, so a tiny random model learns it within minutes."""
    return [_user(f"Write the letter a as many times as you can. ({i})", target_char="a") for i in range(8)]


def _sums(question: str, left: range, right: range) -> list[PromptSpec]:
    return [_user(question.format(a=a, b=b), answer=str(a + b)) for a in left for b in right]


def _arithmetic() -> list[PromptSpec]:
    return _sums("What is {a} + {b}? Answer with the number.", range(0, 50, 7), range(0, 50, 11))


def _tool_arithmetic() -> list[PromptSpec]:
    """For runs with the ``add`` tool: the model learns to call it and report the result."""
    return _sums("Use the add tool to compute {a} + {b}, then state the sum.", range(3, 90, 13), range(5, 90, 17))


def _guess_number() -> list[PromptSpec]:
    """For the ``guess_number`` environment: the secret is in the metadata, never the prompt."""
    question = "Guess my number between 1 and 20. Answer with one number."
    return [_user(question, secret=str(secret)) for secret in (3, 7, 11, 14, 18)]


BUILTIN_DATASETS = {
    "letters": _letters,
    "repeat_a": _repeat_a,
    "arithmetic": _arithmetic,
    "tool_arithmetic": _tool_arithmetic,
    "guess_number": _guess_number,
}
"""Toy datasets for the embedded default, by ``RunSpec.prompt_source.dataset`` name."""


def builtin_dataset(name: str) -> list[PromptSpec]:
    try:
        return BUILTIN_DATASETS[name]()
    except KeyError:
        raise InvalidArgument(
            f"unknown dataset {echo(name)}; built-in datasets: {', '.join(sorted(BUILTIN_DATASETS))}"
        ) from None


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: list[int]
    text: str
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[dict[str, str], ...] = ()

    def item(self, index: int) -> PromptItem:
        return PromptItem(index, self.token_ids, self.text, self.metadata, self.messages)

    def approx_bytes(self) -> int:
        strings = [self.text, *self.metadata, *self.metadata.values()]
        strings += [value for message in self.messages for value in message.values()]
        return _BYTES_PER_TOKEN_ID * len(self.token_ids) + sum(len(value.encode()) for value in strings)


class PromptRenderer:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self._decode = _decoder(tokenizer)

    def render(
        self, spec: PromptSpec, max_tokens: int, tools: list[dict[str, Any]] | None = None
    ) -> tuple[list[int], str]:
        """Token ids and decoded text; ``tools`` (JSON schemas) go to the chat template of chat prompts."""
        forms = [spec.messages is not None, spec.text is not None, spec.token_ids is not None]
        if sum(forms) != 1:
            raise InvalidArgument("a prompt needs exactly one of messages, text or token_ids")
        self._check_sizes(spec)
        if spec.messages is not None:
            if not spec.messages:
                raise InvalidArgument("a chat prompt needs at least one message")
            _check_roles(spec.messages)
            ids = list(
                self.tokenizer.apply_chat_template(
                    spec.messages, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        elif spec.text is not None:
            if not spec.text:
                raise InvalidArgument("a text prompt must not be empty")
            ids = self.tokenizer.encode(spec.text, add_special_tokens=False)
        else:
            ids = list(spec.token_ids or [])
            if not ids:
                raise InvalidArgument("a token-id prompt must not be empty")
            if bad := [i for i in ids if i >= self.vocab_size]:
                raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if len(ids) + max_tokens > self.max_model_len:
            raise InvalidArgument(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the model's context "
                f"of {self.max_model_len}; shorten the prompt or lower sampling.max_tokens"
            )
        return ids, self.decode(ids)

    def _check_sizes(self, spec: PromptSpec) -> None:
        """Refuse what cannot fit before tokenizing it: the tokenizer runs on the event loop."""
        metadata_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in spec.metadata.items())
        if metadata_bytes > MAX_METADATA_BYTES:
            raise InvalidArgument(
                f"prompt metadata is {metadata_bytes} bytes; keep it within {MAX_METADATA_BYTES} "
                "(it travels with every group of the prompt)"
            )
        self.check_chars(len(spec.text or "") + sum(len(m.get("content") or "") for m in spec.messages or []))
        if spec.token_ids is not None and len(spec.token_ids) > self.max_model_len:
            raise InvalidArgument(
                f"prompt of {len(spec.token_ids)} token ids exceeds the model's context of {self.max_model_len}"
            )

    def check_chars(self, chars: int, what: str = "prompt") -> None:
        """Refuse text that cannot fit the context before a tokenizer spends seconds on it."""
        max_chars = self.max_model_len * MAX_CHARS_PER_TOKEN
        if chars > max_chars:
            raise InvalidArgument(
                f"{what} of {chars} characters cannot fit the model's context of {self.max_model_len} tokens "
                f"(at most {max_chars} characters are read); shorten it"
            )

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Special tokens are kept unless asked: samples and tool parsers see them, rewards do not."""
        return self._decode(ids, skip_special_tokens=skip_special_tokens)


def _decoder(tokenizer: Any) -> Callable[..., str]:
    """The fast tokenizer's Rust decode where it gives what ``tokenizer.decode`` does (no space clean-up):
    transformers first checks every id in Python, a per-token cost on the service's hot path."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend.decode  # type: ignore[no-any-return]
    return tokenizer.decode  # type: ignore[no-any-return]


def _check_roles(messages: list[dict[str, str]]) -> None:
    """A role the chat template does not know would be rendered as whatever it makes of it."""
    for index, message in enumerate(messages):
        if message.get("role") not in CHAT_ROLES:
            raise InvalidArgument(
                f"message {index} has role {echo(message.get('role'))}; use one of {', '.join(CHAT_ROLES)}"
            )


class PromptSource(Protocol):
    """Yields the next prompt of a run; may wait (submitted prompts)."""

    async def next(self) -> PromptItem: ...

    def discard(self) -> None:
        """The run was deleted: free its prompts."""


class CyclingPromptSource:
    def __init__(self, rendered: list[RenderedPrompt]) -> None:
        if not rendered:
            raise InvalidArgument("a prompt list must not be empty")
        self._cycle = itertools.cycle(rendered)
        self._count = itertools.count()

    async def next(self) -> PromptItem:
        return next(self._cycle).item(next(self._count))

    def discard(self) -> None:
        self._cycle = itertools.cycle([])


class OncePromptSource:
    """A fixed list of rendered prompts, each handed out once (an evaluation set)."""

    def __init__(self, rendered: list[RenderedPrompt]) -> None:
        if not rendered:
            raise InvalidArgument("a prompt list must not be empty")
        self.size = len(rendered)
        self._rendered = rendered
        self._next = 0

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._rendered)

    async def next(self) -> PromptItem:
        self._next += 1
        return self._rendered[self._next - 1].item(self._next - 1)

    def discard(self) -> None:
        self._rendered = []


def _pack(prompt: RenderedPrompt) -> tuple[bytes, int]:
    fields = (prompt.token_ids, prompt.text, prompt.metadata, prompt.messages)
    return pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL), prompt.approx_bytes()


def _pack_all(rendered: list[RenderedPrompt]) -> list[tuple[bytes, int]]:
    packed = [_pack(prompt) for prompt in rendered]
    rendered.clear()  # here, off the event loop: freeing 100k objects takes a while
    return packed


def _unpack(index: int, blob: bytes) -> PromptItem:
    return PromptItem(index, *pickle.loads(blob))  # the fields ``_pack`` pickled, in PromptItem's order


SUBMIT_CHUNK = 1024
"""Prompts handled per step, so a large submit does not hold up other RPCs."""


class SubmittedPromptSource:
    """Prompts pushed through SubmitPrompts, in order; a run waits while none are queued.

    Bounded by bytes: a submit that would pass the bound is refused whole. Queued prompts are
    held pickled, one bytes object each, so the garbage collector has few objects to walk.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self._queue: asyncio.Queue[tuple[int, bytes, int]] = asyncio.Queue()
        self._count = itertools.count()
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._submitting = asyncio.Lock()
        """One submit at a time: the room it found stays its own."""
        self._discarded = False

    async def submit(
        self, rendered: list[RenderedPrompt], persist: Callable[[list[PromptItem]], Awaitable[None]]
    ) -> None:
        """Queue the prompts (all or none) ``SUBMIT_CHUNK`` at a time, each chunk persisted
        before a group can be made of it; ``rendered`` is emptied."""
        packed = await asyncio.to_thread(_pack_all, rendered)
        async with self._submitting:  # meanwhile the run only takes prompts: the room only grows
            total = sum(size for _, size in packed)
            if self.queued_bytes + total > self.max_bytes:
                raise ResourceExhausted(
                    f"{len(packed)} prompts of about {total} bytes do not fit in the run's queue, which holds "
                    f"{self.queued_bytes} of {self.max_bytes} bytes (scheduler.max_queued_prompt_bytes); "
                    "submit fewer or smaller prompts, or wait for the run to consume some"
                )
            for start in range(0, len(packed), SUBMIT_CHUNK):
                if start:  # the loop's other work gets a turn between chunks, whether or not persist waited
                    await asyncio.sleep(0)
                if self._discarded:  # the run was deleted meanwhile
                    return
                chunk = [(next(self._count), blob, size) for blob, size in packed[start : start + SUBMIT_CHUNK]]
                for entry in chunk:
                    self._queue.put_nowait(entry)
                    self.queued_bytes += entry[2]
                await persist([_unpack(index, blob) for index, blob, _ in chunk])

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def restore(self, items: list[PromptItem], submitted: int) -> None:
        """A restarted service's stored prompts; new ones are numbered on from ``submitted``."""
        for item in items:
            blob, size = _pack(RenderedPrompt(item.token_ids, item.text, item.metadata, item.messages))
            self._queue.put_nowait((item.index, blob, size))
            self.queued_bytes += size
        self._count = itertools.count(max([submitted, *(item.index + 1 for item in items)]))

    async def next(self) -> PromptItem:
        index, blob, size = await self._queue.get()
        self.queued_bytes -= size
        return _unpack(index, blob)

    def discard(self) -> None:
        self._discarded = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self.queued_bytes = 0
