"""The bias audit: SMD and KS by hand, and simulated runs whose drops are planted on long, hard
prompts (flagged, once), uniform (quiet) or absent (quiet), with its bounds and warm-up."""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Sequence

import pytest

from rollout_service.delivery.audit import AuditReport, BiasAudit, drift
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup

LOGGER = "rollout_service.delivery.audit"
PROMPTS = [PromptItem(i, [i, 7, 7], f"p{i}") for i in range(40)]
Fate = Callable[[PromptItem, random.Random], str]
"""What becomes of a started group: "cut" in flight, "dropped" after scoring, or "trained"."""


def scored(prompt: PromptItem, lengths: Sequence[int], rewards: Sequence[float], run_id: str = "r") -> ScoredGroup:
    """A group whose samples have ``lengths`` policy tokens (and two masked tool tokens each)."""
    episodes = [EpisodeResult([1] * (n + 2), [-0.1] * (n + 2), [1] * n + [0, 0], "stop", "x", 0, 0) for n in lengths]
    return ScoredGroup("g", run_id, prompt, episodes, list(rewards), {}, {}, [0.0] * len(lengths), 0.1)


def is_long(prompt: PromptItem) -> bool:
    return prompt.index % 2 == 0


def long_or_short(prompt: PromptItem, rng: random.Random) -> ScoredGroup:
    """Even prompts are long and hard, odd ones short and easy; four samples each."""
    if is_long(prompt):
        return scored(prompt, [rng.randint(150, 250) for _ in range(4)], [float(rng.random() < 0.2) for _ in range(4)])
    return scored(prompt, [rng.randint(20, 60) for _ in range(4)], [float(rng.random() < 0.8) for _ in range(4)])


def alike(prompt: PromptItem, rng: random.Random) -> ScoredGroup:
    return scored(prompt, [50] * 4, [0.5] * 4)


def biased(prompt: PromptItem, rng: random.Random) -> str:
    """90% of the long prompts' groups are lost: half cut in flight, the rest dropped stale."""
    if not is_long(prompt):
        return "trained"
    draw = rng.random()
    return "cut" if draw < 0.5 else "dropped" if draw < 0.9 else "trained"


def uniform(prompt: PromptItem, rng: random.Random) -> str:
    """Half the groups are lost, whatever their prompt."""
    draw = rng.random()
    return "cut" if draw < 0.25 else "dropped" if draw < 0.5 else "trained"


def no_drops(prompt: PromptItem, rng: random.Random) -> str:
    return "trained"


