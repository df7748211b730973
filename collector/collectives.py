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


class _Open:
    """A collective this rank entered and has not (yet) left (a plain slots class: built per collective)."""

    __slots__ = (
        "op", "group", "seq", "group_seq", "step", "peer", "nbytes", "dtype", "async_op", "enter_wall", "enter_mono",
        "cuda_start", "cuda_end",
    )

    def __init__(
        self, op: str, group: GroupInfo, seq: int, group_seq: int, step: int, peer: int | None, nbytes: int,
        dtype: str, async_op: bool, enter_wall: int, enter_mono: int,
    ) -> None:
        self.op, self.group, self.seq, self.group_seq, self.step = op, group, seq, group_seq, step
        self.peer, self.nbytes, self.dtype, self.async_op = peer, nbytes, dtype, async_op
        self.enter_wall, self.enter_mono = enter_wall, enter_mono
        self.cuda_start: Any = None
        self.cuda_end: Any = None


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
        overlap = sum(max(0, min(hi, b) - max(lo, a)) for a, b in self.blocked)
        return max(0, hi - lo - overlap)


class _Timed:
    """Context manager of `CollectiveTracker.timed` (a class, not a generator: it is on the hot path)."""

    __slots__ = ("_tracker", "_args", "_open")

    def __init__(self, tracker: CollectiveTracker, op: str, group: Any, tensor: Any, peer: int | None) -> None:
        self._tracker = tracker
        self._args = (op, group, tensor, peer)

    def __enter__(self) -> GroupInfo | None:
        op, group, tensor, peer = self._args
        try:
            self._open: _Open | None = self._tracker.enter(op, group, tensor, peer=peer)
        except Exception as exc:
            self._tracker._on_internal("collective.enter", exc)
            self._open = None
        return self._open.group if self._open is not None else None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._open is not None:  # CollectiveTracker._safe_exit, inlined: one call less per collective
            try:
                self._tracker.exit(self._open, exc)
            except Exception as internal:
                self._tracker._on_internal("collective.exit", internal)


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_OK, _ERROR, _IN_FLIGHT = str(CollectiveStatus.OK), str(CollectiveStatus.ERROR), str(CollectiveStatus.IN_FLIGHT)


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


