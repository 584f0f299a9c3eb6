"""The vLLM HTTP client against a local aiohttp server, and the pool's routing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from rollout_common.ports import free_port
from rollout_service.config import EngineSettings
from rollout_service.engine import vllm_client
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.protocol import episode_affinity
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.errors import EngineError, RequestRejected
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import SamplingParams
from tests.unit.rollout_service.engine.vllm_http import OK_BODY, make_client, serving


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted server fails on cue: retries need not wait the production backoff."""
    monkeypatch.setattr(vllm_client, "BACKOFF_BASE_S", 0.01)


@pytest.fixture
async def scripted_server() -> AsyncIterator[tuple[str, list[int], list[dict]]]:
    """Answers /v1/completions with the statuses queued in ``statuses`` (then 200)."""
    statuses: list[int] = []
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        status = statuses.pop(0) if statuses else 200
        if status != 200:
            return web.Response(status=status, text=f"scripted {status}")
        return web.json_response(OK_BODY)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        yield url, statuses, bodies


async def test_request_body_is_token_ids_with_sampled_logprobs(scripted_server) -> None:
    url, _, bodies = scripted_server
    client = await make_client(url)
    completion = await client.generate([1, 2, 3], SamplingParams(max_tokens=2, seed=7, stop=("x",)))
    await client.close()
    assert completion.token_ids == [5, 6] and completion.logprobs == [-0.1, -0.2]
    assert completion.finish_reason == "length"
    body = bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["return_token_ids"] is True and body["logprobs"] == 0
    assert body["seed"] == 7 and body["stop"] == ["x"] and body["top_k"] == -1


async def test_5xx_is_retried_then_succeeds(scripted_server) -> None:
    url, statuses, bodies = scripted_server
    statuses.extend([503, 500])
    client = await make_client(url, retries=2)
    assert (await client.generate([1], SamplingParams())).token_ids == [5, 6]
    await client.close()
    assert len(bodies) == 3
    assert client.consecutive_failures == 0


async def test_retries_are_bounded(scripted_server) -> None:
    url, statuses, bodies = scripted_server
    statuses.extend([503, 503, 503])
    client = await make_client(url, retries=2)
    with pytest.raises(EngineError, match="after 3 attempts"):
        await client.generate([1], SamplingParams())
    await client.close()
    assert len(bodies) == 3
    assert client.consecutive_failures == 1


VLLM_REFUSAL = {"error": {"message": "temperature must be in [0, 2], got 5.0.", "type": "BadRequestError", "code": 400}}


