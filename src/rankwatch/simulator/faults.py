"""What can go wrong in a simulated run: the fault and benign-variation dataclasses the simulator lays over a
healthy run (`SimFault`), their enums, and `parse_sim_fault`. On the command line each fault is one
``KIND:key=value,...`` spec in the spelling `rankwatch train --fault` uses wherever train has the fault, e.g.
``slow:rank=5,from=100,delay=0.03`` or ``kill:rank=3,step=120``, and the simulator's own kinds in the same
conventions, e.g. ``host_dataloader:host=2,from=50,delay=0.02`` (`SIM_FAULT_HELP` lists them all).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from rankwatch.base.topology import Hosts, Layout

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


_SLOW_RANGE = (0.05, 1.0)
"""The slowdowns a `Straggler` models, as a share of the rank's nominal compute."""


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
        if not _SLOW_RANGE[0] <= self.slow <= _SLOW_RANGE[1]:
            raise ValueError(f"straggler slow={self.slow}: must be in [{_SLOW_RANGE[0]}, {_SLOW_RANGE[1]}]")
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
#
# One syntax for `rankwatch train --fault` and `rankwatch simulate --fault`: a fault both can run is spelled as train
# spells it (canary.faults: kind names, keys, defaults, seconds), and the simulator turns it into its own terms here
# (a delay into a share of the rank's nominal compute, a device slot into the rank on it). The simulator cannot import
# the canary (the layering), so the shared keys are written out below and tests/unit/test_faults.py pins them to
# canary.faults.FAULT_KEYS.

_Conv = Callable[[str], Any]
_Values = dict[str, Any]


def _ranks(raw: str) -> tuple[int, ...]:
    return tuple(int(x) for x in raw.split("+"))


def _hosts(raw: str) -> tuple[int, int]:
    a, dash, b = raw.partition("-")
    if not dash or not a.isdigit() or not b.isdigit():
        raise ValueError
    return int(a), int(b)


def _target(raw: str) -> str:
    if raw not in ("grad", "param"):
        raise ValueError
    return raw


def _flag(raw: str) -> bool:
    if raw not in ("0", "1", "true", "false"):
        raise ValueError
    return raw in ("1", "true")


class _RunShape(Protocol):
    """What `parse_sim_fault` reads of the run a fault goes into: a `SimConfig` (not imported: config imports this
    module)."""

    @property
    def layout(self) -> Layout: ...
    @property
    def hosts(self) -> int: ...
    @property
    def compute_s(self) -> float: ...


_LOSS_SHARE = 0.02
"""The last pipeline stage computes this much longer than the others (it also computes the loss): `model._nominal`,
which tests/unit/test_simulate.py pins this to."""


