"""A stand-in vLLM server, for benchmarks only: it answers the endpoints the rollout service calls
with random token ids at a set speed, so that the service's own CPU ceiling can be measured against
1-64 servers without GPUs. It samples nothing: never take it as evidence that a feature works.

Answers are vLLM 0.32's JSON, field for field and so about as long (parsing them is part of the
service's cost): ``/inference/v1/generate`` as ``GenerateTokensResponse`` (``GenerateTokensChoice``,
``GenerateLogProbs``, ``GenerateLogProbsContent``, ``GenerateLogProb``, ``UsageInfo``,
``WeightVersionSpan``); ``/v1/completions`` as ``CompletionResponse`` (``CompletionResponseChoice``,
``CompletionLogProbs``, with made-up 4-character token strings: there is no tokenizer);
``/v1/models`` as ``ModelList``/``ModelCard``; ``/metrics`` with the ``vllm:`` series the service
reads and vLLM's request histograms; the RL control endpoints as ``entrypoints/rl/online/api_router.py``
(a pause holds new requests until ``/resume``; ``mode=keep`` freezes those in flight, ``abort`` ends
them with finish_reason "abort", ``wait`` answers once they are done). Each answer is joined from
byte fragments precomputed at start-up.

A request of n sequences (``--length`` N, or A:B drawn per sequence; capped at its ``max_tokens``)
is answered after ``ttft + longest / min(max_seq_tokens_per_s, tokens_per_s / running)`` seconds,
``running`` counting the sequences on the server at its admission, its own included; a rate of 0 is
no limit.

Usage::

    python benchmarks/standin_vllm.py --port 0 --model NAME --vocab-size 151936 --eos-token-id 151645 \\
        --max-model-len 2048 --length 128:512 --ttft-s 0.05 --tokens-per-s 3000 --max-seq-tokens-per-s 60 --seed 0

prints ``standin ready http://127.0.0.1:<port>`` once it listens; SIGTERM or SIGINT ends it with
status 0. From a benchmark::

    async with StandinFleet(64, model=NAME, vocab_size=151936, eos_token_id=151645, length="256") as fleet:
        ...  # fleet.urls, fleet.pids
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import os
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import IO, Any

import msgspec
from aiohttp import web

try:
    import uvloop
except ImportError:  # the stand-in runs on asyncio's own loop, only slower
    uvloop = None  # type: ignore[assignment]

READY_PREFIX = "standin ready "
EXITED_PREFIX = "standin exited "
VLLM_VERSION = "0.32.0"
SPREAD = 4096
"""Distinct start positions on the tape: one request's sequences start far apart."""
BLOCK_SIZE = 16
NOMINAL_SEQS = 256
"""vLLM's default max_num_seqs, against which the stand-in reports a nominal KV-cache fill."""
PAUSE_MODES = ("abort", "wait", "keep")

_JSON = "application/json"
SCRIPT = Path(__file__).resolve()


def parse_length(text: str) -> tuple[int, int]:
    """``N`` or ``A:B`` as (low, high), both at least 1."""
    low, _, high = text.partition(":")
    bounds = (int(low), int(high or low))
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"length {text!r}: want N or A:B with 1 <= A <= B")
    return bounds


@dataclass(frozen=True)
class StandinConfig:
    model: str = "standin"
    vocab_size: int = 151936
    eos_token_id: int = 151645
    max_model_len: int = 2048
    length: tuple[int, int] = (256, 256)
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0
    """The server's whole generation rate, shared by its running sequences; 0: no limit."""
    max_seq_tokens_per_s: float = 0.0
    """The fastest one sequence generates; 0: no limit."""
    seed: int = 0
    weight_version: str = "default"
    """What ``/weight_info`` says before any update labels the weights (vLLM: "default")."""


def _float32(value: float) -> float:
    # vLLM's logprobs are float32 values widened to float: their JSON has as many digits.
    return struct.unpack("f", struct.pack("f", value))[0]


class _Joined:
    """ASCII pieces joined by commas, with each piece's byte span, so any run of them is one slice."""

    def __init__(self, pieces: Sequence[str]) -> None:
        self.data = memoryview(",".join(pieces).encode("ascii"))
        self.starts = array.array("q")
        self.ends = array.array("q")
        position = 0
        for piece in pieces:
            self.starts.append(position)
            position += len(piece)
            self.ends.append(position)
            position += 1

    def run(self, start: int, count: int) -> memoryview:
        return self.data[self.starts[start] : self.ends[start + count - 1]] if count else self.data[:0]


