"""The vLLM client asks for token ids through vLLM's token-in, token-out endpoint with
detokenization off, and uses /v1/completions for stop strings and for a server without it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rollout_service.engine.vllm_client import COMPLETIONS_PATH, GENERATE_PATH
from rollout_service.types import SamplingParams
from tests.unit.rollout_service.engine.vllm_http import OK_BODY, make_client, serving


def generated(n: int) -> dict:
    choice = {
        "token_ids": [5, 6],
        "logprobs": {"content": [{"token_id": 5, "logprob": -0.1}, {"token_id": 6, "logprob": -0.2}]},
    }
    return {"choices": [{"index": i, "finish_reason": "length", **choice} for i in reversed(range(n))]}


@pytest.fixture
async def server(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, list[tuple[str, dict]]]]:
    """Serves both endpoints, or (param "no-token-endpoint") answers the token one 403, as
    vLLM does without --enable-scale-out. Records (path, body) of every request."""
    seen: list[tuple[str, dict]] = []
    without = getattr(request, "param", "") == "no-token-endpoint"

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, body))
        if request.path == GENERATE_PATH:
            if without:
                return web.json_response({"error": {"message": "Scale-out endpoints are disabled"}}, status=403)
            return web.json_response(generated(body["sampling_params"]["n"]))
        return web.json_response(OK_BODY)

    app = web.Application()
    app.router.add_post(GENERATE_PATH, answer)
    app.router.add_post(COMPLETIONS_PATH, answer)
    async with serving(app) as url:
        yield url, seen


async def test_samples_come_as_token_ids_without_detokenization(server) -> None:
    url, seen = server
    client = await make_client(url)
    params = SamplingParams(max_tokens=2, seed=7, cache_salt="v3", model="adapter-1")
    completions = await client.generate_many([1, 2, 3], params, 2)
    await client.close()
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in completions] == [([5, 6], [-0.1, -0.2], "length")] * 2
    [(path, body)] = seen
    assert path == GENERATE_PATH and body["token_ids"] == [1, 2, 3] and body["model"] == "adapter-1"
    assert body["cache_salt"] == f"{client.salt_prefix}-v3"
    sampling = body["sampling_params"]
    assert sampling["detokenize"] is False and sampling["logprobs"] == 0 and sampling["n"] == 2
    assert sampling["seed"] == 7 and sampling["top_k"] == 0 and sampling["max_tokens"] == 2


async def test_two_lives_of_the_service_never_share_cached_blocks_of_one_version_label(server) -> None:
    """A restarted service (or another one on the same servers) labels other weights with the
    same version number: its requests must not reuse the blocks the first one cached."""
    url, seen = server
    first, second = await make_client(url), await make_client(url)
    for client in (first, second):
        await client.generate([1], SamplingParams(cache_salt="policy-v1"))
        await client.close()
    salts = [body["cache_salt"] for _, body in seen]
    assert len(set(salts)) == 2 and all(salt.endswith("-policy-v1") for salt in salts)


async def test_stop_strings_need_vllms_text_so_they_go_to_completions(server) -> None:
    url, seen = server
    client = await make_client(url)
    await client.generate([1], SamplingParams(stop=("\n",)))
    await client.close()
    assert [path for path, _ in seen] == [COMPLETIONS_PATH]


@pytest.mark.parametrize("server", ["no-token-endpoint"], indirect=True)
async def test_a_server_without_the_endpoint_is_asked_once_then_gets_completions(server) -> None:
    url, seen = server
    client = await make_client(url)
    first = await client.generate([1], SamplingParams())
    second = await client.generate([1], SamplingParams())
    await client.close()
    assert first.token_ids == second.token_ids == [5, 6] and client.consecutive_failures == 0
    assert [path for path, _ in seen] == [GENERATE_PATH, COMPLETIONS_PATH, COMPLETIONS_PATH]
