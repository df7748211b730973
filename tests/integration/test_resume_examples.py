"""The recovery contract in jobs rankwatch did not write: each example under examples/ saves with
`recovery.Checkpointer`, is SIGKILLed from outside mid-run, is launched again with the same command, resumes from its
newest committed checkpoint behind the consistency gate, and ends bitwise equal to a run that was never interrupted
(every rank's parameter and optimizer fingerprints at every step trained after the resume). 4 gloo ranks under
`rankwatch torchrun`.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rankwatch.recovery.catalog import Verdict, list_checkpoints

from example_jobs import WORLD, live_record, run_ok, running
from support import rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 40
ARGS = ("--save-every", "4", "--fingerprint-every", "1", "--resume")


def fingerprints(run_dir: Path, attempt: int | None = None) -> dict[tuple[int, int], tuple[str, str]]:
    """(rank, step) -> (param hash, optimizer hash), of one attempt or of the whole run."""
    where = f"WHERE attempt = {attempt}" if attempt is not None else ""
    got = rows(run_dir, f"SELECT rank, step, param_hash, optim_hash FROM fingerprints {where}")
    return {(r, s): (p, o) for r, s, p, o in got}


def lineage(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (run_dir / "lineage.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("example", ["ddp_gpt", "fsdp2_transformer", "fsdp_tp_2d"])
def test_killed_example_resumes_bitwise(tmp_path: Path, example: str) -> None:
    extra = ("--tp", "2") if example == "fsdp_tp_2d" else ()
    reference = run_ok(tmp_path / "reference", example, *ARGS, *extra, steps=STEPS)

    with running(tmp_path / "killed", example, *ARGS, *extra, steps=STEPS) as job:
        pid = live_record(job.run_dir, 1, min_step=13).pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert job.wait() != 0, job.tail()
    run = job.run_dir
    committed = [c.step for c in list_checkpoints(run, verify=False) if c.verdict is Verdict.COMMITTED]
    killed_at = max(s for (_, s) in fingerprints(run, 0))
    assert committed and max(committed) < STEPS - 1, (committed, killed_at)

    with running(tmp_path / "killed", example, *ARGS, *extra, steps=STEPS) as again:
        assert again.wait() == 0, again.tail()
    resumed_from = max(committed)
    log = again.log.read_text()
    assert f"resume from step-{resumed_from:08d}" in log, again.tail()

    want = fingerprints(reference)
    got = fingerprints(run, 1)
    trained = sorted({s for (_, s) in got})
    assert trained[0] == resumed_from + 1 and trained[-1] == STEPS - 1, trained
    assert {k for k in got} == {(r, s) for r in range(WORLD) for s in trained}
    assert {k: got[k] for k in got} == {k: want[k] for k in got}, "the resumed run left the uninterrupted trajectory"

    kinds = [(e["kind"], e["details"]) for e in lineage(run)]  # type: ignore[index]
    names = [k for k, _ in kinds]
    if killed_at > resumed_from:
        assert names[-2:] == ["rollback", "replayed_data_range"], names
        replayed = kinds[-1][1]
        assert replayed["from_step"] == resumed_from + 1 and replayed["to_step"] >= killed_at, replayed  # type: ignore[index]
    else:
        assert names[-1] == "restart", names


def test_a_half_written_asynchronous_save_is_passed_over_and_the_resume_is_bitwise(tmp_path: Path) -> None:
    """FSDP2 with `--async-save`: rank 1 is killed halfway through writing its file of the step-11 save (on the
    save's own thread, while training goes on: `recovery.checkpoint.CheckpointFault`, the drills' hook). The save
    never committed: the catalog calls it PARTIAL, the relaunch resumes from step 7 and ends bitwise equal to a run
    with synchronous saves that was never interrupted — the asynchronous save held the state of its own step."""
    from rankwatch.recovery.checkpoint import CHECKPOINT_FAULT_ENV

    example = "fsdp2_transformer"
    reference = run_ok(tmp_path / "reference", example, *ARGS, steps=STEPS)
    fault = {CHECKPOINT_FAULT_ENV: "kill:rank=1,step=11,at=shard"}
    with running(tmp_path / "killed", example, *ARGS, "--async-save", steps=STEPS, env=fault) as job:
        assert job.wait() != 0, job.tail()
    run = job.run_dir
    found = {c.path.name: c.verdict for c in list_checkpoints(run, verify=True)}
    assert found.get(".step-00000011.tmp") is Verdict.PARTIAL and found.get("step-00000007") is Verdict.COMMITTED, found
    assert "step-00000011" not in found, found

    with running(tmp_path / "killed", example, *ARGS, "--async-save", steps=STEPS) as again:
        assert again.wait() == 0, again.tail()
    assert "resume from step-00000007" in again.log.read_text(), again.tail()
    want, got = fingerprints(reference), fingerprints(run, 1)
    assert min(s for (_, s) in got) == 8 and got == {k: want[k] for k in got}
