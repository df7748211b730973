"""Resume from the newest usable checkpoint: bitwise continuation after a rollback, and a dp change marked CHANGED."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rankwatch.base.schema import ChangeReason, Comparability
from rankwatch.canary import Faults
from rankwatch.recovery.lineage import EntryKind, lineage_path, read, verify
from support import canary, rows, run

pytestmark = [pytest.mark.slow]

STEPS, EVERY, FAIL_AT = 8, 3, 5


def _final(run_dir: Path, step: int) -> list[tuple[object, ...]]:
    return rows(run_dir, f"SELECT rank, param_hash, optim_hash, rng_torch_hash, data_position FROM fingerprints "
                         f"WHERE step = {step} ORDER BY rank")


@pytest.mark.timeout(120)
def test_rollback_and_resume_is_bitwise_identical(tmp_path: Path) -> None:
    base = dict(layout="dp=2", steps=STEPS, checkpoint_every=EVERY, fingerprint_every=0, seed=3, pg_timeout_s=4.0)
    clean = run(canary(tmp_path / "clean", **base))
    assert clean.ok, clean
    broken_dir = tmp_path / "broken"
    failed = run(canary(broken_dir, faults=Faults().exit(rank=1, step=FAIL_AT), **base))
    assert not failed.ok
    resumed = run(replace(canary(broken_dir, **base), resume=True))
    assert resumed.ok, resumed
    assert _final(broken_dir, STEPS - 1) == _final(tmp_path / "clean", STEPS - 1)
    assert len(_final(broken_dir, STEPS - 1)) == 2

    entries = read(lineage_path(broken_dir))
    assert [e.kind for e in entries] == [EntryKind.ROLLBACK, EntryKind.REPLAYED_DATA_RANGE, EntryKind.REPLAY_VERIFIED]
    ckpt_step = FAIL_AT // EVERY * EVERY - 1  # last checkpoint before the fault: step 2
    rollback, replay, verified = entries
    assert (verified.details.attempt, verified.details.from_step) == (1, ckpt_step + 1)  # its first step was checked
    assert (rollback.details.from_step, rollback.details.to_step) == (FAIL_AT - 1, ckpt_step + 1)
    assert rollback.details.checkpoint_id == f"step-{ckpt_step:08d}"
    assert (replay.details.from_step, replay.details.to_step) == (ckpt_step + 1, FAIL_AT)
    assert all(e.verdict.comparability is Comparability.BITWISE_IDENTICAL_EXPECTED for e in entries)
    assert verify(lineage_path(broken_dir)).ok
    gate = rows(broken_dir, "SELECT rank, message FROM events WHERE message LIKE 'consistency gate %' ORDER BY message")
    assert [str(m).split()[2].split(":")[0] for _, m in gate] == ["replicas", "world"]
    assert all(r == 0 and ": agree" in str(m) for r, m in gate)  # each domain's outcome said once, by its first rank
    attempts = rows(broken_dir, "SELECT DISTINCT attempt FROM steps WHERE step >= 3 ORDER BY attempt")
    assert attempts == [(0,), (1,)]


@pytest.mark.timeout(120)
def test_resume_with_other_dp_is_marked_changed_and_other_tp_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = dict(steps=4, checkpoint_every=2, fingerprint_every=0, pg_timeout_s=4.0)
    assert run(canary(run_dir, layout="dp=4", **base)).ok

    refused = run(replace(canary(run_dir, layout="tp=2,dp=1", **base), resume=True))
    assert not refused.ok
    why = rows(run_dir, "SELECT message FROM events WHERE kind = 'exception' AND attempt = 1")
    assert why and all("layout incompatible" in str(m) and "only the dp degree" in str(m) for (m,) in why)
    assert not lineage_path(run_dir).exists()

    resumed = run(replace(canary(run_dir, layout="dp=2", **{**base, "steps": 6}), resume=True))
    assert resumed.ok, resumed
    entries = read(lineage_path(run_dir))
    assert [e.kind for e in entries] == [EntryKind.RESTART, EntryKind.WORLD_SIZE_CHANGE, EntryKind.LAYOUT_CHANGE]
    for e in entries:
        assert e.verdict.comparability is Comparability.CHANGED
        assert set(e.verdict.reasons) == {ChangeReason.BATCH_COMPOSITION, ChangeReason.ORDERING}
    assert (entries[1].details.old_world_size, entries[1].details.new_world_size) == (4, 2)
    assert verify(lineage_path(run_dir)).ok
    final = _final(run_dir, 5)
    assert len(final) == 2 and final[0][1:] == final[1][1:]  # both new replicas hold the same state


@pytest.mark.timeout(120)
def test_a_pipeline_resumes_on_fewer_replicas_from_a_replica_of_each_stage(tmp_path: Path) -> None:
    """dp=2,pp=2 saved, dp=1,pp=2 resumes: new rank 1 (stage 1) takes the rank file of old rank 2 (dp 0 of stage
    1), not old rank 1 (dp 1 of stage 0): what it restored is what that replica saved, so the gate agrees."""
    run_dir = tmp_path / "run"
    base = dict(steps=4, checkpoint_every=2, fingerprint_every=0, pg_timeout_s=4.0)
    assert run(canary(run_dir, layout="dp=2,pp=2", **base)).ok
    resumed = run(replace(canary(run_dir, layout="dp=1,pp=2", **{**base, "steps": 6}), resume=True))
    assert resumed.ok, resumed
    entries = read(lineage_path(run_dir))
    assert [e.kind for e in entries] == [EntryKind.RESTART, EntryKind.WORLD_SIZE_CHANGE, EntryKind.LAYOUT_CHANGE]
    assert (entries[1].details.old_world_size, entries[1].details.new_world_size) == (4, 2)
    gate = rows(run_dir, "SELECT message FROM events WHERE attempt = 1 AND message LIKE 'consistency gate%'")
    assert gate and all(": agree" in str(m) for (m,) in gate), gate
