"""Why the scheduler drops a group, as the goodput ledger books it: a reason not listed here is a
failure (a request vLLM refused or that failed, an environment, a reward, a group too large)."""

from __future__ import annotations

_OUTCOME_OF_DROP = {"stale_inflight": "aborted", "aborted": "aborted", "deadline": "filtered", "cancelled": "cancelled"}


def drop_outcome(reason: str) -> str:
    """The ledger outcome of a scheduler drop reason (``rollout_groups_dropped``'s label)."""
    return _OUTCOME_OF_DROP.get(reason, "failed")