@pytest.mark.parametrize("status", [400, 413, 422])
async def test_a_4xx_fails_its_request_at_once_with_vllms_message_and_the_server_stays_healthy(status: int) -> None:
    """Retrying a refusal made ~400 requests a second, and counting it against the server
    made the pool (and the service's health) flap to no server answering."""
    attempts: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        attempts.append(await request.json())
        return web.json_response(VLLM_REFUSAL, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        client = await make_client(url, retries=3)
        pool = EnginePool([client], probe_interval_s=60)
        async with asyncio.timeout(10):
            with pytest.raises(RequestRejected) as info:
                await pool.generate([1], SamplingParams(stop=("x",)))
            await pool.probe()
        await client.close()
    assert len(attempts) == 1
    assert str(info.value) == f"{url}: vLLM refused the request: HTTP {status}: temperature must be in [0, 2], got 5.0."
    assert client.consecutive_failures == 0 and pool.usable
    failures = client.metrics.registry.get_sample_value("rollout_engine_request_failures_total", {"server": url})
    assert failures == 1


@pytest.mark.parametrize("status", [408, 429])
async def test_408_and_429_are_retried(scripted_server, status: int) -> None:
    url, statuses, bodies = scripted_server
    statuses.append(status)
    client = await make_client(url, retries=2)
    assert (await client.generate([1], SamplingParams(stop=("x",)))).token_ids == [5, 6]
    await client.close()
    assert len(bodies) == 2 and client.consecutive_failures == 0


async def test_greedy_groups_are_one_sample_copied_as_vllm_refuses_n_above_1_when_greedy(scripted_server) -> None:
    url, _, bodies = scripted_server
    client = await make_client(url)
    completions = await client.generate_many([1], SamplingParams(temperature=0.0, stop=("x",)), 3)
    await client.close()
    assert [c.token_ids for c in completions] == [[5, 6]] * 3
    assert len(bodies) == 1 and "n" not in bodies[0]


@pytest.mark.parametrize(
    ("answer", "message"),
    [(b"<html>proxy error</html>", "not JSON"), (b"[1, 2]", "not vLLM.s answer")],
)
async def test_an_answer_that_is_not_a_json_object_fails_the_request_with_what_came(answer, message) -> None:
    async def completions(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        client = await make_client(url)
        with pytest.raises(EngineError, match=f"/v1/completions answered with .*{message}"):
            await asyncio.wait_for(client.generate([1], SamplingParams()), 10)
        await client.close()
    assert client.consecutive_failures == 1


@pytest.fixture
async def hung_server() -> AsyncIterator[tuple[str, asyncio.Event, asyncio.Event]]:
    """Accepts requests and answers nothing (completions nor /health) until ``release`` is
    set; ``arrived`` is set once a completion request reached it."""
    release, arrived = asyncio.Event(), asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        if request.path == "/v1/completions":
            arrived.set()
        await release.wait()
        return web.json_response(OK_BODY) if request.path == "/v1/completions" else web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", hang)
    app.router.add_get("/health", hang)
    async with serving(app) as url:
        yield url, release, arrived
        release.set()


async def test_a_request_fails_at_its_deadline_however_long_the_read_timeout(hung_server) -> None:
    url, _, _ = hung_server
    client = await make_client(url, retries=3, read_timeout_s=300, request_deadline_s=0.3)
    async with asyncio.timeout(10):
        with pytest.raises(EngineError, match=r"no answer within 0.3s \(engine.request_deadline_s\)"):
            await client.generate([1], SamplingParams())
    await client.close()
    assert client.inflight == 0 and client.consecutive_failures == 1


async def test_a_busy_server_that_stops_answering_health_is_given_up_and_probed_back(hung_server) -> None:
    url, release, arrived = hung_server
    client = await make_client(url, request_deadline_s=300)
    pool = EnginePool([client], probe_interval_s=60, health_timeout_s=0.2)
    request = asyncio.ensure_future(client.generate([1], SamplingParams()))
    async with asyncio.timeout(10):
        await arrived.wait()
        await pool.probe()  # /health does not answer within 0.2s: the server is hung
        with pytest.raises(EngineError, match=r"request abandoned: the server did not answer /health within 0\.2s"):
            await request
        assert client.inflight == 0 and client.consecutive_failures > 0 and not pool.usable
        release.set()  # it answers again
        await pool.probe()
        assert client.consecutive_failures == 0 and pool.usable
        assert (await client.generate([1], SamplingParams())).token_ids == [5, 6]  # a later request is unaffected
    await client.close()


def pool_of(loads: list[int], failures: list[int] | None = None) -> EnginePool:
    clients = []
    for i, load in enumerate(loads):
        client = VLLMServerClient(f"http://s{i}", "m", EngineSettings(urls=["http://x"]), ServiceMetrics(), 4)
        client.inflight = load
        client.consecutive_failures = (failures or [0] * len(loads))[i]
        clients.append(client)
    return EnginePool(clients)


def test_least_loaded_server_is_picked() -> None:
    pool = pool_of([3, 1, 2])
    assert pool.pick().base_url == "http://s1"


def test_equally_loaded_servers_take_turns() -> None:
    """Light traffic (one group at a time) spreads over the servers, not all to the first."""
    pool = pool_of([0, 0, 0])
    assert [pool.pick(f"g{i}").base_url for i in range(4)] == ["http://s0", "http://s1", "http://s2", "http://s0"]
    assert pool.pick("g2").base_url == "http://s2"  # a group's later requests still stick (s1 was picked longer ago)


def test_group_members_stick_to_their_server_within_the_slack() -> None:
    pool = pool_of([0, 0])
    first = pool.pick("g")
    first.inflight += pool.sticky_slack
    assert pool.pick("g") is first  # prefix cache beats a small imbalance
    first.inflight += 1
    assert pool.pick("g") is not first  # ... but not a large one


def test_episodes_start_on_their_groups_server_stay_on_their_own_and_let_go_when_they_end() -> None:
    pool = pool_of([0, 0, 0])
    group = pool.pick("g")
    episodes = [pool.pick(episode_affinity("g", i)) for i in range(2)]
    assert episodes == [group, group]  # the prompt's blocks are cached there
    group.inflight += 2
    third = pool.pick(episode_affinity("g", 2))
    assert third is group  # within the slack
    group.inflight += 1
    moved = pool.pick(episode_affinity("g", 3))
    assert moved is not group  # too busy for a new episode: it starts elsewhere ...
    assert pool.pick(episode_affinity("g", 3)) is moved  # ... and its later turns follow it
    assert pool.pick(episode_affinity("g", 0)) is not group  # an episode moves once its server is too busy
    group.inflight = 0
    pool.forget(episode_affinity("g", 3))
    pool.forget("g")
    assert pool._affinity.keys() == {episode_affinity("g", 0), episode_affinity("g", 1), episode_affinity("g", 2)}


def test_a_request_without_a_key_goes_to_the_least_loaded_and_sticks_nowhere() -> None:
    pool = pool_of([0, 0])
    first = pool.pick(None)
    first.inflight += 1
    assert pool.pick(None) is not first and not pool._affinity


def test_failing_servers_are_used_only_when_nothing_else_is_left() -> None:
    assert pool_of([0, 5], failures=[1, 0]).pick().base_url == "http://s1"
    assert pool_of([0, 5], failures=[1, 1]).pick().base_url == "http://s0"


async def test_held_servers_take_no_requests_and_with_all_held_requests_wait_for_a_release(scripted_server) -> None:
    url, _, bodies = scripted_server
    client = await make_client(url)
    pool = EnginePool([client])
    try:
        pool.hold(url + "/", "restarting")  # URLs compare without their trailing slash
        generating = asyncio.ensure_future(pool.generate([1], SamplingParams(max_tokens=2)))
        done, _ = await asyncio.wait({generating}, timeout=0.2)  # bounded: it must still be waiting
        assert not done and not bodies
        pool.release(url)
        completion = await asyncio.wait_for(generating, 10)
        assert completion.token_ids == [5, 6] and len(bodies) == 1
    finally:
        await client.close()


async def test_a_held_server_is_not_routed_to_while_another_is_free() -> None:
    pool = pool_of([0, 5])
    pool.hold("http://s0", "restarting")
    free = await asyncio.wait_for(pool.routable(), 1)
    assert [c.base_url for c in free] == ["http://s1"]
    assert pool.pick(servers=free).base_url == "http://s1"  # though s0 is the less loaded
    pool.release("http://s0")
    assert pool.pick(servers=await pool.routable()).base_url == "http://s0"


async def test_a_stuck_server_is_held_and_the_pool_is_unusable_while_no_other_can_generate() -> None:
    """Health follows ``usable``: a server whose engine is busy with an aborted update's call
    cannot generate, and with every server stuck the service must not say SERVING."""
    pool = pool_of([0, 0])
    told: list[bool] = []
    pool.on_usable = told.append
    pool.set_stuck("http://s0", "joining an aborted update")
    assert [c.base_url for c in await asyncio.wait_for(pool.routable(), 1)] == ["http://s1"]
    assert pool.usable and told == []  # s1 still generates
    pool.set_stuck("http://s1", "joining an aborted update")
    assert not pool.usable and told == [False]
    waiting = asyncio.ensure_future(pool.routable())
    done, _ = await asyncio.wait({waiting}, timeout=0.05)
    assert not done  # requests wait for a free server instead of failing
    pool.set_stuck("http://s1", None)
    assert [c.base_url for c in await asyncio.wait_for(waiting, 1)] == ["http://s1"]
    assert pool.usable and told == [False, True]


async def test_a_pool_started_before_its_server_is_unusable_until_the_server_answers() -> None:
    """The service's gRPC health follows ``usable``: started before vLLM (Kubernetes starts
    pods in any order), it says NOT_SERVING until a server answers, not SERVING on a guess."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    client = VLLMServerClient(url, "m", EngineSettings(urls=[url]), ServiceMetrics(), max_connections=4)
    pool = EnginePool([client], probe_interval_s=3600)  # probed by hand below
    told: list[bool] = []
    pool.on_usable = told.append
    await pool.start()
    try:
        assert not pool.usable and client.consecutive_failures == 1

        async def health(request: web.Request) -> web.Response:
            return web.Response()

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            await pool.probe()  # the server answers now
            assert pool.usable and told == [True] and client.consecutive_failures == 0
        finally:
            await runner.cleanup()
    finally:
        await pool.close()
