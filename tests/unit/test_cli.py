"""Bad input to the command line gets one clear line and exit code 2."""

from __future__ import annotations

import sys
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
        (["--rollup-every", "0"], "--rollup-every must be > 0 seconds, got 0.0"),
        (["--rollup-every", "5", "--supervise", "1"], "--rollup-every and --supervise"),
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


def test_analyze_bad_runs_get_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(tmp_path / "nope"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1
    (tmp_path / "empty" / "telemetry").mkdir(parents=True)
    assert main(["analyze", str(tmp_path / "empty"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no telemetry part files" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--fault", "bogus:rank=1"], "unknown kind 'bogus'"),
        (["--fault", "gpu_slow:rank=99,from=3,factor=1.1"], "rank 99 outside world size 16"),
        (["--fault", "gpu_slow:rank=1,from=x,factor=1.1"], "from='x' is not a valid value"),
        (["--layout", "dp=3"], "dp*tp*pp=3 but --ranks is 16; the product must equal it"),
        (["--hosts", "3"], "--hosts 3 must be >= 1 and divide the world size 16"),
    ],
)
def test_simulate_bad_input(argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--ranks": "16", "--hosts": "2", "--steps": "20", "--out": str(tmp_path / "sim")}
    for i in range(0, len(argv), 2):
        args[argv[i]] = argv[i + 1] if argv[i] != "--fault" else args.get("--fault", "") + argv[i + 1]
    flat = [x for kv in args.items() for x in kv]
    rc = main(["simulate", *flat])
    err = capsys.readouterr().err
    assert rc == 2
    assert expected in err and err.count("\n") == 1
    assert not (tmp_path / "sim").exists()


def test_simulate_analyze_and_localize(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--ranks", "16", "--hosts", "2", "--layout", "dp=4,tp=2,pp=2", "--steps", "60",
                 "--out", str(out), "--fault", "gpu_slow:rank=5,from=30,factor=1.3", "--no-phases"]) == 0
    said = capsys.readouterr()
    assert "expect straggler rank:5 from step 30" in said.out
    assert "  .. writing steps (" in said.err  # simulate at 2,048 ranks takes ~20 s: a line per table
    assert main(["analyze", str(out), "--json", "--quiet"]) == 0
    import json

    incidents = json.loads(capsys.readouterr().out)["incidents"]
    assert [(i["class"], i["subject_kind"], i["subject"]) for i in incidents] == [("straggler", "rank", "5")]
    assert (out / "analysis" / "incidents.parquet").exists()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a person at a terminal
    assert main(["localize", str(out)]) == 0
    said = capsys.readouterr()
    assert "follows inconclusive" in said.out  # one run cannot tell a device from a rank
    assert said.err.startswith("rankwatch localize: reading every run's incidents …")  # before seconds of work


