"""A rank SIGKILLed from outside at a random step, resumed from the newest checkpoint, ends bitwise where an
uninterrupted run ends — at dp=4, dp=2,tp=2 and dp=2,tp=2,pp=2 (a sum of four replicas is not order-free) — and
the product checks that promise itself: replayed steps are compared with the attempt that trained them first.

A replay made non-bitwise on purpose (one ulp on every rank right after the load: the replicas still agree, the
gate passes) is caught only by replay verification: a divergence incident and a CHANGED lineage."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from rankwatch.analytics.analyze import analyze
from rankwatch.analytics.incidents import Cause, IncidentClass
from rankwatch.base.schema import ChangeReason, Comparability, Table
from rankwatch.canary import CanaryConfig, Faults
from rankwatch.canary.model import ModelConfig
from rankwatch.collector.sink import partition_dir
from rankwatch.recovery.lineage import EntryKind, lineage_path, read
from rankwatch.recovery.promises import PromiseStatus, evaluate
from support import canary, rows, run

pytestmark = [pytest.mark.slow]

STEPS, EVERY = 12, 3
KILL_EVERY = 4
"""Checkpoint period of the outside-kill runs: checkpoints after steps 3 and 7 leave three steps between the first
step after a checkpoint (which the killer waits to see flushed) and the next save."""
DELAY_S = 0.3
"""Every rank sleeps this long a step (numerics untouched): the killer sees flushed steps at most ~0.55 s late
(0.5 s flushes), i.e. within the two steps before the next checkpoint."""


def _final(run_dir: Path) -> list[tuple[object, ...]]:
    return rows(run_dir, f"""SELECT rank, param_hash, optim_hash, rng_torch_hash, data_position FROM fingerprints
                             WHERE step = {STEPS - 1} QUALIFY row_number() OVER (PARTITION BY rank ORDER BY wall_ns DESC) = 1
                             ORDER BY rank""")


def _slow_everywhere(world: int) -> Faults:
    f = Faults()
    for r in range(world):
        f = f.slow(rank=r, delay_s=DELAY_S)
    return f


def _pid_of(run_dir: Path, rank: int, deadline: float) -> int:
    """The rank's pid from its topology row, which is on disk before its first step."""
    folder = partition_dir(run_dir, Table.TOPOLOGY, rank)
    while time.monotonic() < deadline:
        for part in sorted(folder.glob("part-*.parquet")):
            try:
                return int(pq.read_table(part, columns=["pid"]).column("pid")[0].as_py())
            except Exception:  # being renamed into place
                pass
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never wrote its topology row")


def _steps_done(run_dir: Path, rank: int) -> int:
    done = -1
    for part in sorted(partition_dir(run_dir, Table.STEPS, rank).glob("part-*.parquet")):
        try:
            done = max(done, max(pq.read_table(part, columns=["step"]).column("step").to_pylist(), default=-1))
        except Exception:
            pass
    return done


