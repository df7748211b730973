"""How often to checkpoint: the expected cost of an interval, the interval that minimizes it, and a Monte Carlo
simulation of a long job that checks both.

The model (Daly's, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future Generation
Computer Systems 22(3), 2006: exponential interruptions, a restart that can itself be interrupted), extended here to
asynchronous saves. A job computes for `interval_s`, then blocks for a save; interruptions arrive at rate 1/M
(M = `IntervalCosts.mtbf_s`) whatever the job is doing; each loses the work since the last *completed* checkpoint and
costs `restore_s` of restart, which starts over if interrupted. So:

- a synchronous save blocks for its whole cost C and is a recovery point when it ends. Daly's expected wall time per
  interval of work is M e^(R/M) (e^((tau + C)/M) - 1), so goodput = tau / (M e^(R/M) (e^((tau + C)/M) - 1)).
- an asynchronous save blocks for a pause P (the state copied), then writes for W in the background while training
  goes on; it becomes a recovery point only when the write ends, and the next save waits for a write still in flight
  (as `recovery.Checkpointer` does). Derived here the same way (a run from one restart to the next interruption is
  Exp(M) long; checkpoint n is complete at n c + min(W, tau) after the restart, c = max(tau, W) + P):
  goodput = tau e^(-min(W, tau)/M) / (M e^(R/M) (e^(c/M) - 1)). With W = 0 it is the synchronous formula with C = P;
  for W <= tau the write window acts as W more seconds of restart per interruption.

R never moves the best interval (e^(R/M) is a constant factor), nor does W while W <= tau: the best interval solves
1 - e^(-(tau + C)/M) = tau/M (C the blocking cost), which Daly's higher-order formula approximates and Young's
sqrt(2 C M) ("A first order approximation to the optimum checkpoint interval", Communications of the ACM 17(9), 1974)
approximates to first order. `advised_interval` solves it exactly (bisection), and takes W instead where the write
outlasts that interval (saves would queue behind writes).

Times in seconds throughout. Torch-free and pure: the simulation draws from a `random.Random(seed)` of its own.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "LLAMA3_DEVICE_MTBF_S", "IntervalAdvice", "IntervalCosts", "IntervalFigures", "InterruptionModel",
    "InterruptionTrace", "Interruptions", "SimulatedRun", "advised_interval", "expected_figures", "interval_advice",
    "job_mtbf_s", "simulate_goodput", "young_daly_interval", "young_interval",
]

LLAMA3_DEVICE_MTBF_S = 54 * 86_400 * 16_384 / 419
"""One GPU's mean time between unexpected job interruptions it causes, as the Llama 3 pre-training saw them: 419
unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs (Meta, "The Llama 3 Herd of Models", 2024,
section 3.3.4), read as independent per-device failures: about 5.8 years per GPU, 3.09 h for the whole job."""


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalCosts:
    """What checkpointing costs a job and how often it is interrupted."""

    save_s: float
    """Training time one save blocks: a synchronous save's whole time; an asynchronous save's pause (the state
    copied) only."""
    restore_s: float
    """From an interruption to training again, the lost work aside: detection, decision, relaunch, load, gate."""
    mtbf_s: float
    """The job's mean time between interruptions at its rank count (`job_mtbf_s`)."""
    async_write_s: float = 0.0
    """Asynchronous saves only: the background write after the pause. A checkpoint is a recovery point only once its
    write ends; an interruption inside the write falls back to the one before. 0 = synchronous saves."""

    def __post_init__(self) -> None:
        _positive("IntervalCosts.save_s", self.save_s)
        _non_negative("IntervalCosts.restore_s", self.restore_s)
        _positive("IntervalCosts.mtbf_s", self.mtbf_s)
        _non_negative("IntervalCosts.async_write_s", self.async_write_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalFigures:
    """The expected long-run split of a job's wall time at one checkpoint interval (`expected_figures`)."""

    interval_s: float
    """Compute time between saves."""
    save_share: float
    """Share of wall time blocked in saves (a pause, or waiting for the previous asynchronous write)."""
    lost_share: float
    """Share of wall time computing work that an interruption later threw away (redone)."""
    restart_share: float
    """Share of wall time restarting after interruptions (including restarts that were themselves interrupted)."""
    goodput: float
    """Share of wall time computing work that is kept: 1 - the three shares above."""
    lost_per_interruption_s: float
    """Work lost per interruption on average (interruptions during a restart lose nothing and count)."""

    @property
    def overhead(self) -> float:
        """1 - goodput."""
        return 1.0 - self.goodput


def job_mtbf_s(device_mtbf_s: float, ranks: int) -> float:
    """The job's mean time between interruptions when each of its `ranks` devices fails independently with mean
    `device_mtbf_s` and any one failure interrupts the job: device MTBF / ranks."""
    _positive("device_mtbf_s", device_mtbf_s)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks!r}")
    return device_mtbf_s / ranks


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum (1974): sqrt(2 C M), for a save cost C much smaller than the MTBF M."""
    _positive("save_s", save_s)
    _positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum compute time between saves (Daly 2006, for exponential
    interruptions): sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C where C < 2M, else M. Its leading term is
    Young's sqrt(2 C M) (`young_interval`)."""
    _positive("save_s", save_s)
    _positive("mtbf_s", mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def expected_figures(costs: IntervalCosts, interval_s: float) -> IntervalFigures:
    """The expected split of wall time at `interval_s` under the module's model (Daly 2006's exponential
    interruptions, interruptible restarts; asynchronous saves as derived in the module docstring). A run is the time
    from the end of one restart to the next interruption (Exp with mean M), followed by a restart that takes
    M (e^(R/M) - 1) on average; every figure is an expectation over one run divided by M e^(R/M)."""
    _positive("interval_s", interval_s)
    tau, p, w, m = interval_s, costs.save_s, costs.async_write_s, costs.mtbf_s
    cycle = max(tau, w) + p  # from one save's end to the next's; the first after a restart is tau + p
    per_run = m * math.exp(costs.restore_s / m)
    # checkpoint n is complete at n * cycle + min(w, tau) after the restart; each keeps tau of work
    kept = tau * math.exp(-min(w, tau) / m) / math.expm1(cycle / m)
    # blocked time: the first save's pause [tau, tau + p), then [start + tau, start + cycle) of every later cycle
    first = math.exp(-tau / m) * -math.expm1(-p / m)
    later = math.exp(-(tau + p) / m) * math.exp(-tau / m) * -math.expm1(-(cycle - tau) / m) / -math.expm1(-cycle / m)
    blocked = m * (first + later)
    restart = m * math.expm1(costs.restore_s / m)
    lost = m - blocked - kept
    return IntervalFigures(
        interval_s=tau, save_share=blocked / per_run, lost_share=lost / per_run, restart_share=restart / per_run,
        goodput=kept / per_run, lost_per_interruption_s=lost / per_run * m)


def advised_interval(costs: IntervalCosts) -> float:
    """The compute time between saves that maximizes `expected_figures(costs, ·).goodput`: the root of
    1 - e^(-(tau + C)/M) = tau/M (C = `save_s`, the blocking cost), found by bisection, or the asynchronous write time
    where that is longer (a shorter interval only queues saves behind writes). `rankwatch advise` reports this one,
    with Young's and Daly's beside it: it is the exact optimum of the model Daly's formula approximates, and it stays
    right where the approximation drifts (a save cost near the MTBF) and where the write window decides (async)."""
    m, w = costs.mtbf_s, costs.async_write_s
    a = costs.save_s / m
    lo, hi = 0.0, 1.0  # in units of M: h(0) = 1 - e^-a > 0, h(1) = -e^(-1-a) < 0, h decreasing
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if -math.expm1(-(mid + a)) - mid > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15:
            break
    best = max(0.5 * (lo + hi) * m, w)
    if w > m:  # below the write time goodput rises up to tau = M: compare that candidate too
        best = max((best, m), key=lambda tau: expected_figures(costs, tau).goodput)
    return best


@dataclass(frozen=True, kw_only=True, slots=True)
class IntervalAdvice:
    """The advised interval beside Young's and Daly's, and what the current interval costs (`interval_advice`)."""

    costs: IntervalCosts
    """The costs the advice is for."""
    young_s: float
    """Young's sqrt(2 C M) with C the blocking save cost."""
    daly_s: float
    """Daly's higher-order estimate (`young_daly_interval`)."""
    advised_s: float
    """`advised_interval`: the model's optimum."""
    advised: IntervalFigures
    """The expected figures at the advised interval."""
    current: IntervalFigures | None
    """The expected figures at the job's current interval, where one was given."""


def interval_advice(costs: IntervalCosts, *, current_s: float | None = None) -> IntervalAdvice:
    """Young's, Daly's and the advised interval for `costs`, with the expected figures at the advised interval and at
    `current_s` (the interval the job uses now), if given."""
    advised = advised_interval(costs)
    return IntervalAdvice(
        costs=costs, young_s=young_interval(costs.save_s, costs.mtbf_s),
        daly_s=young_daly_interval(costs.save_s, costs.mtbf_s), advised_s=advised,
        advised=expected_figures(costs, advised),
        current=None if current_s is None else expected_figures(costs, current_s))


@dataclass(frozen=True, kw_only=True, slots=True)
class InterruptionModel:
    """Interruptions as a renewal process: times between them drawn independently from a Weibull distribution whose
    mean is the job's MTBF. Shape 1 is the exponential (a Poisson process, the expected-value model's assumption);
    below 1, interruptions come in bursts (a failure is more likely soon after the last one)."""

    shape: float = 1.0
    """The Weibull shape k: 1 = exponential; < 1 burstier; > 1 more regular."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.shape) and self.shape > 0):
            raise ValueError(f"InterruptionModel.shape must be a positive finite number, got {self.shape!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class InterruptionTrace:
    """Interruptions at given times: a recorded trace replayed, or a test's hand-placed failures."""

    times_s: tuple[float, ...]
    """Seconds from the job's start, increasing."""

    def __post_init__(self) -> None:
        if any(not math.isfinite(t) or t < 0 for t in self.times_s):
            raise ValueError(f"InterruptionTrace.times_s must be finite and >= 0, got {self.times_s!r}")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:])):
            raise ValueError(f"InterruptionTrace.times_s must increase, got {self.times_s!r}")