def test_analyze_warns_about_a_cut_part_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--ranks", "8", "--hosts", "2", "--layout", "dp=4,tp=2", "--steps", "30",
                 "--out", str(out), "--no-phases"]) == 0
    victim = next((out / "telemetry" / "collectives" / "rank=3").glob("part-*.parquet"))
    victim.write_bytes(victim.read_bytes()[:100])
    capsys.readouterr()
    assert main(["analyze", str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(victim) in warnings[0] and "left out" in warnings[0]
    assert "no incidents" in captured.out


def test_watch_reports_each_incident_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--ranks", "16", "--hosts", "2", "--layout", "dp=4,tp=2,pp=2", "--steps", "60",
                 "--out", str(out), "--fault", "gpu_slow:rank=5,from=30,factor=1.3", "--no-phases"]) == 0
    capsys.readouterr()
    assert main(["watch", str(out), "--window", "40", "--every", "0", "--count", "2", "--no-anomaly"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("straggler" in line and "rank:5" in line for line in lines) == 1
    assert any(line.startswith("[steps 20..59]") for line in lines)


def test_checkpoints_of_a_run_without_any(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["checkpoints", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "checkpoints" / ".step-00000004.tmp").mkdir(parents=True)
    assert main(["checkpoints", str(tmp_path), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "1 candidate(s)" in out and "partial" in out and "no usable checkpoint" in out


def test_evidence_of_analyzed_incidents(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    assert main(["evidence", str(out)]) == 2  # no run, no analysis: one line
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["simulate", "--ranks", "16", "--hosts", "2", "--layout", "dp=4,tp=2,pp=2", "--steps", "60",
                 "--out", str(out), "--fault", "gpu_slow:rank=5,from=30,factor=1.3", "--no-phases"]) == 0
    assert main(["analyze", str(out), "--quiet", "--no-anomaly"]) == 0
    capsys.readouterr()
    assert main(["evidence", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    inc_id = line.split(":")[0]
    bundle = out / "evidence" / inc_id
    assert (bundle / "evidence.json").exists()
    assert sorted(p.name for p in (bundle / "telemetry" / "steps").iterdir()) == ["rank=5"]  # the affected rank only
    assert len(list((bundle / "telemetry" / "events").iterdir())) == 16  # events of every rank
    assert main(["evidence", str(out), "--incident", "nope"]) == 2


@pytest.mark.timeout(120)
def test_watch_sends_each_incident_signed_to_the_webhook_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`watch --webhook`: the straggler of a simulated run reaches a real loopback receiver once, as a verified
    Standard Webhooks request with an Alertmanager-v4 body; a second monitor on the same outbox sends it again never."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from standardwebhooks.webhooks import Webhook

    out = tmp_path / "sim"
    assert main(["simulate", "--ranks", "16", "--hosts", "2", "--layout", "dp=4,tp=2,pp=2", "--steps", "60",
                 "--out", str(out), "--fault", "gpu_slow:rank=5,from=30,factor=1.3", "--no-phases"]) == 0
    secret = tmp_path / "secret"
    assert main(["webhook-secret", str(secret)]) == 0
    assert main(["webhook-secret", str(secret)]) == 2  # never overwritten
    hook = Webhook(secret.read_text().strip())
    got: list[dict[str, object]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            hook.verify(body, {k.lower(): v for k, v in self.headers.items()})  # raises on a bad signature
            got.append({"id": self.headers["webhook-id"], **json.loads(body)})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/alerts"
    try:
        capsys.readouterr()
        argv = ["watch", str(out), "--window", "40", "--every", "0", "--count", "2", "--no-anomaly", "--poll", "0.05",
                "--webhook", url, "--secret-file", str(secret)]
        assert main(argv) == 0
        assert main(argv) == 0  # a restarted monitor: the outbox remembers what was sent
    finally:
        server.shutdown()
        server.server_close()
    firing = [m for m in got if m["type"] == "incident.firing"]
    assert len(firing) == 1 and len({m["id"] for m in got}) == len(got)
    (m,) = firing
    assert m["version"] == "4" and m["status"] == "firing"
    (alert,) = m["alerts"]  # type: ignore[misc]
    assert alert["labels"]["class"] == "straggler" and alert["labels"]["rank"] == "5"
    assert all(isinstance(v, str) for v in alert["annotations"].values())
    assert "no decisions sent" in capsys.readouterr().err  # a simulated run records no launch: incidents only


# -- the shape of the command line ----------------------------------------------------------------------------------

def _walk(parser: object, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    import argparse

    assert isinstance(parser, argparse.ArgumentParser)
    found: list[tuple[tuple[str, ...], object]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.append(((*path, name), child))
                found += _walk(child, (*path, name))
    return found


def test_every_command_has_a_description_and_every_flag_a_help_text() -> None:
    import argparse

    from rankwatch.cli import build_parser

    parser = build_parser()
    commands = _walk(parser)
    assert len(commands) >= 18
    missing = []
    for path, child in [((), parser), *commands]:
        assert isinstance(child, argparse.ArgumentParser)
        if path and path != ("torchrun",) and not child.description:
            missing.append(f"{' '.join(path)}: no description")
        for action in child._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not action.help:
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}: no help")
    assert missing == []
    help_text = dict(commands)[("simulate",)].format_help()  # type: ignore[attr-defined]
    assert "(default: 50)" in help_text  # --fingerprint-every: defaults shown


def test_version_typos_and_the_other_spelling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"rankwatch {__version__}"
    assert main(["analyzee", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "rankwatch: error: unknown command 'analyzee' (did you mean 'analyze'?); `rankwatch --help` lists them")
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate';" in capsys.readouterr().err
    assert main(["analyse", str(tmp_path / "nope"), "--quiet"]) == 2  # the other spelling is the same command
    assert capsys.readouterr().err.strip() == f"rankwatch analyze: error: {tmp_path / 'nope'}: not a run directory " \
                                              "(does not exist)"


@pytest.mark.parametrize("command", ["checkpoints", "lineage", "telemetry", "analyze", "recover", "postmortem"])
def test_a_folder_that_is_no_run_is_refused_at_once(command: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "photos").mkdir()
    extra = ["--out", str(tmp_path / "x.ipynb")] if command == "postmortem" else []
    assert main([command, str(tmp_path / "photos"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run directory (none of run.json, telemetry" in err, err


@pytest.mark.parametrize("width", [80, 120])
def test_the_incidents_table_fits_the_terminal(width: int) -> None:
    from rankwatch.analytics.analyze import render_incidents
    from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind

    long_summary = ("GPU GPU-3f1c2a4e-9b7d-4c1e-8a2f-5d6e7f8a9b0c of rank 5 runs at 41 % of its maximum clock with the "
                    "thermal throttle reason set for 14 of 14 slow steps; its compute is 148.6 % of its peers'")
    incidents = [
        Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.DEVICE,
                 id="GPU-3f1c2a4e-9b7d-4c1e-8a2f-5d6e7f8a9b0c"), ranks=(5,), onset_step=120, detection_step=128,
                 confidence=0.93, cause=Cause.THERMAL_THROTTLE, summary=long_summary),
        Incident(klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.RANK, id="2"), ranks=(2,),
                 onset_step=216, detection_step=216, confidence=0.95, cause=Cause.UNKNOWN, summary="short"),
    ]
    text = render_incidents(incidents, width=width)
    assert max(len(line) for line in text.splitlines()) <= width, text
    words = " ".join(line.strip() for line in text.splitlines())
    assert "148.6 %" in words and "rank:2" in words  # wrapped, not cut
    assert len(render_incidents(incidents).splitlines()) == 3  # without a width: one line each, as before


def test_drill_lists_every_drill_and_suggests_a_near_name(capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch.canary.drills import DRILLS

    assert main(["drill", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(DRILLS) and len(listed) >= 15
    assert main(["drill", "sigkil"]) == 2
    assert "unknown drill 'sigkil' (did you mean 'sigkill'?)" in capsys.readouterr().err


# -- one fault syntax for train and simulate ------------------------------------------------------------------------


def test_train_and_simulate_help_list_the_shared_kinds_with_the_same_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    from rankwatch.canary.faults import FAULT_KEYS, FaultKind
    from rankwatch.cli import build_parser
    from rankwatch.simulator.faults import SHARED_KINDS, SIM_FAULT_HELP

    monkeypatch.setenv("COLUMNS", "4000")  # no wrapping inside a spec
    commands = dict(_walk(build_parser()))
    text = {name: " ".join(commands[(name,)].format_help().split())  # type: ignore[attr-defined]
            for name in ("train", "simulate")}
    assert SIM_FAULT_HELP in text["simulate"]  # cli.py spells the simulator's vocabulary out: the same words
    for kind in SHARED_KINDS:
        listed = {name: re.findall(rf"(?<![\w]){kind}:((?:\w+=,?)*)", help_text) for name, help_text in text.items()}
        assert listed["train"] == listed["simulate"] == [",".join(f"{key}=" for key in FAULT_KEYS[FaultKind(kind)])]
    for old in ("straggler:", "fail_stop:", "slow="):
        assert old not in text["simulate"]


@pytest.mark.parametrize(
    ("command", "spec", "expected"),
    [
        ("train", "slwo:rank=1,delay=0.1", "unknown fault 'slwo' in 'slwo:rank=1,delay=0.1' (did you mean 'slow'?)"),
        ("simulate", "slwo:rank=1,delay=0.01", "sim fault 'slwo:rank=1,delay=0.01': unknown kind 'slwo' (did you "
                                               "mean 'slow'?)"),
        ("simulate", "freeze:rank=1,step=3,seconds=2", "sim fault 'freeze:rank=1,step=3,seconds=2': freeze is a "
                                                       "train-only fault"),
        ("simulate", "slow:rank=1,delay=0.2", "delay=0.2 is 245% of rank 1's compute (0.0816 s a step); the "
                                              "simulator models delay=0.00408..0.0816"),  # pp=1: loss on every rank
    ],
)
def test_a_mistyped_or_train_only_fault_is_one_line(command: str, spec: str, expected: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = (["train", "--nproc", "4", "--steps", "2", "--run-dir", str(tmp_path / "run")] if command == "train" else
            ["simulate", "--ranks", "16", "--hosts", "4", "--steps", "20", "--out", str(tmp_path / "run")])
    assert main([*argv, "--fault", spec]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("timing", "cause"), [("cpu", "unknown"), ("gpu", "host_stall")])
def test_simulate_takes_trains_spelling(timing: str, cause: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Train's `slow` is a stall of the rank's host thread: on the device clock told apart as host_stall."""
    assert main(["simulate", "--ranks", "16", "--hosts", "4", "--layout", "dp=4,tp=2,pp=2", "--steps", "30",
                 "--out", str(tmp_path / "sim"), "--timing", timing, "--no-phases",
                 "--fault", "slow:rank=5,from=10,delay=0.03", "--fault", "kill:rank=9,step=25,signal=15"]) == 0
    out = capsys.readouterr().out
    assert f"expect straggler rank:5 from step 10 ({cause})" in out
    assert "expect fail_stop rank:9 from step 25 (signal)" in out
