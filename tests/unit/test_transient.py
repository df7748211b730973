"""The transient-stall detector: a rank frozen for seconds that then carried on is a transient hang, reported once
(who, when, how long, where the peers waited); a job-wide pause, a rank that never came back and a slow step are not."""

from __future__ import annotations

import polars as pl
import pytest

from rankwatch.analytics.analyze import detect_all
from rankwatch.analytics.frames import Clock, Frames
from rankwatch.analytics.incidents import Cause, IncidentClass
from rankwatch.analytics.transient import TransientConfig, detect_transient_stalls

MS = 1_000_000
pytestmark = pytest.mark.timeout(60)


def _frames(*, ranks: int = 4, steps: int = 30, stall: dict[tuple[int, int], float] | None = None,
            everyone: set[int] = frozenset(), until: dict[int, int] | None = None,  # type: ignore[assignment]
            clock: Clock = Clock.CPU, ckpt: dict[tuple[int, int], float] | None = None,
            step_ms: int = 40) -> Frames:
    """`step_ms` (+3 ms of collectives) steps; `stall[(rank, step)]` = seconds that rank froze at that step (its
    peers waited as long); `ckpt[(rank, step)]` = seconds of checkpoint in that step (on the device clock the idle
    GPU's compute holds it; a rank whose save is longer than the others' keeps them waiting as long)."""
    stall = stall or {}
    until = until or {}
    ckpt = ckpt or {}
    rows = []
    for s in range(steps):
        frozen = {r: sec for (r, st), sec in stall.items() if st == s}
        for r in range(ranks):
            if s > until.get(r, steps):
                continue
            saves = {k: v for (k, st), v in ckpt.items() if st == s}
            own = step_ms * MS + int(frozen.get(r, 0) * 1e9) + (int(20e9) if s in everyone else 0)
            wait = 3 * MS + int(max((v for k, v in frozen.items() if k != r), default=0) * 1e9)
            save = int(saves.get(r, 0) * 1e9)
            wait += int((max(saves.values(), default=0) - saves.get(r, 0)) * 1e9)
            own += save if clock is Clock.DEVICE else 0
            rows.append({"rank": r, "attempt": 0, "step": s, "start_wall_ns": s * 10**9, "end_wall_ns": s * 10**9 + own,
                         "duration_ns": own + wait, "compute_ns": own, "collective_wait_ns": wait,
                         "dataloader_wait_ns": 100_000, "checkpoint_ns": save, "all_finite": True})
    topo = pl.DataFrame({"rank": list(range(ranks)), "world_size": [ranks] * ranks, "pp": [0] * ranks,
                         "role": ["pp=0"] * ranks, "host": ["h0"] * ranks})
    return Frames.build(steps=pl.DataFrame(rows), topology=topo, heartbeat_interval_ns=10**9, clock=clock)


def test_a_frozen_rank_that_carried_on_is_one_transient_hang() -> None:
    (inc,) = detect_transient_stalls(_frames(stall={(2, 10): 20.0}))
    assert inc.klass is IncidentClass.HANG and inc.cause is Cause.TRANSIENT_STALL and inc.ranks == (2,)
    assert inc.onset_step == inc.detection_step == 10
    assert "stalled for 20.0 s at step 10" in inc.summary and "3 peers waited 20.0 s" in inc.summary


def test_a_stall_over_two_steps_is_one_incident_and_two_stalls_far_apart_are_two() -> None:
    (inc,) = detect_transient_stalls(_frames(stall={(1, 5): 8.0, (1, 6): 8.0}))
    assert (inc.onset_step, inc.detection_step) == (5, 6)
    assert len(detect_transient_stalls(_frames(stall={(1, 5): 8.0, (1, 20): 8.0}))) == 2


def test_what_is_not_a_transient_stall() -> None:
    assert detect_transient_stalls(_frames()) == ()
    assert detect_transient_stalls(_frames(everyone={12})) == ()  # a job-wide pause: nobody waited for anybody
    assert detect_transient_stalls(_frames(stall={(2, 10): 0.3})) == ()  # a slow step, not seconds
    assert detect_transient_stalls(_frames(stall={(2, 29): 20.0})) == ()  # its last step: it may not be back
    assert detect_transient_stalls(_frames(stall={(2, 10): 20.0}, until={2: 10})) == ()


def test_in_a_run_of_long_steps_a_seconds_long_freeze_is_found_and_a_slow_step_is_not() -> None:
    # 0.9 s steps: a 16 s freeze is under 20 steps long, and still no step of a running job takes that long.
    (inc,) = detect_transient_stalls(_frames(stall={(2, 10): 16.0}, step_ms=900))
    assert inc.ranks == (2,) and inc.onset_step == 10 and "stalled for 16.0 s" in inc.summary
    # 1.5 s steps: one step 4x as long (4.5 s more than its peers, over three heartbeats) is a slow step.
    assert detect_transient_stalls(_frames(stall={(2, 10): 4.5}, step_ms=1500)) == ()


def test_the_device_clock_reads_device_compute_alone() -> None:
    (inc,) = detect_transient_stalls(_frames(stall={(3, 7): 12.0}, clock=Clock.DEVICE))
    assert inc.fields[0] == "device_compute_ns" and "device clock" in inc.summary


@pytest.mark.parametrize("clock", [Clock.CPU, Clock.DEVICE])
def test_a_freeze_in_a_step_every_rank_spends_seconds_saving_in_is_still_found(clock: Clock) -> None:
    everyone_saves = {(r, 10): 12.0 for r in range(4)}
    (inc,) = detect_transient_stalls(_frames(stall={(2, 10): 20.0}, ckpt=everyone_saves, clock=clock))
    assert inc.ranks == (2,) and inc.onset_step == 10 and "stalled for 20.0 s" in inc.summary


def test_a_rank_whose_save_alone_is_long_is_not_a_transient_stall() -> None:
    saves = {(r, 10): 12.0 for r in range(4)} | {(1, 10): 40.0}  # the checkpoint detector's case
    assert detect_transient_stalls(_frames(ckpt=saves, clock=Clock.DEVICE)) == ()
    assert detect_transient_stalls(_frames(ckpt=saves)) == ()


def test_in_the_whole_analysis_it_is_the_only_incident() -> None:
    found = detect_all(_frames(stall={(2, 10): 20.0}))
    assert [(i.klass, i.ranks, i.cause) for i in found] == [(IncidentClass.HANG, (2,), Cause.TRANSIENT_STALL)]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="wait_share"):
        TransientConfig(wait_share=0)
