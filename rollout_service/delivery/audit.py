"""The bias audit of one run: do the groups it trains look like the groups it starts?

Dropping groups is not neutral: groups cut for staleness are the slow ones, so a run that drops
many trains on its fast, easy prompts. Over a sliding window the audit compares what was started
with what was trained, feature by feature, and warns when they drift apart.

Groups cut in flight never return their completions, so features are kept per prompt (a
profile), learned whenever a group of the prompt finishes generating, and both windows look
their prompts up in the same current profiles: a prompt whose groups are usually cut still has
a profile from the times it finished, and its absence from the trained window shows.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rollout_service.types import PromptItem, ScoredGroup

logger = logging.getLogger(__name__)

PromptKey = int
"""``hash(tuple(prompt.token_ids))``: the prompt as the engine sees it."""
FEATURES = ("completion_length", "reward")
"""Per prompt: mean completion tokens (the mask's sum) per sample, and mean reward per sample."""
COVERAGE = "prompt_coverage"
CLEAR_FRACTION = 0.5
"""A flag clears only once its gap (|smd|, or 1 - coverage) falls below this share of its
threshold's, so a drift near the threshold warns once rather than at every report."""
COVERAGE_MIN_REPEATS = 4.0
"""Coverage is judged only when both windows hold each started prompt this many times on average:
with a prompt set much larger than the window, a prompt is missing from the trained window
because it was started too recently to be trained yet, not because its groups were dropped."""
COVERAGE_SIGMAS = 3.0
"""Coverage is flagged when more prompts are missing from the trained window than uniform drops
would leave by this many standard deviations, and by more than one prompt."""
ADVICE = "drops are biased toward fast prompts: a larger max_staleness lets slow groups finish"


def prompt_key(prompt: PromptItem) -> PromptKey:
    return hash(tuple(prompt.token_ids))


@dataclass
class PromptProfile:
    """Running means over every sample of the prompt's scored groups, so long prompts have long profiles."""

    samples: int = 0
    completion_length: float = 0.0
    reward: float = 0.0

    def add(self, group: ScoredGroup) -> None:
        for episode, reward in zip(group.episodes, group.rewards, strict=False):
            self.samples += 1
            self.completion_length += (episode.policy_tokens - self.completion_length) / self.samples
            self.reward += (reward - self.reward) / self.samples


@dataclass(frozen=True)
class FeatureDrift:
    feature: str
    started_mean: float
    trained_mean: float
    smd: float
    """Standardized mean difference, (trained - started) / pooled sd; 0.0 when the sd is 0."""
    ks: float
    """Two-sample Kolmogorov-Smirnov statistic, in [0, 1]."""
    started_count: int
    """Started window entries whose prompt has a profile."""
    trained_count: int


@dataclass(frozen=True)
class AuditReport:
    features: tuple[FeatureDrift, ...]
    prompt_coverage: float
    """Share of the distinct prompts started in the window that are in the trained window; 1.0 when
    none was started."""
    uniform_coverage: float
    """The coverage uniform drops would leave: the expected share of those prompts in a trained
    window of its size drawn like the started window."""
    started_prompts: int
    """Distinct prompts started in the window: coverage means little unless they repeat."""
    unprofiled_started: int
    """Started window entries whose prompt has no profile (none of its groups finished yet)."""
    staleness_mean: float
    """Of the trained groups in the window: versions behind when trained."""
    staleness_max: int
    flagged: tuple[str, ...]
    """Features that drift (and ``prompt_coverage`` when too low); empty until both windows hold
    ``min_groups`` profiled entries."""


def drift(started: Sequence[float], trained: Sequence[float]) -> tuple[float, float]:
    """(SMD, KS) of ``trained`` against ``started``; the SMD pools the two population variances.
    (0.0, 0.0) when either is empty."""
    if not started or not trained:
        return 0.0, 0.0
    started_mean, trained_mean = _mean(started), _mean(trained)
    pooled_sd = math.sqrt((_variance(started, started_mean) + _variance(trained, trained_mean)) / 2)
    smd = (trained_mean - started_mean) / pooled_sd if pooled_sd > 0 else 0.0
    return smd, _ks(sorted(started), sorted(trained))


def missing_by_chance(started: Counter[PromptKey], trained_groups: int) -> tuple[float, float]:
    """Mean and variance of the number of ``started`` prompts missing from a trained window of
    ``trained_groups`` drawn like the started one: a prompt started k of S times is missing with
    probability exp(-trained_groups k / S), its Poisson chance of no draw."""
    total = sum(started.values())
    chances = [math.exp(-trained_groups * count / total) for count in started.values()]
    return sum(chances), sum(p * (1.0 - p) for p in chances)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _variance(values: Sequence[float], mean: float) -> float:
    return sum((value - mean) ** 2 for value in values) / len(values)


def _ks(a: list[float], b: list[float]) -> float:
    """max |ECDF_a - ECDF_b| over the pooled values, both sorted; ties step together."""
    i = j = 0
    largest = 0.0
    while i < len(a) and j < len(b):
        value = min(a[i], b[j])
        while i < len(a) and a[i] == value:
            i += 1
        while j < len(b) and b[j] == value:
            j += 1
        largest = max(largest, abs(i / len(a) - j / len(b)))
    return largest  # past the shorter one the gap only closes


class BiasAudit:
    """One run's audit: O(1) per event, bounded memory; ``report`` sorts the windows."""

    def __init__(
        self,
        run_id: str,
        window_groups: int = 512,
        smd_threshold: float = 0.25,
        min_groups: int = 256,
        profiles_kept: int = 65536,
        report_every: int = 16,
    ) -> None:
        """``min_groups`` 256: with fewer, chance alone moves the SMD by its standard error, about
        sqrt(2/n), to near the 0.25 threshold."""
        self.run_id = run_id
        self.smd_threshold = smd_threshold
        self.min_groups = min_groups
        self.profiles_kept = profiles_kept
        self.report_every = report_every
        self.window_groups = window_groups
        self._started: deque[PromptKey] = deque(maxlen=window_groups)
        self._trained: deque[tuple[PromptKey, int]] = deque(maxlen=window_groups)
        self._profiles: OrderedDict[PromptKey, PromptProfile] = OrderedDict()
        self._flagged: frozenset[str] = frozenset()
        """Flags as of the last periodic check: what was warned about and not cleared yet."""
        self._quiet: dict[str, int] = {}
        """Per flag held: trained groups since its drift was last over the clear level. A flag clears
        after a whole window of them, so a count that dips to zero now and then (a prompt trained
        rarely is in one window and not the next) does not warn again and again."""
        self._since_check = 0

    @property
    def profiles_held(self) -> int:
        return len(self._profiles)

    def started(self, prompt: PromptItem) -> None:
        """A group of ``prompt`` started generating."""
        key = prompt_key(prompt)
        self._started.append(key)
        if key in self._profiles:
            self._profiles.move_to_end(key)  # a prompt still being started keeps its profile

    def scored(self, group: ScoredGroup) -> None:
        """A group finished generating: its samples join its prompt's profile."""
        self._learn(prompt_key(group.prompt), group)

    def trained(self, group: ScoredGroup, staleness: int) -> None:
        """A consumer acked ``group`` trained, ``staleness`` versions behind; every ``report_every``
        of these the flags are checked and their changes logged."""
        key = prompt_key(group.prompt)
        self._trained.append((key, staleness))
        if key in self._profiles:
            self._profiles.move_to_end(key)
        else:
            self._learn(key, group)  # restored from the state store, or generated elsewhere: never scored here
        self._since_check += 1
        if self._since_check >= self.report_every:
            self._since_check = 0
            self._check()

    def report(self) -> AuditReport:
        """The windows now; a flag raised earlier holds until it clears at a check."""
        report = self._judge()
        held = tuple(name for name in sorted(self._flagged) if name not in report.flagged)
        return replace(report, flagged=report.flagged + held) if held else report

    def _judge(self) -> AuditReport:
        started = [self._profiles.get(key) for key in self._started]
        started_profiles = [profile for profile in started if profile is not None]
        trained_profiles = [profile for key, _ in self._trained if (profile := self._profiles.get(key)) is not None]
        features = tuple(_feature_drift(feature, started_profiles, trained_profiles) for feature in FEATURES)
        started_prompts = Counter(self._started)  # unprofiled ones too: a prompt whose groups never finish
        trained_prompts = {key for key, _ in self._trained}
        missing = sum(1 for key in started_prompts if key not in trained_prompts)
        expected, variance = missing_by_chance(started_prompts, len(self._trained))
        prompts = max(len(started_prompts), 1)
        coverage, uniform = 1.0 - missing / prompts, 1.0 - expected / prompts
        staleness = [staleness for _, staleness in self._trained]
        flagged: list[str] = []
        profiled = min(len(started_profiles), len(trained_profiles))
        if profiled >= max(self.min_groups, 1):
            flagged = [d.feature for d in features if self._drifts(d.feature, d.smd)]
            repeats = min(len(self._started), len(self._trained)) / len(started_prompts)
            if repeats >= COVERAGE_MIN_REPEATS and self._undercovered(missing - expected, variance):
                flagged.append(COVERAGE)
        return AuditReport(
            features=features,
            prompt_coverage=coverage,
            uniform_coverage=uniform,
            started_prompts=len(started_prompts),
            unprofiled_started=len(started) - len(started_profiles),
            staleness_mean=_mean(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            flagged=tuple(flagged),
        )

    def _drifts(self, feature: str, smd: float) -> bool:
        """|smd| reaches the threshold, or keeps an earlier flag until it falls well below it."""
        return abs(smd) >= self.smd_threshold * (CLEAR_FRACTION if feature in self._flagged else 1.0)

    def _undercovered(self, excess: float, variance: float) -> bool:
        """More prompts are missing than chance explains (``excess`` over uniform drops' mean), or an
        earlier flag holds until the excess is well below that margin."""
        margin = COVERAGE_SIGMAS * math.sqrt(variance) + 1.0
        return excess > margin * (CLEAR_FRACTION if COVERAGE in self._flagged else 1.0)

    def _learn(self, key: PromptKey, group: ScoredGroup) -> None:
        if not group.episodes:
            return
        profile = self._profiles.get(key)
        if profile is None:
            profile = self._profiles[key] = PromptProfile()
            if len(self._profiles) > self.profiles_kept:
                self._profiles.popitem(last=False)
        else:
            self._profiles.move_to_end(key)
        profile.add(group)

    def _check(self) -> None:
        report = self._judge()
        raised = frozenset(report.flagged)
        for name in raised:
            self._quiet.pop(name, None)
        for name in self._flagged - raised:
            self._quiet[name] = self._quiet.get(name, 0) + self.report_every
        cleared = {name for name in self._flagged - raised if self._quiet[name] >= self.window_groups}
        for name in cleared:
            del self._quiet[name]
        flagged = (self._flagged | raised) - cleared
        drifts = {d.feature: d for d in report.features}
        for name in sorted(flagged - self._flagged):
            if name == COVERAGE:
                logger.warning(
                    "run %s: only %.0f%% of the prompts started in the last window were trained, where uniform "
                    "drops would leave %.0f%%: %s",
                    self.run_id, 100 * report.prompt_coverage, 100 * report.uniform_coverage, ADVICE,
                )  # fmt: skip
            else:
                d = drifts[name]
                logger.warning(
                    "run %s: trained groups drift from started ones in %s (started mean %.4g, trained mean %.4g, "
                    "smd %+.2f, ks %.2f): %s",
                    self.run_id, name, d.started_mean, d.trained_mean, d.smd, d.ks, ADVICE,
                )  # fmt: skip
        for name in sorted(self._flagged - flagged):
            logger.info("run %s: trained groups no longer drift from started ones in %s", self.run_id, name)
        self._flagged = flagged


def _feature_drift(feature: str, started: list[PromptProfile], trained: list[PromptProfile]) -> FeatureDrift:
    started_values = [getattr(profile, feature) for profile in started]
    trained_values = [getattr(profile, feature) for profile in trained]
    smd, ks = drift(started_values, trained_values)
    return FeatureDrift(
        feature=feature,
        started_mean=_mean(started_values) if started_values else 0.0,
        trained_mean=_mean(trained_values) if trained_values else 0.0,
        smd=smd,
        ks=ks,
        started_count=len(started_values),
        trained_count=len(trained_values),
    )
