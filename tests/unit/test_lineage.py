"""Lineage: round trip, every way of tampering found at the right seq, concurrent appenders, the resume verdict."""

from __future__ import annotations

import json
import multiprocessing as mp
import warnings
from pathlib import Path
from typing import Any

import pytest

from rankwatch.base.schema import ChangeReason, Comparability
from rankwatch.base.topology import Layout
from rankwatch.recovery import policy as recovery
from rankwatch.recovery.lineage import (
    GENESIS, Details, EntryKind, Lineage, NewEntry, Problem, Verdict, check_lineage, comparability_of_resume,
    lineage_path, read, verify,
)

SAME = Verdict.identical()


def _entries() -> list[NewEntry]:
    return [
        NewEntry(kind=EntryKind.START, details=Details(old_hash="code-a", new_hash="cfg-a"), verdict=SAME, time_ns=1),
        NewEntry(kind=EntryKind.ROLLBACK, details=Details(from_step=140, to_step=100, checkpoint_id="step-00000100"),
                 verdict=SAME, time_ns=2),
        NewEntry(kind=EntryKind.REPLAYED_DATA_RANGE, details=Details(from_step=101, to_step=141), verdict=SAME,
                 time_ns=3),
        NewEntry(kind=EntryKind.WORLD_SIZE_CHANGE, details=Details(old_world_size=8, new_world_size=6),
                 verdict=Verdict.changed(ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION, note="dp 4->3"),
                 time_ns=4),
        NewEntry(kind=EntryKind.DEVICE_REPLACED, details=Details(old_device="GPU-a", new_device="GPU-b"),
                 verdict=Verdict.changed(ChangeReason.HARDWARE), time_ns=5),
        NewEntry(kind=EntryKind.DEVICE_QUARANTINED, details=Details(old_device="GPU-a", text="ecc"), verdict=SAME,
                 time_ns=6),
    ]


def _write(tmp_path: Path) -> Path:
    path = lineage_path(tmp_path)
    lin = Lineage(path)
    for e in _entries():
        lin.append(e)
    return path


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def test_round_trip_chains_and_verifies(tmp_path: Path) -> None:
    path = lineage_path(tmp_path)
    lin = Lineage(path)
    written = [lin.append(e) for e in _entries()]
    back = read(path)
    assert back == tuple(written)
    assert [e.seq for e in back] == list(range(6))
    assert back[0].prev_hash == GENESIS
    assert all(b.prev_hash == a.hash for a, b in zip(back, back[1:]))
    assert back[3].verdict.reasons == (ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION)
    assert back[2].details == Details(from_step=101, to_step=141)
    res = verify(path)
    assert res.ok and res.entries == 6 and res.head == back[-1].hash and res.broken_seq is None
    assert verify(path, anchor=back[-1].hash).ok
    assert verify(path, anchor=back[3].hash).ok


def test_append_stamps_time_and_continues_an_existing_file(tmp_path: Path) -> None:
    path = _write(tmp_path)
    e = Lineage(path).append(NewEntry(kind=EntryKind.RESTART, details=Details(to_step=100), verdict=SAME))
    assert e.seq == 6 and e.time_ns > 10**18
    assert verify(path).ok


def _edit(path: Path, seq: int, change: str) -> None:
    lines = _lines(path)
    d = json.loads(lines[seq])
    if change == "content":
        d["details"]["to_step"] = 99
    elif change == "hash":
        d["hash"] = "f" * 64
    lines[seq] = json.dumps(d, sort_keys=True, separators=(",", ":")) + "\n"
    path.write_text("".join(lines))


