"""The host agent beside a rank (`collector.supervise`): the exit record says how the rank ended the moment it does,
tells a signal the launcher sent to the worker's process group from a SIGKILL of the rank alone, forwards a signal
sent to the agent alone, and the agent ends as its rank did."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankwatch.collector.supervise import child_command

pytestmark = pytest.mark.timeout(120)

_ENV = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "TORCHELASTIC_RESTART_COUNT": "1"}


def _start(tmp_path: Path, script: str, *, new_session: bool = False, via_shell: bool = False) -> subprocess.Popen[bytes]:
    path = tmp_path / "rank.py"
    path.write_text(script)
    env = {**os.environ, **_ENV, "RANKWATCH_RUN_DIR": str(tmp_path / "run")}
    cmd = [sys.executable, "-m", "rankwatch.collector.supervise", str(path)]
    if via_shell:  # the agent's parent is a shell, not this test: a signal from here is from "someone else"
        cmd = ["sh", "-c", '"$@" & echo $! > ' + str(tmp_path / "agent.pid") + "; wait $!", "sh", *cmd]
    return subprocess.Popen(cmd, env=env, start_new_session=new_session, preexec_fn=_as_a_launcher_starts_it)


def _as_a_launcher_starts_it() -> None:
    """The agent starts with no signal blocked or ignored, as under torchrun: the pytest process that forks it may
    have either from what ran in it before (a mask and ignored dispositions survive exec), which is not the agent's
    world (a CI run once timed out waiting for the forwarded signal's effect)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for sig in (signal.SIGUSR1, signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _record(tmp_path: Path) -> dict[str, object]:
    path = tmp_path / "run" / "live" / "exit-2.json"
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, "no exit record"
        time.sleep(0.02)
    doc: dict[str, object] = json.loads(path.read_text())
    return doc


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_the_command_is_a_script_a_module_or_an_executable() -> None:
    assert child_command(["t.py", "-x"]) == [sys.executable, "-u", "t.py", "-x"]
    assert child_command(["--module", "pkg.t"]) == [sys.executable, "-u", "-m", "pkg.t"]
    assert child_command(["--exec", "./run.sh"]) == ["./run.sh"]
    with pytest.raises(ValueError, match="no training script given"):
        child_command(["--module"])


def test_an_exit_code_is_recorded_and_passed_on(tmp_path: Path) -> None:
    agent = _start(tmp_path, "import sys; sys.exit(3)")
    assert agent.wait(timeout=30) == 3
    doc = _record(tmp_path)
    assert (doc["rank"], doc["world_size"], doc["attempt"], doc["exit_code"], doc["signal"],
            doc["outside_signal"]) == (2, 4, 1, 3, None, None)


def test_a_sigkill_of_the_rank_alone_is_signal_9_with_nothing_from_outside(tmp_path: Path) -> None:
    agent = _start(tmp_path, "import os, signal, time\nopen(os.environ['RANKWATCH_RUN_DIR'] + '.pid', 'w')"
                             ".write(str(os.getpid()))\ntime.sleep(60)\n")
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    pid_file = Path(str(tmp_path / "run") + ".pid")
    _wait_for(pid_file)
    t0 = time.time_ns()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert agent.wait(timeout=30) == -signal.SIGKILL  # the launcher reads the same signal
    doc = _record(tmp_path)
    assert (doc["exit_code"], doc["signal"], doc["outside_signal"]) == (None, 9, None)
    assert 0 <= int(str(doc["wall_ns"])) - t0 < 2_000_000_000  # recorded the moment it ended


def test_the_launchers_sigterm_to_the_process_group_is_recorded_as_from_outside(tmp_path: Path) -> None:
    # torchrun: the worker is a session leader and is stopped with os.killpg(pid, SIGTERM)
    agent = _start(tmp_path, "import os, time\nopen(os.environ['RANKWATCH_RUN_DIR'] + '.pid', 'w')"
                             ".write(str(os.getpid()))\ntime.sleep(60)\n", new_session=True)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    _wait_for(Path(str(tmp_path / "run") + ".pid"))
    t0 = time.time_ns()
    os.killpg(agent.pid, signal.SIGTERM)
    assert agent.wait(timeout=30) == -signal.SIGTERM
    doc = _record(tmp_path)
    assert (doc["signal"], doc["outside_signal"]) == (15, 15)
    assert int(str(doc["outside_signal_ns"])) >= t0


def test_a_signal_sent_to_the_agent_alone_is_forwarded_to_its_rank(tmp_path: Path) -> None:
    script = ("import os, signal, sys, time\n"
              "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(7))\n"
              "open(os.environ['RANKWATCH_RUN_DIR'] + '.pid', 'w').write(str(os.getpid()))\n"
              "time.sleep(60)\n")
    shell = _start(tmp_path, script, via_shell=True)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    _wait_for(Path(str(tmp_path / "run") + ".pid"))
    _wait_for(tmp_path / "agent.pid")
    os.kill(int((tmp_path / "agent.pid").read_text()), signal.SIGUSR1)
    assert shell.wait(timeout=90) == 7
    doc = _record(tmp_path)
    assert (doc["exit_code"], doc["outside_signal"]) == (7, signal.SIGUSR1)
