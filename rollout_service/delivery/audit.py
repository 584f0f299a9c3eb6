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
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

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
with fewer, a uniformly dropped prompt is often missing from the trained window by chance (e^-4
of them at 4), and with a prompt set much larger than the window coverage is just the share of
groups trained."""
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
        coverage_threshold: float = 0.8,
        min_groups: int = 256,
        profiles_kept: int = 65536,
        report_every: int = 16,
    ) -> None:
        """``coverage_threshold`` 0.8: where coverage is judged, a uniform drop leaves under 2% of the
        prompts untrained (e^-4), so a fifth missing means some prompts are never trained, with a
        margin for those trained rarely, whose bias the features show.
        ``min_groups`` 256: with fewer, chance alone moves the SMD by its standard error, about
        sqrt(2/n), to near the 0.25 threshold."""
        self.run_id = run_id
        self.smd_threshold = smd_threshold
        self.coverage_threshold = coverage_threshold
        self.min_groups = min_groups
        self.profiles_kept = profiles_kept
        self.report_every = report_every
        self._started: deque[PromptKey] = deque(maxlen=window_groups)
        self._trained: deque[tuple[PromptKey, int]] = deque(maxlen=window_groups)
        self._profiles: OrderedDict[PromptKey, PromptProfile] = OrderedDict()
        self._flagged: frozenset[str] = frozenset()
        """Flags as of the last periodic check: what was warned about and not cleared yet."""
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
        started = [self._profiles.get(key) for key in self._started]
        started_profiles = [profile for profile in started if profile is not None]
        trained_profiles = [profile for key, _ in self._trained if (profile := self._profiles.get(key)) is not None]
        features = tuple(_feature_drift(feature, started_profiles, trained_profiles) for feature in FEATURES)
        started_prompts = set(self._started)  # unprofiled ones too: a prompt whose groups never finish is never trained
        trained_prompts = {key for key, _ in self._trained}
        coverage = len(started_prompts & trained_prompts) / len(started_prompts) if started_prompts else 1.0
        staleness = [staleness for _, staleness in self._trained]
        flagged: list[str] = []
        profiled = min(len(started_profiles), len(trained_profiles))
        if profiled >= max(self.min_groups, 1):
            flagged = [d.feature for d in features if self._drifts(d.feature, d.smd)]
            repeats = min(len(self._started), len(self._trained)) / len(started_prompts)
            if repeats >= COVERAGE_MIN_REPEATS and self._undercovered(coverage):
                flagged.append(COVERAGE)
        return AuditReport(
            features=features,
            prompt_coverage=coverage,
            started_prompts=len(started_prompts),
            unprofiled_started=len(started) - len(started_profiles),
            staleness_mean=_mean(staleness) if staleness else 0.0,
            staleness_max=max(staleness, default=0),
            flagged=tuple(flagged),
        )

    def _drifts(self, feature: str, smd: float) -> bool:
        """|smd| reaches the threshold, or keeps an earlier flag until it falls well below it."""
        return abs(smd) >= self.smd_threshold * (CLEAR_FRACTION if feature in self._flagged else 1.0)

    def _undercovered(self, coverage: float) -> bool:
        """Coverage is below the threshold, or keeps an earlier flag until it is well above it."""
        return 1.0 - coverage > (1.0 - self.coverage_threshold) * (CLEAR_FRACTION if COVERAGE in self._flagged else 1.0)

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
        report = self.report()
        flagged = frozenset(report.flagged)
        drifts = {d.feature: d for d in report.features}
        for name in sorted(flagged - self._flagged):
            if name == COVERAGE:
                logger.warning(
                    "run %s: only %.0f%% of the prompts started in the last window were trained: %s",
                    self.run_id, 100 * report.prompt_coverage, ADVICE,
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