@pytest.mark.parametrize(("how", "seq", "problem"), [
    ("edit-content", 1, Problem.EDITED),
    ("edit-content-last", 5, Problem.EDITED),
    ("edit-and-rehash", 2, Problem.EDITED),
    ("edit-first-and-rehash", 0, Problem.EDITED),
    ("alter-hash", 3, Problem.BAD_HASH),
    ("delete", 2, Problem.DELETED),
    ("delete-first", 0, Problem.DELETED),
    ("swap", 3, Problem.REORDERED),
    ("duplicate", 4, Problem.REORDERED),
    ("truncate", 5, Problem.TRUNCATED),
    ("garbage-line", 2, Problem.EDITED),
])
def test_tampering_is_found_at_the_first_broken_seq(tmp_path: Path, how: str, seq: int, problem: Problem) -> None:
    path = _write(tmp_path)
    lines = _lines(path)
    if how in ("edit-content", "edit-content-last"):
        _edit(path, seq, "content")
    elif how == "alter-hash":
        _edit(path, seq, "hash")
    elif how in ("edit-and-rehash", "edit-first-and-rehash"):
        from rankwatch.recovery.lineage import Entry, _digest
        e = Entry.from_dict(json.loads(lines[seq]))
        body = e.body()
        body["details"]["text"] = "forged"
        if how == "edit-first-and-rehash":
            body["prev_hash"] = "1" * 64
        lines[seq] = json.dumps({**body, "hash": _digest(body)}, sort_keys=True, separators=(",", ":")) + "\n"
        path.write_text("".join(lines))
    elif how in ("delete", "delete-first"):
        del lines[seq]
        path.write_text("".join(lines))
    elif how == "swap":
        lines[3], lines[4] = lines[4], lines[3]
        path.write_text("".join(lines))
    elif how == "duplicate":
        lines.insert(4, lines[3])
        path.write_text("".join(lines))
    elif how == "truncate":
        path.write_text("".join(lines[:-1]) + lines[-1][:40])
    elif how == "garbage-line":
        lines[2] = "{not json\n"
        path.write_text("".join(lines))
    res = verify(path)
    assert not res.ok
    assert (res.broken_seq, res.problem) == (seq, problem), res.why
    assert res.why


def test_an_altered_last_hash_is_told_from_an_edit_only_with_an_anchor(tmp_path: Path) -> None:
    path = _write(tmp_path)
    true_head = read(path)[-1].hash
    _edit(path, 5, "hash")
    assert verify(path).problem is Problem.EDITED
    res = verify(path, anchor=true_head)
    assert (res.broken_seq, res.problem) == (5, Problem.BAD_HASH)


def test_a_deleted_tail_is_found_only_against_an_anchor(tmp_path: Path) -> None:
    path = _write(tmp_path)
    head = read(path)[-1].hash
    path.write_text("".join(_lines(path)[:4]))
    assert verify(path).ok
    res = verify(path, anchor=head)
    assert (res.ok, res.broken_seq, res.problem) == (False, 4, Problem.DELETED)


def test_append_refuses_after_a_torn_or_forged_last_line(tmp_path: Path) -> None:
    path = _write(tmp_path)
    text = path.read_text()
    path.write_text(text[:-10])
    with pytest.raises(ValueError, match="truncated"):
        Lineage(path).append(_entries()[0])
    with pytest.raises(ValueError, match="truncated"):
        read(path)
    path.write_text(text)
    _edit(path, 5, "content")
    with pytest.raises(ValueError, match="seq 5 .*refusing to append"):
        Lineage(path).append(_entries()[0])


@pytest.mark.parametrize("damage", ["edit_first", "delete_middle", "reorder"])
def test_append_refuses_a_tampered_chain_anywhere_and_writes_nothing(tmp_path: Path, damage: str) -> None:
    # only the last entry was checked before: an edited or deleted earlier entry was appended to
    path = _write(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    if damage == "edit_first":
        _edit(path, 0, "content")
    elif damage == "delete_middle":
        path.write_text("".join(lines[:2] + lines[3:]))
    else:
        path.write_text("".join([lines[1], lines[0], *lines[2:]]))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="does not verify.*refusing to append"):
        Lineage(path).append(_entries()[0])
    assert path.read_bytes() == before
    with pytest.raises(ValueError, match="does not verify"):
        check_lineage(path)


