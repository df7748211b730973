"""`rankwatch train --resume` on a bad run directory: a one-line error before anything is launched, created or
appended."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rankwatch.base.rundir import RUN_FILE
from rankwatch.canary.config import config_from_run
from rankwatch.cli import main
from rankwatch.recovery.lineage import Details, EntryKind, Lineage, NewEntry, Verdict, lineage_path

pytestmark = pytest.mark.timeout(60)


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _train(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["train", "--nproc", "2", "--steps", "4", "--run-dir", str(run_dir), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _good_run(run: Path) -> Path:
    run.mkdir()
    (run / RUN_FILE).write_text(json.dumps({"launches": [{"attempt": 0, "layout": "dp=2,tp=1,pp=1", "steps": 4}]}))
    (run / "checkpoints").mkdir()
    book = Lineage(lineage_path(run))
    for k in range(3):
        book.append(NewEntry(kind=EntryKind.RESTART, verdict=Verdict.identical(), details=Details(to_step=k + 1)))
    return run


def test_resume_never_creates_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _train(tmp_path / "mistyped", capsys)
    assert "mistyped: no such run directory (--resume never creates a run)" in err
    assert not (tmp_path / "mistyped").exists()


def test_a_file_given_as_the_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "run.txt"
    f.write_text("not a run")
    assert "run.txt: not a directory" in _train(f, capsys)
    code = main(["train", "--nproc", "2", "--steps", "4", "--run-dir", str(f)])
    assert code == 2 and "run.txt: not a directory" in capsys.readouterr().err
    assert f.read_text() == "not a run"


@pytest.mark.parametrize("damage,message", [
    ("run_json_list", "run.json: not a run file"),
    ("run_json_torn", "run.json: unreadable run file"),
    ("run_json_attempt", "run.json: launch 0: 'attempt' is 'zero', not int"),
    ("edited_entry", "lineage does not verify at seq 0 (edited"),
    ("deleted_entry", "lineage does not verify at seq 1 (deleted"),
    ("no_checkpoints", "checkpoints: no checkpoints folder"),
])
def test_damaged_run_dirs_are_refused_and_left_as_they_were(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            damage: str, message: str) -> None:
    run = _good_run(tmp_path / "run")
    if damage == "run_json_list":
        (run / RUN_FILE).write_text("[]")
    elif damage == "run_json_torn":
        (run / RUN_FILE).write_text('{"launches": [')
    elif damage == "run_json_attempt":
        (run / RUN_FILE).write_text(json.dumps({"launches": [{"attempt": "zero"}]}))
    elif damage == "edited_entry":
        path = lineage_path(run)
        path.write_text(path.read_text().replace('"to_step":1', '"to_step":7', 1))
    elif damage == "deleted_entry":
        lines = lineage_path(run).read_text().splitlines(keepends=True)
        lineage_path(run).write_text(lines[0] + lines[2])
    else:
        (run / "checkpoints").rmdir()
    before = _snapshot(run)
    assert message in _train(run, capsys)
    assert _snapshot(run) == before


def test_config_from_run_names_a_record_of_the_wrong_shape(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_FILE).write_text(json.dumps({"launches": [{"attempt": 0, "steps": 4, "layout": "dp=2", "world_size": 2,
                                                          "hosts": 1, "seed": 0, "checkpoint_every": 0, "threads": 1,
                                                          "collector": True, "model": 3}]}))
    with pytest.raises(ValueError, match="run.json: launch record of the wrong shape"):
        config_from_run(run)


def test_lineage_command_verifies_the_chain_and_lists_promises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _good_run(tmp_path / "run")
    assert main(["lineage", str(run)]) == 0
    out = capsys.readouterr().out
    assert "3 entries, chain verified; run bitwise_identical_expected" in out
    assert out.count(": not_checkable: a restart trains no step twice") == 3
    path = lineage_path(run)
    path.write_text(path.read_text().replace('"to_step":2', '"to_step":9', 1))
    before = path.read_bytes()
    assert main(["lineage", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rankwatch lineage: error: {path}: lineage does not verify at seq 1 (edited")
    assert len(err.splitlines()) == 1 and path.read_bytes() == before
    assert main(["lineage", str(tmp_path / "nothing")]) == 2
    assert "nothing: not a run directory" in capsys.readouterr().err
    (tmp_path / "fresh").mkdir()
    assert main(["lineage", str(tmp_path / "fresh")]) == 2  # an empty folder is no run
    assert "fresh: not a run directory (none of run.json" in capsys.readouterr().err
    (tmp_path / "fresh" / "telemetry").mkdir()  # a run that was never resumed
    assert main(["lineage", str(tmp_path / "fresh")]) == 0
    assert "no lineage entries" in capsys.readouterr().out
