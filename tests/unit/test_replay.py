"""Replay verification (analytics/replay.py), the run file reader, determinism inputs and the resume preflight."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, IncidentClass, SubjectKind
from rankwatch.analytics.replay import detect_replay_divergence, replay_checks, replay_comparisons
from rankwatch.base.rundir import RUN_FILE, read_launches
from rankwatch.base.schema import Table
from rankwatch.collector.sink import partition_dir
from rankwatch.recovery.determinism import DeterminismInputs
from rankwatch.recovery.lineage import Details, EntryKind, Lineage, NewEntry, Verdict, lineage_path
from rankwatch.recovery.resume import last_completed_step, preflight

pytestmark = pytest.mark.timeout(60)


def _fp(rank: int, step: int, attempt: int, *, param: str = "p", optim: str = "o", domain: str = "dp.pp0.tp0",
        members: tuple[int, ...] = (0, 1, 2, 3)) -> dict[str, Any]:
    return {"rank": rank, "step": step, "attempt": attempt, "wall_ns": 1000 * attempt + step, "domain": domain,
            "domain_ranks": list(members), "param_hash": f"{param}{step}", "optim_hash": f"{optim}{step}",
            "rng_python_hash": "a", "rng_numpy_hash": "b", "rng_torch_hash": f"t{step}", "data_position": 8 * step,
            "param_count": 10}


def _frames(rows: list[dict[str, Any]]) -> Frames:
    df = pl.DataFrame(rows)
    return Frames.build(fingerprints=df, replays=df)


def test_an_equal_replay_holds() -> None:
    rows = [_fp(r, s, a) for r in range(4) for s in (6, 9) for a in (0, 1)]
    [check] = replay_checks(_frames(rows))
    assert check.held and (check.attempt, check.earlier_attempt) == (1, 0)
    assert (check.first_step, check.last_step, check.steps, check.ranks) == (6, 9, 2, (0, 1, 2, 3))
    assert "bitwise equal to attempt 0" in check.describe()
    assert detect_replay_divergence(_frames(rows)) == ()


def test_a_replay_that_differs_is_a_divergence_from_its_first_differing_step() -> None:
    rows = [_fp(r, s, 0) for r in range(4) for s in (6, 9)]
    rows += [_fp(r, 6, 1) for r in range(4)] + [_fp(r, 9, 1, param="q", optim="x") for r in range(4)]
    [check] = replay_checks(_frames(rows))
    assert (check.held, check.broken_step, check.fields, check.broken_ranks) == (False, 9, ("param", "optim"),
                                                                                   (0, 1, 2, 3))
    [inc] = detect_replay_divergence(_frames(rows))
    assert inc.klass is IncidentClass.DIVERGENCE and inc.cause is Cause.NONDETERMINISTIC_REPLAY
    assert inc.onset_step == 9 and inc.subject.kind is SubjectKind.DOMAIN
    assert inc.summary.startswith("replayed step 9 differs from attempt 0: param, optim")
    assert inc.evidence[0].rows[0] == (9, 0, "dp.pp0.tp0", 1, 0, "param,optim")


def test_three_attempts_are_each_checked_against_every_earlier_one() -> None:
    rows = [_fp(0, 6, a) for a in (0, 1, 2)] + [_fp(0, 7, 2, param="z"), _fp(0, 7, 1)]
    checks = replay_checks(_frames(rows))
    assert [(c.attempt, c.earlier_attempt, c.held) for c in checks] == [(1, 0, True), (2, 0, True), (2, 1, False)]
    assert checks[2].broken_step == 7


def test_a_changed_domain_membership_is_not_compared() -> None:
    # a resume onto another dp degree: lineage says CHANGED already, the replay is not expected to match
    rows = [_fp(0, 6, 0, members=(0, 1, 2, 3)), _fp(0, 6, 1, param="other", members=(0, 1))]
    assert replay_comparisons(_frames(rows)).height == 0
    assert replay_checks(_frames(rows)) == ()


def test_an_earlier_attempt_is_no_reference_from_where_its_own_replicas_disagreed() -> None:
    # attempt 0 diverged at step 9 (rank 1's RNG skewed); the rollback replays 6 and 9 cleanly: 9 differs from
    # attempt 0 on rank 1, which is the recovery undoing the divergence, not a nondeterministic replay
    rows = [_fp(r, s, a) for r in range(4) for s in (6, 9) for a in (0, 1)]
    rows = [dict(r, rng_torch_hash="skewed") if (r["rank"], r["step"], r["attempt"]) == (1, 9, 0) else r for r in rows]
    [check] = replay_checks(_frames(rows))
    assert check.held and (check.first_step, check.last_step) == (6, 6)
    assert detect_replay_divergence(_frames(rows)) == ()


def test_no_replays_no_checks() -> None:
    assert replay_checks(Frames.build()) == () and detect_replay_divergence(Frames.build()) == ()


def _write_run(run: Path, doc: Any) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / RUN_FILE).write_text(doc if isinstance(doc, str) else json.dumps(doc))


@pytest.mark.parametrize("doc,message", [
    ("{", "unreadable run file"),
    ([1, 2], "not a run file"),
    ({"launches": {}}, "not a run file"),
    ({"launches": [3]}, "launch 0 is not an object"),
    ({"launches": [{"attempt": "0"}]}, "launch 0: 'attempt' is '0', not int"),
    ({"launches": [{"attempt": 0, "layout": 4}]}, "launch 0: 'layout' is 4, not str"),
    ({"launches": [{"attempt": 1}]}, "launch 0 says attempt 1: records edited or reordered"),
])
def test_a_run_file_of_the_wrong_shape_is_one_line_naming_it(tmp_path: Path, doc: Any, message: str) -> None:
    _write_run(tmp_path, doc)
    with pytest.raises(ValueError, match=message) as err:
        read_launches(tmp_path)
    assert str(tmp_path / RUN_FILE) in str(err.value) and "\n" not in str(err.value)


def _inputs(**kw: Any) -> DeterminismInputs:
    base = DeterminismInputs.current(threads=1, backend="gloo", deterministic_algorithms=False, buckets_pinned=True)
    doc = base.to_dict() | kw
    return DeterminismInputs.from_dict(doc, where="test")


def test_determinism_changes_name_each_input() -> None:
    a = _inputs(env={"OMP_NUM_THREADS": "1"})
    b = _inputs(torch_threads=2, ddp_buckets_pinned=False, env={"NCCL_ALGO": "Ring"})
    assert a.changes(a) == ()
    assert a.changes(b) == ("torch_threads 1->2", "ddp_buckets_pinned True->False", "NCCL_ALGO (unset)->Ring",
                            "OMP_NUM_THREADS 1->(unset)")
    with pytest.raises(ValueError, match="where: determinism inputs do not match"):
        DeterminismInputs.from_dict({"torch_threads": 1}, where="where")
    with pytest.raises(ValueError, match="not an object"):
        DeterminismInputs.from_dict([1], where="where")


def test_preflight_refuses_what_resume_must_not_touch(tmp_path: Path) -> None:
    missing = tmp_path / "mistyped"
    with pytest.raises(ValueError, match="no such run directory .--resume never creates a run"):
        preflight(missing)
    assert not missing.exists()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        preflight(a_file)
    run = tmp_path / "run"
    _write_run(run, {"launches": [{"attempt": 0}]})
    with pytest.raises(ValueError, match="no checkpoints folder"):
        preflight(run)
    (run / "checkpoints").mkdir()
    preflight(run)
    book = Lineage(lineage_path(run))
    for k in range(3):
        book.append(NewEntry(kind=EntryKind.RESTART, verdict=Verdict.identical(), details=Details(to_step=k + 1)))
    lines = lineage_path(run).read_text().splitlines(keepends=True)
    lineage_path(run).write_text(lines[0] + lines[2])  # an entry deleted
    before = lineage_path(run).read_bytes()
    with pytest.raises(ValueError, match="lineage does not verify at seq 1 .deleted"):
        preflight(run)
    assert lineage_path(run).read_bytes() == before


def test_last_completed_step_skips_damaged_steps_parts(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = partition_dir(tmp_path, Table.STEPS, 0)
    good.mkdir(parents=True)
    pq.write_table(pa.table({"step": [3, 4], "attempt": pa.array([0, 0], pa.int32())}), good / "part-000000.parquet")
    pq.write_table(pa.table({"step": [9], "attempt": pa.array([1], pa.int32())}), good / "part-000001.parquet")
    bad = partition_dir(tmp_path, Table.STEPS, 1)
    bad.mkdir(parents=True)
    (bad / "part-000000.parquet").write_bytes(b"PAR1 cut short")
    pq.write_table(pa.table({"step": ["7"], "attempt": ["0"]}), bad / "part-000001.parquet")
    pq.write_table(pa.table({"step": pa.array([None, 5], pa.int64()), "attempt": pa.array([0, None], pa.int32())}),
                   bad / "part-000002.parquet")
    assert last_completed_step(tmp_path, before_attempt=1) == 4
    assert "part-000000.parquet: unreadable steps part" in caplog.text
    assert "non-integer step/attempt" in caplog.text


def test_a_replay_basis_ends_the_replaced_attempt_as_a_reference() -> None:
    # attempt 0 took a corrupt gradient at step 7 that every replica all-reduced (they agree); attempt 1 undid it and
    # recorded where the fault may have begun: its steps from there differ from attempt 0 by design
    rows = [_fp(r, s, 0, param="bad" if s >= 7 else "p") for r in range(4) for s in (6, 9)]
    rows += [_fp(r, s, 1) for r in range(4) for s in (6, 9)]
    df = pl.DataFrame(rows)
    events = pl.DataFrame({"rank": [0], "attempt": [1], "kind": ["replay_basis"], "step": [7]})
    [check] = replay_checks(Frames.build(fingerprints=df, replays=df, events=events))
    assert check.held and (check.first_step, check.last_step) == (6, 6)
    assert detect_replay_divergence(Frames.build(fingerprints=df, replays=df, events=events)) == ()
    assert detect_replay_divergence(_frames(rows))  # without the basis the difference is a broken promise
    # a later attempt that did not undo anything is still checked against the one that did
    later = rows + [_fp(r, 9, 2, param="q") for r in range(4)]
    ldf = pl.DataFrame(later)
    checks = replay_checks(Frames.build(fingerprints=ldf, replays=ldf, events=events))
    assert [(c.attempt, c.earlier_attempt, c.held) for c in checks] == [(1, 0, True), (2, 1, False)]
