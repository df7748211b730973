"""`rankwatch analyze` on real canary runs: each injected fault gives the right class on the right subject, and a
clean run (with benign variation: checkpoint stalls on every rank, a throttle bit on a GPU that is not slow)
gives nothing.

Most runs are 4 gloo ranks as pure data parallel (dp=4 over 2 virtual hosts) so that a majority of >= 3 replicas
can blame one rank; the slow-link run needs groups of one kind that cross different links: dp=2,tp=2,pp=2 over 4
hosts, where the stage-0 dp groups cross host0<->host1 and the stage-1 ones host2<->host3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwatch.analytics.analyze import AnalysisConfig, analyze
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, SubjectKind, read_incidents
from rankwatch.canary import Faults
from rankwatch.cli import main

from support import canary, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

STEPS = 80


def _run(tmp: Path, faults: Faults, *, layout: str = "dp=4", hosts: int = 2, ok: bool = True, **kw: object) -> Path:
    run_dir = tmp / "run"
    kw.setdefault("checkpoint_every", 40)
    result = run(canary(run_dir, layout=layout, hosts=hosts, steps=STEPS, faults=faults, fingerprint_every=10, **kw))
    assert result.ok == ok, result
    return run_dir


def _incidents(run_dir: Path) -> tuple[Incident, ...]:
    return analyze(run_dir).incidents


def _one(incidents: tuple[Incident, ...], klass: IncidentClass) -> Incident:
    assert [i.klass for i in incidents] == [klass], [(i.klass, str(i.subject), i.summary) for i in incidents]
    return incidents[0]


def test_clean_run_has_no_incident(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # benign: a thermal-throttle bit on rank 1's (replayed) GPU with no slowdown, checkpoints on every rank
    run_dir = _run(tmp_path, Faults().throttle(rank=1, from_step=30, delay_s=0.0))
    assert _incidents(run_dir) == ()
    assert main(["analyze", str(run_dir), "--quiet"]) == 0
    assert "no incidents" in capsys.readouterr().out
    assert read_incidents(run_dir / "analysis" / "incidents.json") == ()


def test_slow_rank_is_a_straggler_not_a_failure(tmp_path: Path) -> None:
    # 60 ms more per step: on ranks sharing two cores with other load the per-step noise reaches ~30 %, and a
    # slowdown of one or two noise widths (30 ms) leaves its onset a matter of chance within 5-25 steps
    inc = _one(_incidents(_run(tmp_path, Faults().slow(rank=2, from_step=30, delay_s=0.06))), IncidentClass.STRAGGLER)
    assert (inc.subject.kind, inc.subject.id, inc.ranks) == (SubjectKind.RANK, "2", (2,))
    assert inc.onset_step is not None and abs(inc.onset_step - 30) <= 3
    assert inc.detection_step is not None and inc.detection_step - 30 <= 10


def test_throttled_gpu_straggler_names_the_cause(tmp_path: Path) -> None:
    # the replayed GPU throttles to 60 % of its clock with the thermal bits set. Where the clock loss covers most of
    # the slow steps the incident names the device and implicates hardware; on a canary whose CPU noise (20-40 %)
    # makes some noise steps "slow" before the fault the evidence can fall short and it stays on the rank — the
    # cause is the throttle either way, and a device subject always comes with device_fault
    inc = _one(_incidents(_run(tmp_path, Faults().throttle(rank=1, from_step=30, delay_s=0.03))), IncidentClass.STRAGGLER)
    assert (inc.ranks, inc.cause) == ((1,), Cause.THERMAL_THROTTLE)
    if inc.subject.kind is SubjectKind.DEVICE:
        assert inc.device_fault and inc.subject.id.startswith("GPU-")
    else:
        assert (inc.subject.kind, inc.subject.id, inc.device_fault) == (SubjectKind.RANK, "1", False)


def test_slow_link_is_blamed_on_the_link(tmp_path: Path) -> None:
    run_dir = _run(tmp_path, Faults().slow_link(hosts=(0, 1), from_step=30, delay_s=0.03),
                   layout="dp=2,tp=2,pp=2", hosts=4)
    inc = _one(_incidents(run_dir), IncidentClass.STRAGGLER)
    assert (inc.subject.kind, inc.subject.id, inc.cause) == (SubjectKind.LINK, "host0<->host1", Cause.SLOW_LINK)


@pytest.mark.parametrize(("how", "cause"), [("exit", Cause.EXIT), ("kill", Cause.VANISHED)])
def test_fail_stop_finds_the_rank_that_stopped(tmp_path: Path, how: str, cause: Cause) -> None:
    faults = Faults().exit(rank=3, step=40) if how == "exit" else Faults().kill(rank=3, step=40)
    inc = _one(_incidents(_run(tmp_path, faults, ok=False)), IncidentClass.FAIL_STOP)
    assert (inc.subject.id, inc.ranks, inc.onset_step) == ("3", (3,), 40)
    assert inc.cause in (cause, Cause.SIGNAL, Cause.EXIT, Cause.VANISHED)


def test_hang_finds_the_stuck_rank_not_its_waiting_peers(tmp_path: Path) -> None:
    inc = _one(_incidents(_run(tmp_path, Faults().hang(rank=2, step=40), ok=False)), IncidentClass.HANG)
    assert (inc.subject.id, inc.ranks, inc.onset_step) == ("2", (2,), 40)


def test_parameter_bitflip_is_corruption_on_the_minority_rank(tmp_path: Path) -> None:
    faults = Faults().bitflip(rank=3, step=35, target="param", bit=20)
    inc = _one(_incidents(_run(tmp_path, faults)), IncidentClass.CORRUPTION)
    assert (inc.subject.kind, inc.subject.id, inc.cause) == (SubjectKind.RANK, "3", Cause.VALUE_MISMATCH)
    assert inc.onset_step == 40  # the first fingerprint after the flip


def test_gradient_bitflip_is_corruption_seen_only_before_the_allreduce(tmp_path: Path) -> None:
    faults = Faults().bitflip(rank=0, step=25, target="grad", bit=30)
    incidents = _incidents(_run(tmp_path, faults))
    corruption = [i for i in incidents if i.klass == IncidentClass.CORRUPTION]
    assert [(i.subject.id, i.onset_step) for i in corruption] == [("0", 25)], incidents
    assert corruption[0].cause in (Cause.GRAD_NORM_OUTLIER, Cause.NON_FINITE)
    assert all(i.klass == IncidentClass.CORRUPTION for i in incidents)


@pytest.mark.parametrize(("kind", "cause", "field"), [
    ("rng", Cause.RNG_MISMATCH, "rng_torch"), ("data", Cause.DATA_POSITION_MISMATCH, "data_position")])
def test_divergence_names_the_field_and_the_rank(tmp_path: Path, kind: str, cause: Cause, field: str) -> None:
    faults = Faults().skew_rng(rank=1, step=30) if kind == "rng" else Faults().skew_data(rank=1, step=30, offset=3)
    inc = _one(_incidents(_run(tmp_path, faults)), IncidentClass.DIVERGENCE)
    assert (inc.subject.kind, inc.subject.id, inc.cause) == (SubjectKind.RANK, "1", cause)
    assert field in inc.fields and inc.onset_step == 30


def test_window_analysis_of_a_clean_tail(tmp_path: Path) -> None:
    # 0.1 s a step (not 0.06): under CI load a 60 ms slowdown of 20 steps once read as unclassified, not straggler
    run_dir = _run(tmp_path, Faults().slow(rank=2, from_step=30, delay_s=0.1, until_step=50))
    assert [i.klass for i in analyze(run_dir, config=AnalysisConfig(window_steps=20)).incidents] == []
    assert [i.klass for i in _incidents(run_dir)] == [IncidentClass.STRAGGLER]


def test_a_rank_frozen_for_seconds_that_carried_on_is_a_transient_hang(tmp_path: Path) -> None:
    # SIGSTOP for 4 s (every thread, heartbeats too), then SIGCONT: its peers wait 4 s in a collective, the run ends
    inc = _one(_incidents(_run(tmp_path, Faults().freeze(rank=2, step=30, seconds=4.0))), IncidentClass.HANG)
    assert inc.ranks == (2,) and inc.cause is Cause.TRANSIENT_STALL and inc.onset_step == 30
    assert "carried on" in inc.summary
