"""The per-rank collector embedded in the training loop.

    collector = Collector(CollectorConfig(run_dir=run), rank=r, world_size=n, host="host0", local_rank=0)
    collector.start()
    for i in range(steps):
        with collector.step(i) as s:
            batch = next(loader)                      # loader = collector.wrap_loader(data, position=...)
            with collector.phase("forward"): ...
            with collector.collective("all_reduce", group, t): dist.all_reduce(t, group=group)
            s.loss = loss_value
        collector.maybe_fingerprint(i, model, optimizer, data_position=...)
    collector.close(exit_code=0)

Failure semantics: nothing here raises into the training loop or blocks it on I/O. Internal errors are
counted (`errors`) and the first is logged; the user's own exceptions pass through untouched (after being
recorded). Rows go to a `Sink`; the parquet sink writes on a background thread.

Cost: the hot path (steps, phases, collectives) only stamps small records with monotonic clock reads and keeps
them with the step; at step end the step is handed over whole, and the sink's writer thread builds the rows of
steps, phases and collectives (`_drain`, the sink's source) at every flush. At most `max_pending_steps` finished
steps wait for it; beyond that, rows are dropped and counted (phases first).

Liveness (`config.liveness`): a thread of its own keeps <run>/live/rank-<r>.live current (collector/liveness.py) —
the last completed step, the step, phase and collective in progress, and at close how the rank ended — so a monitor
tells a dead rank from a stuck one within a heartbeat (analytics/liveness/). The training thread only stores a
reference to each finished step.

Device time (CUDA): with a `DeviceTimer` (collector/device.py), steps, phases and collectives are also marked on the
device stream, and the writer resolves the marks after the fact, never waiting: a finished step whose marks have not
completed is kept back (its step, phase and collective rows wait) and retried at every flush; past
`device_resolve_s` it is written with null device columns and counted (`device_dropped`, a WARNING event).

This module is long because it is one object: the recorder a training loop holds. What can stand apart already does
(collective records: collectives.py, the sink, GPU sampling, device timers, the liveness writer, fingerprints); what is
left are that object's own methods, which share its state and its never-raise wrapper.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, ParamSpec, TypeVar

import torch

from rankwatch.base.schema import LIVE_VERSION, CheckpointPhase, EventKind, LiveField, LiveState, Table
from rankwatch.base.topology import GroupInfo
from rankwatch.collector.collectives import CollectiveTracker, StepRecord, _Open, _Tensor, _alloc, _make, _new
from rankwatch.collector.device import CudaDeviceTimer, DeviceTimer, Mark
from rankwatch.collector import flight
from rankwatch.collector.backfill import Backfill, Interval
from rankwatch.collector.fingerprint import consistency_domain, fingerprint
from rankwatch.collector.gpu import GpuMonitor, GpuSample, GpuSampler
from rankwatch.collector.liveness import LivenessWriter, rank_record_path
from rankwatch.collector.sink import ParquetSink, Row, Sink, SinkConfig

log = logging.getLogger("rankwatch.collector")
WRITER_CPU_PREFIX = "writer thread CPU "
"""The exit event's message: the part-file writer's CPU time until then (parsed by benchmarks)."""
DEVICE_WARNING_PREFIX = "device timing: "
"""Start of the WARNING event's message when device marks were given up or skipped."""
_mono, _wall = time.monotonic_ns, time.time_ns
_NO_DEVICE = (None, None, None)


def _count(value: object) -> int | None:
    """A count the job set (an int, or a 0-d tensor: `mask.sum()`), as an int; None when unset or not a count
    (a training loop is never stopped over its telemetry)."""
    if value is None:
        return None
    try:
        n = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, RuntimeError):
        return None
    return n if n >= 0 else None

P = ParamSpec("P")
R = TypeVar("R")