Interruptions = InterruptionModel | InterruptionTrace
"""Where a simulation's interruptions come from."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulatedRun:
    """One simulated job (`simulate_goodput`): where its wall time went, in seconds and as goodput."""

    interval_s: float
    """Compute time between saves."""
    horizon_s: float
    """The job's wall time."""
    goodput: float
    """Kept compute / horizon: compute not thrown away by an interruption (the work in progress at the horizon is
    kept: the job ends there without failing)."""
    useful_s: float
    """Kept compute."""
    lost_s: float
    """Compute thrown away by interruptions (redone)."""
    save_s: float
    """Time blocked in saves (pauses, waits for a previous write; a pause cut by an interruption included)."""
    restart_s: float
    """Time restarting (including restarts cut by an interruption)."""
    saves: int
    """Saves whose blocking part completed."""
    lost_saves: int
    """Of those, saves never completed: an interruption inside the asynchronous write."""
    interruptions: int
    """Interruptions within the horizon, during restarts included."""


def _next_times(failures: Interruptions, mtbf_s: float, seed: int) -> Callable[[float], float]:
    """A function from the time of the last interruption (0 at the start) to the next one's (inf when none)."""
    if isinstance(failures, InterruptionTrace):
        times = failures.times_s

        def from_trace(after: float) -> float:
            i = bisect.bisect_right(times, after)
            return times[i] if i < len(times) else math.inf
        return from_trace
    rng = random.Random(seed)
    scale = mtbf_s / math.gamma(1.0 + 1.0 / failures.shape)
    shape = failures.shape

    def drawn(after: float) -> float:
        return after + rng.weibullvariate(scale, shape)
    return drawn