class CollectiveTracker:
    """Times collectives for one rank and writes `collectives` rows to a sink."""

    def __init__(
        self,
        *,
        rank: int,
        append: Callable[[Table, Row], None],
        on_error: Callable[[BaseException, _Open], None],
        on_internal: Callable[[str, Exception], None],
        inflight_after_s: float = 0.5,
    ) -> None:
        self._rank = rank
        self._append = append
        self.counters: StepCounters | None = None
        """The step in progress; the collector sets it at step begin and clears it at step end."""
        self._on_error = on_error
        self._on_internal = on_internal
        self._inflight_after_ns = int(inflight_after_s * 1e9)
        self._groups: dict[int, GroupInfo] = {}
        self._group_seq: dict[str, itertools.count[int]] = {}
        self._open: dict[tuple[str, int], _Open] = {}
        self._pending_cuda: list[tuple[_Open, Row]] = []
        self._cuda = torch.cuda.is_available()  # no CUDA: skip the per-collective device checks
        self._lock = threading.Lock()

    # -- groups ---------------------------------------------------------------------------------------
    def register_group(self, group: Any, info: GroupInfo) -> None:
        self._groups[id(group) if group is not None else 0] = info

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

    # -- enter / exit ---------------------------------------------------------------------------------
    def enter(
        self,
        op: str,
        group: Any,
        tensor: torch.Tensor | list[torch.Tensor] | None = None,
        *,
        peer: int | None = None,
        async_op: bool = False,
    ) -> _Open:
        enter_mono, enter_wall = time.monotonic_ns(), time.time_ns()
        info = self._groups.get(id(group) if group is not None else 0) or self.info(group)
        seqs = self._group_seq.get(info.name)
        if seqs is None:
            with self._lock:
                seqs = self._group_seq.setdefault(info.name, itertools.count())
        gseq = next(seqs)  # atomic under the GIL: collectives may be issued from autograd or comm threads
        counters = self.counters
        if counters is not None:
            seq = counters.seq
            counters.seq = seq + 1
            step = counters.step
            if async_op:
                counters.async_last_enter_mono = enter_mono
        else:
            seq = step = -1
        if isinstance(tensor, torch.Tensor):
            nbytes, dtype = tensor.nbytes, _DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype)
        else:
            nbytes, dtype = _payload(tensor)
        o = _Open(op, info, seq, gseq, step, peer, nbytes, dtype, async_op, enter_wall, enter_mono)
        if self._cuda and not async_op and isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            o.cuda_start = torch.cuda.Event(enable_timing=True)
            o.cuda_start.record()
        self._open[(info.name, gseq)] = o
        return o

    def exit(self, o: _Open, error: BaseException | None = None) -> None:
        exit_mono, exit_wall = time.monotonic_ns(), time.time_ns()
        group = o.group
        self._open.pop((group.name, o.group_seq), None)
        duration = exit_mono - o.enter_mono
        counters = self.counters
        if counters is not None and counters.step == o.step:
            if o.async_op:
                if exit_mono > counters.async_last_exit_mono:
                    counters.async_last_exit_mono = exit_mono
            else:
                counters.blocked_ns += duration
                counters.blocked.append((o.enter_mono, exit_mono))
        if error is None and o.cuda_start is None:  # the common case, inlined: this runs per collective
            self._append(
                Table.COLLECTIVES,
                (
                    self._rank, o.step, o.seq, o.group_seq, o.op, group.name, group.ranks, o.peer, o.nbytes,
                    o.dtype, o.async_op, o.enter_wall, o.enter_mono, exit_wall, exit_mono, duration, None, _OK, None,
                ),
            )
            return
        status = _OK if error is None else _ERROR
        err = None if error is None else f"{type(error).__name__}: {error}"[:500]
        row = self._row(o, exit_wall, exit_mono, duration, None, status, err)
        if error is not None:
            self._on_error(error, o)
        if o.cuda_start is not None and error is None:
            o.cuda_end = torch.cuda.Event(enable_timing=True)
            o.cuda_end.record()
            self._pending_cuda.append((o, row))
            return
        self._append(Table.COLLECTIVES, row)

    def _row(
        self, o: _Open, exit_wall: int | None, exit_mono: int | None, duration: int | None,
        device_ns: int | None, status: str, error: str | None,
    ) -> Row:
        return (
            self._rank, o.step, o.seq, o.group_seq, o.op, o.group.name, o.group.ranks, o.peer, o.nbytes,
            o.dtype, o.async_op, o.enter_wall, o.enter_mono, exit_wall, exit_mono, duration, device_ns,
            status, error,
        )

    def timed(
        self,
        op: str,
        group: Any,
        tensor: torch.Tensor | list[torch.Tensor] | None = None,
        *,
        peer: int | None = None,
    ) -> _Timed:
        """Time a blocking collective issued in the body: ``with tracker.timed("all_reduce", g, t): ...``.

        The body's exceptions pass through; the tracker's own never reach it."""
        return _Timed(self, op, group, tensor, peer)

    def _safe_exit(self, o: _Open, error: BaseException | None = None) -> None:
        try:
            self.exit(o, error)
        except Exception as exc:
            self._on_internal("collective.exit", exc)

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
                o = self.enter("all_reduce", group, buf, async_op=True)
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
                    self._safe_exit(o, exc)
                raise

            def done(f: torch.futures.Future[Any]) -> torch.Tensor:
                try:
                    value = f.value()
                except BaseException as exc:
                    if o is not None:
                        self._safe_exit(o, exc)
                    raise
                if o is not None:
                    self._safe_exit(o)
                return value[0] if isinstance(value, list) else value

            return fut.then(done)

        # DDP checks these annotations at registration; under postponed evaluation they would be strings
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return hook

    # -- state for the writer and heartbeats ---------------------------------------------------------
    def in_flight_rows(self) -> Iterable[tuple[Table, Row]]:
        now = time.monotonic_ns()
        for o in list(self._open.values()):
            if now - o.enter_mono >= self._inflight_after_ns:
                yield Table.COLLECTIVES, self._row(o, None, None, None, None, _IN_FLIGHT, None)

    def oldest_open(self) -> _Open | None:
        opened = list(self._open.values())
        return min(opened, key=lambda o: o.enter_mono) if opened else None

    def resolve_cuda(self, *, wait: bool = False) -> None:
        """Append rows whose CUDA events completed (all of them, synchronizing, when `wait`)."""
        still: list[tuple[_Open, Row]] = []
        for o, row in self._pending_cuda:
            if wait or o.cuda_end.query():
                if wait:
                    o.cuda_end.synchronize()
                device_ns = int(o.cuda_start.elapsed_time(o.cuda_end) * 1e6)
                idx = column_names(Table.COLLECTIVES).index(Collectives.DEVICE_DURATION_NS)
                self._append(Table.COLLECTIVES, row[:idx] + (device_ns,) + row[idx + 1 :])
            else:
                still.append((o, row))
        self._pending_cuda = still