ENQUEUED_OP = "enqueued"
"""The liveness record's operation for a rank in none of its own operations while its group has a collective torch
enqueued and not completed (`Backfill.waiting`): a compiled graph's collective it waits in, or an asynchronous one
it waits on through torch, not through the collector. Its sequence number is unknown (null): torch's numbering is
not the collector's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectorConfig:
    run_dir: Path
    """Run directory; telemetry goes under <run_dir>/telemetry."""
    flush_interval_s: float = 5.0
    """Seconds between part-file writes: bounds what a SIGKILL loses; each write also has a fixed CPU cost
    (one parquet file per table), so shorter intervals cost more."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeat events (written by a thread, so they continue while training is stuck)."""
    gpu_interval_s: float = 1.0
    """Seconds between GPU samples."""
    fingerprint_every: int = 50
    """Fingerprint the training state every N steps (0 = never). A fingerprint reads every parameter and
    optimizer-state byte once, so it is amortized over N steps."""
    grad_norm: bool = True
    """The DDP comm hook measures each bucket's local squared norm before the all-reduce (one read of the gradients
    a step: the steps table's `local_grad_norm`). Off only where the job records its own local norm."""
    inflight_after_s: float = 0.5
    """A collective open this long is written as an in_flight row at the next flush."""
    max_buffered_rows: int = 100_000
    """Per-table buffer bound for evidence tables."""
    low_priority_max_rows: int = 10_000
    """Per-table buffer bound for GPU samples and phases (dropped first)."""
    max_pending_steps: int = 5_000
    """Finished steps whose rows (step, collectives, phases) wait for the writer thread, at most; beyond it a step's
    rows are dropped and counted, and beyond half of it its phases are (they are low priority)."""
    handle_sigterm: bool = True
    """Record SIGTERM and flush before the process dies (main thread only)."""
    device_timing: bool = True
    """Time steps, phases and collectives on the device too (the `device_*` columns), with CUDA events, when the
    job uses CUDA: CUDA is available and initialized in the process by its first step. Never on a CPU-only job. A
    `device_timer` given to the collector is used regardless."""
    device_events: int = 4096
    """Pool of device marks (CUDA events), allocated once. A step takes 2 + 2 per phase + 2 per collective until its
    rows are written; when the pool is empty marks are skipped (those rows get null device columns) and counted."""
    device_resolve_s: float = 5.0
    """Seconds after a step ends (a collective exits) that its rows wait for its device marks to complete; then
    they are written with null device columns and counted. Closing polls outstanding marks at most min(1 s, this)."""
    liveness: bool = True
    """Keep the rank's liveness record <run_dir>/live/rank-<r>.live current from a thread of its own
    (collector/liveness.py; fields `schema.LiveField`): a monitor tells a dead rank from a stuck one within a heartbeat
    interval instead of a part-file interval. Each write is one in-place `pwrite` of under 1 KiB."""
    liveness_poll_s: float = 0.05
    """Seconds between the liveness thread's looks at the rank's progress (at least two writes per heartbeat interval
    while no step completes; a completed step is written at its end by the training thread,
    `LivenessWriter.stepped`)."""
    count_collectives: bool = False
    """At close (or before the process groups are destroyed), record torch's own per-group count of the collectives
    issued while recording (the Flight Recorder's, when it is on: `flight`), for `analytics.coverage` to check the
    collectives table against. On where every collective is recorded (`attach` sets it); a job that times only
    the collectives it chooses (the canary's steps) would be reported short by design. With the Flight Recorder on
    it also turns on `backfill`: the collectives no wrapper saw (a compiled graph's) recorded from its entries."""
    flight_read_share: float = 0.005
    """The largest share of wall time the writer may spend reading the Flight Recorder's entries for `backfill`
    (torch's JSON dump of its whole ring buffer holds the GIL: ~30 ms at 2,000 entries on this machine, a pause of
    the training thread). Entries that leave the ring buffer while reads wait for this budget are counted, and the
    table is short of the compiled collectives among them (`analytics.coverage` says so)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.flight_read_share <= 1.0:
            raise ValueError(f"CollectorConfig.flight_read_share must be in (0, 1], got {self.flight_read_share}")
        for name in ("flush_interval_s", "heartbeat_interval_s", "gpu_interval_s", "liveness_poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CollectorConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.fingerprint_every < 0:
            raise ValueError(f"CollectorConfig.fingerprint_every must be >= 0, got {self.fingerprint_every}")
        if self.max_pending_steps < 2:
            raise ValueError(f"CollectorConfig.max_pending_steps must be >= 2, got {self.max_pending_steps}")
        if self.inflight_after_s < 0:
            raise ValueError(f"CollectorConfig.inflight_after_s must be >= 0, got {self.inflight_after_s}")
        if self.device_events < 1:
            raise ValueError(f"CollectorConfig.device_events must be >= 1, got {self.device_events}")
        if self.device_resolve_s < 0:
            raise ValueError(f"CollectorConfig.device_resolve_s must be >= 0, got {self.device_resolve_s}")

    def sink_config(self) -> SinkConfig:
        return SinkConfig(
            flush_interval_s=self.flush_interval_s,
            max_buffered_rows=self.max_buffered_rows,
            low_priority_max_rows=self.low_priority_max_rows,
        )


@dataclass(kw_only=True, slots=True)
class CheckpointPhaseRecord:
    bytes: int | None = None


class _Phase:
    """A phase context (a class, not a generator: it is on the hot path, several times a step) and its record:
    the step keeps it, and the writer thread builds its row. Built by `Collector.phase` without an `__init__`
    call."""

    __slots__ = ("_c", "name", "_previous", "start", "end")
    _c: Collector
    name: str
    start: int
    end: int

    def __enter__(self) -> None:
        c = self._c
        self._previous = c._phase
        c._phase = self.name
        self.start = _mono()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.end = _mono()
        c = self._c
        c._phase = self._previous
        c._add_phase(self)


class _DevicePhase(_Phase):
    """A phase also marked on the device (current stream) at both ends; the writer resolves `dev_ns`."""

    __slots__ = ("dev_start", "dev_end", "dev_ns")
    dev_start: Mark | None
    dev_end: Mark | None
    dev_ns: int | None

    def __enter__(self) -> None:
        c = self._c
        self._previous = c._phase
        c._phase = self.name
        self.dev_end = self.dev_ns = None
        try:
            self.dev_start = c._timer.mark()  # type: ignore[union-attr]
        except Exception as exc:
            self.dev_start = None
            c._internal_error("phase.device_mark", exc)
        self.start = _mono()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.end = _mono()
        c = self._c
        if self.dev_start is not None:
            try:
                self.dev_end = c._timer.mark()  # type: ignore[union-attr]
            except Exception as internal:
                c._internal_error("phase.device_mark", internal)
        c._phase = self._previous
        c._add_phase(self)


class _Step:
    """The context of `Collector.step` (a class, not a generator: it is on the hot path). Built by
    `Collector.step` without an `__init__` call."""

    __slots__ = ("_c", "_step", "_record")
    _c: Collector
    _step: int

    def __enter__(self) -> StepRecord:
        record = self._record = self._c._begin_step(self._step)
        return record

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._c._end_step(self._record, failed=exc_type is not None)


def _process_numa_node() -> int | None:
    """NUMA node of the first CPU this process may run on (Linux sysfs); None where that is unknown."""
    try:
        cpu = min(os.sched_getaffinity(0))
        for entry in Path(f"/sys/devices/system/cpu/cpu{cpu}").iterdir():
            if entry.name.startswith("node") and entry.name[4:].isdigit():
                return int(entry.name[4:])
    except (OSError, AttributeError, ValueError):
        pass
    return None


def _split(device_ns: int, ops: list[_Open]) -> tuple[int | None, int | None]:
    """(device_compute_ns, device_collective_ns) of a step: the union of its device-timed collectives' intervals
    (from the step's start mark, clipped to the step), and the rest. Nulls where one of them has no device time."""
    spans: list[tuple[int, int]] = []
    for o in ops:
        dev = o._dev
        if not dev:
            continue
        at = o.dev_at if dev == 2 else None
        if at is None:
            return None, None
        a, b = max(0, at), min(device_ns, at + (o.dev_ns or 0))
        if b > a:
            spans.append((a, b))
    spans.sort()
    inside = 0
    hi = 0
    for a, b in spans:
        if b > hi:
            inside += b - max(a, hi)
            hi = b
    return max(0, device_ns - inside), inside


def _safe(method: Callable[P, R]) -> Callable[P, R | None]:
    """Count and swallow internal errors: the collector never raises into training."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            self = args[0]
            self._internal_error(method.__name__, exc)  # type: ignore[attr-defined]
            return None

    return wrapper


class Collector:
    """Records one rank's telemetry. Cheap on the hot path; all file I/O happens on background threads."""

    def __init__(
        self,
        config: CollectorConfig,
        *,
        rank: int,
        world_size: int,
        host: str | None = None,
        local_rank: int = 0,
        attempt: int = 0,
        sink: Sink | None = None,
        gpu_sampler: GpuSampler | None = None,
        device_timer: DeviceTimer | None = None,
    ) -> None:
        """`device_timer`: device-side timing with this timer (e.g. a `FakeDeviceTimer` in tests); None: a
        `CudaDeviceTimer` when `config.device_timing` and the job uses CUDA (decided at the first step), else none."""
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.host = host or socket.gethostname()
        self.local_rank = local_rank
        self.attempt = attempt
        self.sink = sink if sink is not None else ParquetSink(config.run_dir, rank, config.sink_config())
        self.gpu_sampler = gpu_sampler
        self.errors = 0
        self._current: StepRecord | None = None
        self._last_step: int | None = None
        self._phase: str | None = None
        self._data_position: int | None = None
        self._pending_wait: tuple[int, int] | None = None  # (start_mono, ns) of a fetch outside a step
        self._last_failed: _Open | None = None
        self._closed = False
        self._started = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._gpu_monitor: GpuMonitor | None = None
        self._prev_sigterm: Any = None
        self._reported_drops = 0
        self._reported_write_errors = 0
        self._append_phase = self.sink.appender(Table.PHASES)
        self._add_phase: Callable[[_Phase], None] = self._loose_phase
        """Where a finished phase goes: the step in progress's list, or straight to the sink outside a step."""
        self._done: deque[StepRecord] = deque()
        """Finished steps waiting for the writer thread (`_drain`), at most `config.max_pending_steps`."""
        self._dropped: dict[Table, int] = {Table.STEPS: 0, Table.COLLECTIVES: 0, Table.PHASES: 0}
        self._final = False
        self._timer: DeviceTimer | None = None
        self._auto_timer = device_timer is None and config.device_timing
        """Decide at the first step whether to time on the device (the job may initialize CUDA after building us)."""
        self._held: list[StepRecord] = []
        """Finished steps whose device marks have not all completed (writer thread only): at most one per mark."""
        self._resolve_ns = int(config.device_resolve_s * 1e9)
        self.device_dropped = 0
        """Steps written with null device columns because their marks had not completed within `device_resolve_s`."""
        self._gave_up = False
        self._reported_device = (0, 0)
        # the liveness record (`_live_doc`, read by the liveness thread); the training thread only stores references
        self._live: LivenessWriter | None = None
        self._last_done: StepRecord | None = None
        """The last step completed (not failed): the liveness thread's progress token."""
        self._live_seen: StepRecord | None = None
        self._live_durations: deque[int] = deque(maxlen=15)
        self._live_checkpoint: tuple[str, int] | None = None
        self._live_exception: tuple[str, str, _Open | None] | None = None
        self._live_signal: int | None = None
        self._started_wall_ns = 0
        self._issued_at_start: dict[str, int] = {}
        self._counted = False
        self._append_collective = self.sink.appender(Table.COLLECTIVES)
        self._backfill: Backfill | None = None
        """Collectives no wrapper saw, read from the Flight Recorder by the writer (`backfill`); with
        `count_collectives` and the Flight Recorder on."""
        self._domain: tuple[str, tuple[int, ...]] | None = None
        self.tracker = CollectiveTracker(
            rank=rank,
            append=self._append_loose,  # the tracker's own try/except catches a failing sink
            on_error=self._collective_failed,
            on_internal=self._internal_error,
            inflight_after_s=config.inflight_after_s,
            device_resolve_s=config.device_resolve_s,
        )
        if device_timer is not None:
            self._set_timer(device_timer)
        self.sink.set_source(self._drain)
        self.sink.set_snapshot(self.tracker.in_flight_rows)

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> Collector:
        if self._started:
            return self
        self._started = True
        self._started_wall_ns = _wall()
        # torch's per-group collective counts (empty: Flight Recorder off, or not asked for)
        initial = flight.dump() if self.config.count_collectives and flight.enabled() else None
        self._issued_at_start = flight.named(initial) if initial is not None else {}
        if initial is not None:
            self._backfill = Backfill(rank=self.rank, groups=self._c10d_groups, pending=self._unwritten,
                                      ring=flight.ring_size(), share=self.config.flight_read_share, initial=initial)
        self.sink.start()
        self.event(EventKind.START, message=f"pid={os.getpid()}")
        if self.config.liveness:
            try:
                self._live = LivenessWriter(
                    rank_record_path(self.config.run_dir, self.rank), snapshot=self._live_doc,
                    progress=self._live_progress, beat_s=self.config.heartbeat_interval_s / 2,
                    poll_s=self.config.liveness_poll_s, on_error=self._internal_error)
                self._live.start(f"rankwatch-live-{self.rank}")
            except Exception as exc:
                self._internal_error("liveness.start", exc)
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"rankwatch-hb-{self.rank}", daemon=True)
        self._heartbeat.start()
        if self.gpu_sampler is not None:
            self._gpu_monitor = GpuMonitor(self.gpu_sampler, self._emit_gpu, interval_s=self.config.gpu_interval_s)
            self._gpu_monitor.start()
        if self.config.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(self.close)
        return self

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is not None:
            self.exception(exc)
            code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
            self.close(exit_code=code)
        else:
            self.close(exit_code=0)

    def close(self, exit_code: int | None = None) -> None:
        """Record the exit event, stop threads and flush everything. Idempotent."""
        if self._closed:
            return
        self._closed = True
        live = self._live
        try:
            if live is not None:  # the monitor learns of the exit now, not after the flush below
                live.stop()
                live.write(**{LiveField.STATE: str(LiveState.EXITING), LiveField.EXIT_CODE: exit_code})
            self._stop.set()
            if self._gpu_monitor is not None:
                self._gpu_monitor.stop(timeout_s=2.0)
            if self._heartbeat is not None:
                self._heartbeat.join(timeout=2.0)
            self._settle_device()
            self.record_collective_counts()
            self._final = True  # the last drains give up on device marks still pending
            self._report_drops()
            self._report_backfill()
            writer_ns = getattr(self.sink, "writer_cpu_ns", None)  # the collector's own background cost, so far
            self.event(EventKind.EXIT, exit_code=exit_code, dropped_rows=sum(self.dropped.values()),
                       message=None if writer_ns is None else f"{WRITER_CPU_PREFIX}{writer_ns / 1e6:.1f} ms")
            self.sink.close(timeout_s=10.0)
            if self.gpu_sampler is not None:
                self.gpu_sampler.close()
            if live is not None:
                live.write(**{LiveField.STATE: str(LiveState.EXITED), LiveField.EXIT_CODE: exit_code})
                live.close()
        except Exception as exc:
            self._internal_error("close", exc)
        finally:
            if self._prev_sigterm is not None and threading.current_thread() is threading.main_thread():
                try:
                    signal.signal(signal.SIGTERM, self._prev_sigterm)
                except Exception:
                    pass
            atexit.unregister(self.close)

    def _settle_device(self) -> None:
        """Closing: poll (bounded, on this thread) for outstanding device marks to complete; never synchronize."""
        timer = self._timer
        if timer is None:
            return
        deadline = _mono() + int(min(1.0, self.config.device_resolve_s) * 1e9)
        while not timer.settled() and _mono() < deadline:
            time.sleep(0.002)

    def record_collective_counts(self) -> None:
        """The collectives each of this rank's groups issued while recording, by torch's Flight Recorder count
        (`flight`): one COLLECTIVE_COUNTS event, once, nothing when the Flight Recorder is off. At close, or before
        the process groups are destroyed (`attach` calls it then: their counts go with them)."""
        if not self._started or self._counted or not self.config.count_collectives:
            return
        self._counted = True
        if self._backfill is not None:  # the last collectives nothing recorded, while their groups still exist
            self._backfill.closing = True
            self.sink.flush(timeout_s=5.0)
        end = flight.issued()
        if not end:
            return
        start = self._issued_at_start
        delta = {name: n - start.get(name, 0) for name, n in end.items()}
        by_group = flight.issued_by_group(delta, self.tracker)
        if by_group:
            self.event(EventKind.COLLECTIVE_COUNTS, message=flight.encode_counts(by_group))

    @property
    def device_timer(self) -> DeviceTimer | None:
        """The timer device columns come from (None: CPU clock only)."""
        return self._timer

    def _set_timer(self, timer: DeviceTimer | None) -> None:
        self._timer = timer
        self._auto_timer = False
        self.tracker.set_timer(timer)

    def _choose_timer(self) -> None:
        """First step: a CUDA timer if the job uses CUDA (available and initialized in this process)."""
        self._auto_timer = False
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self._set_timer(CudaDeviceTimer(self.config.device_events))
        except Exception as exc:
            self._internal_error("device_timer", exc)

    def flush(self, timeout_s: float | None = 5.0) -> bool:
        try:
            return self.sink.flush(timeout_s)
        except Exception as exc:
            self._internal_error("flush", exc)
            return False

    # -- topology -------------------------------------------------------------------------------------
    def register_group(self, group: Any, info: GroupInfo) -> None:
        """Name a process group so its collectives and topology row say what it is."""
        self.tracker.register_group(group, info)

    @_safe
    def record_topology(
        self,
        *,
        pid: int | None = None,
        backend: str = "gloo",
        dp: int = 0,
        tp: int = 0,
        pp: int = 0,
        dp_size: int = 1,
        tp_size: int = 1,
        pp_size: int = 1,
        device_index: int | None = None,
        numa_node: int | None = None,
    ) -> None:
        device_uuid = pci_bus_id = None
        if self.gpu_sampler is not None:
            devices = list(self.gpu_sampler.devices())
            if devices:
                device = devices[0]
                device_index = device.index if device_index is None else device_index
                device_uuid, pci_bus_id = device.uuid, device.pci_bus_id
                numa_node = device.numa_node if numa_node is None else numa_node
        if numa_node is None and device_uuid is None:
            numa_node = _process_numa_node()
        groups = [
            {"name": g.name, "kind": str(g.kind), "ranks": list(g.ranks), "hosts": list(g.hosts), "links": list(g.links)}
            for g in self.tracker.groups()
            if self.rank in g.ranks
        ]
        self._append(
            Table.TOPOLOGY,
            (
                self.rank, self.attempt, self.world_size, self.local_rank, self.host, pid or os.getpid(),
                time.time_ns(), backend, device_index, device_uuid, pci_bus_id, numa_node,
                dp, tp, pp, dp_size, tp_size, pp_size, groups,
            ),
        )

    # -- steps and phases -----------------------------------------------------------------------------
    def step(self, step: int) -> _Step:
        """Context manager timing one training step; yields its `StepRecord`. A step that raises writes no step
        row (the exception event covers it)."""
        context: _Step = _alloc(_Step)
        context._c, context._step = self, step
        return context

    def _begin_step(self, step: int) -> StepRecord:
        if self._auto_timer:
            self._choose_timer()
        start_mono, start_wall = _mono(), _wall()
        record = StepRecord(step, start_wall, start_mono)
        timer = self._timer
        if timer is not None:
            try:
                record.dev_start = timer.mark()
            except Exception as exc:
                self._internal_error("step.device_mark", exc)
        pending = self._pending_wait
        if pending is not None:  # the batch for this step was fetched just before it began
            self._pending_wait = None
            record.dataloader_wait_ns += pending[1]
            record.start_wall_ns -= start_mono - pending[0]
            record.start_mono_ns = pending[0]
        self._current = record
        self._add_phase = record.phases.append  # type: ignore[union-attr]
        self.tracker.current = record
        return record

    def _end_step(self, record: StepRecord, *, failed: bool = False) -> None:
        """Hand the finished step to the writer thread, which builds its rows (`_drain`). A step that raised
        writes no step row (the exception event covers it); its collectives and phases are written."""
        timer = self._timer
        if timer is not None and record.dev_start is not None:
            try:
                record.dev_end = timer.mark()
            except Exception as exc:
                self._internal_error("step.device_mark", exc)
        record.end_mono_ns = _mono()
        self._current = None
        self.tracker.current = None
        record.seq = len(record.ops)
        self._add_phase = self._loose_phase
        self._last_step = record.step
        if not failed:
            self._last_done = record
            live = self._live
            if live is not None:
                live.stepped()  # never raises
        try:
            record.failed = failed
            loss = record.loss
            if isinstance(loss, torch.Tensor):
                record.loss = loss.detach()  # keep no autograd graph alive until the writer reads it
            if record.data_position is None:
                record.data_position = self._data_position
            done = self._done
            n = len(done)
            if n >= self.config.max_pending_steps // 2:  # the writer fell behind: drop low priority rows first
                dropped = self._dropped
                if record.phases:
                    dropped[Table.PHASES] += len(record.phases)
                    if timer is not None:
                        self._release_phases(record)
                record.phases = None
                if n >= self.config.max_pending_steps:
                    dropped[Table.STEPS] += 1
                    dropped[Table.COLLECTIVES] += len(record.ops) - record.written
                    if timer is not None:
                        self._abandon(record)
                    return
            done.append(record)
        except Exception as exc:
            self._internal_error("_end_step", exc)

    def _loose_phase(self, phase: _Phase) -> None:
        try:
            start = phase.start
            device_ns = None
            if type(phase) is _DevicePhase:  # outside a step: resolved now if the device already ran it, else null
                timer = self._timer
                assert timer is not None
                a, b = phase.dev_start, phase.dev_end
                if a is not None and b is not None:
                    device_ns = timer.elapsed_ns(a, b)
                timer.release(a, b)
                phase.dev_start = phase.dev_end = None
            self._append_phase(
                (self.rank, -1, phase.name, start + _wall() - _mono(), start, phase.end - start, device_ns)
            )
        except Exception as exc:
            self._internal_error("phase", exc)

    # -- device marks (writer thread, except `_abandon` and `_release_phases`) ------------------------
    def _release_phases(self, record: StepRecord) -> None:
        timer = self._timer
        assert timer is not None
        for p in record.phases or ():
            if type(p) is _DevicePhase:
                timer.release(p.dev_start, p.dev_end)
                p.dev_start = p.dev_end = None

    def _abandon(self, record: StepRecord) -> None:
        """A dropped step: its marks go back to the pool unresolved."""
        timer = self._timer
        assert timer is not None
        self._release_phases(record)
        timer.release(record.dev_start, record.dev_end)
        record.dev_start = record.dev_end = None
        self.tracker.abandon(record.ops)

    def _pair(self, a: Mark | None, b: Mark | None, expired: bool) -> tuple[bool, int | None]:
        """(final, device ns) of two marks; releases them once final. Not final while pending and not `expired`."""
        if a is None and b is None:
            return True, None
        timer = self._timer
        assert timer is not None
        ns = timer.elapsed_ns(a, b) if a is not None and b is not None else None
        if ns is None and a is not None and b is not None:
            if not expired:
                return False, None
            self._gave_up = True
        timer.release(a, b)
        return True, (ns if ns is None or ns > 0 else 0)

    def _settle(self, record: StepRecord, expired: bool) -> bool:
        """Resolve a finished step's device marks (its collectives', phases' and its own); True once all are final
        (values or nulls) and back in the pool. Never waits."""
        final = True
        settle_op = self.tracker.settle_op
        self.tracker.claim(record)  # settle_op reads an operation's step
        for o in record.ops:
            if o._dev == 1 and not settle_op(o, expired):
                final = False
            elif expired and o._dev == -1:
                self._gave_up = True
        for p in record.phases or ():
            if type(p) is _DevicePhase and (p.dev_start is not None or p.dev_end is not None):
                ok, ns = self._pair(p.dev_start, p.dev_end, expired)
                if ok:
                    p.dev_start = p.dev_end = None
                    p.dev_ns = ns
                else:
                    final = False
        if not final:
            return False
        ok, ns = self._pair(record.dev_start, record.dev_end, expired)  # the ops needed the start mark until now
        if not ok:
            return False
        record.dev_start = record.dev_end = None
        if ns is not None:
            record.device = (ns, *_split(ns, record.ops))
        return True

    def _settle_steps(self, new: list[StepRecord]) -> list[StepRecord]:
        """The finished steps whose device columns are final (they are written now); the rest are held."""
        held = self._held
        held += new
        if not held:
            return held
        now, bound, final = _mono(), self._resolve_ns, self._final
        ready: list[StepRecord] = []
        keep: list[StepRecord] = []
        for record in held:
            end = record.end_mono_ns
            expired = final or end is None or now - end > bound
            self._gave_up = False
            if self._settle(record, expired):
                if self._gave_up:
                    self.device_dropped += 1
                ready.append(record)
            else:
                keep.append(record)
        self._held = keep
        return ready

    def _drain(self) -> dict[Table, list[Row]]:
        """The rows of finished steps (step, collectives, phases) and of the step in progress's exited collectives:
        the sink's source, called by its writer thread at every flush."""
        done: list[StepRecord] = []
        pop = self._done.popleft
        while True:
            try:
                done.append(pop())
            except IndexError:
                break
        steps: list[Row] = []
        phases: list[Row] = []
        rank = self.rank
        timed = self._timer is not None
        if timed:
            done = self._settle_steps(done)
        for record in done:
            step, offset = record.step, record.wall_offset_ns
            if not record.failed:
                steps.append(self._step_row(record))
            if record.phases:
                if timed:
                    phases += [
                        (rank, step, p.name, p.start + offset, p.start, p.end - p.start, getattr(p, "dev_ns", None))
                        for p in record.phases
                    ]
                else:
                    phases += [(rank, step, p.name, p.start + offset, p.start, p.end - p.start, None) for p in record.phases]
        collectives = self.tracker.drain(done, self._current, final=self._final)
        backfill = self._backfill
        if backfill is not None:
            backfill.note(collectives, [(r.start_wall_ns, (r.end_mono_ns or r.start_mono_ns) + r.wall_offset_ns, r.step)
                                        for r in done])
            current = self._current
            collectives += backfill.rows(None if current is None else (current.step, current.start_wall_ns),
                                         final=self._final)
        return {Table.STEPS: steps, Table.PHASES: phases, Table.COLLECTIVES: collectives}

    def _append_loose(self, row: Row) -> None:
        """A row of an operation outside a step, written as it exits (the tracker's `append`)."""
        self._append_collective(row)
        backfill = self._backfill
        if backfill is not None:
            backfill.note_loose(row)

    def _unwritten(self) -> list[Interval]:
        return [Interval(g, enter, end, asy) for g, op, enter, end, asy in self.tracker.unwritten()
                if op not in ("send", "recv")]

    def _c10d_groups(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """c10d group name -> (the table's name, ranks) of this rank's groups (`backfill`)."""
        return {c10d: (info.name, tuple(info.ranks)) for c10d, info in flight.table_groups(self.tracker).items()}

    def _step_row(self, record: StepRecord) -> Row:
        start_mono, end_mono = record.start_mono_ns, record.end_mono_ns
        assert end_mono is not None
        duration = end_mono - start_mono
        wait = record.waits()
        dataloader_wait, checkpoint = record.dataloader_wait_ns, record.checkpoint_ns
        compute = max(0, duration - wait - dataloader_wait - checkpoint)
        loss = record.loss
        if isinstance(loss, torch.Tensor):
            loss = float(loss)
        grad_norm = record.local_grad_norm
        if grad_norm is None and record.grad_sq:
            grad_norm = sum(float(sq) * factor for sq, factor in record.grad_sq) ** 0.5
        finite = (loss is None or math.isfinite(loss)) and (grad_norm is None or math.isfinite(grad_norm))
        return (
            self.rank, record.step, self.attempt, record.start_wall_ns, end_mono + record.wall_offset_ns,
            start_mono, end_mono, duration, compute, wait, dataloader_wait, checkpoint, record.seq,
            loss, grad_norm, finite, record.data_position, *(record.device or _NO_DEVICE), _count(record.tokens),
        )

    def phase(self, name: str) -> _Phase:
        """Context manager timing a named phase of the current step (forward, backward, optimizer, ...)."""
        context: _Phase = _alloc(_Phase if self._timer is None else _DevicePhase)
        context._c, context.name = self, name
        return context

    def wrap_loader(self, iterable: Iterable[R], *, position: Callable[[], int] | None = None) -> Iterator[R]:
        """Yield from `iterable`, recording time blocked in each fetch and the data position after it."""
        it = iter(iterable)
        while True:
            start = time.monotonic_ns()
            try:
                item = next(it)
            except StopIteration:
                return
            waited = time.monotonic_ns() - start
            current = self._current
            if current is not None:
                current.dataloader_wait_ns += waited
            else:
                self._pending_wait = (start, waited)
            if position is not None:
                try:
                    self._data_position = int(position())
                except Exception as exc:
                    self._internal_error("wrap_loader.position", exc)
            yield item

    def set_data_position(self, position: int) -> None:
        self._data_position = position

    # -- collectives ----------------------------------------------------------------------------------
    def collective(
        self,
        op: str,
        group: Any,
        tensor: torch.Tensor | list[torch.Tensor] | None = None,
        *,
        peer: int | None = None,
    ) -> Any:
        """Context manager timing the blocking collective issued in its body."""
        t = self.tracker
        if type(tensor) is not _Tensor:  # a list, None, a Tensor subclass: the general path
            return _make(t, op, group, tensor, peer, False)
        pool = t._pool  # `collectives._make` for a plain tensor, inlined: this runs per collective
        if pool:
            try:
                o = pool.pop()
            except IndexError:  # another thread took the last one
                o = _new(t)
        else:
            o = _new(t)
        o.op = op
        o._group_obj = group
        o.peer = peer
        o.async_op = False
        o.nbytes = tensor.nbytes
        o.dtype = tensor.dtype
        mode = t._dev_mode
        if mode:  # records come back from the pool with `_dev` 0
            o._dev = mode == 2 or tensor.is_cuda
        return o

    def ddp_comm_hook(self, group: Any = None, *, before: Callable[[GroupInfo], None] | None = None) -> Any:
        """A DDP comm hook that times each gradient bucket and measures the pre-all-reduce gradient norm."""
        return self.tracker.ddp_comm_hook(group, before=before, grad_norm=self.config.grad_norm)

    def _collective_failed(self, exc: BaseException, o: _Open) -> None:
        self._last_failed = o
        self.event(
            EventKind.EXCEPTION,
            exc_type=type(exc).__name__,
            message=str(exc)[:1000],
            collective=o,
        )

    # -- checkpoints ----------------------------------------------------------------------------------
    @contextmanager
    def checkpoint_phase(
        self, step: int, checkpoint_id: str, phase: CheckpointPhase, nbytes: int | None = None, *,
        background: bool = False,
    ) -> Iterator[CheckpointPhaseRecord]:
        """Time one checkpoint phase; set `.bytes` on the yielded record if known only afterwards. `background`: a
        phase of an asynchronous save on a thread of its own, recorded without counting it in the training step that
        runs meanwhile or showing it as where the rank is (the liveness record)."""
        record = CheckpointPhaseRecord(bytes=nbytes)
        start_mono, start_wall = time.monotonic_ns(), time.time_ns()
        error: str | None = None
        if not background:
            self._live_checkpoint = (f"checkpoint.{phase}", start_wall)
        try:
            yield record
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
            raise
        finally:
            end_mono, end_wall = time.monotonic_ns(), time.time_ns()
            current = None if background else self._current
            if not background:
                self._live_checkpoint = None
            if current is not None:
                current.checkpoint_ns += end_mono - start_mono
            self._append(
                Table.CHECKPOINT_PHASES,
                (
                    self.rank, step, checkpoint_id, str(phase), start_wall, start_mono, end_wall, end_mono,
                    end_mono - start_mono, record.bytes, error is None, error,
                ),
            )

    # -- fingerprints ---------------------------------------------------------------------------------
    def maybe_fingerprint(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        domain: str | None = None,
        domain_ranks: list[int] | tuple[int, ...] | None = None,
        data_position: int | None = None,
        force: bool = False,
    ) -> bool:
        """Fingerprint after `step` when it is due (every `fingerprint_every` steps, or `force`). Without a `domain`
        the domain is the model's own (`fingerprint.consistency_domain`: every rank for plain parameters, the
        replicas of this rank's shard for DTensor / FSDP2 ones), computed on the first fingerprint."""
        every = self.config.fingerprint_every
        if not force and (every == 0 or step % every != 0):
            return False
        try:
            if domain is None or domain_ranks is None:
                if self._domain is None:
                    self._domain = consistency_domain(model, self.rank, self.world_size)
                domain, domain_ranks = self._domain
            fp = fingerprint(model, optimizer)
            position = data_position if data_position is not None else self._data_position
            self._append(
                Table.FINGERPRINTS,
                (
                    self.rank, step, self.attempt, time.time_ns(), domain, list(domain_ranks), fp.param_hash,
                    fp.optim_hash,
                    fp.rng_python_hash, fp.rng_numpy_hash, fp.rng_torch_hash, fp.rng_cuda_hash, position,
                    fp.param_count,
                ),
            )
            if fp.nonfinite_params or fp.nonfinite_optim:
                self.event(EventKind.NONFINITE, step=step, message=(
                    f"{fp.nonfinite_params} non-finite value(s) in its parameters, {fp.nonfinite_optim} in its "
                    "optimizer state (the tensors this rank holds)"))
            return True
        except Exception as exc:
            self._internal_error("fingerprint", exc)
            return False

    # -- events ---------------------------------------------------------------------------------------
    @_safe
    def event(
        self,
        kind: EventKind,
        *,
        message: str | None = None,
        exc_type: str | None = None,
        collective: _Open | None = None,
        signal_number: int | None = None,
        exit_code: int | None = None,
        dropped_rows: int | None = None,
        step: int | None = None,
    ) -> None:
        """One event row; its step is the current (or last) one unless `step` names the step it is about."""
        if step is None:
            current = self._current
            step = current.step if current is not None else self._last_step
        self._append(
            Table.EVENTS,
            (
                self.rank, self.attempt, time.time_ns(), time.monotonic_ns(), str(kind), step, self._phase,
                exc_type, message,
                collective.op if collective else None,
                collective.group.name if collective else None,
                collective.group_seq if collective else None,
                signal_number, exit_code, dropped_rows,
            ),
        )

    def exception(self, exc: BaseException) -> None:
        """Record an exception leaving the training loop; names the collective it came from, if any."""
        failed = self._last_failed
        if failed is None:
            failed = self.tracker.oldest_open()
        self._live_exception = (type(exc).__name__, str(exc)[:300], failed)
        self.event(EventKind.EXCEPTION, exc_type=type(exc).__name__, message=str(exc)[:1000], collective=failed)
        self.flush(timeout_s=5.0)

    def warning(self, message: str) -> None:
        self.event(EventKind.WARNING, message=message)

    # -- background -----------------------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self.event(EventKind.HEARTBEAT, collective=self.tracker.oldest_open())
                self._report_drops()
            except Exception as exc:
                self._internal_error("heartbeat", exc)

    @property
    def dropped(self) -> dict[Table, int]:
        """Rows dropped so far, per table: by the sink's bounded buffers and by the bound on finished steps."""
        total = dict(self.sink.dropped)
        for table, n in self._dropped.items():
            total[table] = total.get(table, 0) + n
        return total

    def _report_backfill(self) -> None:
        """A WARNING when Flight Recorder entries left its ring buffer before the writer read them (`backfill`):
        the collectives no wrapper saw among them are missing from the table."""
        backfill = self._backfill
        if backfill is None or not backfill.lost:
            return
        self.event(EventKind.WARNING, message=(
            f"collectives: {backfill.lost} Flight Recorder entries left its buffer of {flight.ring_size()} before "
            f"they were read ({backfill.reads} reads, {backfill.read_ns / 1e6:.0f} ms; at most "
            f"{self.config.flight_read_share:.1%} of the time): the collectives no wrapper saw among them (a "
            "compiled graph's) are not in the table"))

    def _report_drops(self) -> None:
        """Record new drops (a DROPS event with the running total) and new failed writes (a WARNING: the rows are
        kept and retried, so a full disk costs rows only once the bounded buffers overflow)."""
        total = sum(self.dropped.values())
        errors, last = self.sink.write_errors, self.sink.last_write_error
        if total != self._reported_drops:
            self._reported_drops = total
            why = "writer fell behind" if not errors else f"writes failing ({errors} so far, last: {last})"
            self.event(EventKind.DROPS, dropped_rows=total, message=f"{why}; rows dropped")
        if errors != self._reported_write_errors:
            self._reported_write_errors = errors
            self.event(EventKind.WARNING, dropped_rows=total,
                       message=f"telemetry writes failed {errors} time(s), retried at each flush; last: {last}")
        timer = self._timer
        if timer is not None:
            device = (self.device_dropped, timer.dropped)
            if device != self._reported_device:
                self._reported_device = device
                self.event(EventKind.WARNING, message=(
                    f"{DEVICE_WARNING_PREFIX}{device[0]} step(s) written without device time (marks not complete "
                    f"within {self.config.device_resolve_s} s); {device[1]} mark(s) skipped (pool of "
                    f"{timer.capacity} empty)"))

    # -- liveness record (the liveness thread) ---------------------------------------------------------
    def _live_progress(self) -> object:
        return self._last_done

    def _live_doc(self) -> dict[str, object]:
        """The liveness record's fields now (`schema.LiveField`; the writer adds `seq`). Reads what the training
        thread stored (references, no locks but the tracker's for the open collective)."""
        wall, mono = _wall(), _mono()
        done = self._last_done
        if done is not None and done is not self._live_seen and done.end_mono_ns is not None:
            self._live_seen = done
            self._live_durations.append(done.end_mono_ns - done.start_mono_ns)
        durations = sorted(self._live_durations)
        current = self._current
        checkpoint = self._live_checkpoint
        exception = self._live_exception
        o = exception[2] if exception is not None else self.tracker.oldest_open()
        doc: dict[str, object] = {
            LiveField.VERSION: LIVE_VERSION, LiveField.RANK: self.rank, LiveField.WORLD_SIZE: self.world_size,
            LiveField.ATTEMPT: self.attempt, LiveField.PID: os.getpid(), LiveField.HOST: self.host,
            LiveField.STATE: str(LiveState.RUNNING), LiveField.WALL_NS: wall,
            LiveField.HEARTBEAT_NS: int(self.config.heartbeat_interval_s * 1e9),
            LiveField.STARTED_WALL_NS: self._started_wall_ns,
            LiveField.LAST_STEP: done.step if done is not None else None,
            LiveField.LAST_STEP_WALL_NS: (done.end_mono_ns + done.wall_offset_ns
                                          if done is not None and done.end_mono_ns is not None else None),
            LiveField.STEP_NS: durations[len(durations) // 2] if durations else None,
            LiveField.STEP: current.step if current is not None else None,
            LiveField.STEP_START_WALL_NS: current.start_wall_ns if current is not None else None,
            LiveField.PHASE: checkpoint[0] if checkpoint is not None else self._phase,
            LiveField.PHASE_START_WALL_NS: checkpoint[1] if checkpoint is not None else None,
            LiveField.COLLECTIVE_OP: None, LiveField.COLLECTIVE_GROUP: None, LiveField.COLLECTIVE_SEQ: None,
            LiveField.COLLECTIVE_PEER: None, LiveField.COLLECTIVE_WALL_NS: None, LiveField.COLLECTIVE_RANKS: None,
            LiveField.EXIT_CODE: None, LiveField.SIGNAL: self._live_signal,
            LiveField.EXC_TYPE: exception[0] if exception is not None else None,
            LiveField.MESSAGE: exception[1] if exception is not None else None,
        }
        if o is not None and hasattr(o, "enter_mono"):
            opened = mono - o.enter_mono
            doc[LiveField.COLLECTIVE_OP] = o.op
            doc[LiveField.COLLECTIVE_GROUP] = o.group.name
            doc[LiveField.COLLECTIVE_SEQ] = o.group_seq
            doc[LiveField.COLLECTIVE_PEER] = o.peer
            doc[LiveField.COLLECTIVE_WALL_NS] = wall - opened
            if exception is not None or opened >= min(self.config.inflight_after_s, self.config.heartbeat_interval_s) * 1e9:
                doc[LiveField.COLLECTIVE_RANKS] = list(o.group.ranks)
        elif exception is None and current is not None and self._backfill is not None:
            # in no operation of its own, a step running long: a collective torch has not completed on one of its
            # groups, if any (the Flight Recorder's counts, ~0.1 ms; read only while a step overruns)
            overrun = max(2 * durations[len(durations) // 2] if durations else 0, int(self.config.inflight_after_s * 1e9))
            if wall - current.start_wall_ns >= overrun:
                found = self._backfill.waiting()
                if found is not None:
                    doc[LiveField.COLLECTIVE_OP] = ENQUEUED_OP
                    doc[LiveField.COLLECTIVE_GROUP] = found[0]
                    doc[LiveField.COLLECTIVE_RANKS] = list(found[1])
        return doc

    def _emit_gpu(self, sample: GpuSample) -> None:
        current = self._current
        step = current.step if current is not None else (self._last_step if self._last_step is not None else -1)
        self._append(Table.GPU, sample.row(rank=self.rank, step=step))

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:
            # closing on its own already (an exception, the end), interrupted here: returning lets that close
            # finish its flush, and the process exits right after it; a hung close meets the launcher's SIGKILL
            return
        self._live_signal = signum
        self.event(EventKind.SIGNAL, signal_number=signum, message=signal.Signals(signum).name)
        self.close(exit_code=128 + signum)
        previous = self._prev_sigterm
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def _append(self, table: Table, row: tuple[object, ...]) -> None:
        try:
            self.sink.append(table, row)
        except Exception as exc:  # a Sink must not raise; a broken one still must not reach training
            self._internal_error(f"sink.append({table})", exc)

    def _internal_error(self, where: str, exc: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            log.warning("rankwatch collector rank %d: internal error in %s: %s: %s", self.rank, where, type(exc).__name__, exc)