def test_entries_without_the_new_optional_details_keep_their_hash(tmp_path: Path) -> None:
    # attempt and determinism were added to Details later: an entry that leaves them unset hashes as before
    path = _write(tmp_path)
    for line in path.read_text().splitlines():
        assert '"attempt"' not in line and '"determinism"' not in line and "global_batch" not in line
    e = Lineage(path).append(NewEntry(kind=EntryKind.REPLAY_VERIFIED, verdict=SAME,
                                      details=Details(from_step=3, to_step=5, attempt=1, determinism='{"a":1}')))
    assert verify(path).ok and e.details.attempt == 1
    assert read(path)[-1].details.determinism == '{"a":1}'
    Lineage(path).append(NewEntry(kind=EntryKind.WORLD_SIZE_CHANGE, verdict=SAME, details=Details(
        old_world_size=4, new_world_size=3, old_global_batch=32, new_global_batch=24)))
    assert verify(path).ok
    assert (read(path)[-1].details.old_global_batch, read(path)[-1].details.new_global_batch) == (32, 24)


def test_new_entry_validation() -> None:
    with pytest.raises(ValueError, match="missing details checkpoint_id"):
        NewEntry(kind=EntryKind.ROLLBACK, details=Details(from_step=5, to_step=1), verdict=SAME)
    with pytest.raises(ValueError, match="empty range"):
        NewEntry(kind=EntryKind.REPLAYED_DATA_RANGE, details=Details(from_step=5, to_step=5), verdict=SAME)
    with pytest.raises(ValueError, match="nothing changed"):
        NewEntry(kind=EntryKind.WORLD_SIZE_CHANGE, details=Details(old_world_size=4, new_world_size=4), verdict=SAME)
    with pytest.raises(ValueError, match="names neither"):
        NewEntry(kind=EntryKind.DEVICE_QUARANTINED, details=Details(), verdict=SAME)
    with pytest.raises(ValueError, match="changed with reasons"):
        Verdict(comparability=Comparability.CHANGED)
    with pytest.raises(ValueError, match="bitwise_identical_expected with reasons"):
        Verdict(comparability=Comparability.BITWISE_IDENTICAL_EXPECTED, reasons=(ChangeReason.HARDWARE,))


def _appender(path: str, who: int, n: int, start: Any) -> None:
    lin = Lineage(Path(path))
    start.wait()
    for i in range(n):
        lin.append(NewEntry(kind=EntryKind.RESTART, details=Details(to_step=i, text=f"p{who}-" + "x" * 3000),
                            verdict=SAME))


@pytest.mark.slow  # appender processes
@pytest.mark.timeout(60)
def test_concurrent_appenders_do_not_interleave(tmp_path: Path) -> None:
    path = lineage_path(tmp_path)
    # fork: the children only use os and fcntl, and spawn would re-import torch in each (seconds) — long enough
    # for one child to finish before the other starts, which would test nothing. A barrier makes them overlap.
    ctx = mp.get_context("fork")
    start = ctx.Barrier(3)
    n = 150
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a process with threads
        procs = [ctx.Process(target=_appender, args=(str(path), who, n, start)) for who in (0, 1, 2)]
        for p in procs:
            p.start()
    for p in procs:
        p.join(50)
        assert p.exitcode == 0
    res = verify(path)
    assert res.ok and res.entries == 3 * n, res.why
    entries = read(path)
    assert [e.seq for e in entries] == list(range(3 * n))
    for who in (0, 1, 2):
        assert [e.details.to_step for e in entries if e.details.text.startswith(f"p{who}-")] == list(range(n))
    owners = [e.details.text[:3] for e in entries]
    assert sum(a != b for a, b in zip(owners, owners[1:])) > 2, "appenders never overlapped; the test proves nothing"


@pytest.mark.parametrize(("old", "new", "ow", "nw", "code", "cfg", "devices", "expected"), [
    ("dp=4", "dp=4", 4, 4, True, True, True, ()),
    ("dp=4", "dp=3", 4, 3, True, True, True, (ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION)),
    ("dp=2,tp=2", "dp=4", 4, 4, True, True, True,
     (ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION, ChangeReason.NUMERICS)),
    ("dp=2,pp=2", "dp=2,tp=2", 4, 4, True, True, True, (ChangeReason.ORDERING, ChangeReason.NUMERICS)),
    ("dp=4", "dp=4", 4, 4, False, True, True, (ChangeReason.NUMERICS,)),
    ("dp=4", "dp=4", 4, 4, True, False, True, (ChangeReason.NUMERICS,)),
    ("dp=4", "dp=4", 4, 4, True, True, False, (ChangeReason.HARDWARE,)),
    ("dp=4", "dp=2", 4, 2, False, True, False,
     (ChangeReason.ORDERING, ChangeReason.BATCH_COMPOSITION, ChangeReason.NUMERICS, ChangeReason.HARDWARE)),
])
def test_comparability_of_resume(old: str, new: str, ow: int, nw: int, code: bool, cfg: bool, devices: bool,
                                 expected: tuple[ChangeReason, ...]) -> None:
    v = comparability_of_resume(Layout.parse(old), Layout.parse(new), ow, nw, same_code=code, same_config=cfg,
                                same_devices=devices)
    assert v.reasons == expected
    assert v.comparability is (Comparability.CHANGED if expected else Comparability.BITWISE_IDENTICAL_EXPECTED)
    assert v.note


