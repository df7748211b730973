"""Bad input to the command line gets one clear line and exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.cli import main


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--fault", "bogus:rank=1"], "unknown fault 'bogus'"),
        (["--fault", "slow:rank=1"], "missing delay="),
        (["--fault", "slow:rank=9,delay=1"], "rank 9 does not exist"),
        (["--layout", "dp=3,tp=2"], "the product must equal it"),
        (["--layout", "zz=2"], "expected comma-separated dp=N,tp=N,pp=N"),
        (["--hosts", "3"], "--hosts 3 must be >= 1 and divide the world size 4"),
        (["--gpu", "cuda"], "valid values are auto, nvml, replay, off"),
    ],
)
def test_train_bad_input(argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", "--nproc", "4", "--steps", "2", "--run-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert expected in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()  # nothing launched, nothing written


def test_telemetry_of_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["telemetry", str(tmp_path / "nope")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "not a run directory" in captured.err
