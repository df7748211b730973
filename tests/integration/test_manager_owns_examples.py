"""The recovery manager owning a job it did not write: `ManagerService` launches an example's own command line
(`rankwatch torchrun --standalone --nproc-per-node 4 examples/<name>.py ... --resume`, through `control.command`), a
`Monitor` watches the run and sends signed alerts, rank 1 is SIGKILLed from outside mid-run; the service stops what
is left of the job, decides, and relaunches the same command behind the consistency gate, from the checkpoint its
policy chose. The job must end bitwise equal to a run that was never interrupted (every rank's parameter and
optimizer fingerprints at every step the relaunch trained), with the recovery in the lineage.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rankwatch.base.rundir import QuarantineEntry, read_launches, write_quarantine
from rankwatch.base.topology import Layout
from rankwatch.control.command import CommandJob, CommandLauncher
from rankwatch.control.monitor import Monitor
from rankwatch.control.service import ManagerService
from rankwatch.control.signer import write_secret
from rankwatch.control.manager import continue_on
from rankwatch.recovery.catalog import Verdict, list_checkpoints
from rankwatch.recovery.decision import MembershipSupport

from example_jobs import EXAMPLES_DIR, FAULT_VARS, WORLD, live_record, run_ok
from test_resume_examples import ARGS, STEPS, fingerprints, lineage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def _wait(pred: Callable[[], bool], timeout_s: float, what: str, failed: list[BaseException]) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert not failed, f"the monitor failed: {failed[0]!r}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.1)


def _job(run_dir: Path, example: str, extra: tuple[str, ...], **kw: Any) -> CommandJob:
    command = [sys.executable, "-m", "rankwatch.cli", "torchrun", "--standalone", "--nproc-per-node", str(WORLD),
               str(EXAMPLES_DIR / f"{example}.py"), "--steps", str(STEPS), *ARGS, *extra]
    layout = Layout(dp=2, tp=2) if example == "fsdp_tp_2d" else None
    return CommandJob.from_args(run_dir, command, layout=layout,
                                env={"OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "2000"}, **kw)


def _kill_under_the_manager(tmp_path: Path, job: CommandJob, *, before_kill: Callable[[], None] = lambda: None
                            ) -> tuple[dict[str, Any], list[str]]:
    """Serve `job`, watch it with a monitor sending signed alerts, SIGKILL rank 1 after step 13, and wait until the
    service carried out its decision and the job ended; the service's final /status and the monitor's lines."""
    run_dir = job.run_dir
    secret_file = tmp_path / "webhook.secret"
    write_secret(secret_file)
    stop = threading.Event()
    failed: list[BaseException] = []
    notes: list[str] = []
    with ManagerService(run_dir, secret=secret_file.read_text().strip(), job=job,
                        launcher=CommandLauncher(term_grace_s=5.0), load_job=CommandJob.from_run) as svc:
        manager = svc.manager
        _wait(lambda: manager.status()["job"]["state"] == "running", 120, "the job running", failed)
        monitor = Monitor(run_dir, window=20, every=1.0, poll=0.1, webhook=f"{svc.url}/alerts",
                          secret_file=secret_file, load_job=CommandJob.from_run, say=notes.append, warn=notes.append)

        def watch() -> None:
            try:
                monitor.run(stop=stop)
            except BaseException as exc:  # noqa: BLE001 - the test's failure
                failed.append(exc)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            victim = live_record(run_dir, 1, min_step=13)
            pids = manager.status()["job"]["pids"]
            assert victim.pid == pids[1], (victim.pid, pids)  # the service learned the ranks' own pids
            before_kill()
            os.kill(victim.pid, signal.SIGKILL)
            _wait(lambda: (manager.status()["last_decision"] or {}).get("state") in ("done", "failed"), 240,
                  "the decision carried out", failed)
        finally:
            stop.set()
            watcher.join(30)
        return manager.status(), notes


@pytest.mark.parametrize("example", ["ddp_gpt", "fsdp2_transformer", "fsdp_tp_2d"])
def test_manager_recovers_a_killed_example_bitwise(tmp_path: Path, example: str, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    for var in FAULT_VARS:
        monkeypatch.delenv(var, raising=False)
    extra = ("--tp", "2") if example == "fsdp_tp_2d" else ()
    reference = run_ok(tmp_path / "reference", example, *ARGS, *extra, steps=STEPS)
    run_dir = (tmp_path / "managed" / "run").resolve()
    run_dir.mkdir(parents=True)
    status, notes = _kill_under_the_manager(tmp_path / "managed", _job(run_dir, example, extra))
    decision = status["last_decision"]
    log = "\n".join(notes[-30:])
    assert decision["state"] == "done" and decision["action"] in ("restart_job", "rollback_domain"), (decision, log)
    assert status["job"]["state"] == "finished", status
    records = sorted((run_dir / "recovery").glob("recovery-*.json"))
    assert len(records) == 1, records
    record = json.loads(records[0].read_text())
    assert record["outcome"] == "recovered", record
    assert any(d["class"] == "fail_stop" and d["subject"] == "rank:1" for d in record["decisions"]), record

    launches = json.loads((run_dir / "run.json").read_text())["launches"]
    assert [rec["job"] for rec in launches] == ["command", "command"], launches
    resumed_from = launches[1]["resume_from"]
    assert resumed_from == record["checkpoint"], (launches[1], record)
    step = int(resumed_from.split("-")[1])
    killed_at = max(s for (_, s) in fingerprints(run_dir, 0))
    every = int(ARGS[ARGS.index("--save-every") + 1])
    assert killed_at - 2 * every < step <= killed_at, (step, killed_at)  # the newest save committed before the kill
    assert all(c.verdict is not Verdict.PARTIAL for c in list_checkpoints(run_dir, verify=False))
    attempt_log = (run_dir / "manager" / "attempt-1.log").read_text()
    assert f"resume from {resumed_from}" in attempt_log, attempt_log[-3000:]

    want = fingerprints(reference)
    got = fingerprints(run_dir, 1)
    trained = sorted({s for (_, s) in got})
    assert trained[0] == step + 1 and trained[-1] == STEPS - 1, trained
    assert set(got) == {(r, s) for r in range(WORLD) for s in trained}
    assert got == {k: want[k] for k in got}, "the recovered run left the uninterrupted trajectory"
    names = [e["kind"] for e in lineage(run_dir)]
    assert "rollback" in names or "restart" in names, names


def _quarantine_device_1(run_dir: Path) -> Callable[[], None]:
    """An operator's quarantine of device 1 while the job runs (its rank is then SIGKILLed): the relaunch cannot
    place the whole world on the three devices left."""
    return lambda: write_quarantine(run_dir, [QuarantineEntry(kind="device", id="1", incident="operator")])


def test_a_declared_data_parallel_job_goes_on_with_fewer_ranks_and_lineage_says_so(tmp_path: Path) -> None:
    run_dir = (tmp_path / "run").resolve()
    run_dir.mkdir()
    job = _job(run_dir, "ddp_gpt", (), membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH,
               devices=["0", "1", "2", "3"])
    assert continue_on(job, 3)[0] and not continue_on(job, 5)[0]
    status, notes = _kill_under_the_manager(tmp_path, job, before_kill=_quarantine_device_1(run_dir))
    decision = status["last_decision"]
    assert decision["state"] == "done" and status["job"]["state"] == "finished", (status, notes[-20:])
    launches = read_launches(run_dir)
    assert launches[-1]["world_size"] == 3 and launches[-1]["env"] == launches[0]["env"]
    assert "--nproc-per-node 3" in " ".join(launches[-1]["command"])
    assert launches[-1]["placement"] == {"0": [job.host, 0, "0"], "1": [job.host, 2, "2"], "2": [job.host, 3, "3"]}
    changes = [e for e in lineage(run_dir) if e["kind"] == "world_size_change"]
    assert len(changes) == 1 and changes[0]["verdict"]["comparability"] == "changed", changes
    assert (changes[0]["details"]["old_world_size"], changes[0]["details"]["new_world_size"]) == (4, 3)
    # the example keeps its per-rank batch (--batch-size 8): the global batch shrinks, and the lineage says so
    assert (changes[0]["details"]["old_global_batch"], changes[0]["details"]["new_global_batch"]) == (32, 24)
    got = fingerprints(run_dir, len(launches) - 1)
    assert {r for (r, _) in got} == {0, 1, 2} and max(s for (_, s) in got) == STEPS - 1


def test_a_shrink_with_no_checkpoint_restarts_from_step_0_and_the_job_records_its_new_batch(tmp_path: Path) -> None:
    """No save before the kill: the manager restarts the declared data-parallel job from step 0 on 3 ranks and
    records the restart and the world change; the batch it re-planned only the job knows, and its Checkpointer adds
    it (a BATCH_CHANGE, from the killed attempt's own `global_batch` event)."""
    run_dir = (tmp_path / "run").resolve()
    run_dir.mkdir()
    job = _job(run_dir, "ddp_gpt", ("--save-every", "1000"), membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH,
               devices=["0", "1", "2", "3"])
    status, notes = _kill_under_the_manager(tmp_path, job, before_kill=_quarantine_device_1(run_dir))
    assert status["last_decision"]["state"] == "done" and status["job"]["state"] == "finished", (status, notes[-20:])
    launches = read_launches(run_dir)
    assert launches[-1]["world_size"] == 3 and launches[-1]["resume_from"] == "start", launches[-1]
    entries = lineage(run_dir)
    kinds = [e["kind"] for e in entries]
    assert "restart" in kinds and kinds.count("world_size_change") == 1, kinds
    replayed = [e for e in entries if e["kind"] == "replayed_data_range"]
    assert replayed and all(e["verdict"]["comparability"] == "changed" for e in replayed), replayed
    changes = [e for e in entries if e["kind"] == "batch_change"]
    assert len(changes) == 1, kinds
    d = changes[0]["details"]
    assert (d["old_world_size"], d["new_world_size"], d["old_global_batch"], d["new_global_batch"]) == (4, 3, 32, 24)
    assert d["attempt"] == len(launches) - 1 and changes[0]["verdict"]["comparability"] == "changed"
    assert set(changes[0]["verdict"]["reasons"]) == {"batch_composition", "ordering"}, changes[0]["verdict"]
    got = fingerprints(run_dir, len(launches) - 1)
    assert min(s for (_, s) in got) == 0 and max(s for (_, s) in got) == STEPS - 1


def test_a_job_with_fixed_shapes_is_not_shrunk(tmp_path: Path) -> None:
    run_dir = (tmp_path / "run").resolve()
    run_dir.mkdir()
    job = _job(run_dir, "fsdp_tp_2d", ("--tp", "2"), devices=["0", "1", "2", "3"])
    ok, why = continue_on(job, 3)
    assert not ok and "fixed_shapes" in why[0]
    status, notes = _kill_under_the_manager(tmp_path, job, before_kill=_quarantine_device_1(run_dir))
    assert status["last_decision"]["state"] == "failed" and status["job"]["state"] == "failed", status
    record = json.loads(sorted((run_dir / "recovery").glob("recovery-*.json"))[-1].read_text())
    assert record["outcome"] == "relaunch_refused", record
    assert "needs 4 devices" in record["refused"] and "fixed_shapes" in record["refused"], record["refused"]
    assert len(read_launches(run_dir)) == 1  # nothing relaunched on fewer ranks
