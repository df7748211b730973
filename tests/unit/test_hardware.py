"""Device faults from direct evidence (analytics/hardware.py) and the incident fields that carry them."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from rankwatch.analytics.analyze import detect_all
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.hardware import HardwareConfig, attribute_device_faults, new_device_errors
from rankwatch.analytics.incidents import (
    Cause, Evidence, HardwareSignal, Incident, IncidentClass, Subject, SubjectKind, read_incidents, write_incidents,
)
from rankwatch.base.schema import ThrottleReason

N, STEPS, ONSET = 8, 60, 30
MAX_MHZ = 1980.0
HW = HardwareSignal


def _uuid(r: int) -> str:
    return f"GPU-{r:04d}"


def _frames(*, slow: dict[int, float] | None = None, clock: dict[int, float] | None = None,
            bits: dict[int, int] | None = None, all_bits: int = 0, sbe: dict[int, list[int]] | None = None,
            dbe: dict[int, int] | None = None, xid: dict[int, tuple[int, int]] | None = None,
            steady_sbe: dict[int, int] | None = None, no_clock: bool = False) -> Frames:
    """N ranks of one stage over STEPS steps. From ONSET on: `slow` rank -> compute excess, `clock` rank -> SM clock
    as a fraction of max, `bits` rank -> throttle bits; `all_bits` on every device from ONSET on; `sbe` rank -> the
    steps a corrected ECC error arrives on; `dbe` rank -> the step of one uncorrectable error; `xid` rank ->
    (step, xid); `steady_sbe` rank -> a corrected-error count that never changes."""
    slow, clock, bits = slow or {}, clock or {}, bits or {}
    sbe, dbe, xid, steady_sbe = sbe or {}, dbe or {}, xid or {}, steady_sbe or {}
    steps, gpu = [], []
    for r in range(N):
        sbe_count = steady_sbe.get(r, 0)
        for s in range(STEPS):
            late = s >= ONSET
            comp = int(100e6 * (1 + (slow.get(r, 0.0) if late else 0.0)) * (1 + 0.003 * ((r * 7 + s * 3) % 5)))
            steps.append({"rank": r, "step": s, "compute_ns": comp, "duration_ns": comp + 20_000_000,
                          "dataloader_wait_ns": 1_000_000, "start_wall_ns": s * 10**9, "end_wall_ns": s * 10**9 + comp})
            sbe_count += sum(1 for t in sbe.get(r, []) if t == s)
            rel = clock.get(r, 1.0) if late else 1.0
            gpu.append({
                "rank": r, "device_uuid": _uuid(r), "step": s, "samples": 2,
                "sm_clock_mhz": None if no_clock else MAX_MHZ * rel - 15.0 * ((r + s) % 2),
                "sm_clock_max_mhz": None if no_clock else MAX_MHZ,
                "throttle_reasons": (bits.get(r, 0) | all_bits) if late else 0,
                "ecc_sbe_volatile": sbe_count, "ecc_dbe_volatile": 1 if r in dbe and s >= dbe[r] else 0,
                "xid_events": [xid[r][1]] if r in xid and xid[r][0] == s else [],
                "retired_pages": 0, "remapped_rows": 0, "pcie_replay": 40 if r == 0 else 0,
            })
    topo = pl.DataFrame({"rank": list(range(N)), "world_size": [N] * N, "device_uuid": [_uuid(r) for r in range(N)],
                         "role": ["pp=0"] * N, "pp": [0] * N, "dp": list(range(N)), "host": ["h0"] * N})
    return Frames.build(topology=topo, steps=pl.DataFrame(steps), gpu=pl.DataFrame(gpu))


def _straggler(rank: int, cause: Cause = Cause.UNKNOWN) -> Incident:
    return Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,),
                    onset_step=ONSET, detection_step=ONSET + 4, confidence=0.9, cause=cause,
                    summary=f"rank {rank} slow")


def _failstop(rank: int, onset: int) -> Incident:
    return Incident(klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.RANK, id=str(rank)), ranks=(rank,),
                    onset_step=onset, detection_step=onset + 1, confidence=0.95, cause=Cause.EXCEPTION,
                    summary=f"rank {rank} stopped")


THERMAL = int(ThrottleReason.HW_THERMAL_SLOWDOWN)


# ---------------------------------------------------------------------------------------------- slowdowns


def test_a_throttled_straggler_with_clock_loss_is_a_device_fault_of_its_gpu() -> None:
    frames = _frames(slow={5: 0.25}, clock={5: 0.80}, bits={5: THERMAL})
    (inc,) = attribute_device_faults(frames, [_straggler(5)])
    assert inc.subject == Subject(kind=SubjectKind.DEVICE, id=_uuid(5)) and inc.ranks == (5,)
    assert inc.device_fault and inc.hardware == (HW.CLOCK_LOSS, HW.THROTTLE)
    assert inc.cause is Cause.THERMAL_THROTTLE  # the bits name the cause the straggler left unknown
    assert inc.klass is IncidentClass.STRAGGLER and inc.onset_step == ONSET
    ev = inc.evidence[-1]
    assert ev.source == "gpu" and "clock" in ev.summary and ev.rows


def test_the_device_named_is_the_one_the_slow_steps_ran_on_not_where_a_relaunch_put_the_rank() -> None:
    """The bad_device drill: rank 5 was slow on its GPU; a relaunch moved it to a spare (the topology's latest row
    and its newest GPU samples say GPU-spare), and the post-hoc reading still sees the old slow steps. The device is
    the one that ran them."""
    frames = _frames(slow={5: 0.25}, clock={5: 0.80}, bits={5: THERMAL})
    later = pl.DataFrame([{**frames.gpu.row(0, named=True), "rank": 5, "device_uuid": "GPU-spare", "step": STEPS,
                           "throttle_reasons": 0, "sm_clock_mhz": MAX_MHZ}])
    moved = Frames.build(topology=frames.topology.with_columns(
        pl.when(pl.col("rank") == 5).then(pl.lit("GPU-spare")).otherwise(pl.col("device_uuid")).alias("device_uuid")),
        steps=frames.steps, gpu=pl.concat([frames.gpu, later], how="diagonal_relaxed"))
    (inc,) = attribute_device_faults(moved, [_straggler(5)])
    assert inc.subject == Subject(kind=SubjectKind.DEVICE, id=_uuid(5)) and inc.device_fault


def test_clock_loss_without_throttle_bits_is_evidence_enough() -> None:
    (inc,) = attribute_device_faults(_frames(slow={2: 0.4}, clock={2: 0.7}), [_straggler(2, Cause.DEVICE_SLOW)])
    assert inc.hardware == (HW.CLOCK_LOSS,) and inc.cause is Cause.DEVICE_SLOW


def test_throttle_bits_alone_are_the_evidence_only_without_clock_readings() -> None:
    with_clock = _frames(slow={5: 0.25}, bits={5: THERMAL})
    assert attribute_device_faults(with_clock, [_straggler(5)]) == (_straggler(5),)
    (inc,) = attribute_device_faults(_frames(slow={5: 0.25}, bits={5: THERMAL}, no_clock=True), [_straggler(5)])
    assert inc.hardware == (HW.THROTTLE,)


def test_a_clock_dip_that_explains_little_of_the_slowdown_is_not_evidence() -> None:
    # 6 % below the peers' clock implies ~6 % slower, against 60 % observed
    frames = _frames(slow={5: 0.6}, clock={5: 0.94})
    assert attribute_device_faults(frames, [_straggler(5)]) == (_straggler(5),)


def test_job_wide_throttling_implicates_no_device() -> None:
    # every device throttled and clocked down together; rank 5 is slow for another reason
    frames = _frames(slow={5: 0.25}, clock={r: 0.8 for r in range(N)}, all_bits=int(ThrottleReason.SW_POWER_CAP))
    assert attribute_device_faults(frames, [_straggler(5)]) == (_straggler(5),)


@pytest.mark.parametrize("cause", [Cause.DATALOADER, Cause.HOST_STALL])
def test_a_straggler_whose_time_is_not_the_devices_is_left_alone(cause: Cause) -> None:
    frames = _frames(slow={5: 0.25}, clock={5: 0.8}, bits={5: THERMAL})
    assert attribute_device_faults(frames, [_straggler(5, cause)]) == (_straggler(5, cause),)


def test_a_throttle_bit_on_a_gpu_that_is_not_slow_raises_nothing() -> None:
    frames = _frames(bits={3: THERMAL}, steady_sbe={6: 4})
    assert attribute_device_faults(frames, []) == ()
    assert detect_all(frames) == ()


# ------------------------------------------------------------------------------------------------- errors


def test_a_fail_stop_at_an_uncorrectable_ecc_error_names_the_device() -> None:
    frames = _frames(dbe={4: 40}, xid={4: (40, 48)})
    (inc,) = attribute_device_faults(frames, [_failstop(4, 41)])
    assert inc.klass is IncidentClass.FAIL_STOP and inc.cause is Cause.EXCEPTION
    assert inc.subject.id == _uuid(4) and inc.hardware == (HW.ECC_DBE, HW.XID)
    assert "ecc_dbe_volatile" in inc.fields and inc.evidence[-1].rows[0][:2] == (4, 40)


def _with_events(frames: Frames, *rows: tuple[int, int, str], nvml: bool = True) -> Frames:
    ev = pl.DataFrame([{"rank": r, "step": s, "kind": "exception", "exc_type": "RuntimeError", "message": m}
                       for r, s, m in rows])
    return Frames.build(topology=frames.topology, steps=frames.steps, gpu=frames.gpu if nvml else None, events=ev)


@pytest.mark.parametrize("nvml", [True, False], ids=["nvml", "no-nvml"])
def test_a_rank_dead_of_an_ecc_error_its_sampler_never_read_names_the_device_from_its_own_error(nvml: bool) -> None:
    # the rank died inside the step: no NVML sample after the error, only the CUDA error text it raised
    frames = _with_events(_frames(), (4, 41, "CUDA error: uncorrectable ECC error encountered"),
                          (5, 41, "NCCL watchdog: collective timed out waiting for rank 4"), nvml=nvml)
    inc, other = attribute_device_faults(frames, [_failstop(4, 41), _failstop(5, 43)])
    assert inc.subject == Subject(kind=SubjectKind.DEVICE, id=_uuid(4)) and inc.hardware == (HW.DRIVER_ERROR,)
    assert inc.device_fault and inc.evidence[-1].source == "events" and "uncorrectable ECC" in inc.evidence[-1].rows[0][2]
    assert other == _failstop(5, 43)  # the peer's timeout is not its device's


@pytest.mark.parametrize(("text", "hardware"), [
    ("CUDA error: unspecified launch failure", False),
    ("CUDA error: an illegal memory access was encountered", False),
    ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ("NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception", False),
    ("NVRM: Xid 79, GPU has fallen off the bus", True),
    ("NVRM: Xid (PCI:0000:3b:00): 48, An uncorrectable double bit error", True),
    ("CUDA error: uncorrectable NVLink error detected during the execution", True),
])
def test_only_the_drivers_words_for_a_hardware_fault_implicate_the_device(text: str, hardware: bool) -> None:
    (inc,) = attribute_device_faults(_with_events(_frames(), (2, 30, text)), [_failstop(2, 30)])
    assert inc.device_fault is hardware and (inc.subject.kind is SubjectKind.DEVICE) is hardware


def test_a_driver_error_far_from_the_incident_does_not_explain_it() -> None:
    frames = _with_events(_frames(), (2, 5, "CUDA error: uncorrectable ECC error encountered"))
    assert attribute_device_faults(frames, [_failstop(2, 50)]) == (_failstop(2, 50),)


def test_an_error_long_before_a_fail_stop_is_its_own_incident() -> None:
    frames = _frames(dbe={4: 5})
    fail, own = attribute_device_faults(frames, [_failstop(4, 50)])
    assert fail == _failstop(4, 50)
    assert (own.klass, own.cause, own.subject.id, own.onset_step) == (
        IncidentClass.CORRUPTION, Cause.HARDWARE_ERROR, _uuid(4), 5)
    assert own.hardware == (HW.ECC_DBE,)


def test_corrected_errors_rising_on_one_device_are_a_failing_device() -> None:
    frames = _frames(sbe={6: [20, 22, 25, 25, 27, 30, 31, 33, 34, 36, 38, 40], 1: [44]})
    (inc,) = attribute_device_faults(frames, [])
    assert (inc.klass, inc.cause, inc.subject.id, inc.ranks) == (
        IncidentClass.CORRUPTION, Cause.HARDWARE_ERROR, _uuid(6), (6,))
    assert inc.hardware == (HW.ECC_SBE_RISING,)
    assert inc.onset_step == 20 and inc.detection_step is not None and inc.onset_step < inc.detection_step


def test_steady_few_or_shared_corrected_errors_are_not_rising() -> None:
    assert attribute_device_faults(_frames(steady_sbe={3: 500}), []) == ()
    assert attribute_device_faults(_frames(sbe={3: [10, 20, 30]}), []) == ()  # three errors: below sbe_min
    shared = {r: list(range(10, 50, 3)) for r in range(N)}
    assert attribute_device_faults(_frames(sbe=shared), []) == ()  # every device alike: not one device's fault


def test_an_application_xid_is_not_a_hardware_error() -> None:
    assert attribute_device_faults(_frames(xid={2: (30, 13)}), []) == ()


def test_new_device_errors_counts_increases_only() -> None:
    errs = new_device_errors(_frames(steady_sbe={1: 7}, sbe={2: [12, 12, 15]}, dbe={3: 20}))
    assert errs.select("rank", "step", "new_sbe", "new_dbe").rows() == [(2, 12, 2, 0), (2, 15, 1, 0), (3, 20, 0, 1)]


def test_no_gpu_rows_changes_nothing() -> None:
    incs = (_straggler(1), _failstop(2, 10))
    assert attribute_device_faults(Frames.build(), incs) == incs


def test_detect_all_reports_a_failing_device_once_and_the_anomaly_model_counts_it_as_known() -> None:
    frames = _frames(sbe={6: list(range(20, 60, 2))}, xid={6: (20, 63)})
    (inc,) = detect_all(frames)
    assert inc.klass is IncidentClass.CORRUPTION and inc.subject.id == _uuid(6)
    assert set(inc.hardware) >= {HW.ECC_SBE_RISING, HW.XID}


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="clock_loss"):
        HardwareConfig(clock_loss=0)
    with pytest.raises(ValueError, match="clock_share"):
        HardwareConfig(clock_share=1.5)
    with pytest.raises(ValueError, match="sbe_min"):
        HardwareConfig(sbe_min=-1)


# -------------------------------------------------------------------------------------- the incident fields


def _device_incident() -> Incident:
    return Incident(klass=IncidentClass.FAIL_STOP, subject=Subject(kind=SubjectKind.DEVICE, id="GPU-x"), ranks=(3,),
                    onset_step=7, detection_step=8, confidence=0.9, cause=Cause.EXCEPTION, summary="s",
                    hardware=(HW.ECC_DBE, HW.XID),
                    evidence=(Evidence(source="gpu", summary="e", columns=("rank", "xids"), rows=((3, [48]),)),))


def test_hardware_round_trips_through_dict_json_and_parquet(tmp_path: Path) -> None:
    inc = _device_incident()
    d = inc.to_dict()
    assert d["device_fault"] is True and d["hardware"] == ["ecc_dbe", "xid"]
    assert Incident.from_dict(d) == inc
    plain = _failstop(2, 10)
    assert plain.to_dict()["device_fault"] is False and not plain.device_fault
    pq_path, js_path = write_incidents([inc, plain], tmp_path)
    assert read_incidents(pq_path) == (inc, plain) == read_incidents(js_path)
    assert json.loads(js_path.read_text())["version"] == 3


def test_a_version_1_record_reads_as_no_hardware_evidence(tmp_path: Path) -> None:
    d = _failstop(2, 10).to_dict()
    del d["device_fault"], d["hardware"]
    (tmp_path / "incidents.json").write_text(json.dumps({"version": 1, "incidents": [d]}))
    (inc,) = read_incidents(tmp_path / "incidents.json")
    assert inc == _failstop(2, 10) and inc.hardware == ()


def test_hardware_evidence_needs_a_device_subject() -> None:
    with pytest.raises(ValueError, match="subject is not one"):
        Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id="3"), ranks=(3,),
                 onset_step=1, detection_step=2, confidence=0.5, cause=Cause.UNKNOWN, summary="s",
                 hardware=(HW.THROTTLE,))
    with pytest.raises(ValueError, match="incident record"):
        Incident.from_dict({**_device_incident().to_dict(), "hardware": ["melted"]})
