"""Per-collective timing: explicit torch.distributed calls, DDP gradient buckets, and what is still in flight.

Each operation is entered before the call and exited after it; the hot path only stamps a small record (one
monotonic clock read at each end) and appends it to the step in progress. Rows are built later, on the sink's
writer thread (`CollectiveTracker.drain`), with wall-clock times derived from the step's wall − monotonic offset.
An operation that never exits — the rank died, hung or was killed inside it — stays open; the writer snapshots
open operations older than a threshold as ``in_flight`` rows at every flush, and writes the exited operations of
a step still running, so a post-mortem sees where every rank was stuck.

Device time (with a `DeviceTimer`, collector/device.py): a blocking operation is marked on the current stream
before the call and after it (the blocking API makes the current stream wait for NCCL's); an asynchronous one
before the call and in its future's callback (torch runs a CUDA future's callbacks on streams synchronized with
its value, i.e. after the collective on NCCL's stream). The writer resolves the marks later (`settle_op`) and never
waits for the device: an operation's row waits until its marks completed, or at most `device_resolve_s`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.base.schema import CollectiveStatus, Collectives, Table, column_names
from rankwatch.base.topology import GroupInfo, group_kind, group_name
from rankwatch.collector.device import DeviceTimer, Mark
from rankwatch.collector.sink import Row

assert column_names(Table.COLLECTIVES)[0] == Collectives.RANK  # rows below are built in schema order


class StepRecord:
    """The step in progress: what the training loop sets (`loss`, `local_grad_norm`, `data_position`, `tokens`: the
    work in its batch, what its compute scales with; it tells data skew from a rank's noise) and what the
    collector gathers during the step (its collectives, phases and bucket norms). The collector hands the whole
    record to its writer thread at step end; rows are built there, off the training thread.

    A plain slots class (built once per step)."""

    __slots__ = (
        "step", "start_wall_ns", "start_mono_ns", "end_mono_ns", "loss", "local_grad_norm", "data_position",
        "dataloader_wait_ns", "checkpoint_ns", "seq", "ops", "phases", "grad_sq", "failed", "written", "claimed",
        "dev_start", "dev_end", "device", "tokens",
    )

    def __init__(self, step: int, start_wall_ns: int = 0, start_mono_ns: int = 0) -> None:
        self.step = step
        self.start_wall_ns = start_wall_ns
        self.start_mono_ns = start_mono_ns
        self.end_mono_ns: int | None = None
        self.loss: float | torch.Tensor | None = None
        self.local_grad_norm: float | None = None
        self.data_position: int | None = None
        self.tokens: int | None = None
        self.dataloader_wait_ns = 0
        self.checkpoint_ns = 0
        self.seq = 0
        """Collectives issued in the step (set when it ends)."""
        self.ops: list[_Open] = []
        """The step's collectives, in issue order (appended at entry; an operation's `seq` is its index)."""
        self.phases: list[Any] | None = []
        """The step's finished phases (None once dropped because the writer fell behind)."""
        self.grad_sq: list[tuple[torch.Tensor, float]] = []
        """Each DDP bucket's local squared norm as (0-d tensor, factor): no device sync and no extra operation on
        the hot path; the writer multiplies."""
        self.failed = False
        """The step raised: its collectives and phases are written, not a step row."""
        self.written = 0
        """How many of `ops` the writer already wrote while the step was still running (it writes them in order,
        up to the first that has not exited)."""
        self.claimed = 0
        """How many of `ops` have their `record` and `seq` set (by the writer or a snapshot: `CollectiveTracker.claim`;
        the hot path only appends)."""
        self.dev_start: Mark | None = None
        """Device marks at step start and end (with a `DeviceTimer`, while not yet resolved)."""
        self.dev_end: Mark | None = None
        self.device: tuple[int, int | None, int | None] | None = None
        """(device_ns, device_compute_ns, device_collective_ns) once resolved; None: null device columns."""

    @property
    def wall_offset_ns(self) -> int:
        """wall - monotonic clock at step start: the wall-clock times of the step's rows are derived with it."""
        return self.start_wall_ns - self.start_mono_ns

    def waits(self) -> int:
        """ns the step spent waiting in collectives, from its exited collectives.

        Blocking collectives count whole. An asynchronous one whose wait was seen (a functional collective:
        `_Open.wait_mono`) counts from that wait to its end: the training thread was blocked there, and the time
        between the call and the wait was its own work. The others (DDP buckets, whose wait torch does inside the
        backward pass) count from the last one issued to the last one done, less the time the training thread spent
        blocked in other collectives meanwhile."""
        blocked = 0
        lo = hi = 0
        spans: list[tuple[int, int]] = []
        for o in self.ops:
            end = o.exit_mono
            if end is None:
                continue
            if o.async_op:
                began = o.wait_mono
                if began is not None:
                    began = began if began > o.enter_mono else o.enter_mono
                    if end > began:
                        blocked += end - began
                        spans.append((began, end))
                    continue
                lo = o.enter_mono if o.enter_mono > lo else lo
                hi = end if end > hi else hi
            else:
                blocked += end - o.enter_mono
                spans.append((o.enter_mono, end))
        exposed = 0
        if hi > lo:
            overlap = 0
            for a, b in spans:
                if b > lo and a < hi:
                    overlap += (b if b < hi else hi) - (a if a > lo else lo)
            exposed = max(0, hi - lo - overlap)
        return blocked + exposed