class Run:
    """Starts groups of ``prompts`` in turn; scored groups reach the trainer ``lag`` groups later."""

    def __init__(
        self,
        audit: BiasAudit,
        prompts: Sequence[PromptItem] = PROMPTS,
        make: Callable[[PromptItem, random.Random], ScoredGroup] = long_or_short,
        lag: int = 8,
        seed: int = 0,
    ) -> None:
        self.audit, self.prompts, self.make, self.lag = audit, prompts, make, lag
        self.rng = random.Random(seed)
        self.step = 0
        self.pending: deque[tuple[ScoredGroup, str]] = deque()

    def go(self, steps: int, fate: Fate) -> None:
        for _ in range(steps):
            prompt = self.prompts[self.step % len(self.prompts)]
            self.step += 1
            self.audit.started(prompt)
            outcome = fate(prompt, self.rng)
            if outcome == "cut":
                continue
            group = self.make(prompt, self.rng)
            self.audit.scored(group)
            self.pending.append((group, outcome))
            if len(self.pending) > self.lag:
                group, outcome = self.pending.popleft()
                if outcome == "trained":
                    self.audit.trained(group, staleness=self.rng.randint(0, 2))


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def infos(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


def by_feature(report: AuditReport) -> dict[str, tuple[float, float]]:
    return {d.feature: (d.smd, d.ks) for d in report.features}


def test_drift_by_hand() -> None:
    # started 1 2 3 4: mean 2.5, variance 1.25; trained 3 4 5 6: mean 4.5, variance 1.25;
    # pooled sd sqrt(1.25), so smd = 2 / sqrt(1.25) = 4 / sqrt(5).
    # ECDFs over 1..6: started .25 .5 .75 1 1 1, trained 0 0 .25 .5 .75 1: the gap is at most .5.
    smd, ks = drift([1, 2, 3, 4], [3, 4, 5, 6])
    assert smd == pytest.approx(4 / 5**0.5)
    assert ks == pytest.approx(0.5)
    # ties step together: at 1, 2/3 against 1/3; at 2, both 1. Means 4/3 and 5/3, variances 2/9 each:
    # smd = (1/3) / sqrt(2/9) = 1 / sqrt(2).
    smd, ks = drift([1, 1, 2], [2, 1, 2])
    assert (smd, ks) == (pytest.approx(2**-0.5), pytest.approx(1 / 3))
    assert drift([3, 1, 2], [1, 2, 3]) == (0.0, 0.0)
    assert drift([1, 2], [3, 4]) == (pytest.approx(4.0), 1.0)  # means 1.5 and 3.5, sd 0.5
    assert drift([1, 1], [2, 2]) == (0.0, 1.0)  # no spread: no SMD, but KS still sees it
    assert drift([], [1.0]) == (0.0, 0.0)


def test_a_profile_is_the_mean_over_samples_of_policy_tokens_and_rewards() -> None:
    audit = BiasAudit("r")
    prompt = PROMPTS[0]
    audit.started(prompt)
    assert audit.report().unprofiled_started == 1
    audit.scored(scored(prompt, [2, 4], [0.0, 1.0]))
    audit.scored(scored(prompt, [6], [1.0]))  # per sample: (2 + 4 + 6) / 3, not the groups' (3 + 6) / 2
    report = audit.report()
    length, reward = report.features
    assert (length.started_mean, reward.started_mean) == (pytest.approx(4.0), pytest.approx(2 / 3))
    assert (length.started_count, length.trained_count, report.unprofiled_started) == (1, 0, 0)
    assert report.prompt_coverage == 0.0


def test_drops_planted_on_long_hard_prompts_are_flagged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("run-bias")
    Run(audit).go(40 * 80, biased)
    report = audit.report()
    # trained a tenth as often, some long prompts miss the trained window, which uniform drops would not do
    assert set(report.flagged) == {"completion_length", "reward", "prompt_coverage"}
    assert report.prompt_coverage < 0.98 < report.uniform_coverage
    drifts = by_feature(report)
    assert drifts["completion_length"][0] < -1.0  # trained prompts are shorter
    assert drifts["reward"][0] > 1.0  # and easier
    assert drifts["completion_length"][1] > 0.3
    length = report.features[0]
    assert length.trained_mean < length.started_mean
    assert length.started_count == 512 - report.unprofiled_started
    assert report.prompt_coverage > 0.8  # the long prompts still get trained now and then
    messages = warnings(caplog)
    assert len(messages) == 3, messages
    assert sum("completion_length" in m for m in messages) == 1
    assert sum(" reward " in m for m in messages) == 1
    assert sum("prompts started in the last window were trained, where uniform drops" in m for m in messages) == 1
    assert all("run-bias" in m and "a larger max_staleness" in m for m in messages)
    assert infos(caplog) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_drops_stay_quiet(caplog: pytest.LogCaptureFixture, seed: int) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("run-uniform")
    run = Run(audit, seed=seed)
    largest = 0.0
    for _ in range(150):
        run.go(40, uniform)
        report = audit.report()
        assert report.flagged == ()
        if report.features[0].trained_count >= audit.min_groups:
            largest = max(largest, *(abs(d.smd) for d in report.features))
    assert 0.0 < largest < 0.15  # well under the 0.25 threshold
    assert report.features[0].trained_count == 512
    assert report.prompt_coverage > 0.9
    assert warnings(caplog) == []


def test_no_drops_stay_quiet_with_no_drift(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("run-paced")
    Run(audit).go(40 * 40, no_drops)
    report = audit.report()
    assert report.flagged == ()
    for d in report.features:
        assert abs(d.smd) < 0.05 and d.ks < 0.05, d
    assert report.prompt_coverage == 1.0
    assert warnings(caplog) == []


def test_no_flag_before_both_windows_hold_min_groups(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("r", min_groups=64, report_every=1)
    run = Run(audit, lag=0)
    run.go(100, biased)  # about 55 trained
    report = audit.report()
    length = report.features[0]
    assert length.trained_count < 64 <= length.started_count
    assert length.smd < -0.5  # biased already, but too few to say
    assert report.flagged == ()
    assert warnings(caplog) == []
    run.go(40, biased)
    assert audit.report().features[0].trained_count >= 64
    assert "completion_length" in audit.report().flagged
    assert len(warnings(caplog)) == 2


def test_windows_and_profiles_stay_bounded() -> None:
    audit = BiasAudit("r", window_groups=8, profiles_kept=5, min_groups=1, report_every=1)
    kept = PromptItem(-1, [-1], "kept")
    audit.scored(scored(kept, [10], [1.0]))
    for i in range(100):
        prompt = PromptItem(i, [i], f"p{i}")
        audit.started(kept)  # a prompt still being started keeps its profile
        audit.started(prompt)
        group = scored(prompt, [i + 1], [0.0])
        audit.scored(group)
        audit.trained(group, staleness=0)
        assert audit.profiles_held <= 5
        report = audit.report()
        assert report.features[0].started_count + report.unprofiled_started <= 8
        assert report.features[0].trained_count <= 8
    report = audit.report()
    # started: kept, p96, kept, p97, kept, p98, kept, p99; profiles: kept and p96..p99
    assert (report.features[0].started_count, report.unprofiled_started, report.started_prompts) == (8, 0, 5)
    assert report.features[0].trained_count == 4  # p92..p99 trained, p92..p95 forgotten
    assert audit.profiles_held == 5


def test_staleness_of_the_trained_window() -> None:
    audit = BiasAudit("r", window_groups=3)
    assert (audit.report().staleness_mean, audit.report().staleness_max) == (0.0, 0)
    group = scored(PROMPTS[0], [5], [1.0])
    for staleness in (0, 4, 1, 2):
        audit.trained(group, staleness)
    report = audit.report()
    assert (report.staleness_mean, report.staleness_max) == (pytest.approx(7 / 3), 4)  # 4, 1, 2
    audit.trained(group, 0)
    audit.trained(group, 0)
    report = audit.report()
    assert (report.staleness_mean, report.staleness_max) == (pytest.approx(2 / 3), 2)  # 2, 0, 0


def test_a_flag_clears_once_the_bias_stops(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("run-heal")
    run = Run(audit)
    run.go(40 * 60, biased)
    assert set(audit.report().flagged) == {"completion_length", "reward", "prompt_coverage"}
    run.go(40 * 60, no_drops)
    assert audit.report().flagged == ()
    cleared = infos(caplog)
    assert len(cleared) == 3, cleared
    assert sum("completion_length" in m for m in cleared) == 1
    assert sum(m.endswith(" reward") for m in cleared) == 1
    assert sum(m.endswith(" prompt_coverage") for m in cleared) == 1
    assert all("run-heal" in m for m in cleared)
    assert len(warnings(caplog)) == 3  # no flapping on the way down


def test_prompts_never_trained_lower_coverage(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("run-coverage")
    # every prompt alike, so no feature drifts; a quarter of them always finish, then are dropped stale
    Run(audit, make=alike).go(40 * 60, lambda prompt, rng: "dropped" if prompt.index % 4 == 0 else "trained")
    report = audit.report()
    assert report.prompt_coverage == pytest.approx(0.75)
    assert report.flagged == ("prompt_coverage",)
    assert by_feature(report) == {"completion_length": (0.0, 0.0), "reward": (0.0, 0.0)}
    messages = warnings(caplog)
    assert len(messages) == 1 and "run-coverage" in messages[0] and "75%" in messages[0]


def test_coverage_is_not_judged_when_prompts_do_not_repeat(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    audit = BiasAudit("run-dataset")
    many = [PromptItem(i, [i, 7, 7], f"p{i}") for i in range(2000)]  # far more prompts than the window
    run = Run(audit, prompts=many, seed=3)
    run.go(6000, uniform)  # past an epoch, so prompts cut the first time have profiles
    report = audit.report()
    assert report.prompt_coverage < 0.9  # just the share of groups trained
    assert report.flagged == ()
    assert warnings(caplog) == []


def test_a_flag_holds_until_the_drift_is_well_below_the_threshold(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    short, long = scored(PROMPTS[1], [10], [0.5]), scored(PROMPTS[2], [20], [0.5])

    def audit_training(*shares_of_long: int) -> BiasAudit:
        """Started half short, half long; then a full trained window per share (in %) of long groups."""
        audit = BiasAudit("run-hold", window_groups=100, min_groups=10, report_every=100)
        for group in (short, long):
            audit.scored(group)
            for _ in range(50):
                audit.started(group.prompt)
        for share in shares_of_long:
            for i in range(100):
                audit.trained(long if i < share else short, staleness=0)
        return audit

    # share q of long in trained: smd = (q - 0.5) / sqrt((0.25 + q(1 - q)) / 2) in units of the 10-token gap
    audit = audit_training(30)  # smd -0.2 / sqrt(0.23) = -0.42
    assert audit.report().flagged == ("completion_length",)
    audit = audit_training(30, 42)  # smd -0.08 / sqrt(0.2468) = -0.16: under 0.25, over half of it
    assert audit.report().features[0].smd == pytest.approx(-0.08 / 0.2468**0.5)
    assert audit.report().flagged == ("completion_length",)
    assert audit_training(42).report().flagged == ()  # the same drift, never flagged: not raised by it
    audit = audit_training(30, 42, 50)
    assert audit.report().flagged == ()
    run_hold = [r.getMessage() for r in caplog.records if "run-hold" in r.getMessage()]
    assert sum("no longer drift" in m for m in run_hold) == 1  # the last audit only: it cleared at 50%
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 3  # once for each audit that saw 30%