class _Run:
    """What a spec in seconds or device slots needs of the run it goes into (`parse_sim_fault`'s `cfg`)."""

    def __init__(self, cfg: _RunShape | None) -> None:
        self._cfg = cfg

    def _need(self, what: str) -> _RunShape:
        if self._cfg is None:
            raise ValueError(f"{what} needs the run the fault goes into: parse_sim_fault(spec, cfg)")
        return self._cfg

    def compute_s(self, rank: int, what: str) -> float:
        """Nominal compute seconds per step of `rank`: what the model multiplies a straggler's `slow` with."""
        cfg = self._need(what)
        lay = cfg.layout
        if not 0 <= rank < lay.world_size:
            raise ValueError(f"rank {rank} outside world size {lay.world_size}")
        last_stage = rank // (lay.tp * lay.dp) == lay.pp - 1
        return cfg.compute_s * (1.0 + _LOSS_SHARE * last_stage)

    def share(self, delay_s: float, rank: int) -> float:
        """`delay_s` more per step as a `Straggler`'s `slow`: the share of the rank's nominal compute it adds."""
        base = self.compute_s(rank, "delay= (seconds)")
        lo, hi = _SLOW_RANGE
        slow = delay_s / base
        if not lo * (1 - 1e-9) <= slow <= hi * (1 + 1e-9):
            raise ValueError(f"delay={delay_s:g} is {slow:.0%} of rank {rank}'s compute ({base:g} s a step); the "
                             f"simulator models delay={lo * base:g}..{hi * base:g}")
        return round(min(max(slow, lo), hi), 12)

    def host_share(self, delay_s: float, host: int) -> float:
        """`delay_s` more data wait per step for every rank of `host`, as a `HostDataloader`'s `slow` (the share of
        the host's first rank's compute: exact where a host holds one pipeline stage, as hosts filled with whole
        stages do)."""
        cfg = self._need("delay= (seconds)")
        per_host = Hosts(count=cfg.hosts, world_size=cfg.layout.world_size).per_host
        if not 0 <= host < cfg.hosts:
            raise ValueError(f"host {host} outside {cfg.hosts} hosts")
        if delay_s <= 0:
            raise ValueError(f"delay={delay_s:g} must be > 0")
        return round(delay_s / self.compute_s(host * per_host, "delay= (seconds)"), 12)

    def rank_on(self, host: int, index: int) -> int:
        """The rank on device slot `index` of `host` (the simulator places local rank l on slot l)."""
        cfg = self._need("bad_device")
        per_host = Hosts(count=cfg.hosts, world_size=cfg.layout.world_size).per_host
        if not 0 <= host < cfg.hosts:
            raise ValueError(f"host {host} does not exist (hosts are 0..{cfg.hosts - 1})")
        if not 0 <= index < per_host:
            raise ValueError(f"device slot {index} does not exist (a host has slots 0..{per_host - 1})")
        return host * per_host + index


@dataclass(frozen=True, kw_only=True, slots=True)
class _Kind:
    """One spelling: its keys in help order with their converters, the required ones, and how the parsed values (by
    key, defaults not filled in) become a fault."""

    keys: dict[str, _Conv]
    required: tuple[str, ...]
    build: Callable[[_Values, _Run], SimFault]
    extra: tuple[str, ...] = ()
    """Keys among `keys` that only simulate takes on a kind train has too (the help lists them apart)."""
    train_only: dict[str, str] | None = None
    """Keys train takes on this kind that the simulator cannot model, and why."""


_MIN = {"signal": 1, "period": 1, "burst": 1, "offset": 1, "count": 1, "duration": 1}
"""Smallest value of an integer key (others: 0)."""


def _beyond(factor: float) -> float:
    """A multiplier of the compute (`factor=`, 1 = none extra) as the share it adds (`slow`, `extra`)."""
    return round(factor - 1.0, 12)


def _straggler(cause: StragglerCause, v: _Values, rank: int, slow: float) -> Straggler:
    return Straggler(rank=rank, from_step=v.get("from", 0), slow=slow, until_step=v.get("until"),
                     period=v.get("period"), burst=v.get("burst"), cause=cause)


def _delayed(cause: StragglerCause) -> Callable[[_Values, _Run], SimFault]:
    return lambda v, run: _straggler(cause, v, v["rank"], run.share(v["delay"], v["rank"]))


def _throttle_cause(reason: str) -> StragglerCause:
    causes = {"thermal": StragglerCause.THERMAL, "power": StragglerCause.POWER}
    if reason not in causes:
        raise ValueError(f"reason={reason!r}: the simulator models reason=thermal|power (the others are train-only)")
    return causes[reason]


def _throttle(v: _Values, run: _Run) -> SimFault:
    cause = _throttle_cause(v.get("reason", "thermal"))
    return _straggler(cause, v, v["rank"], run.share(v.get("delay", 0.02), v["rank"]))


def _bad_device(v: _Values, run: _Run) -> SimFault:
    cause = _throttle_cause(v.get("reason", "thermal"))
    rank = run.rank_on(v["host"], v["index"])
    return _straggler(cause, v, rank, run.share(v.get("delay", 0.02), rank))


def _gpu_slow(v: _Values, run: _Run) -> SimFault:
    lo, hi = _SLOW_RANGE
    if not lo <= _beyond(v["factor"]) <= hi:
        raise ValueError(f"factor={v['factor']:g}: the simulator models factor={1 + lo:g}..{1 + hi:g} (more is "
                         "train-only)")
    return _straggler(StragglerCause.NONE, v, v["rank"], _beyond(v["factor"]))


