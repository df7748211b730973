"""Per-collective timing: explicit torch.distributed calls, DDP gradient buckets, and what is still in flight.

Each operation is entered (clocks read, registered as open) before the call and exited after it. An operation
that never exits — the rank died, hung or was killed inside it — stays in the open set; the sink's writer
snapshots open operations older than a threshold as ``in_flight`` rows at every flush, so a post-mortem sees
where every rank was stuck. On CUDA, device time comes from CUDA events resolved after the fact by polling
``Event.query()``; nothing here synchronizes the device.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.collector.schema import CollectiveStatus, Collectives, GroupKind, Table, column_names, link_name
from rankwatch.collector.sink import Row

assert column_names(Table.COLLECTIVES)[0] == Collectives.RANK  # rows below are built in schema order


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupInfo:
    """A process group as telemetry names it."""

    name: str
    kind: GroupKind
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    """Host of each member, in `ranks` order."""

    @property
    def links(self) -> tuple[str, ...]:
        """Inter-host links a ring over the members crosses, sorted and unique."""
        n = len(self.hosts)
        if n < 2:
            return ()
        pairs = {link_name(self.hosts[i], self.hosts[(i + 1) % n]) for i in range(n)}
        return tuple(sorted(p for p in pairs if p.split("<->")[0] != p.split("<->")[1]))


class StepCounters:
    """What the collective tracker adds to the step in progress (owned by the collector's step)."""

    __slots__ = (
        "step", "seq", "blocked_ns", "blocked", "async_last_enter_mono", "async_last_exit_mono", "grad_sq", "grad_sq_dev",
    )

    def __init__(self, step: int) -> None:
        self.step = step
        self.seq = 0
        self.blocked_ns = 0
        self.blocked: list[tuple[int, int]] = []  # (enter, exit) monotonic ns of blocking collectives
        self.async_last_enter_mono = 0
        self.async_last_exit_mono = 0
        self.grad_sq = 0.0
        self.grad_sq_dev: torch.Tensor | None = None

    def async_exposed_ns(self) -> int:
        """Exposed tail of asynchronous collectives (DDP buckets): from the last one issued to the last one done,
        less the time the training thread spent blocked in other collectives meanwhile (counted already)."""
        lo, hi = self.async_last_enter_mono, self.async_last_exit_mono
        if hi <= lo:
            return 0
        overlap = 0
        for a, b in self.blocked:
            if b > lo and a < hi:
                overlap += (b if b < hi else hi) - (a if a > lo else lo)
        return max(0, hi - lo - overlap)


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
_DEVICE_IDX = column_names(Table.COLLECTIVES).index(Collectives.DEVICE_DURATION_NS)
_mono, _wall, _Tensor = time.monotonic_ns, time.time_ns, torch.Tensor


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _payload(tensor: torch.Tensor | list[torch.Tensor] | None) -> tuple[int, str]:
    if tensor is None:
        return 0, ""
    if isinstance(tensor, torch.Tensor):
        return tensor.nbytes, _dtype_name(tensor.dtype)
    nbytes = sum(t.numel() * t.element_size() for t in tensor)
    return nbytes, (_dtype_name(tensor[0].dtype) if tensor else "")


class _Open:
    """One collective: the context manager `Collector.collective` returns, and the record of an operation this
    rank entered and has not (yet) left. A plain slots class, built per collective: on the hot path its
    `__enter__` and `__exit__` do all the work themselves (no calls into the tracker, no separate record).

    Entering reads the clocks, numbers the operation, and registers it in the tracker's open set, where the
    writer thread sees it (`CollectiveTracker.in_flight_rows`) until it exits. The row's first columns, fixed
    at entry, are kept as one tuple (`_prefix`); exiting appends prefix + exit columns. Neither raises into
    the caller: an internal error is counted, and an operation whose entry failed records nothing."""

    __slots__ = (
        "_tracker", "op", "_group_obj", "_tensor", "peer", "async_op", "group", "enter_mono", "_counters",
        "_prefix", "cuda_start", "cuda_end",
    )
    # set when built (`_make`, or inline in `Collector.collective`)
    _tracker: CollectiveTracker
    op: str
    _group_obj: Any
    _tensor: Any
    peer: int | None
    async_op: bool
    # set when entered
    _prefix: Row | None
    """Columns rank .. enter_mono of the row; None if entering failed."""
    group: GroupInfo
    enter_mono: int
    _counters: StepCounters | None
    cuda_start: Any
    """CUDA event recorded at entry (CUDA tensors only), else None."""
    cuda_end: Any
    """CUDA event recorded at exit, when there is a `cuda_start`."""

    def __enter__(self) -> GroupInfo | None:
        enter_mono, enter_wall = _mono(), _wall()
        t = self._tracker
        try:
            g = t._fast.get(id(self._group_obj)) or t._group_state(self._group_obj)
            gseq = g.next_seq()
            counters = t.counters
            self._counters = counters
            if counters is not None:
                seq = counters.seq
                counters.seq = seq + 1
                step = counters.step
                if self.async_op:
                    counters.async_last_enter_mono = enter_mono
            else:
                seq = step = -1
            tensor = self._tensor
            if isinstance(tensor, _Tensor):
                nbytes, dtype = tensor.nbytes, _DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype)
                if t._cuda and not self.async_op and tensor.is_cuda:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                    self.cuda_start = start
                else:
                    self.cuda_start = None
            else:
                nbytes, dtype = _payload(tensor)
                self.cuda_start = None
            info = g.info
            self.group = info
            self.enter_mono = enter_mono
            self._prefix = (
                t._rank, step, seq, gseq, self.op, g.name, g.ranks, self.peer, nbytes, dtype, self.async_op,
                enter_wall, enter_mono,
            )
            t._live.add(self)
            return info
        except Exception as exc:
            self._prefix = None
            t._on_internal("collective.enter", exc)
            return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        exit_mono, exit_wall = _mono(), _wall()
        t = self._tracker
        try:
            prefix = self._prefix
            if prefix is None:  # entering failed: nothing to record
                return
            t._live.discard(self)
            enter_mono = self.enter_mono
            duration = exit_mono - enter_mono
            counters = self._counters
            if counters is not None and counters is t.counters:  # still the step it was issued in
                if self.async_op:
                    if exit_mono > counters.async_last_exit_mono:
                        counters.async_last_exit_mono = exit_mono
                else:
                    counters.blocked_ns += duration
                    counters.blocked.append((enter_mono, exit_mono))
            if exc is None and self.cuda_start is None:  # the common case
                t._append_row(prefix + (exit_wall, exit_mono, duration, None, _OK, None))
                return
            t._finish(self, prefix, exit_wall, exit_mono, duration, exc)
        except Exception as internal:
            t._on_internal("collective.exit", internal)

    # what events and tests read of an operation (cold paths)
    @property
    def step(self) -> int:
        return self._entered()[1]  # type: ignore[return-value]

    @property
    def seq(self) -> int:
        return self._entered()[2]  # type: ignore[return-value]

    @property
    def group_seq(self) -> int:
        return self._entered()[3]  # type: ignore[return-value]

    def _entered(self) -> Row:
        prefix = getattr(self, "_prefix", None)
        if prefix is None:
            raise ValueError(f"collective {self.op!r} was never entered")
        return prefix


