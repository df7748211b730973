"""The recovery manager on the real canary: a fail-stop and a divergence, each supervised from launch to a
recovered run whose final parameters are bitwise those of a fault-free run, with evidence, retirement, lineage and
a recovery record; and a relaunch the consistency gate refuses."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rankwatch.analytics.incidents import IncidentClass
from rankwatch.base.rundir import CHECKPOINT_DIR, RECOVERY_DIR
from rankwatch.base.schema import Comparability
from rankwatch.canary import Faults
from rankwatch.canary.config import canary_declaration, config_from_run
from rankwatch.canary.launcher import launch
from rankwatch.control.manager import apply, assess, supervise
from rankwatch.recovery.catalog import rank_shard_name, sha256_file
from rankwatch.recovery.decision import Action
from rankwatch.recovery.evidence import verify_evidence
from rankwatch.recovery.lineage import EntryKind, lineage_path, read, verify
from support import canary, rows, run

pytestmark = [pytest.mark.slow]

BASE = dict(layout="dp=2", steps=10, checkpoint_every=3, fingerprint_every=1, seed=5, pg_timeout_s=4.0)
LAUNCH = dict(timeout_s=150, failure_grace_s=3.0, term_grace_s=2.0)


def _final(run_dir: Path) -> list[tuple[object, ...]]:
    last = BASE["steps"] - 1  # type: ignore[operator]
    # the latest fingerprint of the last step per rank: a replayed step is fingerprinted again by the new attempt
    return rows(run_dir, "SELECT rank, param_hash, optim_hash, rng_torch_hash, data_position FROM fingerprints "
                         f"WHERE step = {last} QUALIFY row_number() OVER (PARTITION BY rank ORDER BY wall_ns DESC) = 1 "
                         "ORDER BY rank")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[object, ...]]:
    run_dir = tmp_path_factory.mktemp("clean") / "run"
    assert run(canary(run_dir, **BASE)).ok  # type: ignore[arg-type]
    final = _final(run_dir)
    assert len(final) == 2
    return final


@pytest.mark.timeout(240)
def test_fail_stop_is_restarted_from_the_newest_checkpoint_and_ends_bitwise_clean(
    tmp_path: Path, clean: list[tuple[object, ...]]
) -> None:
    run_dir = tmp_path / "run"
    said: list[str] = []
    out = supervise(canary(run_dir, faults=Faults().exit(rank=1, step=7), **BASE), launcher=launch,  # type: ignore[arg-type]
                    say=said.append, **LAUNCH)  # type: ignore[arg-type]
    assert not out.first.ok and out.ok, (out.stopped, said)
    assert len(out.records) == 1 and out.stopped == "attempt completed"
    rec = out.records[0]
    [d] = [d for d in rec.plan.decided if d.incident.klass is IncidentClass.FAIL_STOP]
    assert d.incident.ranks == (1,)
    # no process answers a gate after the job ended: agreement unproven, so the policy restarts from a checkpoint
    assert "gate=none" in d.decision.path and d.decision.action is Action.RESTART_JOB
    assert rec.plan.checkpoint is not None and rec.plan.checkpoint.id == "step-00000005"
    assert _final(run_dir) == clean  # the recovered run ends exactly where the fault-free one did

    # evidence first, and verifiable; the record says what happened; lineage says the replay is bitwise comparable
    assert rec.evidence and all(verify_evidence(p) == () for p in rec.evidence)
    doc = json.loads((run_dir / RECOVERY_DIR / f"{rec.id}.json").read_text())
    assert doc["outcome"] == "recovered" and doc["checkpoint"] == "step-00000005" and d.incident.id in doc["incidents"]
    entries = read(lineage_path(run_dir))
    assert [e.kind for e in entries][:2] == [EntryKind.ROLLBACK, EntryKind.REPLAYED_DATA_RANGE]
    assert [e.kind for e in entries][2:] in ([], [EntryKind.REPLAY_VERIFIED])  # the replay checked, when it could be
    assert all(e.verdict.comparability is Comparability.BITWISE_IDENTICAL_EXPECTED for e in entries)
    assert verify(lineage_path(run_dir)).ok
    gate = rows(run_dir, "SELECT message FROM events WHERE attempt = 1 AND message LIKE 'consistency gate %' "
                         "ORDER BY message")
    assert [str(m).split()[2].split(":")[0] for (m,) in gate] == ["replicas", "world"]
    assert all(": agree" in str(m) for (m,) in gate)

    # assessing again finds nothing to act on: the recovered attempt completed, and the replayed steps (which the
    # killed rank's lost, never-flushed fingerprints leave uneven) read as no divergence
    layout = config_from_run(run_dir).layout
    again = assess(run_dir, layout=layout, job=canary_declaration(layout))
    assert not again.relaunch and not again.decided


@pytest.mark.timeout(240)
def test_divergence_rolls_back_to_before_the_onset_and_retires_the_newer_checkpoint(
    tmp_path: Path, clean: list[tuple[object, ...]]
) -> None:
    run_dir = tmp_path / "run"
    said: list[str] = []
    out = supervise(canary(run_dir, faults=Faults().skew_rng(rank=1, step=6), **BASE), launcher=launch,  # type: ignore[arg-type]
                    say=said.append, **LAUNCH)  # type: ignore[arg-type]
    assert out.first.ok, "a divergence does not stop the job by itself"
    assert out.ok and len(out.records) == 1, (out.stopped, said)
    rec = out.records[0]
    [d] = [d for d in rec.plan.decided if d.incident.klass is IncidentClass.DIVERGENCE]
    assert d.incident.onset_step == 6 and d.decision.action is Action.ROLLBACK_DOMAIN
    # step-00000008 holds the diverged state: the rollback goes to step 5 and the newer one leaves the catalog
    assert rec.plan.checkpoint is not None and rec.plan.checkpoint.id == "step-00000005"
    assert [r.split(" -> ")[0] for r in rec.retired] == ["step-00000008"]
    retired = run_dir / CHECKPOINT_DIR / rec.retired[0].split(" -> ")[1]
    assert retired.is_dir()  # kept as evidence, not deleted
    assert _final(run_dir) == clean
    entries = read(lineage_path(run_dir))
    # no replay_verified entry: the diverged attempt is no reference from its divergence on, and undoing it must
    # differ from it (what is no nondeterministic replay)
    assert [e.kind for e in entries] == [EntryKind.ROLLBACK, EntryKind.REPLAYED_DATA_RANGE]
    assert (entries[0].details.from_step, entries[0].details.to_step) == (9, 6)


@pytest.mark.timeout(240)
def test_a_relaunch_the_gate_refuses_ends_supervision(tmp_path: Path) -> None:
    """A checkpoint whose bytes verify but whose values disagree (rank 1's RNG state rewritten, the manifest's
    checksum updated to match): integrity checks pass, the consistency gate refuses, nothing trains."""
    run_dir = tmp_path / "run"
    cfg = canary(run_dir, faults=Faults().exit(rank=1, step=7), **BASE)  # type: ignore[arg-type]
    first = run(cfg, **LAUNCH)  # type: ignore[arg-type]
    assert not first.ok
    ckpt = run_dir / CHECKPOINT_DIR / "step-00000005"
    shard = ckpt / rank_shard_name(1)
    state = torch.load(shard, weights_only=True)
    state["rng"]["python"] = (3, tuple(range(625)), None)
    torch.save(state, shard)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for f in manifest["files"]:
        if f["path"] == rank_shard_name(1):
            f["size"], f["sha256"] = shard.stat().st_size, sha256_file(shard)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    plan = assess(run_dir, layout=cfg.layout, job=canary_declaration(cfg.layout))
    assert plan.relaunch and plan.checkpoint is not None and plan.checkpoint.id == "step-00000005"
    rec = apply(replace(cfg, faults=Faults()), plan, launcher=launch, **LAUNCH)  # type: ignore[arg-type]
    assert rec.outcome == "relaunch_failed" and rec.relaunch is not None and not rec.relaunch.ok
    refused = rows(run_dir, "SELECT DISTINCT rank FROM events WHERE attempt = 1 AND message LIKE "
                            "'consistency gate: restore check failed: rank 1: rng_python%' ORDER BY rank")
    assert refused == [(0,), (1,)]
    assert rows(run_dir, "SELECT count(*) FROM steps WHERE attempt = 1") == [(0,)]
    assert not lineage_path(run_dir).exists()  # nothing resumed, so no lineage entry claims it did
