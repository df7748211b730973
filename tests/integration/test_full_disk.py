"""A full disk on real gloo ranks: the canary on a small tmpfs where telemetry and one checkpoint fit and a second
checkpoint does not. The job goes on (the CheckpointConfig policy), the failed saves' partial files are removed and
described in checkpoint_failed events, telemetry keeps its rows, and every reader answers on the full disk. And the
sink alone on the same small disk: rows kept while it is full, what fits written when a little space frees, the rest
once it all frees."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.base.schema import COLUMNS, EventKind, Events, Table
from rankwatch.canary.model import ModelConfig
from rankwatch.cli import main
from rankwatch.collector.sink import ParquetSink, SinkConfig, partition_dir
from rankwatch.recovery.catalog import Verdict, list_checkpoints

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

TMPFS_MB = 20
"""A canary checkpoint of the default model at 4 ranks is 12.6 MB (4 DCP files of 3.2 MB, metadata, rank files);
30 steps of telemetry take under 1 MB here: the first checkpoint fits, the second does not."""
STEPS, EVERY = 30, 10


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(mnt)],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a {TMPFS_MB} MiB tmpfs: {exc}")
    if mounted.returncode:
        pytest.skip(f"mount -t tmpfs not permitted here (needs root or CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def _fill(mnt: Path) -> Path:
    """Write a filler file until the disk is full; returns it."""
    filler = mnt / "filler"
    chunk = b"\0" * 2**16
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    return filler


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()}


def test_a_full_disk_fails_saves_cleanly_keeps_telemetry_and_every_reader_answers(
    small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = small_disk / "run"
    cfg = canary(run_dir, layout="dp=4", steps=STEPS, checkpoint_every=EVERY, model=ModelConfig(), gpu="off",
                 flush_interval_s=1.0)
    result = run(cfg)

    # the policy: a failed save is recorded and training goes on to the end
    assert result.ok, result.exit_codes
    cands = list_checkpoints(run_dir, verify=True)
    assert [(c.path.name, c.verdict) for c in cands] == [("step-00000009", Verdict.COMMITTED)]  # the last good one
    assert sorted(p.name for p in (run_dir / CHECKPOINT_DIR).iterdir()) == ["step-00000009"]  # no .tmp left
    assert not [p for p in small_disk.rglob("*") if ".tmp" in p.name]

    # telemetry kept its rows: every step of every rank, collectives, the checkpoint phases of all three saves
    assert rows(run_dir, "SELECT count(*), max(step) FROM steps") == [(4 * STEPS, STEPS - 1)]
    assert rows(run_dir, "SELECT count(*) > 0 FROM collectives") == [(True,)]
    saves = rows(run_dir, "SELECT step, bool_and(ok) FROM checkpoint_phases GROUP BY step ORDER BY step")
    assert saves == [(9, True), (19, False), (29, False)]
    errors = rows(run_dir, "SELECT DISTINCT error FROM checkpoint_phases WHERE NOT ok")
    assert errors and all(e.startswith("DcpSaveError: rank ") and "\n" not in e for (e,) in errors), errors
    exits = rows(run_dir, "SELECT rank, exit_code, dropped_rows FROM events WHERE kind = 'exit' ORDER BY rank")
    assert exits == [(r, 0, 0) for r in range(4)]

    # each failed save is described on every rank; rank 0's event names the bytes it freed
    failed = rows(run_dir, "SELECT rank, step, message FROM events WHERE kind = 'checkpoint_failed' "
                           "ORDER BY step, rank")
    assert [(r, s) for r, s, _ in failed] == [(r, s) for s in (19, 29) for r in range(4)]
    freed = [int(m.group(1)) for r, _, msg in failed if r == 0 and (m := re.search(r"(\d+) bytes freed", msg))]
    assert len(freed) == 2 and all(f > 2**20 for f in freed), failed
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    assert free > min(freed) // 2, (free, freed)  # the disk is not left full (telemetry written since takes some)
    failed_writes = ("SELECT count(DISTINCT rank) FROM events "
                     "WHERE kind = 'warning' AND message LIKE 'telemetry writes failed%'")
    figures = (f"tmpfs {TMPFS_MB} MiB, bytes freed per failed save {freed}, {free} bytes free after the job, "
               f"{rows(run_dir, 'SELECT count(*) FROM collectives')[0][0]} collective rows, "
               f"{rows(run_dir, 'SELECT count(*) FROM checkpoint_phases')[0][0]} checkpoint-phase rows, "
               f"{rows(run_dir, failed_writes)[0][0]} rank(s) saw telemetry writes fail and retried")
    with capsys.disabled():
        print(f"\nfull disk: {figures}")

    # `train` ends with the failed saves (its last lines read them like this)
    from rankwatch.analytics.saves import failed_saves

    incident = failed_saves(run_dir)
    assert incident is not None and incident.summary.startswith("2 checkpoint save(s) committed nothing (the disk "
                                                                "was full): "), incident

    # every reader answers on a full disk, writes nothing beside the data, and raises nothing
    filler = _fill(small_disk)
    before = _files(run_dir)
    capsys.readouterr()
    assert main(["telemetry", str(run_dir)]) == 0
    assert main(["checkpoints", str(run_dir), "--verify"]) == 0
    assert main(["watch", str(run_dir), "--count", "1", "--every", "0"]) == 0
    assert main(["localize", str(run_dir)]) == 0
    out = capsys.readouterr()
    assert "step-00000009" in out.out and "newest usable: step-00000009" in out.out
    assert main(["analyze", str(run_dir), "--quiet"]) == 0
    out = capsys.readouterr()
    assert f"rankwatch analyze: {run_dir}: 4 ranks, steps 0..{STEPS - 1}" in out.out  # the answer is printed
    # the failed saves are an incident of their own, read as a full disk, with the work at risk
    text = " ".join(out.out.split())
    assert "checkpoint job:checkpoints" in text and "storage_full" in text, out.out
    assert (f"2 checkpoint save(s) committed nothing (the disk was full)" in text
            and f"the last committed checkpoint is at step 9, {STEPS - 1 - 9} step(s) trained since have no "
                "recovery point" in text), out.out
    warnings = [line for line in out.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "could not save the analysis" in warnings[0], out.err
    assert _files(run_dir) == before  # no temporary file, no half-written analysis
    assert not (run_dir / "analysis").exists()
    filler.unlink()


def test_the_sink_keeps_rows_on_a_real_full_disk_and_writes_them_once_space_frees(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    sink = ParquetSink(run_dir, 0, SinkConfig(flush_interval_s=60.0, close_retry_s=0.0))
    sink.start()
    try:
        sink.append(Table.EVENTS, _event(0))
        assert sink.flush(timeout_s=10) and sink.write_errors == 0  # the partition folders exist before the disk fills
        filler = _fill(small_disk)
        for i in range(1, 4):
            sink.append(Table.EVENTS, _event(i))
        assert sink.flush(timeout_s=10)
        assert sink.write_errors == 1 and "No space left on device" in (sink.last_write_error or "")
        assert sink.buffered_rows() == 3 and sink.dropped_total == 0
        assert not [p for p in small_disk.rglob("*") if p.name.startswith(".")]  # no temporary part left behind
        os.truncate(filler, filler.stat().st_size - 2**16)  # 64 KiB free: a part of 4,000 rows does not fit, halves do
        for i in range(4, 4004):
            sink.append(Table.EVENTS, _event(i, message=os.urandom(32).hex()))
        assert sink.flush(timeout_s=10)
        written = _event_steps(run_dir)
        assert written[:4] == [0, 1, 2, 3] and 4 < len(written) < 4004, len(written)
        assert sink.buffered_rows() == 4004 - len(written) and sink.dropped_total == 0
        # rows 1..3 waited too
        assert sink.last_write_error == f"events: disk full: {len(written) - 1} of 4003 rows written"
        filler.unlink()
        assert sink.flush(timeout_s=10) and sink.buffered_rows() == 0
        assert _event_steps(run_dir) == list(range(4004))  # every row, in order
        print(f"\nfull disk, sink: with 64 KiB free {len(written) - 4} of 4000 rows fitted; the rest once space freed")
    finally:
        sink.close(timeout_s=5)


def _event(i: int, message: str | None = None) -> tuple[object, ...]:
    values = {Events.RANK: 0, Events.ATTEMPT: 0, Events.WALL_NS: 1_700_000_000_000_000_000 + i, Events.MONO_NS: i,
              Events.KIND: str(EventKind.HEARTBEAT), Events.STEP: i, Events.MESSAGE: message}
    return tuple(values.get(Events(c.name)) for c in COLUMNS[Table.EVENTS])


def _event_steps(run_dir: Path) -> list[int]:
    parts = sorted(partition_dir(run_dir, Table.EVENTS, 0).glob("part-*.parquet"))
    return [int(r[Events.STEP]) for p in parts for r in pq.read_table(p).to_pylist()]
