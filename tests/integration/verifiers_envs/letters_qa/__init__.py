"""A single-turn verifiers environment, built in code: write one letter; the rubric scores its
share of the reply (so even a tiny model earns varied rewards)."""

import verifiers.v1 as vf


class LetterData(vf.TaskData):
    letter: str


class LetterTask(vf.Task[LetterData]):
    @vf.reward(weight=1.0)
    async def letter_share(self, trace: vf.Trace) -> float:
        text = "".join((trace.last_reply or "").split())
        return text.count(self.data.letter) / len(text) if text else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class LettersConfig(vf.TasksetConfig):
    letters: str = "ae"


class LettersTaskset(vf.Taskset[LetterTask, LettersConfig]):
    def load(self):
        for letter in self.config.letters:
            data = LetterData(id=f"letter-{letter}", prompt=f"Write the letter {letter} many times.", letter=letter)
            yield LetterTask(data, self.config.task)


__all__ = ["LettersTaskset"]
