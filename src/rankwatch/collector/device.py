"""Device-side timing: marks recorded on a device stream now, read back later, never waited for.

On CUDA the training thread only enqueues work, so its clock says when work was *issued*, not when the device ran
it. A `DeviceTimer` records marks (CUDA events) on a stream at step, phase and collective boundaries; the
collector's writer thread asks later, without blocking, whether they have completed and how far apart they are.

    timer = CudaDeviceTimer(capacity=4096)
    a = timer.mark()                 # training thread: an event recorded on the current stream (None: pool empty)
    ...
    b = timer.mark()
    ns = timer.elapsed_ns(a, b)      # writer thread: None until both completed; never waits
    timer.release(a, b)              # back to the pool

Marks come from a pool allocated once; an empty pool skips the mark (`dropped` counts them). `FakeDeviceTimer`
stands in for an asynchronous device in tests: its clock only moves when the test advances it, so its marks
complete late, and on several streams out of order.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch


class Mark:
    """A point recorded on a device stream, from a timer's pool (opaque to callers)."""

    __slots__ = ()


class DeviceTimer(ABC):
    """Marks on device streams, resolved after the fact. `mark` is called on the training thread (and on threads
    that run collective callbacks); the rest on the writer thread. No method waits for the device."""

    cuda_only: ClassVar[bool] = True
    """Collectives are marked only when their tensor is a CUDA tensor (False for the fake: every one is)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"DeviceTimer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.dropped = 0
        """Marks not recorded because the pool was empty."""
        self.resolved = 0
        """`elapsed_ns` calls that returned a value."""
        self._all: tuple[Any, ...] = ()
        self._free: list[Any] = []

    @abstractmethod
    def mark(self, stream: Any = None) -> Mark | None:
        """Record a mark now on `stream` (default: the current stream); None when the pool is empty."""

    @abstractmethod
    def done(self, mark: Mark) -> bool:
        """The device has passed `mark`."""

    @abstractmethod
    def elapsed_ns(self, start: Mark, end: Mark) -> int | None:
        """Device ns from `start` to `end`; None while either has not completed. Never waits."""

    def release(self, *marks: Mark | None) -> None:
        """Return marks to the pool (None entries are skipped). A mark still pending may be released: the next
        `mark` re-records it, as CUDA allows for an event."""
        free = self._free
        for m in marks:
            if m is not None:
                free.append(m)

    @property
    def pending(self) -> int:
        """Marks taken from the pool and not released."""
        return self.capacity - len(self._free)

    def settled(self) -> bool:
        """Every mark taken and not released has completed (the closing thread polls this, bounded)."""
        free = {id(m) for m in list(self._free)}
        return all(self.done(m) for m in self._all if id(m) not in free)


class _CudaMark(Mark):
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = torch.cuda.Event(enable_timing=True)


class CudaDeviceTimer(DeviceTimer):
    """CUDA events from a pool (`torch.cuda.Event(enable_timing=True)`), read with `query` and `elapsed_time`
    only: nothing here synchronizes. One timer serves one device (an event stays on the device of its first
    record)."""

    cuda_only = True

    def __init__(self, capacity: int = 4096) -> None:
        super().__init__(capacity)
        self._all = tuple(_CudaMark() for _ in range(capacity))
        self._free = list(self._all)

    def mark(self, stream: Any = None) -> Mark | None:
        try:
            m = self._free.pop()
        except IndexError:
            self.dropped += 1
            return None
        m.event.record(stream)
        return m

    def done(self, mark: Mark) -> bool:
        return bool(mark.event.query())  # type: ignore[attr-defined]

    def elapsed_ns(self, start: Mark, end: Mark) -> int | None:
        a, b = start.event, end.event  # type: ignore[attr-defined]
        if not (a.query() and b.query()):
            return None
        self.resolved += 1
        return int(a.elapsed_time(b) * 1e6)  # ms, resolution about 0.5 µs


class FakeMark(Mark):
    """A mark of `FakeDeviceTimer`: completes when the fake device clock reaches `at`."""

    __slots__ = ("stream", "at")

    def __init__(self) -> None:
        self.stream = ""
        self.at = 0


class FakeDeviceTimer(DeviceTimer):
    """An in-memory asynchronous device for tests: streams run the work enqueued on them in order, on a device
    clock that moves only when the test says so.

        dev = FakeDeviceTimer(capacity=64)
        dev.enqueue(5_000)                 # 5 µs of work on the current stream ("compute")
        a = dev.mark()                     # completes when the device clock reaches 5_000
        with dev.stream("comm"):
            dev.wait_stream("compute")     # comm waits for the compute stream's work so far
            dev.enqueue(2_000)
        dev.done(a)                        # False: the device clock is still 0
        dev.run_until(5_000)               # now True

    A mark recorded on a stream completes when the stream's work enqueued before it has run (at once on an idle
    stream). Nothing blocks: the clock never moves by itself."""

    cuda_only = False

    def __init__(self, capacity: int = 1024, *, default_stream: str = "compute") -> None:
        super().__init__(capacity)
        self._all = tuple(FakeMark() for _ in range(capacity))
        self._free = list(self._all)
        self.now_ns = 0
        """The device clock."""
        self.current = default_stream
        """The current stream (`mark()` and `enqueue()` without a stream use it)."""
        self._tail: dict[str, int] = {}
        """Per stream: device time its enqueued work ends."""
        self._lock = threading.Lock()
        self.marks_recorded = 0

    # -- driving the fake -------------------------------------------------------------------------
    @contextmanager
    def stream(self, name: str) -> Iterator[None]:
        """Make `name` the current stream in the body (as ``torch.cuda.stream`` does)."""
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def tail(self, stream: str | None = None) -> int:
        """Device time the work enqueued so far on `stream` ends (the clock, if the stream is idle)."""
        with self._lock:
            return self._tail_locked(stream or self.current)

    def _tail_locked(self, stream: str) -> int:
        return max(self._tail.get(stream, 0), self.now_ns)

    def enqueue(self, ns: int, stream: str | None = None) -> int:
        """Enqueue `ns` of work on `stream`; returns the device time it ends."""
        if ns < 0:
            raise ValueError(f"work must be >= 0 ns, got {ns}")
        name = stream or self.current
        with self._lock:
            end = self._tail[name] = self._tail_locked(name) + ns
        return end

    def wait_stream(self, other: str, stream: str | None = None) -> None:
        """`stream` (default: current) waits for the work enqueued on `other` so far (``Stream.wait_stream``)."""
        name = stream or self.current
        with self._lock:
            self._tail[name] = max(self._tail_locked(name), self._tail_locked(other))

    def advance(self, ns: int) -> None:
        """Let the device run for `ns`."""
        with self._lock:
            self.now_ns += ns

    def run_until(self, ns: int) -> None:
        """Let the device run until its clock reads `ns` (never backwards)."""
        with self._lock:
            self.now_ns = max(self.now_ns, ns)

    def run_all(self) -> None:
        """Let the device finish everything enqueued."""
        with self._lock:
            self.now_ns = max([self.now_ns, *self._tail.values()])

    # -- DeviceTimer ------------------------------------------------------------------------------
    def mark(self, stream: Any = None) -> Mark | None:
        try:
            m: FakeMark = self._free.pop()
        except IndexError:
            self.dropped += 1
            return None
        name = stream or self.current
        with self._lock:
            m.stream, m.at = name, self._tail_locked(name)
            self.marks_recorded += 1
        return m

    def done(self, mark: Mark) -> bool:
        assert isinstance(mark, FakeMark)
        return mark.at <= self.now_ns

    def elapsed_ns(self, start: Mark, end: Mark) -> int | None:
        assert isinstance(start, FakeMark) and isinstance(end, FakeMark)
        now = self.now_ns
        if start.at > now or end.at > now:
            return None
        self.resolved += 1
        return end.at - start.at
