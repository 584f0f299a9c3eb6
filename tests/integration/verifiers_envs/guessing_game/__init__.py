"""A multi-turn verifiers environment, built in code: the environment answers each wrong guess
and the model tries again, up to three turns; the rubric rewards a right guess, and the turns
taken (so the test can tell that the episode went on)."""

import re

import verifiers.v1 as vf

MAX_TURNS = 3


def guess(text: str | None) -> str | None:
    found = re.search(r"<answer>(.*?)</answer>", text or "", re.S)
    return found.group(1).strip() if found else None


class GuessData(vf.TaskData):
    answer: str


class GuessTask(vf.Task[GuessData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(guess(trace.last_reply) == self.data.answer)

    @vf.reward(weight=1.0)
    async def turns_taken(self, trace: vf.Trace) -> float:
        return trace.num_turns / MAX_TURNS


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for answer in ("4", "8"):
            data = GuessData(
                id=f"guess-{answer}", prompt="Guess my number (1-10). Reply <answer>N</answer>.", answer=answer
            )
            yield GuessTask(data, self.config.task)


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            for _ in range(MAX_TURNS - 1):
                if reply.terminated or guess(reply.last_reply) == task.data.answer:
                    break
                reply = await chat.turn("Wrong, try again.")


__all__ = ["GuessEnv", "GuessTaskset"]