class _Group:
    """Per-group constants the hot path needs, looked up once per collective (a plain slots class)."""

    __slots__ = ("info", "name", "ranks", "next_seq")

    def __init__(self, info: GroupInfo, next_seq: Callable[[], int]) -> None:
        self.info = info
        self.name = info.name
        self.ranks = info.ranks
        self.next_seq = next_seq
        """`__next__` of the group's sequence counter: atomic under the GIL (collectives may be issued from
        autograd or comm threads)."""


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_OK, _ERROR, _IN_FLIGHT = str(CollectiveStatus.OK), str(CollectiveStatus.ERROR), str(CollectiveStatus.IN_FLIGHT)
_mono, _wall, _Tensor = time.monotonic_ns, time.time_ns, torch.Tensor


def _dtype_name(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return ""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _payload(tensors: list[torch.Tensor] | None) -> tuple[int, torch.dtype | None]:
    """(bytes, dtype) of a collective's tensor list (all_gather's output, ...) or of no tensor."""
    if tensors is None:
        return 0, None
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return nbytes, (tensors[0].dtype if tensors else None)


class _Open:
    """One collective: the context manager `Collector.collective` returns, and its record. A plain slots class,
    taken from its tracker's pool (`CollectiveTracker._pool`) and handed back by the writer once its row and its
    step's row are built: records live as long as the job, so the garbage collector's young collections neither
    count nor walk one per collective.

    The hot path only stamps it: entering numbers it, appends it to the step in progress (`StepRecord.ops`) and
    reads the monotonic clock; exiting reads the clock again. Rows are built from it later on the writer thread
    (`CollectiveTracker.drain`), wall-clock times derived from the step's wall - monotonic offset. Until it
    exits, the writer sees it as in flight. Outside a step it is kept in the tracker's open set instead and
    written when it exits. Neither entering nor exiting raises into the caller: an internal error is counted,
    and an operation whose entry failed records nothing.

    Reuse rules (`CollectiveTracker._retire`): an operation goes back to the pool only after its own row and its
    step's row are built; one that failed (its error text, the collector's last failed operation) or ran outside
    a step is never reused. Nothing reads an operation after its exit is visible (`exit_mono` set) except the
    writer and snapshots taken under the tracker's lock (`oldest_open` copies)."""

    __slots__ = (
        "_tracker", "op", "_group_obj", "nbytes", "dtype", "peer", "async_op", "group", "group_seq", "seq",
        "record", "enter_mono", "exit_mono", "wait_mono", "wall_offset", "_dev", "dev_start", "dev_end", "dev_ns", "dev_at",
        "_failed", "_loose",
    )
    # set when taken from the pool (`_take`, or inline in `Collector.collective`); `_tracker` once, when allocated
    _tracker: CollectiveTracker
    op: str
    _group_obj: Any
    nbytes: int
    dtype: torch.dtype | None
    peer: int | None
    async_op: bool
    _dev: int
    """Device timing: 0 none; 1 marked, not yet resolved; 2 resolved (`dev_ns`, `dev_at`); -1 given up (a mark
    was skipped or did not complete in time)."""
    # set when entered
    group: GroupInfo
    group_seq: int
    seq: int
    """Index in its step's `ops` (-1 outside a step); with `record`, set off the hot path
    (`CollectiveTracker.claim`)."""
    record: StepRecord | None
    """The step it was issued in (None outside a step, and while in the pool)."""
    enter_mono: int
    """Unset until entered (deleted again when the record goes back to the pool)."""
    exit_mono: int | None
    """None until it exits."""
    wait_mono: int | None
    """When the training thread began to block on an asynchronous operation's result (a functional collective's
    `wait_tensor`: collector/funcol.py); None where that is not seen (DDP buckets, blocking operations)."""
    # set on the uncommon paths
    wall_offset: int
    """wall - monotonic clock at entry, for operations outside a step."""
    dev_start: Mark | None
    """Device marks at entry and exit (set when `_dev` is 1 at entry; released once resolved)."""
    dev_end: Mark | None
    dev_ns: int | None
    """Device ns between the marks, once resolved."""
    dev_at: int | None
    """Device ns from the step's start mark to the entry mark, once resolved (None outside a step)."""
    _failed: bool
    """It exited with an error (set before the exit is visible): never reused."""
    _loose: bool
    """Entered outside a step: never reused."""

    def __enter__(self) -> GroupInfo | None:
        t = self._tracker
        try:
            group = self._group_obj
            g = t._fast.get(group) or t._group_state(group)
            self.group = info = g.info
            self.group_seq = g.next_seq()
            t._add(self)  # the step's `ops.append` (its `record` and `seq` are set later), or `_enter_loose`
            if self._dev:
                t._start_mark(self)  # never raises
            self.enter_mono = _mono()
            return info
        except Exception as exc:  # raised before `_add`: nothing refers to it
            self._dev = 0
            t._on_internal("collective.enter", exc)
            return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._dev:  # before the clock read: the writer sees the end mark once it sees `exit_mono`
            self._tracker._end_mark(self, exc)
        if exc is not None:
            self._tracker._exit_failed(self, exc)
            return
        loose = self._loose  # read before the exit is visible: from then on the writer may reuse the record
        self.exit_mono = _mono()
        if loose:
            self._tracker._exit_loose(self)

    def _future_done(self, f: torch.futures.Future[Any]) -> torch.Tensor:
        """The DDP hook's callback on the bucket's future (a bound method: no closure per bucket)."""
        try:
            value = f.value()
        except BaseException as exc:
            self.__exit__(type(exc), exc, None)
            raise
        # never raises; on CUDA this callback runs on streams synchronized with the bucket's all-reduce, so the exit
        # mark completes after the collective on NCCL's stream
        self.__exit__(None, None, None)
        return value[0] if isinstance(value, list) else value

    @property
    def step(self) -> int:
        return self.record.step if self.record is not None else -1

    def _copy(self) -> _Open:
        """A detached copy of an entered operation (for snapshots that outlive the tracker's lock)."""
        c: _Open = _alloc(_Open)
        for name in _COPIED:
            try:
                setattr(c, name, getattr(self, name))
            except AttributeError:
                pass
        return c


_alloc = object.__new__
_COPIED = tuple(n for n in _Open.__slots__ if n != "_tracker")
_POOL_MAX = 1 << 17
"""Records a tracker keeps for reuse at most: about the sink's default bound on buffered rows a table (records beyond
it, e.g. more than that many collectives between two flushes, are allocated and left to the garbage collector)."""


def _entry_order(o: _Open) -> int:
    return o.enter_mono


def _unwrap(f: torch.futures.Future[Any]) -> torch.Tensor:
    """The DDP hook's callback when the bucket is not timed (entering failed)."""
    value = f.value()
    return value[0] if isinstance(value, list) else value


def _new(tracker: CollectiveTracker) -> _Open:
    """A record for the pool (built without an `__init__` call)."""
    o: _Open = _alloc(_Open)
    o._tracker = tracker
    o.record = o.exit_mono = o.wait_mono = None
    o._dev = 0
    o._failed = o._loose = False
    return o


def _make(tracker: CollectiveTracker, op: str, group: Any, tensor: Any, peer: int | None, async_op: bool) -> _Open:
    """A not yet entered operation, from the pool (`Collector.collective` does the same inline for a plain tensor)."""
    pool = tracker._pool
    if pool:
        try:
            o = pool.pop()
        except IndexError:  # another thread took the last one
            o = _new(tracker)
    else:
        o = _new(tracker)
    o.op = op
    o._group_obj = group
    o.peer = peer
    o.async_op = async_op
    mode = tracker._dev_mode
    if isinstance(tensor, _Tensor):
        o.nbytes = tensor.nbytes
        o.dtype = tensor.dtype
        if mode:
            o._dev = mode == 2 or tensor.is_cuda
    else:
        o.nbytes, o.dtype = _payload(tensor)
        if mode:
            o._dev = mode == 2 or bool(tensor and tensor[0].is_cuda)
    return o


class CollectiveTracker:
    """Times collectives for one rank and writes `collectives` rows to a sink."""

    def __init__(
        self,
        *,
        rank: int,
        append: Callable[[Row], None],
        on_error: Callable[[BaseException, _Open], None],
        on_internal: Callable[[str, Exception], None],
        inflight_after_s: float = 0.5,
        timer: DeviceTimer | None = None,
        device_resolve_s: float = 5.0,
    ) -> None:
        """`append` adds one row to the collectives table (`Sink.appender(Table.COLLECTIVES)`): rows of operations
        outside a step, written when they exit. Rows of a step's operations are built by `drain`. With a `timer`,
        operations are marked on the device and their rows wait for the marks, at most `device_resolve_s`."""
        self._rank = rank
        self._append_row = append
        self._current: StepRecord | None = None
        self._add: Callable[[_Open], None] = self._enter_loose
        """Where an entered operation goes: the step in progress's `ops.append`, or the open set outside a step."""
        self._on_error = on_error
        self._on_internal = on_internal
        self._inflight_after_ns = int(inflight_after_s * 1e9)
        self._groups: dict[int, GroupInfo] = {}
        self._group_seq: dict[str, itertools.count[int]] = {}
        self._fast: dict[Any, _Group] = {}
        """Group object -> its constants, filled on first use (cleared when a group is registered)."""
        self._live: set[_Open] = set()
        """Operations entered outside a step and not yet left."""
        self._errors: dict[_Open, str] = {}
        """Error text of failed operations until their rows are written (kept off the object: the common, successful
        operation then never has the attribute looked up and missing)."""
        self._late: list[_Open] = []
        """Operations of finished steps (or outside steps) that had not exited, or whose device marks had not
        completed, when the writer came to them: retried at every drain."""
        self._calling: _Open | None = None
        """The call that issues collectives from C++ the training thread is inside, if any (`enter_call`): what
        the liveness record says the rank waits in while none of its own operations is open."""
        self._orphans: list[_Open] = []
        """Device-timed operations of dropped steps that had not exited: their exit may still take an end mark,
        returned to the pool once they exit (no row)."""
        self._pool: list[_Open] = []
        """Records for reuse: popped by the hot path (any thread; atomic under the GIL), handed back by the writer
        (`_retire`)."""
        self._resolve_ns = int(device_resolve_s * 1e9)
        self._timer: DeviceTimer | None = None
        self._dev_mode = 0
        """0: no device timing; 1: operations on CUDA tensors are marked; 2: every operation is (the fake)."""
        self.set_timer(timer)
        self._lock = threading.Lock()

    @property
    def current(self) -> StepRecord | None:
        """The step in progress; the collector sets it at step begin and clears it at step end."""
        return self._current

    @current.setter
    def current(self, record: StepRecord | None) -> None:
        self._current = record
        self._add = self._enter_loose if record is None else record.ops.append

    def set_timer(self, timer: DeviceTimer | None) -> None:
        """Time operations entered from now on with `timer` (the collector calls it before the first step)."""
        self._timer = timer
        self._dev_mode = 0 if timer is None else (1 if timer.cuda_only else 2)

    # -- groups ---------------------------------------------------------------------------------------
    def register_group(self, group: Any, info: GroupInfo) -> None:
        self._groups[id(group) if group is not None else 0] = info
        self._fast.clear()

    def groups(self) -> list[GroupInfo]:
        return list(dict.fromkeys(self._groups.values()))

    def info(self, group: Any) -> GroupInfo:
        found = self._groups.get(id(group) if group is not None else 0)
        if found is None and (group is None or group is dist.GroupMember.WORLD):
            found = self._groups.get(0) or self._groups.get(id(dist.GroupMember.WORLD))
        if found is None:
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
            name = group_name(str(getattr(group, "group_desc", "") or ""),
                              str(getattr(group, "group_name", "") or len(self._groups)), ranks)
            found = GroupInfo(name=name, kind=group_kind(name), ranks=ranks, hosts=())
            self._groups[id(group) if group is not None else 0] = found
        return found

    def _group_state(self, group: Any) -> _Group:
        """The hot path's constants of `group` (first collective on it: resolved by `info`, then cached)."""
        info = self.info(group)
        with self._lock:
            seqs = self._group_seq.setdefault(info.name, itertools.count())
            state = self._fast.setdefault(group, _Group(info, seqs.__next__))
        return state

    # -- enter / exit ---------------------------------------------------------------------------------
    def timed(
        self,
        op: str,
        group: Any,
        tensor: torch.Tensor | list[torch.Tensor] | None = None,
        *,
        peer: int | None = None,
    ) -> _Open:
        """Time a blocking collective issued in the body: ``with tracker.timed("all_reduce", g, t): ...``.

        The body's exceptions pass through; the tracker's own never reach it."""
        return _make(self, op, group, tensor, peer, False)

    def enter(
        self,
        op: str,
        group: Any,
        tensor: torch.Tensor | list[torch.Tensor] | None = None,
        *,
        peer: int | None = None,
        async_op: bool = False,
    ) -> _Open:
        """Enter an operation that is left elsewhere (`exit`: e.g. an async one, from its future's callback).
        Never raises: an internal error is counted and the operation records nothing."""
        o = _make(self, op, group, tensor, peer, async_op)
        o.__enter__()
        return o

    def past(self, op: str, group: Any, nbytes: int, enter_mono: int, exit_mono: int) -> None:
        """Record an operation that already happened, between two instants of this process's monotonic clock (an
        operation torch issued inside a call that was timed as a whole: `ddp`'s DDP internals, from torch's own
        timestamps). Never raises."""
        try:
            o = _make(self, op, group, None, None, False)
            o._dev = 0
            if o.__enter__() is None:
                return
            o.nbytes = nbytes
            o.enter_mono = enter_mono
            loose = o._loose
            o.exit_mono = max(exit_mono, enter_mono)
            if loose:
                self._exit_loose(o)
        except Exception as exc:
            self._on_internal("collective.past", exc)

    def exit(self, o: _Open, error: BaseException | None = None) -> None:
        """Leave `o` (entered by `enter`), with the error it failed with, if any. Never raises."""
        o.__exit__(None if error is None else type(error), error, None)

    def _enter_loose(self, o: _Open) -> None:
        """Entering outside a step: the operation goes to the open set, with its own wall-clock offset."""
        o._loose = True
        o.record = None
        o.seq = -1
        o.wall_offset = _wall() - _mono()
        with self._lock:
            self._live.add(o)

    def _start_mark(self, o: _Open) -> None:
        """Entering a device-timed operation: its entry mark (`_dev` -1 when the pool is empty). Never raises."""
        o.dev_start = o.dev_end = o.dev_ns = o.dev_at = None
        o._dev = -1
        try:
            timer = self._timer
            m = o.dev_start = timer.mark() if timer is not None else None
            if m is not None:
                o._dev = 1
        except Exception as internal:
            self._on_internal("collective.device_mark", internal)

    def _end_mark(self, o: _Open, exc: BaseException | None) -> None:
        """Leaving a device-timed operation: its exit mark, on the current stream. Never raises."""
        try:
            if o._dev == 1 and exc is None and self._timer is not None:
                o.dev_end = self._timer.mark()
        except Exception as internal:
            self._on_internal("collective.device_mark", internal)

    def _exit_failed(self, o: _Open, exc: BaseException) -> None:
        """A failed operation's exit: its error is recorded before its exit is visible to the writer (so its row is
        an error row, and the record is never reused), then it is left as any other, and the error callback runs.
        Never raises."""
        end = _mono()
        try:
            if not hasattr(o, "enter_mono"):  # entering failed: nothing to record
                o.exit_mono = end
                return
            o._failed = True
            with self._lock:
                self._errors[o] = f"{type(exc).__name__}: {exc}"[:500]
            o.exit_mono = end
            if o._loose:
                self._exit_loose(o)
            self._on_error(exc, o)
        except Exception as internal:
            self._on_internal("collective.exit", internal)

    def _exit_loose(self, o: _Open) -> None:
        """Leaving an operation outside a step: it leaves the open set and its row is written now (or by `drain`,
        once its device marks resolved). Never raises."""
        try:
            if not hasattr(o, "enter_mono"):  # entering failed: nothing to record
                return
            pending_device = o._dev == 1
            with self._lock:
                self._live.discard(o)
                if pending_device:
                    self._late.append(o)  # written by `drain` once its marks resolved
            if not pending_device:
                self._append_row(self._final_row(o))  # outside the lock: a sink may take its own
        except Exception as internal:
            self._on_internal("collective.exit", internal)

    @staticmethod
    def claim(record: StepRecord) -> None:
        """Set `record` and `seq` (the index) of the step's operations appended since the last claim: done off the hot
        path, by the writer and by snapshots, before any of them reads those fields (racing claims write the same
        values)."""
        ops = record.ops
        i, n = record.claimed, len(ops)
        while i < n:
            o = ops[i]
            o.record = record
            o.seq = i
            i += 1
        record.claimed = n

    def _row(self, o: _Open) -> Row:
        """The `collectives` row of an entered operation, as it stands (in flight if it has not exited)."""
        record = o.record
        if record is not None:
            offset, step, seq = record.wall_offset_ns, record.step, o.seq
        else:
            offset, step, seq = o.wall_offset, -1, -1
        g = o.group
        enter, end = o.enter_mono, o.exit_mono
        error = self._errors.get(o) if self._errors else None
        status = _ERROR if error is not None else (_IN_FLIGHT if end is None else _OK)
        device_ns, device_at = (o.dev_ns, o.dev_at) if o._dev else (None, None)
        return (
            self._rank, step, seq, o.group_seq, o.op, g.name, g.ranks, o.peer, o.nbytes, _dtype_name(o.dtype),
            o.async_op, enter + offset, enter,
            None if end is None else end + offset, end, None if end is None else end - enter,
            device_ns, device_at, status, error,
        )

    def _final_row(self, o: _Open) -> Row:
        """The row of an exited operation, written once: its error text is not kept past it."""
        row = self._row(o)
        if self._errors:
            with self._lock:
                self._errors.pop(o, None)
        return row

    def _retire(self, ops: Iterable[_Open]) -> None:
        """Operations whose rows, and their steps' rows, are built (writer thread): device marks still held go back
        to the timer's pool (an end mark taken by an exit racing the writer's give-up), and the records to this
        tracker's pool, except failed ones and ones outside a step (see `_Open`). Under the lock: snapshots read open
        operations under it, so none is seen half reset or reused meanwhile."""
        pool = self._pool
        timer = self._timer
        with self._lock:
            room = _POOL_MAX - len(pool)
            for o in ops:
                if o._dev and timer is not None and (o.dev_start is not None or o.dev_end is not None):
                    timer.release(o.dev_start, o.dev_end)
                    o.dev_start = o.dev_end = None
                if o._loose or o._failed or room <= 0 or not hasattr(o, "enter_mono"):
                    continue
                o.record = o._group_obj = o.exit_mono = o.wait_mono = None  # no step (its tensors) or group kept alive by the pool
                o._dev = 0
                del o.enter_mono  # "not entered" again, for the writer and snapshots
                pool.append(o)
                room -= 1

    def abandon(self, ops: Iterable[_Open]) -> None:
        """A dropped step's operations (training thread, the writer fell behind): device marks go back to the pool
        unresolved, those of operations still open once they exit. Their records are not reused."""
        timer = self._timer
        if timer is None:
            return
        open_ops: list[_Open] = []
        for o in ops:
            if o._dev == 1:
                o._dev = -1
                timer.release(o.dev_start, o.dev_end)
                o.dev_start = o.dev_end = None
                if o.exit_mono is None:
                    open_ops.append(o)
        if open_ops:
            with self._lock:
                self._orphans += open_ops

    def _release_orphans(self) -> None:
        """Writer thread: end marks that exits of dropped steps' operations took after `abandon`."""
        with self._lock:
            orphans, self._orphans = self._orphans, []
        timer = self._timer
        still: list[_Open] = []
        for o in orphans:
            if o.exit_mono is None:
                still.append(o)
            elif timer is not None:
                timer.release(o.dev_start, o.dev_end)
                o.dev_start = o.dev_end = None
        if still:
            with self._lock:
                self._orphans += still

    def settle_op(self, o: _Open, expired: bool) -> bool:
        """Resolve `o`'s device marks if they completed (writer thread; never waits): True once its device columns
        are final, values or nulls, and its marks are back in the pool. `expired`: give up on what has not
        completed (or, for an operation not yet exited, on its device time)."""
        if o._dev != 1:
            return True
        timer = self._timer
        assert timer is not None
        if o.exit_mono is None:
            if not expired:
                return False
            o._dev = -1  # an exit racing this may still take its end mark: `_retire` returns it
            timer.release(o.dev_start)
            o.dev_start = None
            return True
        start, end = o.dev_start, o.dev_end
        ns = at = None
        if start is not None and end is not None:
            ns = timer.elapsed_ns(start, end)
            record = o.record
            base = record.dev_start if record is not None else None
            if ns is not None and base is not None:
                at = timer.elapsed_ns(base, start)
                if at is None:  # the step's start mark (another stream) has not completed yet
                    ns = None
            if ns is None and not expired:
                return False
        o.dev_start = o.dev_end = None
        timer.release(start, end)
        if ns is None:
            o._dev = -1
        else:
            o.dev_ns, o.dev_at, o._dev = (ns if ns > 0 else 0), at, 2
        return True

    def drain(self, done: Iterable[StepRecord], current: StepRecord | None = None, *, final: bool = False) -> list[Row]:
        """Rows of exited operations not yet written: those of finished steps `done`, those kept back earlier, and
        the leading exited ones of the step in progress. Operations not yet exited (or with device marks not yet
        complete, for at most `device_resolve_s` after their exit; `final`: not at all) are kept back for the next
        drain. Runs on the writer thread."""
        rows: list[Row] = []
        with self._lock:
            late, self._late = self._late, []
        keep: list[_Open] = []
        written: list[_Open] = []
        """Rows built and steps' rows built (the caller built those of `done`): back to the pool at the end."""
        claim = self.claim
        for record in done:
            claim(record)
            ops, n = record.ops, record.written
            written += ops[:n]  # written while their step ran
            late += ops[n:]
        now, bound = _mono(), self._resolve_ns
        for o in late:
            if not hasattr(o, "enter_mono"):
                continue
            end = o.exit_mono
            if end is None or (o._dev == 1 and not self.settle_op(o, final or now - end > bound)):
                keep.append(o)
                continue
            rows.append(self._final_row(o))
            written.append(o)
        if current is not None:
            claim(current)
            ops, i = current.ops, current.written
            n = len(ops)
            while i < n:
                o = ops[i]
                if not hasattr(o, "enter_mono"):
                    break
                end = o.exit_mono
                if end is None or (o._dev == 1 and not self.settle_op(o, final or now - end > bound)):
                    break
                rows.append(self._final_row(o))
                i += 1
            current.written = i
        if keep:
            with self._lock:
                self._late[:0] = keep
        if self._orphans:
            self._release_orphans()
        if written:
            self._retire(written)
        return rows

    # -- DDP ------------------------------------------------------------------------------------------
    def ddp_comm_hook(
        self, group: Any = None, *, before: Callable[[GroupInfo], None] | None = None, grad_norm: bool = True
    ) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
        """A DDP comm hook (``ddp.register_comm_hook(None, hook)``): averaging all-reduce per bucket, timed,
        and the bucket's local squared norm added to the step's pre-all-reduce gradient norm."""

        size = dist.get_world_size(group)

        scale = float(size * size)

        def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            buf: torch.Tensor = bucket.buffer()  # flat, 1-D
            buf.div_(size)  # the averaging DDP does anyway; an error here is DDP's own, as without the collector
            o: _Open | None = None
            try:
                record = self.current
                if record is not None and grad_norm:
                    # after the division, while the bucket is still in cache: one more pass costs a fraction of a
                    # pass over cold memory. |g / n|² · n² = |g|² (exactly, for a power-of-two n)
                    flat = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
                    record.grad_sq.append((torch.dot(flat, flat), scale))  # a 0-d tensor: read by the writer
                o = _make(self, "all_reduce", group, buf, None, True)
                if o.__enter__() is None:  # never raises; an internal error is counted, and nothing is timed
                    o = None
            except Exception as exc:
                self._on_internal("ddp_comm_hook", exc)
            try:
                if before is not None and o is not None:
                    before(o.group)
                # the unwrapped all_reduce: with `instrument_distributed` on too, the bucket is recorded once, here
                work = getattr(dist.all_reduce, "__rankwatch_wrapped__", dist.all_reduce)(buf, group=group, async_op=True)
                assert work is not None
                fut = work.get_future()
            except BaseException as exc:
                if o is not None:
                    o.__exit__(type(exc), exc, None)
                raise
            return fut.then(_unwrap if o is None else o._future_done)

        # DDP checks these annotations at registration; under postponed evaluation they would be strings
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return hook

    # -- state for the writer and heartbeats ---------------------------------------------------------
    def _entered_unwritten(self) -> list[_Open]:
        """Operations entered and not yet written (a copy: other threads add and remove them meanwhile). Call with
        the lock held: the writer hands records back to the pool under it, so none of these is reused meanwhile."""
        candidates = list(self._live) + self._late
        current = self._current
        if current is not None:
            self.claim(current)
            candidates += current.ops[current.written :]
        return [o for o in candidates if hasattr(o, "enter_mono")]

    def _open_now(self) -> list[_Open]:
        """Operations entered and not exited (`_entered_unwritten`'s that have not exited; with the lock held)."""
        return [o for o in self._entered_unwritten() if o.exit_mono is None]

    def unwritten(self) -> list[tuple[str, str, int, int | None, bool]]:
        """(group, op, enter wall, exit wall or None while open, async_op) of every operation entered and not yet
        written, and of the C++ call the training thread is inside (`enter_call`, open): what may have enqueued collectives the
        writer has not seen rows of (`backfill`). Writer thread."""
        with self._lock:
            rows: list[Any] = [self._row(o) for o in self._entered_unwritten()]
            calling = self._calling
        out: list[tuple[str, str, int, int | None, bool]] = [(r[5], r[4], r[11], r[13], bool(r[10])) for r in rows]
        if calling is not None:
            out.append((calling.group.name, calling.op, calling.enter_mono + _wall() - _mono(), None, False))
        return out

    def in_flight_rows(self) -> Iterable[tuple[Table, Row]]:
        now, after = _mono(), self._inflight_after_ns
        with self._lock:
            rows = [self._row(o) for o in sorted(self._open_now(), key=_entry_order) if now - o.enter_mono >= after]
        for row in rows:
            yield Table.COLLECTIVES, row

    def oldest_open(self) -> _Open | None:
        """The operation open the longest, as a copy (the caller reads it after the record may be reused); else the
        call issuing collectives from C++ the training thread is inside (`enter_call`)."""
        with self._lock:
            opened = self._open_now()
            return min(opened, key=_entry_order)._copy() if opened else self._calling

    def enter_call(self, op: str, group: Any) -> None:
        """The training thread enters a call that issues collectives from C++ and is recorded only once it returns
        (`collector.ddp.wrap_internal`: DDP's buffer broadcast in every forward). Until `exit_call`, a rank blocked
        inside it reads as waiting in `op` on `group` (its sequence number unknown: null), not as stuck outside
        any collective, which would make it a hang's suspect beside the rank its peers really wait for. Never
        raises."""
        try:
            o: _Open = _alloc(_Open)
            o.op, o.group, o.group_seq, o.peer, o.async_op = op, self.info(group), None, None, False  # type: ignore[assignment]
            o.enter_mono, o.exit_mono = _mono(), None
            self._calling = o
        except Exception as exc:
            self._on_internal("enter_call", exc)

    def exit_call(self) -> None:
        self._calling = None