def _exit(v: _Values, run: _Run) -> SimFault:
    if v.get("code", 1) != 1:
        raise ValueError(f"code={v['code']}: the simulator's exit code is 1 (other codes are train-only)")
    return FailStop(rank=v["rank"], step=v["step"], how=FailHow.EXIT, in_collective=v.get("in_collective", False))


def _kill(v: _Values, run: _Run) -> SimFault:
    return FailStop(rank=v["rank"], step=v["step"], how=FailHow.SIGNAL, signal=v.get("signal", 9),
                    in_collective=v.get("in_collective", False))


def _vanish(v: _Values, run: _Run) -> SimFault:
    how = FailHow.KILLED_ALL if v.get("killed", False) else FailHow.VANISHED
    return FailStop(rank=v["rank"], step=v["step"], how=how, in_collective=v.get("in_collective", False))


def _bitflip(v: _Values, run: _Run) -> SimFault:
    # bit, param and index name an element of real parameters the simulator has no values for: any flip of a
    # parameter changes its replica's hash from that step on, which is all the simulated telemetry shows of it
    if v.get("target", "grad") != "param":
        raise ValueError("target=grad (bitflip's default) is train-only: the simulator has no gradient values to "
                         "flip (target=param it models; corruption:kind=grad_spike is the spike a flipped exponent "
                         "makes)")
    if v.get("bit", 30) > 63:
        raise ValueError(f"bit must be in 0..63, got {v['bit']}")
    return Corruption(rank=v["rank"], step=v["step"], kind=CorruptionKind.BITFLIP_PARAM,
                      hardware=v.get("hardware", False))


def _corruption(v: _Values, run: _Run) -> SimFault:
    if v["kind"] is CorruptionKind.BITFLIP_PARAM:
        raise ValueError("kind=bitflip_param is spelled bitflip:rank=,step=,target=param")
    spike = {key: v[key] for key in ("factor", "duration") if key in v}
    return Corruption(rank=v["rank"], step=v["step"], kind=v["kind"], hardware=v.get("hardware", False), **spike)


def _fields(cls: type, names: dict[str, str]) -> Callable[[_Values, _Run], SimFault]:
    """A builder that passes each given key to the dataclass field `names[key]` (the others keep their defaults)."""
    return lambda v, run: cls(**{names[k]: x for k, x in v.items()})


