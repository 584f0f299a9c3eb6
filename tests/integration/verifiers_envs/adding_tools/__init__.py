"""A verifiers tool environment, built in code: a sum, an ``add`` tool, and a rubric that checks
the answer and rewards a reply in the asked form."""

import re

import verifiers.v1 as vf

from adding_tools.tools import AddingToolset


class SumData(vf.TaskData):
    answer: str


class SumTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class SumTask(vf.Task[SumData, vf.State, SumTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumTaskConfig) -> list[vf.Toolset]:
        return [AddingToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = re.search(r"<answer>(.*?)</answer>", trace.last_reply or "", re.S)
        return float(bool(found) and found.group(1).strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def says_something(self, trace: vf.Trace) -> float:
        return float(bool((trace.last_reply or "").strip()))


class SumsConfig(vf.TasksetConfig):
    task: SumTaskConfig = SumTaskConfig()


class SumsTaskset(vf.Taskset[SumTask, SumsConfig]):
    def load(self):
        for a, b in ((2, 2), (17, 25)):
            data = SumData(id=f"sum-{a}-{b}", prompt=f"Use the add tool: what is {a}+{b}?", answer=str(a + b))
            yield SumTask(data, self.config.task)


__all__ = ["SumsTaskset"]
