"""What can go wrong in a simulated run: the fault and benign-variation dataclasses the simulator lays over a
healthy run (`SimFault`), their enums, and `parse_sim_fault`. On the command line each fault is one
``KIND:key=value,...`` spec, e.g. ``straggler:rank=5,from=100,slow=0.1`` or
``fail_stop:rank=3,step=120,how=killed_all``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from rankwatch.base.topology import Layout


class StragglerCause(StrEnum):
    NONE = "none"
    """The rank's own compute is slower: on the device under `Timing.GPU` (labeled device_slow), on the training
    thread under `Timing.CPU` (labeled unknown, as a CPU run cannot tell where)."""
    THERMAL = "thermal"
    POWER = "power"
    DATALOADER = "dataloader"
    HOST_STALL = "host_stall"
    """The training thread stalls inside the forward phase (the trainer's `slow` fault, a host sleep): under
    `Timing.GPU` it shows in that phase's CPU time and in device time (the device waits for work), not in the device
    kernel time of other phases (labeled host_stall); under `Timing.CPU` it is compute like any other (unknown)."""


class FailHow(StrEnum):
    EXIT = "exit"
    """Exit event with code 1 on the culprit."""
    SIGNAL = "signal"
    """Signal event on the culprit (and an exit event 128+signal when the signal is catchable)."""
    VANISHED = "vanished"
    """No event at all from the culprit; peers time out and exit with errors."""
    KILLED_ALL = "killed_all"
    """No event from the culprit, and the launcher kills everyone before the peers time out: no error rows,
    exception or exit events anywhere; peers' in_flight rows stay open."""


class DivergeField(StrEnum):
    RNG = "rng"
    DATA = "data"
    STEP = "step"


class CorruptionKind(StrEnum):
    BITFLIP_PARAM = "bitflip_param"
    NAN = "nan"
    GRAD_SPIKE = "grad_spike"


@dataclass(frozen=True, kw_only=True, slots=True)
class Straggler:
    """`rank` computes `slow` (a fraction: 0.1 = 10 % longer) slower from `from_step` (until `until_step`,
    exclusive); with `period`/`burst` only `burst` steps of every `period`. `cause` thermal/power also lowers the
    device's SM clock and sets the matching throttle bit; dataloader puts the extra time into dataloader wait;
    host_stall puts it into a host stall at the start of forward."""

    rank: int
    from_step: int = 0
    slow: float
    until_step: int | None = None
    period: int | None = None
    burst: int | None = None
    cause: StragglerCause = StragglerCause.NONE

    def __post_init__(self) -> None:
        if not 0.05 <= self.slow <= 1.0:
            raise ValueError(f"straggler slow={self.slow}: must be in [0.05, 1.0]")
        if self.period is not None and not 1 <= (self.burst or 1) < self.period:
            raise ValueError(f"straggler period={self.period} burst={self.burst}: need 1 <= burst < period")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostDataloader:
    """Every rank of host `host` (an index) waits `slow` x its compute time longer for data from `from_step`."""

    host: int
    from_step: int = 0
    slow: float = 0.3


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowLink:
    """Transfers over the link between hosts `host_a` and `host_b` take `factor` times longer from `from_step`."""

    host_a: int
    host_b: int
    from_step: int = 0
    factor: float = 4.0

    def __post_init__(self) -> None:
        if self.host_a == self.host_b or self.factor <= 1.0:
            raise ValueError(f"slow_link {self.host_a}-{self.host_b}: needs two different hosts and factor > 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class StageImbalance:
    """Every rank of pipeline stage `stage` computes `factor` times longer from `from_step`."""

    stage: int
    factor: float = 1.3
    from_step: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSkew:
    """Each step the batches of `count` random data-parallel replicas are `extra` (a fraction) longer: every rank of
    those replicas (all stages and tensor shards, which work on the same batch) computes that much longer, and a
    different replica is late each step."""

    extra: float = 0.3
    count: int = 1
    from_step: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class FailStop:
    """`rank` dies during `step` (`in_collective`: inside that step's data-parallel all-reduce, else mid-compute)."""

    rank: int
    step: int
    how: FailHow = FailHow.EXIT
    signal: int = 9
    in_collective: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Hang:
    """`rank` stops at the start of `step` but stays alive (heartbeats) for `alive_s` simulated seconds; with
    `killed` the launcher kills every rank `kill_after_s` after the hang began, before any peer times out."""

    rank: int
    step: int
    alive_s: float = 20.0
    killed: bool = False
    kill_after_s: float = 5.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Divergence:
    """From `step` on, `ranks` (or every rank of data-parallel replica `replica`) disagree with their domain in
    `field`; parameters and optimizer state follow from the fingerprint after."""

    step: int
    field: DivergeField = DivergeField.RNG
    ranks: tuple[int, ...] = ()
    replica: int | None = None
    offset: int = 8
    """Samples skipped (data divergence)."""

    def __post_init__(self) -> None:
        if bool(self.ranks) == (self.replica is not None):
            raise ValueError("divergence: give exactly one of ranks= or replica=")


@dataclass(frozen=True, kw_only=True, slots=True)
class Corruption:
    """Silent corruption on `rank` at `step`; `hardware` adds an ECC double-bit error and XID 48 on its device."""

    rank: int
    step: int
    kind: CorruptionKind = CorruptionKind.BITFLIP_PARAM
    hardware: bool = False
    factor: float = 100.0
    """grad_spike: local gradient norm multiplier (10..1000)."""
    duration: int = 1
    """grad_spike: steps the spike lasts."""

    def __post_init__(self) -> None:
        if self.kind is CorruptionKind.GRAD_SPIKE and not 10 <= self.factor <= 1000:
            raise ValueError(f"corruption grad_spike factor={self.factor}: must be in [10, 1000]")
        if self.duration < 1:
            raise ValueError(f"corruption duration={self.duration}: must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowHardware:
    """Benign: `rank` is `slow` (a fraction) slower all run long."""

    rank: int
    slow: float = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class ThrottleBitOnly:
    """Benign: `rank`'s GPU reports the SW power-cap bit and a slightly lower clock, but the rank is not slower."""

    rank: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SteadyCounters:
    """Benign: `rank`'s GPU has nonzero ECC single-bit and PCIe replay counts that never increase."""

    rank: int
    sbe: int = 12
    pcie_replay: int = 7


SimFault = (
    Straggler | HostDataloader | SlowLink | StageImbalance | DataSkew | FailStop | Hang | Divergence | Corruption
    | SlowHardware | ThrottleBitOnly | SteadyCounters
)
_BENIGN_TYPES = (SlowHardware, ThrottleBitOnly, SteadyCounters)


# ------------------------------------------------------------------------------------------------ spec parser

_Conv = Callable[[str], Any]


def _ranks(raw: str) -> tuple[int, ...]:
    return tuple(int(x) for x in raw.split("+"))


def _flag(raw: str) -> bool:
    if raw not in ("0", "1", "true", "false"):
        raise ValueError
    return raw in ("1", "true")


_SPECS: dict[str, tuple[type, dict[str, tuple[str, _Conv]]]] = {
    "straggler": (Straggler, {"rank": ("rank", int), "from": ("from_step", int), "until": ("until_step", int),
                              "slow": ("slow", float), "period": ("period", int), "burst": ("burst", int),
                              "cause": ("cause", StragglerCause)}),
    "host_dataloader": (HostDataloader, {"host": ("host", int), "from": ("from_step", int), "slow": ("slow", float)}),
    "slow_link": (SlowLink, {"a": ("host_a", int), "b": ("host_b", int), "from": ("from_step", int),
                             "factor": ("factor", float)}),
    "stage_imbalance": (StageImbalance, {"stage": ("stage", int), "factor": ("factor", float),
                                         "from": ("from_step", int)}),
    "data_skew": (DataSkew, {"extra": ("extra", float), "count": ("count", int), "from": ("from_step", int)}),
    "fail_stop": (FailStop, {"rank": ("rank", int), "step": ("step", int), "how": ("how", FailHow),
                             "signal": ("signal", int), "in_collective": ("in_collective", _flag)}),
    "hang": (Hang, {"rank": ("rank", int), "step": ("step", int), "alive": ("alive_s", float),
                    "killed": ("killed", _flag), "kill_after": ("kill_after_s", float)}),
    "divergence": (Divergence, {"step": ("step", int), "field": ("field", DivergeField), "ranks": ("ranks", _ranks),
                                "replica": ("replica", int), "offset": ("offset", int)}),
    "corruption": (Corruption, {"rank": ("rank", int), "step": ("step", int), "kind": ("kind", CorruptionKind),
                                "hardware": ("hardware", _flag), "factor": ("factor", float),
                                "duration": ("duration", int)}),
    "slow_hardware": (SlowHardware, {"rank": ("rank", int), "slow": ("slow", float)}),
    "throttle_bit_only": (ThrottleBitOnly, {"rank": ("rank", int)}),
    "steady_counters": (SteadyCounters, {"rank": ("rank", int), "sbe": ("sbe", int), "pcie_replay": ("pcie_replay", int)}),
}


def parse_sim_fault(text: str) -> SimFault:
    """Parse ``KIND:key=value,...`` (lists as ``ranks=3+7``, flags as 0/1); errors are one line naming the spec."""
    kind, _, rest = text.strip().partition(":")
    if kind not in _SPECS:
        raise ValueError(f"sim fault {text!r}: unknown kind {kind!r}; valid kinds: {', '.join(_SPECS)}")
    cls, keys = _SPECS[kind]
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key not in keys:
            raise ValueError(f"sim fault {text!r}: bad item {item!r}; valid keys for {kind}: {', '.join(keys)}")
        name, conv = keys[key]
        try:
            values[name] = conv(raw)
        except ValueError:
            raise ValueError(f"sim fault {text!r}: {key}={raw!r} is not a valid value") from None
    try:
        fault: SimFault = cls(**values)
    except TypeError:
        required = [k for k, (name, _) in keys.items()
                    if name in {f.name for f in fields(cls) if f.default is f.default_factory}
                    and name not in values]
        raise ValueError(f"sim fault {text!r}: missing {', '.join(k + '=' for k in required)}") from None
    except ValueError as exc:
        raise ValueError(f"sim fault {text!r}: {exc}") from None
    return fault


# ------------------------------------------------------------------------------------------------ ranks a fault touches


def replica_ranks(layout: Layout, dp: int) -> tuple[int, ...]:
    """Every rank of data-parallel replica `dp` (one per consistency domain)."""
    return tuple(layout.rank_of(dp=dp, tp=t, pp=p) for p in range(layout.pp) for t in range(layout.tp))


def _div_ranks(f: Divergence, layout: Layout) -> tuple[int, ...]:
    return replica_ranks(layout, f.replica) if f.replica is not None else f.ranks