_alloc = object.__new__


def _entry_order(o: _Open) -> int:
    return o.enter_mono


def _make(tracker: CollectiveTracker, op: str, group: Any, tensor: Any, peer: int | None, async_op: bool) -> _Open:
    """A new, not yet entered operation (built without an `__init__` call: `Collector.collective` does the same
    inline, once per collective)."""
    o: _Open = _alloc(_Open)
    o._tracker, o.op, o._group_obj, o._tensor, o.peer, o.async_op = tracker, op, group, tensor, peer, async_op
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
    ) -> None:
        """`append` adds one row to the collectives table (`Sink.appender(Table.COLLECTIVES)`)."""
        self._rank = rank
        self._append_row = append
        self.counters: StepCounters | None = None
        """The step in progress; the collector sets it at step begin and clears it at step end."""
        self._on_error = on_error
        self._on_internal = on_internal
        self._inflight_after_ns = int(inflight_after_s * 1e9)
        self._groups: dict[int, GroupInfo] = {}
        self._group_seq: dict[str, itertools.count[int]] = {}
        self._fast: dict[int, _Group] = {}
        """id(group object) -> its constants, filled on first use (cleared when a group is registered)."""
        self._live: set[_Open] = set()
        """Operations entered and not yet left; the writer thread snapshots them (`in_flight_rows`)."""
        self._pending_cuda: list[tuple[_Open, Row]] = []
        self._cuda = torch.cuda.is_available()  # no CUDA: skip the per-collective device checks
        self._lock = threading.Lock()

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
            found = GroupInfo(name=f"group{len(self._groups)}", kind=GroupKind.OTHER, ranks=ranks, hosts=())
            self._groups[id(group) if group is not None else 0] = found
        return found

    def _group_state(self, group: Any) -> _Group:
        """The hot path's constants of `group` (first collective on it: resolved by `info`, then cached)."""
        info = self.info(group)
        with self._lock:
            seqs = self._group_seq.setdefault(info.name, itertools.count())
            state = self._fast.setdefault(id(group), _Group(info, seqs.__next__))
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

    def exit(self, o: _Open, error: BaseException | None = None) -> None:
        """Leave `o` (entered by `enter`), with the error it failed with, if any. Never raises."""
        o.__exit__(None if error is None else type(error), error, None)

    def _finish(
        self, o: _Open, prefix: Row, exit_wall: int, exit_mono: int, duration: int, error: BaseException | None
    ) -> None:
        """The uncommon exits: a failed operation (error row, then the error callback) or a CUDA one (its row
        waits for the device events, `resolve_cuda`)."""
        o._tensor = None  # the operation may be kept a while (pending CUDA events, the last failure): not its payload
        status = _OK if error is None else _ERROR
        err = None if error is None else f"{type(error).__name__}: {error}"[:500]
        row = prefix + (exit_wall, exit_mono, duration, None, status, err)
        if error is not None:
            self._on_error(error, o)
        if o.cuda_start is not None and error is None:
            o.cuda_end = torch.cuda.Event(enable_timing=True)
            o.cuda_end.record()
            self._pending_cuda.append((o, row))
            return
        self._append_row(row)

    def _row(
        self, o: _Open, exit_wall: int | None, exit_mono: int | None, duration: int | None,
        device_ns: int | None, status: str, error: str | None,
    ) -> Row:
        return o._entered() + (exit_wall, exit_mono, duration, device_ns, status, error)

    # -- DDP ------------------------------------------------------------------------------------------
    def ddp_comm_hook(
        self, group: Any = None, *, before: Callable[[GroupInfo], None] | None = None
    ) -> Callable[[Any, Any], torch.futures.Future[torch.Tensor]]:
        """A DDP comm hook (``ddp.register_comm_hook(None, hook)``): averaging all-reduce per bucket, timed,
        and the bucket's local squared norm added to the step's pre-all-reduce gradient norm."""

        size = dist.get_world_size(group)

        def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            buf: torch.Tensor = bucket.buffer()
            o: _Open | None = None
            try:
                counters = self.counters
                if counters is not None:
                    flat = buf.detach().view(-1)
                    if flat.dtype not in (torch.float32, torch.float64):
                        flat = flat.float()
                    sq = torch.dot(flat, flat)  # one pass, no temporary
                    if buf.is_cuda:
                        counters.grad_sq_dev = sq if counters.grad_sq_dev is None else counters.grad_sq_dev + sq
                    else:
                        counters.grad_sq += float(sq)
                o = _make(self, "all_reduce", group, buf, None, True)
                o.__enter__()  # never raises; an internal error is counted and leaves no prefix
                if o._prefix is None:  # entering failed: nothing to time
                    o = None
            except Exception as exc:
                self._on_internal("ddp_comm_hook", exc)
            try:
                if before is not None and o is not None:
                    before(o.group)
                buf.div_(size)
                work = dist.all_reduce(buf, group=group, async_op=True)
                assert work is not None
                fut = work.get_future()
            except BaseException as exc:
                if o is not None:
                    o.__exit__(type(exc), exc, None)
                raise

            def done(f: torch.futures.Future[Any]) -> torch.Tensor:
                try:
                    value = f.value()
                except BaseException as exc:
                    if o is not None:
                        o.__exit__(type(exc), exc, None)
                    raise
                if o is not None:
                    o.__exit__(None, None, None)  # never raises
                return value[0] if isinstance(value, list) else value

            return fut.then(done)

        # DDP checks these annotations at registration; under postponed evaluation they would be strings
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return hook

    # -- state for the writer and heartbeats ---------------------------------------------------------
    def in_flight_rows(self) -> Iterable[tuple[Table, Row]]:
        now = time.monotonic_ns()
        # a copy (the training thread adds and removes operations meanwhile), in the order they were entered
        for o in sorted(list(self._live), key=_entry_order):
            if now - o.enter_mono >= self._inflight_after_ns:
                yield Table.COLLECTIVES, self._row(o, None, None, None, None, _IN_FLIGHT, None)

    def oldest_open(self) -> _Open | None:
        opened = list(self._live)
        return min(opened, key=_entry_order) if opened else None

    def resolve_cuda(self, *, wait: bool = False) -> None:
        """Append rows whose CUDA events completed (all of them, synchronizing, when `wait`)."""
        still: list[tuple[_Open, Row]] = []
        for o, row in self._pending_cuda:
            if wait or o.cuda_end.query():
                if wait:
                    o.cuda_end.synchronize()
                device_ns = int(o.cuda_start.elapsed_time(o.cuda_end) * 1e6)
                self._append_row(row[:_DEVICE_IDX] + (device_ns,) + row[_DEVICE_IDX + 1 :])
            else:
                still.append((o, row))
        self._pending_cuda = still