_KINDS: dict[str, _Kind] = {
    # -- train's spelling (canary.faults): same kinds, keys, defaults and units -----------------------------------
    "slow": _Kind(keys={"rank": int, "from": int, "delay": float, "until": int, "period": int, "burst": int},
                  required=("rank", "delay"), build=_delayed(StragglerCause.HOST_STALL)),
    "exit": _Kind(keys={"rank": int, "step": int, "code": int, "in_collective": _flag}, required=("rank", "step"),
                  build=_exit, extra=("in_collective",)),
    "kill": _Kind(keys={"rank": int, "step": int, "signal": int, "in_collective": _flag}, required=("rank", "step"),
                  build=_kill, extra=("in_collective",)),
    "hang": _Kind(keys={"rank": int, "step": int, "alive": float, "killed": _flag, "kill_after": float},
                  required=("rank", "step"), extra=("alive", "killed", "kill_after"),
                  build=_fields(Hang, {"rank": "rank", "step": "step", "alive": "alive_s", "killed": "killed",
                                       "kill_after": "kill_after_s"})),
    "bitflip": _Kind(keys={"rank": int, "step": int, "target": _target, "bit": int, "param": int, "index": int,
                           "hardware": _flag}, required=("rank", "step"), build=_bitflip, extra=("hardware",)),
    "skew_rng": _Kind(keys={"rank": int, "step": int}, required=("rank", "step"),
                      build=lambda v, run: Divergence(step=v["step"], field=DivergeField.RNG, ranks=(v["rank"],))),
    "skew_data": _Kind(keys={"rank": int, "step": int, "offset": int}, required=("rank", "step"),
                       build=lambda v, run: Divergence(step=v["step"], field=DivergeField.DATA, ranks=(v["rank"],),
                                                       offset=v.get("offset", 1))),
    "throttle": _Kind(keys={"rank": int, "from": int, "delay": float, "until": int, "reason": str},
                      required=("rank",), build=_throttle),
    "bad_device": _Kind(keys={"host": int, "index": int, "from": int, "delay": float, "until": int, "reason": str},
                        required=("host", "index"), build=_bad_device),
    "gpu_slow": _Kind(keys={"rank": int, "from": int, "factor": float, "until": int}, required=("rank", "factor"),
                      build=_gpu_slow),
    # -- the simulator's own: same conventions (rank=, step=, from=, until=; delay= in seconds, factor= x compute) --
    "slow_link": _Kind(keys={"hosts": _hosts, "from": int, "factor": float}, required=("hosts",),
                       build=lambda v, run: SlowLink(host_a=v["hosts"][0], host_b=v["hosts"][1],
                                                     from_step=v.get("from", 0), factor=v.get("factor", 4.0)),
                       train_only={"delay": "train adds seconds to each collective over the link; the simulator "
                                            "stretches its transfers, give factor=",
                                   "until": "the simulator's slow link lasts to the end of the run"}),
    "dataloader": _Kind(keys={"rank": int, "from": int, "delay": float, "until": int, "period": int, "burst": int},
                        required=("rank", "delay"), build=_delayed(StragglerCause.DATALOADER)),
    "host_dataloader": _Kind(keys={"host": int, "from": int, "delay": float}, required=("host", "delay"),
                             build=lambda v, run: HostDataloader(host=v["host"], from_step=v.get("from", 0),
                                                                 slow=run.host_share(v["delay"], v["host"]))),
    "stage_imbalance": _Kind(keys={"stage": int, "from": int, "factor": float}, required=("stage",),
                             build=_fields(StageImbalance, {"stage": "stage", "from": "from_step",
                                                            "factor": "factor"})),
    "data_skew": _Kind(keys={"count": int, "from": int, "factor": float}, required=(),
                       build=lambda v, run: DataSkew(count=v.get("count", 1), from_step=v.get("from", 0),
                                                     extra=_beyond(v.get("factor", 1.3)))),
    "vanish": _Kind(keys={"rank": int, "step": int, "in_collective": _flag, "killed": _flag},
                    required=("rank", "step"), build=_vanish),
    "divergence": _Kind(keys={"step": int, "field": DivergeField, "ranks": _ranks, "replica": int, "offset": int},
                        required=("step",),
                        build=_fields(Divergence, {"step": "step", "field": "field", "ranks": "ranks",
                                                   "replica": "replica", "offset": "offset"})),
    "corruption": _Kind(keys={"rank": int, "step": int, "kind": CorruptionKind, "hardware": _flag,
                              "factor": float, "duration": int}, required=("rank", "step", "kind"),
                        build=_corruption),
    "slow_hardware": _Kind(keys={"rank": int, "factor": float}, required=("rank",),
                           build=lambda v, run: SlowHardware(rank=v["rank"], slow=_beyond(v.get("factor", 1.02)))),
    "throttle_bit_only": _Kind(keys={"rank": int}, required=("rank",),
                               build=_fields(ThrottleBitOnly, {"rank": "rank"})),
    "steady_counters": _Kind(keys={"rank": int, "sbe": int, "pcie_replay": int}, required=("rank",),
                             build=_fields(SteadyCounters, {"rank": "rank", "sbe": "sbe",
                                                            "pcie_replay": "pcie_replay"})),
}

SHARED_KINDS: tuple[str, ...] = ("slow", "exit", "kill", "hang", "bitflip", "skew_rng", "skew_data", "throttle",
                                 "bad_device", "gpu_slow")
"""Kinds `rankwatch train --fault` and `rankwatch simulate --fault` both take, spelled alike."""
TRAIN_ONLY_KINDS: tuple[str, ...] = ("nudge", "freeze", "failing_device", "device_error")
"""Train's kinds the simulator does not model (a one-line error in simulate). Train's slow_link is its own:
seconds per collective, where the simulator's stretches the link's transfers (`factor=`)."""
SIM_FAULT_KEYS: dict[str, tuple[str, ...]] = {
    kind: tuple(key for key in k.keys if key not in k.extra) for kind, k in _KINDS.items()}
