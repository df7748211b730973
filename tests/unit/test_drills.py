"""The drill report (dataclass, JSON, table), the drill command's bad input, and the Monitor the drills run."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rankwatch.canary.drills import (
    DRILLS, REPORT_FILE, DrillReport, Tamper, drill_config, read_report, report_json, report_table, run_drill,
    write_report,
)
from rankwatch.canary.drills.run import _cut_connections, _tamper, _tcp_connections
from rankwatch.cli import main
from rankwatch.control.monitor import Monitor
from rankwatch.recovery.catalog import Verdict, list_checkpoints
from support import make_checkpoint

PASS = DrillReport(name="sigkill", fault="SIGKILL of rank 1", passed=True, reason="bitwise equal", detected="fail_stop rank:1",
                   detect_s=0.23, decision="restart_job (job)", decision_s=0.27, recovery="recovery-0001: recovered",
                   gate="gate=none", resume_from="step-00000019", training_again_s=21.5, steps_lost=9, attempts=2,
                   bitwise=True, run_dir="/tmp/x")
FAIL = DrillReport(name="sigstop", fault="SIGSTOP of rank 1", passed=False,
                   reason="TimeoutError: hang rank:1 detected: not within 60 s")


def test_report_round_trips_through_json(tmp_path: Path) -> None:
    path = write_report(tmp_path / REPORT_FILE, [PASS, FAIL])
    doc = json.loads(path.read_text())
    assert doc["passed"] is False and [d["verdict"] for d in doc["drills"]] == ["PASS", "FAIL"]
    assert read_report(path) == (PASS, FAIL)
    assert report_json([PASS])["passed"] is True
    assert report_json([])["passed"] is False  # no drill run is not a pass


def test_a_damaged_report_is_one_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / REPORT_FILE
    bad.write_text("{")
    with pytest.raises(ValueError, match=str(bad)):
        read_report(bad)


def test_table_has_one_row_per_drill_with_the_verdict_and_its_reason() -> None:
    lines = report_table([PASS, FAIL]).splitlines()
    assert len(lines) == 3 and lines[0].split()[:3] == ["drill", "detected", "detect_s"]
    assert lines[1].startswith("sigkill ") and "0.23" in lines[1] and "21.50" in lines[1] and lines[1].endswith(
        "PASS: bitwise equal")
    assert lines[2].startswith("sigstop ") and lines[2].endswith("FAIL: TimeoutError: hang rank:1 detected: not "
                                                                 "within 60 s")
    assert lines[2].split()[1] == "-"  # nothing detected
    assert lines[1].index("PASS") == lines[2].index("FAIL")  # columns aligned


def test_every_drill_config_is_valid(tmp_path: Path) -> None:
    for spec in DRILLS.values():
        cfg = drill_config(tmp_path / spec.name, spec.faults)
        assert cfg.world_size == 4 and cfg.checkpoint_every and cfg.fingerprint_every
        assert spec.rank < cfg.world_size
        # one fault each: an outside signal (after a spoiled checkpoint or under a save fault) or connection cut, or
        # an in-job one
        assert (spec.signal is not None or spec.cut) != bool(spec.faults.specs()), spec.name
        assert not (spec.signal is not None and spec.cut), spec.name
        assert spec.tamper is None and not spec.env or spec.signal is not None, spec.name


def test_tampering_spoils_the_newest_committed_checkpoint_so_the_catalog_rejects_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in (9, 19):
        make_checkpoint(run, step)
    assert "cut" in _tamper(run, Tamper.MANIFEST, 1)
    make_checkpoint(run, 29)
    assert "flipped the byte" in _tamper(run, Tamper.SHARD, 1)
    got = {c.path.name: c.verdict for c in list_checkpoints(run, verify=True)}
    assert got == {"step-00000009": Verdict.COMMITTED, "step-00000019": Verdict.CORRUPT,
                   "step-00000029": Verdict.CORRUPT}
    with pytest.raises(RuntimeError, match="no committed checkpoint to tamper with"):
        _tamper(tmp_path / "empty", Tamper.SHARD, 1)


def test_an_unknown_drill_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown drill 'nope'"):
        run_drill("nope", tmp_path)


@pytest.mark.parametrize(("argv", "expected"), [([], "name drills or give --all"),
                                                (["sigkill", "--all"], "name drills or give --all"),
                                                (["nope"], "unknown drill 'nope'")])
def test_drill_command_bad_input(argv: list[str], expected: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drill", *argv, "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
    assert not (tmp_path / "reference").exists()  # refused before anything ran


def test_monitor_keeps_each_incident_first_seen_with_its_clock(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--ranks", "16", "--hosts", "2", "--layout", "dp=4,tp=2,pp=2", "--steps", "60",
                 "--out", str(out), "--fault", "gpu_slow:rank=5,from=30,factor=1.3", "--no-phases"]) == 0
    said: list[str] = []
    warned: list[str] = []
    m = Monitor(out, window=40, every=0, poll=0.01, anomaly=False, say=said.append, warn=warned.append)
    m.run(count=2)
    assert said[0].startswith(f"rankwatch watch: {out}") and any(s.startswith("[steps 20..59]") for s in said)
    assert [(s.source, s.incident.klass, str(s.incident.subject)) for s in m.seen] == [
        ("parts", "straggler", "rank:5")]
    assert m.ticks == 2 and m.sent_bodies() == []
    with pytest.raises(ValueError, match="--webhook and --secret-file go together"):
        Monitor(out, webhook="http://127.0.0.1:1/alerts")
    with pytest.raises(ValueError, match="--poll 0 must be > 0"):
        Monitor(out, poll=0)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")
def test_cutting_a_processs_connections_resets_its_peers_and_leaves_it_alive() -> None:
    """The partition drill's outside action on a real process: every established TCP connection of the pid is
    destroyed; its peer (here the test) reads a reset, the process lives and sees its own end aborted."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys\n"
        f"c = socket.create_connection(('127.0.0.1', {port}))\n"
        "print('up', flush=True)\n"
        "try:\n    c.recv(1)\nexcept OSError as e:\n    print(e.strerror, flush=True)\n"
        "input()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    conn: socket.socket | None = None
    try:
        conn, _ = srv.accept()
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        assert len(_tcp_connections(child.pid)) == 1
        assert _cut_connections(child.pid) == "1 TCP connection(s)"
        assert child.stdout.readline().strip() == "Software caused connection abort"  # its own end: local
        with pytest.raises(ConnectionResetError):  # the peer's: the other end went away
            conn.recv(1)
        assert child.poll() is None and _tcp_connections(child.pid) == []
        with pytest.raises(RuntimeError, match="no established TCP connection"):
            _cut_connections(child.pid)
    finally:
        child.kill()
        child.communicate(timeout=10)
        if conn is not None:
            conn.close()
        srv.close()
