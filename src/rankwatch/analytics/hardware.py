"""Device faults from direct evidence: which incidents a device's own counters pin on its hardware.

A post-pass over the incidents the other detectors found (`attribute_device_faults(frames, incidents)`), run
before the anomaly model. It reads only the device's NVML counters (`Frames.gpu`) and compares them with the other
devices of the job at the same steps, so job-wide effects (a power cap on every device, a global slowdown) never
implicate one device.

(a) An incident on one rank whose device shows direct hardware evidence is re-subjected to that device
(`device:<uuid>`) and carries the evidence (`Incident.hardware`, `device_fault`, an `Evidence` item from `gpu`):

- a straggler whose slowness is the device's own work (not dataloader, host-thread, link or checkpoint time):
  during its slow steps (compute at least `slow_excess` above the median of its role peers) the device's SM clock,
  relative to its max, is at least `clock_loss` below the other devices' median at the same steps on at least
  `clock_share` of them, and the slowdown that clock loss implies (peer clock / own clock - 1) is at least
  `clock_match` of the observed slowdown (CLOCK_LOSS); slowdown throttle bits on at least `throttle_share` more of
  those steps than the peers show add THROTTLE and name the cause. Throttle bits without clock loss explain nothing
  (a bit on a GPU that is not slow is benign); without clock readings the bits alone are the evidence.
- any incident on the rank (straggler, fail-stop, hang, corruption) with new device errors within
  `error_before_steps` before to `error_after_steps` after its onset: an increase of the uncorrectable ECC counter
  (ECC_DBE), a hardware XID (XID: `HARDWARE_XIDS`), corrected ECC errors rising on this device only (ECC_SBE_RISING,
  below); new remapped rows or retired pages add ROW_REMAP as corroboration but do not implicate a device alone.
- any such incident whose rank's own error event, within the same steps, carries the CUDA driver's report of a
  hardware fault (DRIVER_ERROR: "uncorrectable ECC error", "uncorrectable NVLink error", "fallen off the bus", or
  an XID of `HARDWARE_XIDS` named in the text). A rank that dies of a double-bit error usually dies before its NVML
  sampler reads the counter again, so its own exception is the only record; application errors ("illegal memory
  access", out of memory, a peer's timeout) never match.

(b) A device whose counters alone show it failing — a new uncorrectable ECC error, a hardware XID, or corrected ECC
errors rising — and that no incident of (a) already names, is one CORRUPTION incident (cause HARDWARE_ERROR, the
device as subject): an ECC error the hardware could not correct, or a memory that keeps correcting more, means the
values it holds are in doubt. Corrected errors are *rising* when at least `sbe_min` new ones arrive over at least
`sbe_min_steps` steps and at least `sbe_ratio` times as many as on any other device; steady nonzero counters, errors
logged before the run, and PCIe / NVLink replays (the link's, not the device's) are never new device errors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import polars as pl

from rankwatch.analytics.corruption import HARDWARE_XIDS
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Evidence, HardwareSignal, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import SLOWDOWN_REASONS, Gpu, ThrottleReason

__all__ = ["HardwareConfig", "attribute_device_faults", "driver_errors", "new_device_errors"]

_R, _S, _DEV = "rank", "step", "device_uuid"
_THERMAL = int(ThrottleReason.SW_THERMAL_SLOWDOWN | ThrottleReason.HW_THERMAL_SLOWDOWN)
_POWER = int(ThrottleReason.SW_POWER_CAP | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN)
_HW = int(ThrottleReason.HW_SLOWDOWN)

# Straggler causes that say where the time went outside the device: the device's clock cannot explain them.
_NOT_THE_DEVICE = frozenset({Cause.DATALOADER, Cause.HOST_STALL, Cause.SLOW_LINK, Cause.CHECKPOINT_IO})
_CAN_IMPLICATE = frozenset({IncidentClass.STRAGGLER, IncidentClass.FAIL_STOP, IncidentClass.HANG,
                            IncidentClass.CORRUPTION})
# Evidence that implicates a device by itself; ROW_REMAP only corroborates.
_FAILING = frozenset({HardwareSignal.ECC_DBE, HardwareSignal.XID, HardwareSignal.ECC_SBE_RISING})

# The CUDA runtime's and driver's words for a hardware fault of the device (cudaErrorECCUncorrectable,
# cudaErrorNvlinkUncorrectable, Xid 79's "fallen off the bus"); an XID is hardware only when in HARDWARE_XIDS.
_DRIVER_HW = re.compile(r"uncorrectable\s+ecc|ecc\s+error|uncorrectable\s+nvlink|fallen\s+off\s+the\s+bus", re.I)
_XID_TEXT = re.compile(r"\bxid\b(?:\s*\([^)]*\))?\s*[:,]?\s*(\d+)", re.I)  # "Xid 79", "Xid (PCI:0000:3b:00): 48"

_ERROR_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    _R: pl.Int32, _S: pl.Int64, _DEV: pl.String, "new_sbe": pl.Int64, "new_dbe": pl.Int64, "new_remap": pl.Int64,
    "xids": pl.List(pl.Int32),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class HardwareConfig:
    """Thresholds of the device-fault post-pass. Clock values are fractions of the device's max SM clock."""

    slow_excess: float = 0.03
    """A straggler's step counts as slow when its compute exceeds its role peers' median by this (3 %)."""
    clock_loss: float = 0.05
    """The device's clock must be this far below the other devices' median at the same step (5 % of max; the
    benign spread between devices is ~1 %)."""
    clock_share: float = 0.5
    """Share of the slow steps that must show the clock loss (the loss comes with the slowness, not once)."""
    clock_match: float = 0.25
    """The slowdown the clock loss implies must be at least this share of the observed one: a small clock dip
    under a large slowdown explains little of it (a quarter: compute does not scale fully with the clock, and a
    throttled step also waits on memory and launches)."""
    throttle_share: float = 0.5
    """Slowdown throttle bits on at least this share more of the slow steps than the other devices show."""
    error_before_steps: int = 10
    """Device errors up to this many steps before an incident's onset count as its cause."""
    error_after_steps: int = 10
    """... and up to this many after it (a counter is sampled after the step that hit it)."""
    sbe_min: int = 10
    """New corrected ECC errors during the run for them to be rising ..."""
    sbe_min_steps: int = 3
    """... arriving on at least this many steps (a trend, not one burst) ..."""
    sbe_ratio: float = 5.0
    """... and at least this many times the most new corrected errors of any other device."""
    fault_confidence: float = 0.9
    """Confidence of a device fault raised from the counters alone (they admit few other readings)."""

    def __post_init__(self) -> None:
        for name in ("slow_excess", "clock_loss", "sbe_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HardwareConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("clock_share", "clock_match", "throttle_share", "fault_confidence"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"HardwareConfig.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("error_before_steps", "error_after_steps", "sbe_min", "sbe_min_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"HardwareConfig.{name} must be >= 0, got {getattr(self, name)}")


def attribute_device_faults(frames: Frames, incidents: Sequence[Incident],
                            config: HardwareConfig = HardwareConfig()) -> tuple[Incident, ...]:
    """`incidents` with those that direct hardware evidence pins on one device re-subjected to it, followed by one
    CORRUPTION incident per failing device no incident names (see the module docstring)."""
    driver = driver_errors(frames)
    if frames.gpu.height == 0 and driver.height == 0:
        return tuple(incidents)
    errors = new_device_errors(frames)
    rising = _sbe_rising(errors, config)
    devices = _rank_devices(frames)
    out: list[Incident] = []
    for inc in incidents:
        out.append(_attribute(inc, frames, errors, rising, devices, driver, config))
    named = {i.subject.id for i in out if i.device_fault}
    out.extend(_failing_devices(errors, rising, named, config))
    return tuple(out)


def new_device_errors(frames: Frames) -> pl.DataFrame:
    """Per rank per step with a new device error: the increase over the rank's earlier samples of the corrected
    (`new_sbe`) and uncorrectable (`new_dbe`) ECC counters and of remapped rows + retired pages (`new_remap`), and
    the hardware XIDs reported (`xids`). A counter's first reading in the frames is its baseline, so errors logged
    before the run (or the window) and steady nonzero counters are never new."""
    g = frames.gpu
    if g.height == 0:
        return pl.DataFrame(schema=_ERROR_SCHEMA)

    def new(col: str) -> pl.Expr:
        cum = pl.col(col).fill_null(strategy="forward").over(_R).cum_max().over(_R)
        return (cum - cum.shift(1).over(_R)).fill_null(0).clip(lower_bound=0)

    g = g.sort(_R, _S).with_columns(
        new(Gpu.ECC_SBE_VOLATILE.value).alias("new_sbe"),
        new(Gpu.ECC_DBE_VOLATILE.value).alias("new_dbe"),
        (new("remapped_rows") + new("retired_pages")).alias("new_remap"),
        pl.col(Gpu.XID_EVENTS.value).fill_null([]).list.eval(
            pl.element().filter(pl.element().is_in(sorted(HARDWARE_XIDS)))).alias("xids"),
    )
    hit = (pl.col("new_sbe") > 0) | (pl.col("new_dbe") > 0) | (pl.col("new_remap") > 0) | (pl.col("xids").list.len() > 0)
    return g.filter(hit).select(list(_ERROR_SCHEMA)).cast(_ERROR_SCHEMA)  # type: ignore[arg-type]


def driver_errors(frames: Frames) -> pl.DataFrame:
    """(rank, step, message) of the error events whose text is the CUDA driver's report of a hardware fault
    (see the module docstring); step may be null."""
    ev = frames.events
    schema = {_R: pl.Int32, _S: pl.Int64, "message": pl.String}
    if ev.height == 0:
        return pl.DataFrame(schema=schema)
    ev = ev.filter(pl.col("message").is_not_null() & pl.col("kind").is_in(["exception", "warning"]))
    keep = [bool(_DRIVER_HW.search(m)) or any(int(x) in HARDWARE_XIDS for x in _XID_TEXT.findall(m))
            for m in ev.get_column("message").to_list()]
    return ev.filter(pl.Series(keep, dtype=pl.Boolean)).select(_R, _S, "message").cast(schema)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- (a) attribution


def _attribute(inc: Incident, frames: Frames, errors: pl.DataFrame, rising: dict[int, int],
               devices: dict[int, str], driver: pl.DataFrame, config: HardwareConfig) -> Incident:
    if inc.klass not in _CAN_IMPLICATE or inc.device_fault or len(inc.ranks) != 1:
        return inc
    if inc.subject.kind not in (SubjectKind.RANK, SubjectKind.DEVICE):
        return inc
    rank = inc.ranks[0]
    device = devices.get(rank)
    anchor = inc.onset_step if inc.onset_step is not None else inc.detection_step
    if device is None or anchor is None:
        return inc
    signals: list[HardwareSignal] = []
    evidence: list[Evidence] = []
    cause = inc.cause
    if inc.klass is IncidentClass.STRAGGLER and inc.cause not in _NOT_THE_DEVICE:
        slow_signals, slow_cause, ev, on = _slowdown_evidence(rank, anchor, frames, config)
        signals += slow_signals
        device = on or device  # the GPU the slow steps ran on (a relaunch may have moved the rank since)
        if ev is not None:
            evidence.append(ev)
        if slow_cause is not None and inc.cause in (Cause.UNKNOWN, Cause.DEVICE_SLOW):
            cause = slow_cause
    since = _lookback(inc, rank, anchor, frames)
    err_signals, ev = _error_evidence(rank, since, anchor, errors, rising, config)
    if set(err_signals) & _FAILING:
        signals += err_signals
        if ev is not None:
            evidence.append(ev)
        if inc.klass is IncidentClass.CORRUPTION:
            cause = Cause.HARDWARE_ERROR
    lo, hi = since - config.error_before_steps, anchor + config.error_after_steps
    said = driver.filter((pl.col(_R) == rank) & (pl.col(_S).is_null() | pl.col(_S).is_between(lo, hi)))
    if said.height:
        signals.append(HardwareSignal.DRIVER_ERROR)
        evidence.append(Evidence(
            source="events", summary=f"rank {rank}'s own error events report a hardware fault of its GPU",
            columns=("rank", "step", "message"),
            rows=tuple((int(r), None if s is None else int(s), str(m)) for r, s, m in said.head(20).iter_rows())))
        if inc.klass is IncidentClass.CORRUPTION:
            cause = Cause.HARDWARE_ERROR
    if not signals:
        return inc
    what = ", ".join(str(s) for s in dict.fromkeys(signals))
    return replace(
        inc, id="", subject=Subject(kind=SubjectKind.DEVICE, id=device), hardware=tuple(signals), cause=cause,
        evidence=(*inc.evidence, *evidence), fields=(*inc.fields, *(f for f in _fields(signals) if f not in inc.fields)),
        summary=f"{inc.summary}; device fault: rank {rank}'s GPU {device} shows {what}",
    )


def _slowdown_evidence(rank: int, onset: int, frames: Frames, config: HardwareConfig
                       ) -> tuple[list[HardwareSignal], Cause | None, Evidence | None, str | None]:
    """CLOCK_LOSS / THROTTLE over the straggler's slow steps from `onset` on, the throttle cause, and the device the
    rank's samples of those steps came from (the most samples showing the signals: in a relaunched run one step
    number can have run on two devices)."""
    slow = _slow_steps(rank, onset, frames, config)
    if slow.height == 0:
        return [], None, None, None
    g = frames.gpu.filter(pl.col(_S).is_in(slow.get_column(_S).implode())).with_columns(
        (pl.col(Gpu.SM_CLOCK_MHZ.value) / pl.col(Gpu.SM_CLOCK_MAX_MHZ.value)).alias("rel"),
        ((pl.col(Gpu.THROTTLE_REASONS.value).fill_null(0) & int(SLOWDOWN_REASONS)) != 0).alias("bits"),
    )
    own = g.filter(pl.col(_R) == rank)
    peers = g.filter(pl.col(_R) != rank).group_by(_S).agg(
        pl.col("rel").median().alias("peer_rel"), pl.col("bits").mean().alias("peer_bits"))
    rows = own.join(peers, on=_S, how="inner").join(slow, on=_S, how="inner").sort(_S)
    if rows.height == 0:
        return [], None, None, None
    bits_share = float(rows.get_column("bits").mean()) - float(rows.get_column("peer_bits").mean())  # type: ignore[arg-type]
    throttled = bits_share >= config.throttle_share
    clocks = rows.filter(pl.col("rel").is_not_null() & pl.col("peer_rel").is_not_null() & (pl.col("rel") > 0))
    signals: list[HardwareSignal] = []
    note = ""
    if clocks.height:  # throttle bits that do not slow the clock do not explain the slowdown
        lost = clocks.filter(pl.col("peer_rel") - pl.col("rel") >= config.clock_loss)
        share = lost.height / clocks.height
        implied = float((lost["peer_rel"] / lost["rel"] - 1).median()) if lost.height else 0.0  # type: ignore[arg-type]
        observed = float(clocks.get_column("excess").median())  # type: ignore[arg-type]
        if share < config.clock_share or implied < config.clock_match * observed:
            return [], None, None, None
        signals.append(HardwareSignal.CLOCK_LOSS)
        # one slowdown figure per incident: the straggler's own (its summary); here only what the clock explains
        note = (f"SM clock below the other devices' at the same steps on {lost.height} of the {clocks.height} slow "
                f"steps with a GPU sample ({slow.height} slow steps in all): a clock loss that alone makes it "
                f"{implied:.0%} slower")
    elif not throttled:
        return [], None, None, None
    cause = None
    if throttled:
        signals.append(HardwareSignal.THROTTLE)
        cause = _throttle_cause(rows.filter(pl.col("bits")).get_column(Gpu.THROTTLE_REASONS.value))
        note = (note + "; " if note else "") + (f"slowdown throttle bits ({cause}) on {bits_share:.0%} more of its "
                                                "GPU-sampled slow steps than on the other devices")
    ev = Evidence(
        source="gpu",
        summary=f"rank {rank}'s GPU during its slow steps against the other devices at the same steps: {note}",
        columns=("rank", "step", "compute_excess", "sm_clock_rel", "peers_sm_clock_rel", "throttle_reasons"),
        rows=tuple((rank, int(s), round(float(x), 4), _round(r), _round(p), int(b or 0)) for s, x, r, p, b in rows.select(
            _S, "excess", "rel", "peer_rel", Gpu.THROTTLE_REASONS.value).head(20).iter_rows()),
    )
    showing = rows.filter(pl.col("bits") | (pl.col("peer_rel") - pl.col("rel") >= config.clock_loss))
    devs = (showing if showing.height else rows).get_column(_DEV).drop_nulls()
    return signals, cause, ev, (str(devs.mode().sort()[0]) if devs.len() else None)


def _slow_steps(rank: int, onset: int, frames: Frames, config: HardwareConfig) -> pl.DataFrame:
    """(step, excess) for the steps from `onset` on where `rank`'s compute exceeds its role peers' median by
    `slow_excess` (on the device clock compute_ns is the device's own work)."""
    st = frames.steps.filter(pl.col(_S) >= onset)
    topo = frames.topology
    if topo.height and rank in set(topo.get_column(_R).to_list()):
        role = topo.filter(pl.col(_R) == rank).get_column("role")[0]
        if role is not None:
            st = st.filter(pl.col(_R).is_in(topo.filter(pl.col("role") == role).get_column(_R).implode()))
    peers = st.filter(pl.col(_R) != rank).group_by(_S).agg(pl.col("compute_ns").median().alias("peer_ns"))
    own = st.filter(pl.col(_R) == rank).select(_S, "compute_ns").join(peers, on=_S, how="inner")
    return own.filter(pl.col("peer_ns") > 0).select(
        _S, (pl.col("compute_ns") / pl.col("peer_ns") - 1).alias("excess"),
    ).filter(pl.col("excess") >= config.slow_excess)


def _throttle_cause(reasons: pl.Series) -> Cause:
    b = reasons.fill_null(0)
    counts = {Cause.THERMAL_THROTTLE: int(((b & _THERMAL) != 0).sum()),
              Cause.POWER_THROTTLE: int(((b & _POWER) != 0).sum()),
              Cause.HW_SLOWDOWN: int(((b & _HW) != 0).sum())}
    return max(counts, key=lambda k: counts[k])


def _lookback(inc: Incident, rank: int, anchor: int, frames: Frames) -> int:
    """The step device errors may precede the onset from: a corruption's onset is the first fingerprint that shows
    it, so the fault may lie anywhere after the fingerprint before."""
    if inc.klass is not IncidentClass.CORRUPTION or frames.fingerprints.height == 0:
        return anchor
    before = frames.fingerprints.filter((pl.col(_R) == rank) & (pl.col(_S) < anchor)).get_column(_S)
    return int(before.max()) if before.len() else anchor  # type: ignore[arg-type]


def _error_evidence(rank: int, since: int, anchor: int, errors: pl.DataFrame, rising: dict[int, int],
                    config: HardwareConfig) -> tuple[list[HardwareSignal], Evidence | None]:
    lo, hi = since - config.error_before_steps, anchor + config.error_after_steps
    near = errors.filter((pl.col(_R) == rank) & pl.col(_S).is_between(lo, hi)).sort(_S)
    signals = _error_signals(near)
    if rank in rising and rising[rank] <= hi:
        signals.append(HardwareSignal.ECC_SBE_RISING)
        near = errors.filter((pl.col(_R) == rank) & (pl.col(_S) <= hi)).sort(_S)
    if not signals:
        return [], None
    return signals, _error_rows(near, f"new device errors of rank {rank}'s GPU up to step {hi}")


def _error_signals(rows: pl.DataFrame) -> list[HardwareSignal]:
    out = []
    if (rows.get_column("new_dbe") > 0).any():
        out.append(HardwareSignal.ECC_DBE)
    if (rows.get_column("xids").list.len() > 0).any():
        out.append(HardwareSignal.XID)
    if (rows.get_column("new_remap") > 0).any():
        out.append(HardwareSignal.ROW_REMAP)
    return out


def _error_rows(rows: pl.DataFrame, summary: str) -> Evidence:
    return Evidence(
        source="gpu", summary=summary,
        columns=("rank", "step", "device_uuid", "new_sbe", "new_dbe", "new_remap", "xids"),
        rows=tuple((int(r), int(s), d, int(a), int(b), int(c), list(x)) for r, s, d, a, b, c, x in rows.select(
            list(_ERROR_SCHEMA)).head(20).iter_rows()),
    )


def _fields(signals: Sequence[HardwareSignal]) -> tuple[str, ...]:
    cols = {HardwareSignal.THROTTLE: Gpu.THROTTLE_REASONS.value, HardwareSignal.CLOCK_LOSS: Gpu.SM_CLOCK_MHZ.value,
            HardwareSignal.ECC_DBE: Gpu.ECC_DBE_VOLATILE.value, HardwareSignal.XID: Gpu.XID_EVENTS.value,
            HardwareSignal.ECC_SBE_RISING: Gpu.ECC_SBE_VOLATILE.value, HardwareSignal.ROW_REMAP: "remapped_rows",
            HardwareSignal.DRIVER_ERROR: "message"}
    return tuple(dict.fromkeys(cols[s] for s in signals))


def _round(v: float | None) -> float | None:
    return None if v is None or math.isnan(v) else round(float(v), 4)


def _rank_devices(frames: Frames) -> dict[int, str]:
    """rank -> the device UUID its GPU rows report (the topology's where it has none)."""
    out: dict[int, str] = {}
    topo = frames.topology
    for r, d in topo.select(_R, Gpu.DEVICE_UUID.value).iter_rows():
        if d:
            out[int(r)] = str(d)
    for r, d in frames.gpu.group_by(_R).agg(pl.col(_DEV).drop_nulls().last()).iter_rows():
        if d:
            out[int(r)] = str(d)
    return out


# -------------------------------------------------------------------------------------------- (b) failing devices


def _sbe_rising(errors: pl.DataFrame, config: HardwareConfig) -> dict[int, int]:
    """rank -> the step by which its device's corrected ECC errors were rising (see the module docstring)."""
    sbe = errors.filter(pl.col("new_sbe") > 0).sort(_R, _S)
    if sbe.height == 0:
        return {}
    per = sbe.group_by(_R).agg(pl.col("new_sbe").sum().alias("total"), pl.len().alias("steps"))
    totals = dict(per.select(_R, "total").iter_rows())
    out: dict[int, int] = {}
    for rank, total, n in per.iter_rows():
        others = max((v for k, v in totals.items() if k != rank), default=0)
        if total < config.sbe_min or n < config.sbe_min_steps or total < config.sbe_ratio * others:
            continue
        rows = sbe.filter(pl.col(_R) == rank).with_columns(
            pl.col("new_sbe").cum_sum().alias("cum"), pl.int_range(1, pl.len() + 1).alias("k"))
        at = rows.filter((pl.col("cum") >= config.sbe_min) & (pl.col("k") >= config.sbe_min_steps))
        out[int(rank)] = int(at.get_column(_S)[0])
    return out


def _failing_devices(errors: pl.DataFrame, rising: dict[int, int], named: set[str],
                     config: HardwareConfig) -> list[Incident]:
    out: list[Incident] = []
    for (rank, device), rows in errors.sort(_S).group_by([_R, _DEV], maintain_order=True):
        rank, device = int(rank), str(device)
        if device in named:
            continue
        hard = rows.filter((pl.col("new_dbe") > 0) | (pl.col("xids").list.len() > 0))
        signals = _error_signals(rows)
        if rank in rising:
            signals.append(HardwareSignal.ECC_SBE_RISING)
        if not set(signals) & _FAILING:
            continue
        onset = int(rows.get_column(_S)[0])
        first_hard = int(hard.get_column(_S)[0]) if hard.height else None
        detection = min(s for s in (first_hard, rising.get(rank)) if s is not None)
        what = ", ".join(str(s) for s in signals)
        counts = (f"{int(rows['new_dbe'].sum())} uncorrectable and {int(rows['new_sbe'].sum())} corrected ECC errors, "
                  f"{int(rows['new_remap'].sum())} remapped rows / retired pages, hardware XIDs "
                  f"{sorted({x for xs in rows['xids'].to_list() for x in xs}) or 'none'}")
        out.append(Incident(
            klass=IncidentClass.CORRUPTION, subject=Subject(kind=SubjectKind.DEVICE, id=device), ranks=(rank,),
            onset_step=onset, detection_step=detection, confidence=config.fault_confidence,
            cause=Cause.HARDWARE_ERROR, hardware=tuple(signals), fields=_fields(signals),
            summary=(f"device fault: rank {rank}'s GPU {device} shows {what} from step {onset} ({counts} during the "
                     f"run); the values it holds are in doubt"),
            evidence=(_error_rows(rows, f"new device errors of rank {rank}'s GPU; other devices: "
                                        f"{_others_note(errors, rank)}"),),
        ))
    return out


def _others_note(errors: pl.DataFrame, rank: int) -> str:
    o = errors.filter(pl.col(_R) != rank)
    if o.height == 0:
        return "none"
    most = int(o.group_by(_R).agg(pl.col("new_sbe").sum()).get_column("new_sbe").max())  # type: ignore[arg-type]
    return f"{o.get_column(_R).n_unique()} with new errors, at most {most} corrected ECC errors each"