"""Every kind simulate takes, with its keys (without the simulate-only keys of shared kinds)."""


def _spelling(kind: str, keys: tuple[str, ...]) -> str:
    return f"{kind}:{','.join(f'{key}=' for key in keys)}"


def _extras_by_keys() -> dict[tuple[str, ...], list[str]]:
    out: dict[tuple[str, ...], list[str]] = {}
    for kind in SHARED_KINDS:
        if _KINDS[kind].extra:
            out.setdefault(_KINDS[kind].extra, []).append(kind)
    return out


SIM_FAULT_HELP = (
    "train's spelling, keys and units (delays in seconds): "
    + "; ".join(_spelling(kind, SIM_FAULT_KEYS[kind]) for kind in SHARED_KINDS)
    + " (simulate also takes "
    + ", ".join(f"{','.join(f'{key}=' for key in extra)} on {' and '.join(kinds)}"
                for extra, kinds in _extras_by_keys().items())
    + "); simulate only: "
    + "; ".join(_spelling(kind, keys) for kind, keys in SIM_FAULT_KEYS.items() if kind not in SHARED_KINDS)
    + f"; train only: {', '.join(TRAIN_ONLY_KINDS)}"
)
"""The vocabulary of `rankwatch simulate --fault` (cli.py spells it out so as not to import the simulator; a test
pins the two together)."""

def parse_sim_fault(text: str, cfg: _RunShape | None = None) -> SimFault:
    """Parse ``KIND:key=value,...`` in train's spelling where train has the fault (`SIM_FAULT_HELP`; lists as
    ``ranks=3+7``, flags as 0/1). `cfg` is the `SimConfig` the fault goes into (its faults unread): a delay in
    seconds becomes a share of the rank's nominal compute and a device slot the rank on it, so a spec that names
    either needs it. Errors are one line naming the spec."""
    kind, _, rest = text.strip().partition(":")
    if kind in TRAIN_ONLY_KINDS:
        raise ValueError(f"sim fault {text!r}: {kind} is a train-only fault (rankwatch train --fault); the simulator "
                         f"does not model it")
    spelling = _KINDS.get(kind)
    if spelling is None:
        near = difflib.get_close_matches(kind, list(_KINDS), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"sim fault {text!r}: unknown kind {kind!r}{hint}; valid kinds: {', '.join(_KINDS)}")
    values: _Values = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if eq and spelling.train_only and key in spelling.train_only:
            raise ValueError(f"sim fault {text!r}: {kind} {key}= is train-only: {spelling.train_only[key]}")
        if not eq or key not in spelling.keys:
            raise ValueError(f"sim fault {text!r}: bad item {item!r}; valid keys for {kind}: "
                             f"{', '.join(spelling.keys)}")
        try:
            value = spelling.keys[key](raw)
        except ValueError:
            raise ValueError(f"sim fault {text!r}: {key}={raw!r} is not a valid value") from None
        low = _MIN.get(key, 0)
        if isinstance(value, int | float) and not isinstance(value, bool) and not low <= value < math.inf:
            raise ValueError(f"sim fault {text!r}: {key} must be >= {low}, got {raw}")
        values[key] = value
    missing = [key for key in spelling.required if key not in values]
    if missing:
        raise ValueError(f"sim fault {text!r}: missing {', '.join(key + '=' for key in missing)}")
    try:
        return spelling.build(values, _Run(cfg))
    except ValueError as exc:
        raise ValueError(f"sim fault {text!r}: {exc}") from None


# ------------------------------------------------------------------------------------------------ ranks a fault touches


def replica_ranks(layout: Layout, dp: int) -> tuple[int, ...]:
    """Every rank of data-parallel replica `dp` (one per consistency domain)."""
    return tuple(layout.rank_of(dp=dp, tp=t, pp=p) for p in range(layout.pp) for t in range(layout.tp))


def _div_ranks(f: Divergence, layout: Layout) -> tuple[int, ...]:
    return replica_ranks(layout, f.replica) if f.replica is not None else f.ranks
