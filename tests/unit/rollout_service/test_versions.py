"""PolicyVersion is the one owner of a policy's versions: pushes move it, and runs, the store
and evaluations read it or watch it instead of keeping copies."""

from __future__ import annotations

from dataclasses import replace

from rollout_service.versions import PolicyVersion, VersionChange
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.scripted import ScriptedEngine, make_service


def test_a_push_moves_the_trainer_ahead_and_its_commit_moves_the_servers() -> None:
    versions = PolicyVersion(3)
    changes: list[VersionChange] = []
    stop = versions.watch(changes.append)
    versions.begin()
    assert (versions.served, versions.trainer) == (3, 4)
    versions.commit(4)
    assert (versions.served, versions.trainer) == (4, 4)
    versions.begin()
    versions.abort()
    assert (versions.served, versions.trainer) == (4, 4)
    versions.begin(resend=True)  # the current weights again: nothing moves
    versions.commit(4)
    assert (versions.served, versions.trainer) == (4, 4)
    assert changes == [
        VersionChange(committed=False, served_moved=False, previous_trainer=3),
        VersionChange(committed=True, served_moved=True, previous_trainer=4),
        VersionChange(committed=False, served_moved=False, previous_trainer=4),
        VersionChange(committed=False, served_moved=False, previous_trainer=5),
        VersionChange(committed=False, served_moved=False, previous_trainer=4),
        VersionChange(committed=True, served_moved=False, previous_trainer=4),
    ]
    stop()
    versions.begin()
    assert len(changes) == 6


def test_the_trainer_never_falls_behind_the_servers() -> None:
    versions = PolicyVersion(5)
    versions.set_trainer(2)
    assert versions.trainer == 5


async def test_runs_on_the_base_weights_share_the_services_record_and_others_keep_their_own() -> None:
    service = make_service(ScriptedEngine())
    meta: dict[str, int] = {}
    service.store.set_meta = meta.__setitem__  # type: ignore[method-assign]
    base = await service.create_run(spec())
    adapter = await service.create_run(replace(spec(), serve_adapter=True))
    try:
        assert base.admission.versions is service.versions
        assert adapter.admission.versions is not service.versions
        service.versions.set_trainer(1)
        service.set_policy_version(1)
        assert (base.policy_version, adapter.policy_version) == (1, 0)
        assert meta == {"policy_version": 1}  # the store keeps the servers' version
    finally:
        await service.delete_run(base.run_id)
        await service.delete_run(adapter.run_id)