class Tape:
    """A long random completion; each sequence served is a slice of it at its own start."""

    def __init__(self, rng: random.Random, vocab_size: int, eos_token_id: int, longest: int) -> None:
        self.longest = longest
        size = longest + SPREAD
        skip_eos = 0 <= eos_token_id < vocab_size
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []
        for _ in range(size):
            token = rng.randrange(vocab_size - 1 if skip_eos else vocab_size)
            self.token_ids.append(token + 1 if skip_eos and token >= eos_token_id else token)
            logprob = _float32(-min(max(rng.expovariate(1.0), 1e-6), 7.99))
            self.logprobs.append(logprob)
            self.ranks.append(1 if logprob > -0.5 else 1 + int(-logprob * rng.uniform(1.0, 8.0)))
        self.ids = _Joined([str(token) for token in self.token_ids])
        self.content = _Joined(
            [
                f'{{"token_id":{t},"logprob":{lp!r},"rank":{r},"top_logprobs":[{{"token_id":{t},"logprob":{lp!r},"rank":{r}}}]}}'
                for t, lp, r in zip(self.token_ids, self.logprobs, self.ranks, strict=True)
            ]
        )

    def start_positions(self, rng: random.Random, count: int) -> list[int]:
        """``count`` distinct starts (while there are that many), evenly apart from a random one."""
        stride = max(1, (SPREAD + 1) // count)
        base = rng.randrange(SPREAD + 1)
        return [(base + i * stride) % (SPREAD + 1) for i in range(count)]

    @cached_property
    def completion_pieces(self) -> dict[str, Any]:
        """The ``/v1/completions`` fragments, built on its first use: the service seldom falls back to it."""
        words = [" " + "".join(chr(97 + (t // 26**k) % 26) for k in range(3)) for t in self.token_ids]
        return {
            "text": memoryview("".join(words).encode("ascii")),
            "text_offset": _Joined([str(4 * i) for i in range(self.longest)]),
            "token_logprobs": _Joined([repr(lp) for lp in self.logprobs]),
            "tokens": _Joined([f'"{w}"' for w in words]),
            "top_logprobs": _Joined([f'{{"{w}":{lp!r}}}' for w, lp in zip(words, self.logprobs, strict=True)]),
        }


class _BadRequest(Exception):
    pass


def _error(message: str, status: int = 400) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "Error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(body=msgspec.json.encode(body), status=status, content_type=_JSON)


def _json(body: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type=_JSON)


class StandinServer:
    """One stand-in's state and handlers."""

    def __init__(self, config: StandinConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        longest = min(config.length[1], config.max_model_len)
        self.tape = Tape(self.rng, config.vocab_size, config.eos_token_id, longest)
        self.weight_version = config.weight_version
        self.loras: dict[str, str] = {}
        self.started = int(time.time())
        self._id_base = self.rng.getrandbits(64)
        self._ids = 0
        self.fingerprint = f"vllm-{VLLM_VERSION}-{self.rng.getrandbits(32):08x}".encode()
        self.running = 0
        """Sequences admitted and not answered."""
        self.waiting = 0
        """Sequences held at admission by a pause."""
        self.requests: dict[str, int] = {}
        """HTTP requests answered, by path."""
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        """Sequences answered, by finish reason."""
        self.generated = 0
        self.prompt_tokens = 0
        self.prefix_queries = 0
        self.prefix_cache_hits = 0
        self.paused = False
        self.frozen = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._frozen_total = 0.0
        self._frozen_since = 0.0
        self._abort_epoch = 0
        self._holding: set[asyncio.Future[None]] = set()
        self._watchers: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._metrics_tail = _histograms(config.model, config.max_model_len)

    # -- test and benchmark hooks ------------------------------------------------------------

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds; it is checked whenever a count changes."""
        if predicate():
            return
        future = asyncio.get_running_loop().create_future()
        entry = (predicate, future)
        self._watchers.append(entry)
        try:
            await future
        finally:
            with contextlib.suppress(ValueError):
                self._watchers.remove(entry)

    def _changed(self) -> None:
        for predicate, future in self._watchers:
            if not future.done() and predicate():
                future.set_result(None)

    # -- generation ----------------------------------------------------------------------------

    def _request_id(self) -> str:
        self._ids += 1
        return f"{(self._id_base + self._ids) & 0xFFFFFFFFFFFFFFFF:016x}"

    def _plan(self, prompt_len: int, n: int, max_tokens: Any, strict: bool) -> tuple[list[int], int]:
        """Each sequence's length, and the cap that makes its finish reason "length"."""
        room = self.config.max_model_len - prompt_len
        if max_tokens is None:
            cap = room
        elif strict and prompt_len + int(max_tokens) > self.config.max_model_len:
            raise _BadRequest(
                f"This model's maximum context length is {self.config.max_model_len} tokens. However, you "
                f"requested {int(max_tokens)} output tokens and your prompt contains {prompt_len} input tokens, "
                f"for a total of {prompt_len + int(max_tokens)} tokens. Please reduce the length of the input "
                "prompt or the number of requested output tokens."
            )
        else:
            cap = min(int(max_tokens), room)
        if cap < 1:
            raise _BadRequest(
                f"The decoder prompt (length {prompt_len}) is longer than the maximum model length of "
                f"{self.config.max_model_len}, or max_tokens is below 1."
            )
        low, high = self.config.length
        if low == high:
            return [min(low, cap)] * n, cap
        return [min(self.rng.randint(low, high), cap) for _ in range(n)], cap

    def _rate(self) -> float:
        """Tokens per second of each running sequence; 0: no limit."""
        limits = [self.config.max_seq_tokens_per_s] if self.config.max_seq_tokens_per_s > 0 else []
        if self.config.tokens_per_s > 0:
            limits.append(self.config.tokens_per_s / self.running)
        return min(limits) if limits else 0.0

    def _frozen_seconds(self, now: float) -> float:
        return self._frozen_total + (now - self._frozen_since if self.frozen else 0.0)

    async def _generate(self, n: int, lengths: list[int]) -> list[int] | None:
        """Hold the request for its time; returns how many tokens each sequence had when an abort
        ended it, or None when it ran to the end."""
        if self.paused:
            self.waiting += n
            self._changed()
            try:
                while self.paused:
                    await self._resumed.wait()
            finally:
                self.waiting -= n
        self.running += n
        self._changed()
        try:
            rate = self._rate()
            duration = self.config.ttft_s + (max(lengths) / rate if rate else 0.0)
            active = await self._hold(duration)
        finally:
            self.running -= n
            self._changed()
        if active is None:
            return None
        decoding = active - self.config.ttft_s
        if not rate:
            return [length if decoding >= 0 else 0 for length in lengths]
        return [min(length, int(max(decoding, 0.0) * rate)) for length in lengths]

    async def _hold(self, duration: float) -> float | None:
        """Wait ``duration`` seconds not counting frozen time; returns the seconds it ran if aborted."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        frozen_at_start = self._frozen_seconds(start)
        epoch = self._abort_epoch
        while True:
            while self.frozen and self._abort_epoch == epoch:
                await self._resumed.wait()
            now = loop.time()
            active = now - start - (self._frozen_seconds(now) - frozen_at_start)
            if self._abort_epoch != epoch:
                return active
            remaining = duration - active
            if remaining <= 0:
                return None
            # A bare future and timer rather than a sleep task: the cheapest wait an abort can cut short.
            future = loop.create_future()
            self._holding.add(future)
            timer = loop.call_later(remaining, _wake, future)
            try:
                await future
            finally:
                timer.cancel()
                self._holding.discard(future)

    async def _serve(
        self, path: str, prompt_len: int, n: int, max_tokens: Any, strict: bool
    ) -> tuple[list[int], list[int], list[str]]:
        """One request of ``n`` sequences, both endpoints: each one's tape start, tokens generated and
        finish reason, after holding it for its time; raises ``_BadRequest`` before holding."""
        lengths, cap = self._plan(prompt_len, n, max_tokens, strict)
        starts = self.tape.start_positions(self.rng, n)
        aborted = await self._generate(n, lengths)
        generated = lengths if aborted is None else aborted
        reasons = ["abort" if aborted is not None else "length" if length == cap else "stop" for length in lengths]
        self._count(path, prompt_len, generated, reasons)
        return starts, generated, reasons

    def _count(self, path: str, prompt_len: int, generated: list[int], reasons: list[str]) -> None:
        self.requests[path] = self.requests.get(path, 0) + 1
        n = len(generated)
        self.generated += sum(generated)
        self.prompt_tokens += prompt_len * n
        self.prefix_queries += prompt_len * n
        self.prefix_cache_hits += prompt_len // BLOCK_SIZE * BLOCK_SIZE * (n - 1)
        for reason in reasons:
            self.finished[reason] += 1

    async def generate(self, request: web.Request) -> web.Response:
        """vLLM's token-in, token-out endpoint, answered as ``GenerateTokensResponse``."""
        body = msgspec.json.decode(await request.read())
        sampling = body.get("sampling_params") or {}
        prompt = body.get("token_ids")
        if not isinstance(prompt, list) or not prompt:
            return _error("token_ids: a non-empty list of token ids is required")
        try:
            starts, generated, reasons = await self._serve(
                request.path, len(prompt), int(sampling.get("n") or 1), sampling.get("max_tokens"), strict=False
            )
        except _BadRequest as exc:
            return _error(str(exc))
        tape = self.tape
        with_logprobs = sampling.get("logprobs") is not None
        label = msgspec.json.encode(self.weight_version)
        completion_tokens = sum(generated)
        model = msgspec.json.encode(body.get("model") or self.config.model)
        prompt_ids = msgspec.json.encode(prompt) if body.get("return_token_ids") else b"null"
        parts: list[bytes | memoryview] = [
            b'{"request_id":"generate-tokens-%s","model":%s,"created":%d,"usage":{"prompt_tokens":%d,'
            b'"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":null,'
            b'"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_id_logprobs":null,'
            b'"prompt_token_ids":%s,"mm_placeholders":null,"metrics":null,"kv_transfer_params":null,'
            b'"ec_transfer_params":null,"output_mode":"tokens","choices":['
            % (
                self._request_id().encode(),
                model,
                int(time.time()),
                len(prompt),
                len(prompt) + completion_tokens,
                completion_tokens,
                prompt_ids,
            )
        ]
        for index, (start, count, reason) in enumerate(zip(starts, generated, reasons, strict=True)):
            spans = b'[{"version":%s,"start":0,"end":%d}]' % (label, count) if count else b"[]"
            parts.append(
                b'%s{"index":%d,"finish_reason":"%s","stop_reason":null,"token_ids":['
                % (b"," if index else b"", index, reason.encode())
            )
            parts.append(tape.ids.run(start, count))
            parts.append(b'],"routed_experts":null,"sampling_mask":null,"weight_versions":%s,"logprobs":' % spans)
            if with_logprobs:
                parts.append(b'{"content":[')
                parts.append(tape.content.run(start, count))
                parts.append(b"]}}")
            else:
                parts.append(b"null}")
        parts.append(b"]}")
        return web.Response(body=b"".join(parts), content_type=_JSON)

    async def completions(self, request: web.Request) -> web.Response:
        """The OpenAI-compatible endpoint with token-id prompts, answered as ``CompletionResponse``."""
        body = msgspec.json.decode(await request.read())
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) for t in prompt[:1]):
            return _error("prompt: the stand-in takes one prompt of token ids")
        try:
            starts, generated, reasons = await self._serve(
                request.path, len(prompt), int(body.get("n") or 1), body.get("max_tokens"), strict=True
            )
        except _BadRequest as exc:
            return _error(str(exc))
        tape = self.tape
        pieces = tape.completion_pieces
        with_logprobs = body.get("logprobs") is not None
        with_ids = bool(body.get("return_token_ids"))
        prompt_ids = msgspec.json.encode(prompt) if with_ids else b"null"
        completion_tokens = sum(generated)
        parts: list[bytes | memoryview] = [
            b'{"id":"cmpl-%s","object":"text_completion","created":%d,"model":%s,"choices":['
            % (
                self._request_id().encode(),
                int(time.time()),
                msgspec.json.encode(body.get("model") or self.config.model),
            )
        ]
        for index, (start, count, reason) in enumerate(zip(starts, generated, reasons, strict=True)):
            parts.append(b'%s{"index":%d,"text":"' % (b"," if index else b"", index))
            parts.append(pieces["text"][4 * start : 4 * (start + count)])
            if with_logprobs:
                parts.append(b'","logprobs":{"text_offset":[')
                parts.append(pieces["text_offset"].run(0, count))
                for name in ("token_logprobs", "tokens", "top_logprobs"):
                    parts.append(b'],"%s":[' % name.encode())
                    parts.append(pieces[name].run(start, count))
                parts.append(b"]}")
            else:
                parts.append(b'","logprobs":null')
            parts.append(b',"finish_reason":"%s","stop_reason":null,"token_ids":' % reason.encode())
            if with_ids:
                parts.extend((b"[", tape.ids.run(start, count), b"]"))
            else:
                parts.append(b"null")
            parts.append(b',"prompt_logprobs":null,"prompt_token_ids":%s,"routed_experts":null}' % prompt_ids)
        parts.append(
            b'],"service_tier":null,"system_fingerprint":"%s","usage":{"prompt_tokens":%d,"total_tokens":%d,'
            b'"completion_tokens":%d,"prompt_tokens_details":null,"completion_tokens_details":null},'
            b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
            % (self.fingerprint, len(prompt), len(prompt) + completion_tokens, completion_tokens)
        )
        return web.Response(body=b"".join(parts), content_type=_JSON)

    # -- status --------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def models(self, request: web.Request) -> web.Response:
        def card(name: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
            permission = {
                "id": f"modelperm-{self._request_id()}",
                "object": "model_permission",
                "created": self.started,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
            return {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_model_len,
                "permission": [permission],
            }

        model = self.config.model
        cards = [card(model, model, None, self.config.max_model_len)]
        cards += [card(name, path, model, None) for name, path in self.loras.items()]
        return _json({"object": "list", "data": cards})

    @property
    def kv_usage(self) -> float:
        # A nominal fill: there is no cache, and vLLM's default max_num_seqs is a full one.
        return min(1.0, self.running / NOMINAL_SEQS)

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'{{model_name="{_escape(self.config.model)}",engine="0"}}'
        series = [
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", self.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", self.kv_usage),
            ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in tokens.", self.prefix_queries),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in tokens.", self.prefix_cache_hits),
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", 0),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", self.generated),
        ]
        lines = []
        for name, kind, help_text, value in series:
            family = name.removesuffix("_total")
            lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}", f"{name}{labels} {float(value)}"]
        lines.append("# HELP vllm:request_success Count of successfully processed requests.")
        lines.append("# TYPE vllm:request_success counter")
        for reason, count in self.finished.items():
            lines.append(f'vllm:request_success_total{labels[:-1]},finished_reason="{reason}"}} {float(count)}')
        lines += ["# HELP standin:requests HTTP requests the stand-in answered.", "# TYPE standin:requests counter"]
        for path, count in sorted(self.requests.items()):
            lines.append(f'standin:requests_total{{path="{path}"}} {float(count)}')
        text = "\n".join(lines).encode() + b"\n" + self._metrics_tail
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

    # -- RL control --------------------------------------------------------------------------

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return _error(f"mode must be one of {PAUSE_MODES}, not {mode!r}", status=422)
        if not self.paused:
            self.paused = True
            self._resumed.clear()
            if mode == "keep":
                self.frozen = True
                self._frozen_since = asyncio.get_running_loop().time()
            elif mode == "abort":
                self._abort_epoch += 1
                for future in list(self._holding):
                    _wake(future)
            else:
                await self.wait_until(lambda: self.running == 0)
        return _json({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        if self.frozen:
            self._frozen_total += asyncio.get_running_loop().time() - self._frozen_since
            self.frozen = False
        self.paused = False
        self._resumed.set()
        return _json({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return _json({"is_paused": self.paused})

    async def world_size(self, request: web.Request) -> web.Response:
        return _json({"world_size": 1})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        version = (await _body(request)).get("weight_version")
        if version is not None:
            self.weight_version = str(version)
        return _json({"message": "Weight update finished"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        version = (await _body(request)).get("new_version")
        if not isinstance(version, str):
            return _error("new_version: a string is required", status=422)
        self.weight_version = version
        return _json({"success": True, "new_version": version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return _json({"weight_version": self.weight_version})

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name = str(body.get("lora_name"))
        self.loras[name] = str(body.get("lora_path"))
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        name = str((await _body(request)).get("lora_name"))
        if self.loras.pop(name, None) is None:
            return _error(f"The lora adapter '{name}' cannot be found.", status=404)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    answer = msgspec.json.decode(raw) if raw else {}
    return answer if isinstance(answer, dict) else {}


def _reply(body: dict[str, Any]) -> Callable[[web.Request], Any]:
    payload = msgspec.json.encode(body)

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=payload, content_type=_JSON)

    return handler


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_HISTOGRAMS = (
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration"),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "itl"),
    ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", "itl"),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "latency"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "latency"),
    ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", "latency"),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", "latency"),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "latency"),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "tokens"),
    ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", "tokens"),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "tokens"),
    ("vllm:request_num_preemptions", "Histogram of number of preemptions per request.", "preemptions"),
    ("vllm:request_prefill_kv_computed_tokens", "Histogram of new KV tokens computed during prefill.", "tokens"),
)


def _histograms(model: str, max_model_len: int) -> bytes:
    """vLLM's request histograms, empty: ``/metrics`` is as long as vLLM's for the service to scan."""
    tokens, exponent = [], 0
    while True:
        values = [m * 10**exponent for m in (1, 2, 5) if m * 10**exponent <= max_model_len]
        tokens += values
        if len(values) < 3:
            break
        exponent += 1
    buckets: dict[str, list[float]] = {
        "tokens": tokens,
        "iteration": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        "n": [1, 2, 5, 10, 20],
        "preemptions": [1, 2, 3, 4, 5, 10, 20],
        "ttft": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0, 160.0, 640.0, 2560.0],
        "itl": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0],
        "latency": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0],
    }  # fmt: skip
    labels = f'model_name="{_escape(model)}",engine="0"'
    created = time.time()
    lines = []
    for name, help_text, family in _HISTOGRAMS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound in [*buckets[family], "+Inf"]:
            lines.append(f'{name}_bucket{{{labels},le="{float(bound) if bound != "+Inf" else bound}"}} 0.0')
        lines += [f"{name}_count{{{labels}}} 0.0", f"{name}_sum{{{labels}}} 0.0"]
        lines.append(f"{name}_created{{{labels}}} {created}")
    return ("\n".join(lines) + "\n").encode()


SERVER = web.AppKey("standin_server", StandinServer)


def make_app(config: StandinConfig) -> web.Application:
    """The stand-in's aiohttp application; ``app[SERVER]`` is its ``StandinServer``."""
    server = StandinServer(config)
    app = web.Application(client_max_size=64 * 1024**2)
    app[SERVER] = server
    routes = app.router
    routes.add_post("/inference/v1/generate", server.generate)
    routes.add_post("/v1/completions", server.completions)
    routes.add_get("/health", server.health)
    routes.add_get("/v1/models", server.models)
    routes.add_get("/metrics", server.metrics)
    routes.add_post("/pause", server.pause)
    routes.add_post("/resume", server.resume)
    routes.add_get("/is_paused", server.is_paused)
    routes.add_get("/get_world_size", server.world_size)
    routes.add_post("/init_weight_transfer_engine", _reply({"message": "Weight transfer initialized"}))
    routes.add_post("/start_weight_update", _reply({"message": "Weight update started"}))
    routes.add_post("/update_weights", _reply({"message": "Weights updated"}))
    routes.add_post("/finish_weight_update", server.finish_weight_update)
    routes.add_post("/update_weight_version", server.update_weight_version)
    routes.add_get("/weight_info", server.weight_info)
    routes.add_post("/shutdown_weight_transfer_engine", _reply({"message": "Weight transfer shut down"}))
    routes.add_post("/v1/load_lora_adapter", server.load_lora)
    routes.add_post("/v1/unload_lora_adapter", server.unload_lora)
    return app


async def start(config: StandinConfig, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve a stand-in on ``host``:``port`` (0: a free one); returns its runner and base URL."""
    # Cancelling a disconnected client's handler is what vLLM does to its request (with_cancellation).
    runner = web.AppRunner(make_app(config), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    return runner, f"http://{host}:{runner.addresses[0][1]}"


async def _serve_until_signalled(config: StandinConfig, host: str, port: int, ready_suffix: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner, url = await start(config, host, port)
    # One write, shorter than PIPE_BUF: forked stand-ins sharing the pipe never interleave their lines.
    os.write(sys.stdout.fileno(), f"{READY_PREFIX}{url}{ready_suffix}\n".encode())
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def serve(config: StandinConfig, host: str = "127.0.0.1", port: int = 0, ready_suffix: str = "") -> None:
    """Serve until SIGTERM or SIGINT, on uvloop where it is installed."""
    loop_factory = uvloop.new_event_loop if uvloop is not None else None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve_until_signalled(config, host, port, ready_suffix))


def fork_fleet(config: StandinConfig, host: str, count: int) -> int:
    """Fork ``count`` stand-ins (seeds ``config.seed`` + index) from this process, whose imports they
    share, and wait for them; SIGTERM or SIGINT here ends them all. Each one prints its ready line
    followed by its index and pid, and this process prints ``standin exited <index> <pid> <status>``
    as each ends. Returns 0 when all of them ended cleanly."""
    children: dict[int, int] = {}
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    # Installed before forking: a stop that comes while the children start still reaches them all.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sys.stdout.flush()
    sys.stderr.flush()
    for index in range(count):
        if stopping:
            break
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            status = 1
            try:
                serve(replace(config, seed=config.seed + index), host, 0, f" {index} {os.getpid()}")
                status = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(status)  # not the parent's exit path: its handlers belong to the parent
        children[pid] = index
    failed = False
    while children:
        pid, wait_status = os.waitpid(-1, 0)
        index = children.pop(pid, None)
        if index is not None:
            status = os.waitstatus_to_exitcode(wait_status)
            failed |= status != 0
            os.write(sys.stdout.fileno(), f"{EXITED_PREFIX}{index} {pid} {status}\n".encode())
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--model", default=StandinConfig.model)
    parser.add_argument("--vocab-size", type=int, default=StandinConfig.vocab_size)
    parser.add_argument("--eos-token-id", type=int, default=StandinConfig.eos_token_id, help="never generated")
    parser.add_argument("--max-model-len", type=int, default=StandinConfig.max_model_len)
    parser.add_argument("--length", type=parse_length, default="256", help="tokens per sequence: N or A:B")
    parser.add_argument("--ttft-s", type=float, default=0.0, help="seconds to the first token")
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="the server's total rate; 0: no limit")
    parser.add_argument("--max-seq-tokens-per-s", type=float, default=0.0, help="one sequence's rate; 0: no limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-version", default=StandinConfig.weight_version, help="/weight_info's first label")
    parser.add_argument(
        "--fork-count", type=int, default=0, help="fork this many stand-ins on free ports (StandinFleet's way)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    config = StandinConfig(
        model=args.model,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        max_model_len=args.max_model_len,
        length=args.length,
        ttft_s=args.ttft_s,
        tokens_per_s=args.tokens_per_s,
        max_seq_tokens_per_s=args.max_seq_tokens_per_s,
        seed=args.seed,
        weight_version=args.weight_version,
    )
    if args.fork_count > 0:
        return fork_fleet(config, args.host, args.fork_count)
    serve(config, args.host, args.port)
    return 0


class StandinFleet:
    """``count`` stand-ins, each its own process on its own free port with its own seed::

        async with StandinFleet(64, model="m", vocab_size=151936, eos_token_id=151645, length="256") as fleet:
            fleet.urls  # one base URL per stand-in, fleet.pids their processes

    They are forked from one parent (``--fork-count``) once it has imported aiohttp, so that 64
    start in about the time of one and share its imported modules' memory.
    """

    def __init__(
        self,
        count: int,
        *,
        model: str = StandinConfig.model,
        vocab_size: int = StandinConfig.vocab_size,
        eos_token_id: int = StandinConfig.eos_token_id,
        max_model_len: int = StandinConfig.max_model_len,
        length: str | int = 256,
        ttft_s: float = 0.0,
        tokens_per_s: float = 0.0,
        max_seq_tokens_per_s: float = 0.0,
        seed: int = 0,
        weight_version: str = StandinConfig.weight_version,
        python: str = sys.executable,
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 10.0,
    ) -> None:
        if count < 1:
            raise ValueError(f"count {count}: want at least 1")
        parse_length(str(length))  # a typo fails here, not in the children
        self.count = count
        self.python = python
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.seed = seed
        self._args = [
            "--fork-count", str(count), "--seed", str(seed), "--model", model, "--vocab-size", str(vocab_size),
            "--eos-token-id", str(eos_token_id), "--max-model-len", str(max_model_len), "--length", str(length),
            "--ttft-s", str(ttft_s), "--tokens-per-s", str(tokens_per_s),
            "--max-seq-tokens-per-s", str(max_seq_tokens_per_s), "--weight-version", weight_version,
        ]  # fmt: skip
        self.urls: list[str] = []
        self.pids: list[int] = []
        self.returncodes: list[int | None] = []
        """Each stand-in's exit status once the fleet has stopped (0: it ended cleanly on SIGTERM)."""
        self._parent: asyncio.subprocess.Process | None = None
        self._stderr_dir: tempfile.TemporaryDirectory[str] | None = None

    def _stderr_path(self) -> Path:
        assert self._stderr_dir is not None
        return Path(self._stderr_dir.name) / "standin.stderr"

    def _open_stderr(self) -> IO[bytes]:
        # A file, not a pipe: an unread pipe would block a stand-in that logs much.
        return self._stderr_path().open("wb")

    def _stderr_tail(self) -> str:
        return self._stderr_path().read_bytes()[-3000:].decode(errors="replace")

    async def __aenter__(self) -> StandinFleet:
        self._stderr_dir = tempfile.TemporaryDirectory(prefix="standin-")
        self.returncodes = [None] * self.count
        stderr = self._open_stderr()
        try:
            self._parent = await asyncio.create_subprocess_exec(
                self.python, str(SCRIPT), *self._args,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr,
            )  # fmt: skip
        finally:
            stderr.close()
        try:
            await asyncio.wait_for(self._await_ready(), self.ready_timeout_s)
        except TimeoutError:
            started, tail = sum(1 for url in self.urls if url), self._stderr_tail()
            await self._stop()
            raise RuntimeError(
                f"only {started} of {self.count} stand-ins were ready within {self.ready_timeout_s:g}s; stderr:\n{tail}"
            ) from None
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    async def _await_ready(self) -> None:
        parent = self._parent
        assert parent is not None and parent.stdout is not None
        self.urls, self.pids = [""] * self.count, [0] * self.count
        for _ in range(self.count):
            line = (await parent.stdout.readline()).decode(errors="replace").split()
            if line[:2] == READY_PREFIX.split():
                url, index, pid = line[2], int(line[3]), int(line[4])
                self.urls[index], self.pids[index] = url, pid
                continue
            if line[:2] == EXITED_PREFIX.split():
                index, pid, status = int(line[2]), int(line[3]), int(line[4])
                self.returncodes[index] = status
                why = f"stand-in {index} (pid {pid}, seed {self.seed + index}) exited with status {status}"
            else:
                why = f"the stand-ins' parent (pid {parent.pid}) exited with status {await parent.wait()}"
            tail = self._stderr_tail()
            await self._stop()
            raise RuntimeError(f"{why} before it was ready; stderr:\n{tail}")

    def _record_exits(self, output: bytes) -> None:
        for line in output.decode(errors="replace").splitlines():
            words = line.split()
            if words[:2] == EXITED_PREFIX.split():
                self.returncodes[int(words[2])] = int(words[4])

    async def _stop(self) -> None:
        parent, self._parent = self._parent, None
        if parent is not None:
            assert parent.stdout is not None
            if parent.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    parent.terminate()  # it ends its children, waits for them and reports each status
            try:
                output = await asyncio.wait_for(parent.stdout.read(), self.stop_timeout_s)
                await asyncio.wait_for(parent.wait(), self.stop_timeout_s)
            except TimeoutError:
                for pid in [parent.pid, *self.pids]:
                    if pid:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                output = b""
                await parent.wait()
            self._record_exits(output)
        if self._stderr_dir is not None:
            self._stderr_dir.cleanup()
            self._stderr_dir = None


if __name__ == "__main__":
    sys.exit(main())
