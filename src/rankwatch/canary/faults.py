"""Fault injection: one small chainable helper used by tests, the CLI and the demo.

    Faults().slow(rank=2, from_step=10, delay_s=0.2).exit(rank=3, step=40)

On the command line each fault is one ``--fault KIND:key=value,...`` spec, e.g. ``slow:rank=2,from=10,delay=0.2``
(`parse_fault`). The trainer asks the injector what to do at each point of a step; the injector itself has no
side effects.
"""

from __future__ import annotations

import difflib
from dataclasses import MISSING, dataclass, fields, replace
from enum import StrEnum
from typing import Any, Self

from rankwatch.base.schema import ThrottleReason
from rankwatch.base.topology import link_name


class FaultKind(StrEnum):
    SLOW = "slow"
    EXIT = "exit"
    KILL = "kill"
    HANG = "hang"
    BITFLIP = "bitflip"
    SKEW_RNG = "skew_rng"
    SKEW_DATA = "skew_data"
    THROTTLE = "throttle"
    BAD_DEVICE = "bad_device"
    SLOW_LINK = "slow_link"
    NUDGE = "nudge"
    GPU_SLOW = "gpu_slow"
    FREEZE = "freeze"
    FAILING_DEVICE = "failing_device"
    DEVICE_ERROR = "device_error"


class FlipTarget(StrEnum):
    GRAD = "grad"
    PARAM = "param"


