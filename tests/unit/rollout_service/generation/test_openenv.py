"""What the OpenEnv adapter decides before it talks to a server: a model turn that is no JSON
action is answered, not sent; a prompt's reset column must be a JSON object. The sessions
themselves, against a real OpenEnv server: tests/integration/test_openenv.py."""

from __future__ import annotations

import pytest

from rollout_service.config import OpenEnvSettings
from rollout_service.generation.openenv import OpenEnvError, OpenEnvServer
from rollout_service.types import PromptItem

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("turn", "says"), [("guess 50", "Expecting value"), ("[50]", "it is not an object")])
async def test_a_turn_that_is_no_json_object_is_answered_and_the_episode_goes_on(turn: str, says: str) -> None:
    server = OpenEnvServer("guess", OpenEnvSettings(url="http://127.0.0.1:9", action="json"))
    step = await server.episode().step(turn)
    assert step.observation is not None and "one JSON object" in step.observation and says in step.observation
    assert (step.reward, step.done) == (0.0, False)
    await server.close()


async def test_a_reset_column_that_is_no_json_object_fails_the_episode_before_any_session() -> None:
    server = OpenEnvServer("guess", OpenEnvSettings(url="http://127.0.0.1:9"))
    prompt = PromptItem(index=0, token_ids=[1], text="go", metadata={"openenv_reset": "[7]"})
    with pytest.raises(OpenEnvError, match="openenv_reset column must be a JSON object"):
        await server.episode().reset(prompt)
    await server.close()


def test_the_websocket_address_follows_the_servers_scheme() -> None:
    assert OpenEnvServer("a", OpenEnvSettings(url="https://env.example:8443/")).ws_url == "wss://env.example:8443/ws"
    assert OpenEnvServer("b", OpenEnvSettings(url="http://127.0.0.1:8001")).ws_url == "ws://127.0.0.1:8001/ws"