def test_comparability_of_resume_rejects_a_layout_that_does_not_fit_the_world() -> None:
    with pytest.raises(ValueError, match="has 4 ranks but old world size is 8"):
        comparability_of_resume(Layout.parse("dp=4"), Layout.parse("dp=4"), 8, 4, same_code=True, same_config=True)


def test_recovery_policy_and_lineage_share_their_vocabulary() -> None:
    """analytics cannot import trainer: both take the lineage vocabulary from the one schema module."""
    assert recovery.Comparability is Comparability and recovery.ChangeReason is ChangeReason
    assert recovery.LineageRecord is EntryKind


def test_a_restart_on_another_world_reads_the_earlier_attempts_batch_and_records_the_change(tmp_path: Path) -> None:
    """`previous_batch_plan` takes the latest earlier attempt's `global_batch` event, skipping a damaged part and a
    malformed message; `record_batch_change` appends a BATCH_CHANGE only when the world or the batch changed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rankwatch.base.schema import EventKind, Table
    from rankwatch.collector.sink import partition_dir
    from rankwatch.recovery.resume import BatchPlan, previous_batch_plan, record_batch_change

    def part(rank: int, name: str, rows: list[tuple[str, int, str]]) -> None:
        where = partition_dir(tmp_path, Table.EVENTS, rank)
        where.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"kind": [r[0] for r in rows], "attempt": [r[1] for r in rows],
                                 "message": [r[2] for r in rows]}), where / name)

    batch = str(EventKind.GLOBAL_BATCH)
    assert previous_batch_plan(tmp_path, before_attempt=5) is None
    part(0, "part-000.parquet", [(batch, 0, '{"global_batch": 32, "world_size": 4}'), ("start", 1, ""),
                                 (batch, 1, '{"global_batch": 32, "world_size": 4}'),
                                 (batch, 2, '{"global_batch": "many"}'),  # malformed: left out
                                 (batch, 3, '{"global_batch": 24, "world_size": 3}')])
    (partition_dir(tmp_path, Table.EVENTS, 0) / "part-001.parquet").write_bytes(b"PAR1 cut short")
    got = previous_batch_plan(tmp_path, before_attempt=3)
    assert got == BatchPlan(attempt=1, global_batch=32, world_size=4)
    assert previous_batch_plan(tmp_path, before_attempt=4) == BatchPlan(attempt=3, global_batch=24, world_size=3)

    changed = Verdict.changed(ChangeReason.BATCH_COMPOSITION, ChangeReason.ORDERING)
    assert not record_batch_change(tmp_path, before=got, after=BatchPlan(attempt=3, global_batch=32, world_size=4),
                                   verdict=changed)
    assert not lineage_path(tmp_path).exists()
    assert record_batch_change(tmp_path, before=got, after=BatchPlan(attempt=3, global_batch=24, world_size=3),
                               verdict=changed)
    (entry,) = read(lineage_path(tmp_path))
    assert entry.kind is EntryKind.BATCH_CHANGE and verify(lineage_path(tmp_path)).ok
    assert (entry.details.old_global_batch, entry.details.new_global_batch, entry.details.attempt) == (32, 24, 3)
    assert "global batch 32 -> 24" in entry.details.text
    with pytest.raises(ValueError, match="nothing changed"):
        NewEntry(kind=EntryKind.BATCH_CHANGE, verdict=changed, details=Details(
            old_world_size=4, new_world_size=4, old_global_batch=32, new_global_batch=32))