class _Killer(threading.Thread):
    """SIGKILLs `rank` from outside once its flushed steps reach `at_step` (the kill lands a few steps later, as a
    real one would: between flushes)."""

    def __init__(self, run_dir: Path, rank: int, at_step: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.rank, self.at_step = run_dir, rank, at_step
        self.killed_after: int | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 120
        pid = _pid_of(self.run_dir, self.rank, deadline)
        while time.monotonic() < deadline:
            done = _steps_done(self.run_dir, self.rank)
            if done >= self.at_step:
                os.kill(pid, signal.SIGKILL)
                self.killed_after = done
                return
            time.sleep(0.02)


def _killed_and_resumed(run_dir: Path, base: CanaryConfig, *, seed: int, resume: CanaryConfig | None = None) -> int:
    """Train `base` with an outside SIGKILL of a random rank at a random step, then resume; the step the kill's
    rank had last flushed."""
    rnd = random.Random(seed)
    every = base.checkpoint_every
    victim, at = rnd.randrange(base.world_size), rnd.choice(range(every, STEPS - every, every))  # c + 1
    killer = _Killer(run_dir, victim, at)
    killer.start()
    failed = run(replace(base, faults=_slow_everywhere(base.world_size)))
    killer.join(5)
    assert killer.killed_after is not None and not failed.ok, (killer.killed_after, failed)
    assert failed.exit_codes[victim] == -signal.SIGKILL, failed
    assert killer.killed_after < STEPS - 1, "the kill came too late to make a replay"
    assert killer.killed_after % every != every - 1, "the kill came right after a checkpoint: no replay"
    resumed = run(resume if resume is not None else replace(base, resume=True))
    assert resumed.ok, resumed
    return killer.killed_after


def _fail(cfg: CanaryConfig, *, rank: int, step: int) -> None:
    """Train `cfg` until `rank` exits at the start of `step` (after at least one checkpoint)."""
    failed = run(replace(cfg, faults=Faults().exit(rank=rank, step=step)))
    assert failed.exit_codes[rank] == 1 and not failed.ok, failed
    assert _steps_done(cfg.run_dir, (rank + 1) % cfg.world_size) >= step - 1, "the job failed before the fault"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layout,seed", [("dp=4", 11), ("dp=2,tp=2", 12), ("dp=2,tp=2,pp=2", 13)])
def test_outside_sigkill_then_resume_is_bitwise(tmp_path: Path, layout: str, seed: int) -> None:
    base = canary(tmp_path / "killed", layout=layout, steps=STEPS, checkpoint_every=KILL_EVERY, fingerprint_every=0,
                  seed=3, pg_timeout_s=30.0)  # 8 ranks starting on 2 busy cores can take long to meet
    clean = run(replace(base, run_dir=tmp_path / "clean"))
    assert clean.ok, clean
    _killed_and_resumed(base.run_dir, base, seed=seed)

    assert _final(base.run_dir) == _final(tmp_path / "clean")
    assert len(_final(base.run_dir)) == base.world_size
    verdict = evaluate(base.run_dir)
    assert verdict.comparability is Comparability.BITWISE_IDENTICAL_EXPECTED, verdict
    [promise] = [p for p in verdict.promises if p.kind is EntryKind.REPLAYED_DATA_RANGE]
    assert promise.status is PromiseStatus.HELD, promise  # the first step after the checkpoint was compared
    checked = [e for e in read(lineage_path(base.run_dir)) if e.kind is EntryKind.REPLAY_VERIFIED]
    assert checked and all(e.verdict.comparability is Comparability.BITWISE_IDENTICAL_EXPECTED for e in checked)


def _failed_dp4(run_dir: Path, **kw: Any) -> CanaryConfig:
    """A dp=4 job of 8 steps whose rank 2 exited at step 7 (checkpoints after steps 2 and 5): what a resume
    replays from step-00000005."""
    base = canary(run_dir, layout="dp=4", steps=8, checkpoint_every=EVERY, fingerprint_every=0, seed=3,
                  pg_timeout_s=8.0, **kw)
    _fail(base, rank=2, step=7)
    return base


@pytest.mark.timeout(300)
def test_a_replay_nudged_by_one_ulp_is_caught_by_replay_verification_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = _failed_dp4(run_dir)
    nudged = run(replace(base, resume=True, faults=Faults().nudge(param=1, index=3)))
    assert nudged.ok, nudged
    ckpt_step = 7 // EVERY * EVERY - 1  # step-00000005: the replay starts at 6
    [check] = nudged.replay
    assert (check.held, check.broken_step) == (False, ckpt_step + 1)
    assert "param" in check.fields and check.earlier_attempt == 0

    gate = rows(run_dir, "SELECT message FROM events WHERE message LIKE 'consistency gate %'")
    assert gate and all(": agree" in str(m) for (m,) in gate)  # nothing else says so: the replicas agree

    incidents = analyze(run_dir).incidents
    divergent = [i for i in incidents if i.klass is IncidentClass.DIVERGENCE]
    assert [i.cause for i in divergent] == [Cause.NONDETERMINISTIC_REPLAY], incidents
    assert divergent[0].onset_step == ckpt_step + 1
    assert f"replayed step {ckpt_step + 1} differs from attempt 0: param" in divergent[0].summary

    verdict = evaluate(run_dir)
    assert verdict.comparability is Comparability.CHANGED
    assert ChangeReason.NONDETERMINISTIC_REPLAY in verdict.reasons
    [promise] = [p for p in verdict.promises if p.kind is EntryKind.REPLAYED_DATA_RANGE]
    assert (promise.status, promise.since_step) == (PromiseStatus.BROKEN, ckpt_step + 1)
    assert promise.fields[0] == "param"
    last = read(lineage_path(run_dir))[-1]
    assert last.kind is EntryKind.REPLAY_VERIFIED and last.verdict.reasons == (ChangeReason.NONDETERMINISTIC_REPLAY,)
    assert last.details.from_step == ckpt_step + 1


@pytest.mark.timeout(300)
def test_unpinned_ddp_buckets_break_a_dp4_replay_and_verification_says_so(tmp_path: Path) -> None:
    """The cause of the non-bitwise dp=4 resume: DDP rebuilds its buckets after each fresh process's first
    backward. Without pinning, the replay differs from the first attempt from its first step — and the product
    notices by itself."""
    run_dir = tmp_path / "run"
    base = _failed_dp4(run_dir, pin_ddp_buckets=False, model=ModelConfig())  # buckets of the default size
    resumed = run(replace(base, resume=True))
    assert resumed.ok, resumed
    [check] = resumed.replay
    assert (check.held, check.broken_step) == (False, 6), check
    assert evaluate(run_dir).comparability is Comparability.CHANGED


@pytest.mark.timeout(300)
def test_a_resume_that_changes_a_determinism_input_is_changed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base = canary(run_dir, layout="dp=2", steps=6, checkpoint_every=EVERY, fingerprint_every=0, seed=3,
                  pg_timeout_s=8.0)
    _fail(base, rank=1, step=4)
    assert run(replace(base, resume=True, threads=2)).ok
    first = read(lineage_path(run_dir))[0]
    assert first.kind is EntryKind.ROLLBACK and first.verdict.comparability is Comparability.CHANGED
    assert ChangeReason.DETERMINISM_INPUTS in first.verdict.reasons
    assert "torch_threads 1->2" in first.verdict.note
    assert first.details.determinism is not None and '"torch_threads":2' in first.details.determinism