_RESTART, _COMPUTE, _WAIT, _PAUSE = range(4)


def simulate_goodput(costs: IntervalCosts, interval_s: float, *, horizon_s: float, seed: int = 0,
                     failures: Interruptions = InterruptionModel()) -> SimulatedRun:
    """Simulate one job of `horizon_s` wall time, event by event: compute `interval_s`, wait for a write still in
    flight, block for `costs.save_s`, write `costs.async_write_s` in the background (0: the save is complete at the
    end of its pause), and so on; interruptions come from `failures` (drawn with `seed`, mean `costs.mtbf_s`, or a
    trace). An interruption throws away the compute since the last complete checkpoint and starts a restart of
    `costs.restore_s`, which starts over if interrupted again. The job starts as from a restart's end."""
    _positive("interval_s", interval_s)
    _positive("horizon_s", horizon_s)
    next_after = _next_times(failures, costs.mtbf_s, seed)
    tau, pause, write, restore = interval_s, costs.save_s, costs.async_write_s, costs.restore_s
    t, fail = 0.0, next_after(0.0)
    phase, phase_end = _COMPUTE, tau
    progress = durable = 0.0  # compute on the current lineage; the part a complete checkpoint holds
    pending_at, pending_progress = math.inf, 0.0  # the write in flight: ends at, holds
    computed = lost = blocked = restarting = 0.0
    saves = lost_saves = interruptions = 0
    while t < horizon_s:
        stop = min(phase_end, horizon_s, fail)
        dt = stop - t
        if phase == _COMPUTE:
            computed += dt
            progress += dt
        elif phase == _RESTART:
            restarting += dt
        else:
            blocked += dt
        t = stop
        if pending_at <= t:
            durable, pending_at = pending_progress, math.inf
        if t >= horizon_s:
            break
        if fail <= t:
            interruptions += 1
            if pending_at < math.inf:
                lost_saves += 1
                pending_at = math.inf
            lost += progress - durable
            progress = durable
            phase, phase_end = _RESTART, t + restore
            fail = next_after(t)
        elif phase == _RESTART:
            phase, phase_end = _COMPUTE, t + tau
        elif phase == _COMPUTE and pending_at < math.inf:
            phase, phase_end = _WAIT, pending_at
        elif phase in (_COMPUTE, _WAIT):
            phase, phase_end = _PAUSE, t + pause
        else:  # a pause ended: the save is staged
            saves += 1
            if write > 0:
                pending_at, pending_progress = t + write, progress
            else:
                durable = progress
            phase, phase_end = _COMPUTE, t + tau
    useful = computed - lost
    return SimulatedRun(interval_s=tau, horizon_s=horizon_s, goodput=useful / horizon_s, useful_s=useful, lost_s=lost,
                        save_s=blocked, restart_s=restarting, saves=saves, lost_saves=lost_saves,
                        interruptions=interruptions)