def _active(step: int, from_step: int, until_step: int | None, period: int | None, burst: int | None) -> bool:
    if step < from_step or (until_step is not None and step >= until_step):
        return False
    if period is None:
        return True
    return (step - from_step) % period < (burst or 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Slow:
    """The rank computes `delay_s` longer per step from `from_step` (until `until_step`, exclusive).

    With `period`/`burst` the slowdown is intermittent: active for `burst` steps out of every `period`."""

    rank: int
    from_step: int = 0
    delay_s: float
    until_step: int | None = None
    period: int | None = None
    burst: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Exit:
    """The rank's process exits abruptly (os._exit, nothing flushed) at the start of `step`."""

    rank: int
    step: int
    code: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Kill:
    """The rank sends itself `signal` (default SIGKILL) at the start of `step`."""

    rank: int
    step: int
    signal: int = 9


@dataclass(frozen=True, kw_only=True, slots=True)
class Hang:
    """The rank's training thread stops at the start of `step` and never returns; the process stays alive."""

    rank: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class BitFlip:
    """Flip bit `bit` of element `index` of parameter number `param` (in `model.parameters()` order) on
    `rank` at `step`: in the local gradient before the all-reduce, or in the parameter after the update."""

    rank: int
    step: int
    target: FlipTarget = FlipTarget.GRAD
    bit: int = 30
    param: int = 0
    index: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SkewRng:
    """The rank draws one extra number from its torch RNG at `step`, so its RNG state leaves its peers'."""

    rank: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SkewData:
    """The rank's data position jumps by `offset` samples at `step`."""

    rank: int
    step: int
    offset: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Throttle:
    """The rank's (replayed) GPU reports a clock throttle from `from_step`, and the rank computes `delay_s`
    longer per step, as a throttled device would."""

    rank: int
    from_step: int = 0
    delay_s: float = 0.02
    until_step: int | None = None
    reason: str = "thermal"


@dataclass(frozen=True, kw_only=True, slots=True)
class BadDevice:
    """A faulty (replayed) GPU: device slot `index` of host `host` throttles from `from_step`, and whichever rank is
    placed on it (`CanaryConfig.device_shift` moves ranks between a host's slots) computes `delay_s` longer per
    step. The fault follows the device, not the rank number: what cross-run localization must tell apart."""

    host: int
    index: int
    from_step: int = 0
    delay_s: float = 0.02
    until_step: int | None = None
    reason: str = "thermal"


DEVICE_ERROR_TEXT = "CUDA error: unspecified launch failure"
"""What a rank on a failing device raises (`DeviceError`): the text a GPU fault that leaves no XID or ECC counter
behind gives to the kernel launches of whichever process uses the device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FailingDevice:
    """A failing (replayed) GPU: whichever rank is placed on device slot `index` of host `host` raises a device
    error (`DEVICE_ERROR_TEXT`) at the start of `step`, in every attempt that reaches it, and its process exits. Its
    NVML counters stay healthy: nothing but the failure's recurrence under different rank numbers says it is the
    device (analytics.localize)."""

    host: int
    index: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceError:
    """The rank raises a device error (RuntimeError, `DEVICE_ERROR_TEXT`) at the start of `step`: a failing device
    as the rank placed on it meets it (`Faults.placed`)."""

    rank: int
    step: int


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowLink:
    """Collectives whose group crosses the link between hosts `host_a` and `host_b` take `delay_s` longer."""

    host_a: int
    host_b: int
    from_step: int = 0
    delay_s: float
    until_step: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Nudge:
    """Right after a resume loads its checkpoint, every rank moves element `index` of parameter number `param` one
    ulp up: the replicas still agree and the consistency gate passes, but the replay is no longer bitwise — what
    only replay verification can see."""

    param: int = 0
    index: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuSlow:
    """The rank's device does `factor` times its own compute per step from `from_step` (until `until_step`): extra
    matrix products sized from the rank's measured step compute, enqueued on the compute stream with no host sleep
    and no synchronization, so a slow GPU shows on the device clock and not in the host thread's enqueue time (on
    CPU: the same products on the training thread). `slow` is the host-side stall; this is the device-side one."""

    rank: int
    from_step: int = 0
    factor: float
    until_step: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Freeze:
    """The whole rank process is stopped (SIGSTOP: every thread, heartbeats too) for `seconds` in the forward phase
    of `step`, then continued (SIGCONT, from a helper process started just before): a transient hang that recovers.
    Peers wait in their next collective with it; the run goes on (keep the process-group timeout above `seconds`)."""

    rank: int
    step: int
    seconds: float


Fault = (Slow | Exit | Kill | Hang | BitFlip | SkewRng | SkewData | Throttle | BadDevice | SlowLink | Nudge | GpuSlow
         | Freeze | FailingDevice | DeviceError)

THROTTLE_REASONS: dict[str, ThrottleReason] = {
    "thermal": ThrottleReason.HW_THERMAL_SLOWDOWN,
    "sw_thermal": ThrottleReason.SW_THERMAL_SLOWDOWN,
    "power": ThrottleReason.SW_POWER_CAP,
    "power_brake": ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
    "hw_slowdown": ThrottleReason.HW_SLOWDOWN,
}

GPU_SLOW_MAX_FACTOR = 100.0
"""Largest `gpu_slow` factor: beyond it the extra work is a hang, not a slowdown (use `hang`)."""

# CLI key -> dataclass field, per kind; the CLI keys are short (`from`, `delay`) where Python needs more.
_KINDS: dict[FaultKind, tuple[type, dict[str, str]]] = {
    FaultKind.SLOW: (
        Slow,
        {"rank": "rank", "from": "from_step", "delay": "delay_s", "until": "until_step", "period": "period", "burst": "burst"},
    ),
    FaultKind.EXIT: (Exit, {"rank": "rank", "step": "step", "code": "code"}),
    FaultKind.KILL: (Kill, {"rank": "rank", "step": "step", "signal": "signal"}),
    FaultKind.HANG: (Hang, {"rank": "rank", "step": "step"}),
    FaultKind.BITFLIP: (
        BitFlip,
        {"rank": "rank", "step": "step", "target": "target", "bit": "bit", "param": "param", "index": "index"},
    ),
    FaultKind.SKEW_RNG: (SkewRng, {"rank": "rank", "step": "step"}),
    FaultKind.SKEW_DATA: (SkewData, {"rank": "rank", "step": "step", "offset": "offset"}),
    FaultKind.THROTTLE: (
        Throttle,
        {"rank": "rank", "from": "from_step", "delay": "delay_s", "until": "until_step", "reason": "reason"},
    ),
    FaultKind.BAD_DEVICE: (
        BadDevice,
        {"host": "host", "index": "index", "from": "from_step", "delay": "delay_s", "until": "until_step",
         "reason": "reason"},
    ),
    FaultKind.SLOW_LINK: (SlowLink, {"hosts": "hosts", "from": "from_step", "delay": "delay_s", "until": "until_step"}),
    FaultKind.NUDGE: (Nudge, {"param": "param", "index": "index"}),
    FaultKind.GPU_SLOW: (GpuSlow, {"rank": "rank", "from": "from_step", "factor": "factor", "until": "until_step"}),
    FaultKind.FREEZE: (Freeze, {"rank": "rank", "step": "step", "seconds": "seconds"}),
    FaultKind.FAILING_DEVICE: (FailingDevice, {"host": "host", "index": "index", "step": "step"}),
    FaultKind.DEVICE_ERROR: (DeviceError, {"rank": "rank", "step": "step"}),
}
_KIND_OF: dict[type, FaultKind] = {cls: kind for kind, (cls, _) in _KINDS.items()}

FAULT_KEYS: dict[FaultKind, tuple[str, ...]] = {kind: tuple(keys) for kind, (_, keys) in _KINDS.items()}
"""The keys of each kind, in the order the help lists them: the vocabulary `rankwatch simulate --fault` shares for the
kinds it models (simulator.faults; tests pin the two together)."""

FAULT_HELP = "; ".join(f"{k}:{','.join(f'{key}=' for key in keys)}" for k, keys in FAULT_KEYS.items())


def _convert(kind: FaultKind, key: str, field_name: str, raw: str, cls: type) -> Any:
    field_type = {f.name: f.type for f in fields(cls)}[field_name]
    try:
        if "float" in str(field_type):
            return float(raw)
        if field_name == "target":
            return FlipTarget(raw)
        if field_name == "reason":
            if raw not in THROTTLE_REASONS:
                raise ValueError
            return raw
        return int(raw)
    except ValueError:
        expected = {
            "target": "|".join(FlipTarget),
            "reason": "|".join(THROTTLE_REASONS),
        }.get(field_name, "a number" if "float" in str(field_type) else "an integer")
        raise ValueError(f"fault {kind}: {key}={raw!r} is not {expected}") from None


def parse_fault(spec: str) -> Fault:
    """Parse one ``KIND:key=value,...`` spec; a bad spec is a one-line ValueError listing what is valid."""
    kind_text, _, rest = spec.strip().partition(":")
    try:
        kind = FaultKind(kind_text)
    except ValueError:
        near = difflib.get_close_matches(kind_text, [str(k) for k in FaultKind], n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"unknown fault {kind_text!r} in {spec!r}{hint}; valid kinds: {', '.join(FaultKind)}"
        ) from None
    cls, keys = _KINDS[kind]
    values: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or key not in keys:
            raise ValueError(f"fault {kind}: bad item {item!r}; valid keys: {', '.join(keys)}")
        if key == "hosts":
            a, dash, b = raw.partition("-")
            if not dash or not a.isdigit() or not b.isdigit() or a == b:
                raise ValueError(f"fault {kind}: hosts={raw!r} is not two different host indices like 0-1")
            values["host_a"], values["host_b"] = int(a), int(b)
        else:
            values[keys[key]] = _convert(kind, key, keys[key], raw, cls)
    required = [
        k for k, name in keys.items()
        if name in {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        and name not in values
    ]
    if kind is FaultKind.SLOW_LINK and "host_a" not in values:
        required.insert(0, "hosts")
    if required:
        raise ValueError(f"fault {kind}: missing {', '.join(f'{k}=' for k in required)} in {spec!r}")
    fault: Fault = cls(**values)
    _check_values(fault)
    return fault


def _check_values(fault: Fault) -> None:
    for name in ("rank", "step", "from_step", "host", "host_a", "host_b", "bit", "param", "index"):
        value = getattr(fault, name, 0)
        if value < 0:
            raise ValueError(f"fault {_KIND_OF[type(fault)]}: {name} must be >= 0, got {value}")
    for name in ("until_step", "burst", "signal", "offset"):
        value = getattr(fault, name, None)
        if value is not None and value < (1 if name in ("burst", "signal") else 0):
            raise ValueError(f"fault {_KIND_OF[type(fault)]}: {name} must be >= {1 if name in ('burst', 'signal') else 0}, got {value}")
    if getattr(fault, "delay_s", 0.0) < 0:
        raise ValueError(f"fault {_KIND_OF[type(fault)]}: delay must be >= 0")
    if isinstance(fault, BitFlip) and fault.bit > 63:
        raise ValueError(f"fault bitflip: bit must be in 0..63, got {fault.bit}")
    if isinstance(fault, Slow) and fault.period is not None and fault.period < 1:
        raise ValueError("fault slow: period must be >= 1")
    if isinstance(fault, Freeze) and not 0.0 < fault.seconds <= 3600.0:
        raise ValueError(f"fault freeze: seconds must be in (0, 3600], got {fault.seconds}")
    if isinstance(fault, GpuSlow) and not 1.0 <= fault.factor <= GPU_SLOW_MAX_FACTOR:
        raise ValueError(f"fault gpu_slow: factor must be in 1..{GPU_SLOW_MAX_FACTOR:g} (1 = no extra work), "
                         f"got {fault.factor}")


def fault_spec(fault: Fault) -> str:
    """The CLI spec of a fault (inverse of `parse_fault`)."""
    kind = _KIND_OF[type(fault)]
    _, keys = _KINDS[kind]
    parts = []
    for key, name in keys.items():
        if key == "hosts":
            assert isinstance(fault, SlowLink)
            parts.append(f"hosts={fault.host_a}-{fault.host_b}")
            continue
        value = getattr(fault, name)
        if value is not None:
            parts.append(f"{key}={value}")
    return f"{kind}:{','.join(parts)}"


@dataclass(frozen=True, slots=True)
class Faults:
    """An immutable, chainable set of faults, and the questions the trainer asks of it."""

    faults: tuple[Fault, ...] = ()

    def add(self, fault: Fault) -> Faults:
        _check_values(fault)
        return replace(self, faults=self.faults + (fault,))

    def slow(
        self,
        *,
        rank: int,
        from_step: int = 0,
        delay_s: float,
        until_step: int | None = None,
        period: int | None = None,
        burst: int | None = None,
    ) -> Faults:
        return self.add(Slow(rank=rank, from_step=from_step, delay_s=delay_s, until_step=until_step, period=period, burst=burst))

    def exit(self, *, rank: int, step: int, code: int = 1) -> Faults:
        return self.add(Exit(rank=rank, step=step, code=code))

    def kill(self, *, rank: int, step: int, signal: int = 9) -> Faults:
        return self.add(Kill(rank=rank, step=step, signal=signal))

    def hang(self, *, rank: int, step: int) -> Faults:
        return self.add(Hang(rank=rank, step=step))

    def bitflip(
        self, *, rank: int, step: int, target: FlipTarget | str = FlipTarget.GRAD, bit: int = 30, param: int = 0, index: int = 0
    ) -> Faults:
        return self.add(BitFlip(rank=rank, step=step, target=FlipTarget(target), bit=bit, param=param, index=index))

    def skew_rng(self, *, rank: int, step: int) -> Faults:
        return self.add(SkewRng(rank=rank, step=step))

    def skew_data(self, *, rank: int, step: int, offset: int = 1) -> Faults:
        return self.add(SkewData(rank=rank, step=step, offset=offset))

    def throttle(
        self, *, rank: int, from_step: int = 0, delay_s: float = 0.02, until_step: int | None = None, reason: str = "thermal"
    ) -> Faults:
        if reason not in THROTTLE_REASONS:
            raise ValueError(f"fault throttle: reason {reason!r} is not one of {'|'.join(THROTTLE_REASONS)}")
        return self.add(Throttle(rank=rank, from_step=from_step, delay_s=delay_s, until_step=until_step, reason=reason))

    def slow_link(self, *, hosts: tuple[int, int], from_step: int = 0, delay_s: float, until_step: int | None = None) -> Faults:
        return self.add(SlowLink(host_a=hosts[0], host_b=hosts[1], from_step=from_step, delay_s=delay_s, until_step=until_step))

    @classmethod
    def parse(cls, specs: list[str] | tuple[str, ...]) -> Self:
        return cls(tuple(parse_fault(s) for s in specs))

    def specs(self) -> list[str]:
        return [fault_spec(f) for f in self.faults]

    def validate(self, *, world_size: int, hosts: int) -> None:
        """Reject faults naming ranks, hosts or device slots the job does not have (one-line ValueError)."""
        for f in self.faults:
            if isinstance(f, BadDevice | FailingDevice):
                per_host = world_size // hosts
                if f.host >= hosts:
                    raise ValueError(f"fault {fault_spec(f)!r}: host {f.host} does not exist (hosts are 0..{hosts - 1})")
                if f.index >= per_host:
                    raise ValueError(f"fault {fault_spec(f)!r}: device slot {f.index} does not exist (a host has "
                                     f"slots 0..{per_host - 1})")
            elif isinstance(f, SlowLink):
                for h in (f.host_a, f.host_b):
                    if h >= hosts:
                        raise ValueError(f"fault {fault_spec(f)!r}: host {h} does not exist (hosts are 0..{hosts - 1})")
            elif isinstance(f, Nudge):
                continue
            elif f.rank >= world_size:
                raise ValueError(f"fault {fault_spec(f)!r}: rank {f.rank} does not exist (ranks are 0..{world_size - 1})")

    def placed(self, *, rank: int, host: int, slot: int) -> Faults:
        """These faults as seen by `rank` placed on device `slot` of host `host`: a bad device becomes a throttle
        of the rank now on it, a failing device a device error of it."""
        out: list[Fault] = []
        for f in self.faults:
            if isinstance(f, BadDevice):
                if (f.host, f.index) == (host, slot):
                    out.append(Throttle(rank=rank, from_step=f.from_step, delay_s=f.delay_s, until_step=f.until_step,
                                        reason=f.reason))
            elif isinstance(f, FailingDevice):
                if (f.host, f.index) == (host, slot):
                    out.append(DeviceError(rank=rank, step=f.step))
            else:
                out.append(f)
        return replace(self, faults=tuple(out))

    def bad_device(self, *, host: int, index: int, from_step: int = 0, delay_s: float = 0.02,
                   until_step: int | None = None, reason: str = "thermal") -> Faults:
        if reason not in THROTTLE_REASONS:
            raise ValueError(f"fault bad_device: reason {reason!r} is not one of {'|'.join(THROTTLE_REASONS)}")
        return self.add(BadDevice(host=host, index=index, from_step=from_step, delay_s=delay_s, until_step=until_step,
                                  reason=reason))

    def failing_device(self, *, host: int, index: int, step: int) -> Faults:
        return self.add(FailingDevice(host=host, index=index, step=step))

    def device_error(self, *, rank: int, step: int) -> Faults:
        return self.add(DeviceError(rank=rank, step=step))

    def nudge(self, *, param: int = 0, index: int = 0) -> Faults:
        return self.add(Nudge(param=param, index=index))

    def gpu_slow(self, *, rank: int, from_step: int = 0, factor: float, until_step: int | None = None) -> Faults:
        return self.add(GpuSlow(rank=rank, from_step=from_step, factor=factor, until_step=until_step))

    def freeze(self, *, rank: int, step: int, seconds: float) -> Faults:
        return self.add(Freeze(rank=rank, step=step, seconds=seconds))

    # -- questions the trainer asks -------------------------------------------------------------------
    def _of(self, cls: type, rank: int) -> list[Any]:
        return [f for f in self.faults if isinstance(f, cls) and getattr(f, "rank", None) == rank]

    def compute_delay_s(self, rank: int, step: int) -> float:
        total = sum(f.delay_s for f in self._of(Slow, rank) if _active(step, f.from_step, f.until_step, f.period, f.burst))
        return total + sum(f.delay_s for f in self._of(Throttle, rank) if _active(step, f.from_step, f.until_step, None, None))

    def device_factor(self, rank: int, step: int) -> float:
        """How many times its own compute the rank's device does at `step` (`gpu_slow`): 1.0 = none extra; the
        extra parts of several active faults add up."""
        return 1.0 + sum(f.factor - 1.0 for f in self._of(GpuSlow, rank)
                         if _active(step, f.from_step, f.until_step, None, None))

    def slows_device(self, rank: int) -> bool:
        """Whether any `gpu_slow` fault names `rank` (the trainer calibrates the extra work only then)."""
        return bool(self._of(GpuSlow, rank))

    def throttle_reason(self, rank: int, step: int) -> ThrottleReason | None:
        for f in self._of(Throttle, rank):
            if _active(step, f.from_step, f.until_step, None, None):
                return THROTTLE_REASONS[f.reason]
        return None

    def nudge_after_load(self) -> Nudge | None:
        return next((f for f in self.faults if isinstance(f, Nudge)), None)

    def exit_at(self, rank: int, step: int) -> Exit | None:
        return next((f for f in self._of(Exit, rank) if f.step == step), None)

    def kill_at(self, rank: int, step: int) -> Kill | None:
        return next((f for f in self._of(Kill, rank) if f.step == step), None)

    def device_error_at(self, rank: int, step: int) -> bool:
        return any(f.step == step for f in self._of(DeviceError, rank))

    def freeze_s(self, rank: int, step: int) -> float:
        """Seconds the rank's process is stopped at `step` (`freeze`); 0.0 for none."""
        return sum(f.seconds for f in self._of(Freeze, rank) if f.step == step)

    def hang_at(self, rank: int, step: int) -> bool:
        return any(f.step == step for f in self._of(Hang, rank))

    def bitflips(self, rank: int, step: int, target: FlipTarget) -> list[BitFlip]:
        return [f for f in self._of(BitFlip, rank) if f.step == step and f.target == target]

    def skews_rng(self, rank: int, step: int) -> bool:
        return any(f.step == step for f in self._of(SkewRng, rank))

    def data_offset(self, rank: int, step: int) -> int:
        return sum(f.offset for f in self._of(SkewData, rank) if f.step == step)

    def link_delay_s(self, links: tuple[str, ...] | list[str], step: int, host_names: list[str]) -> float:
        """Extra seconds for a collective whose group crosses `links` (names as `schema.link_name` gives)."""
        total = 0.0
        for f in self.faults:
            if isinstance(f, SlowLink) and _active(step, f.from_step, f.until_step, None, None):
                if link_name(host_names[f.host_a], host_names[f.host_b]) in links:
                    total += f.delay_s
        return total

    def hardware(self) -> Faults:
        """The faults of the machine, not of an attempt (a bad or failing device slot, a slow link): a relaunch on the
        same machine meets them again, wherever its ranks are placed."""
        return replace(self, faults=tuple(f for f in self.faults if isinstance(f, BadDevice | FailingDevice | SlowLink)))

    def __bool__(self) -> bool:
        return bool(self.faults)
