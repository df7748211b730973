"""The liveness channel's writing side: one small record per rank, rewritten in place.

Part files land every `flush_interval_s` (seconds); a monitor that waits for them learns of a dead rank seconds
late. Each rank's collector therefore also keeps ``<run>/live/rank-<r>.live`` (fields: `schema.LiveField`) current:
written at every completed step's end (`stepped`, on the training thread) and from a thread of its own at least every
`beat_s` (half a heartbeat interval), also while training is stuck. A monitor reads these files (analytics/liveness/): a
record that stops changing is a rank whose process is gone or frozen, a record that keeps changing without step progress
is a rank that is alive but stuck, and where it is stuck is in the record. The launcher writes ``exit-<r>.json`` when a
rank's process ends (`write_exit_record`).

A rank record is one frame (`schema.LIVE_HEADER_BYTES`: CRC-32 and length, then the JSON body, then padding) written
with one `pwrite` at offset 0 of a file kept open: a few microseconds, where a write to a temporary name renamed over
the record costs about a millisecond on ext4 (the rename forces the new file's blocks out) and more on network file
systems. A reader that catches a write half done sees the CRC disagree and reads again. No fsync: the records describe
the present, not history.

Failure semantics: nothing here raises into training. A failed write is handed to `on_error` (the collector counts
it) and tried again at the next tick; a record file deleted under the writer is created again at its next write.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

from rankwatch.base.rundir import LIVE_DIR, atomic_write
from rankwatch.base.schema import (
    EXIT_RECORD_PREFIX, EXIT_RECORD_SUFFIX, LIVE_HEADER_BYTES, LIVE_VERSION, RANK_RECORD_PREFIX, RANK_RECORD_SUFFIX,
    ExitField, LiveField,
)

__all__ = ["LivenessWriter", "encode_frame", "exit_record_path", "live_dir", "rank_record_path", "write_exit_record"]


def live_dir(run_dir: Path) -> Path:
    return Path(run_dir) / LIVE_DIR


def rank_record_path(run_dir: Path, rank: int) -> Path:
    return live_dir(run_dir) / f"{RANK_RECORD_PREFIX}{rank}{RANK_RECORD_SUFFIX}"


def exit_record_path(run_dir: Path, rank: int) -> Path:
    return live_dir(run_dir) / f"{EXIT_RECORD_PREFIX}{rank}{EXIT_RECORD_SUFFIX}"


def encode_frame(doc: Mapping[str, object], size: int = 0) -> bytes:
    """`doc` as one rank-record frame, padded with spaces to at least `size` bytes."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    frame = b"%08x %06d " % (zlib.crc32(body), len(body)) + body
    assert len(frame) == LIVE_HEADER_BYTES + len(body)
    return frame + b" " * (size - len(frame)) if size > len(frame) else frame


def write_exit_record(run_dir: Path, *, rank: int, world_size: int, attempt: int, pid: int | None, host: str,
                      returncode: int, wall_ns: int | None = None, outside_signal: int | None = None,
                      outside_signal_ns: int | None = None) -> Path:
    """Record that rank `rank`'s process ended with `returncode` (a `Popen`/`Process` exit status: >= 0 an exit code,
    < 0 the signal that ended it): JSON under a temporary name, renamed over the record. Raises OSError."""
    path = exit_record_path(run_dir, rank)
    doc = {
        ExitField.VERSION: LIVE_VERSION,
        ExitField.RANK: rank,
        ExitField.WORLD_SIZE: world_size,
        ExitField.ATTEMPT: attempt,
        ExitField.PID: pid,
        ExitField.HOST: host,
        ExitField.WALL_NS: time.time_ns() if wall_ns is None else wall_ns,
        ExitField.EXIT_CODE: returncode if returncode >= 0 else None,
        ExitField.SIGNAL: -returncode if returncode < 0 else None,
        ExitField.OUTSIDE_SIGNAL: outside_signal,
        ExitField.OUTSIDE_SIGNAL_NS: outside_signal_ns,
    }
    # no fsync: a record describes a live process, read within seconds (module docstring)
    return atomic_write(path, json.dumps(doc), durable=False)


class LivenessWriter:
    """Keeps one rank's liveness record current from a daemon thread.

    `snapshot()` returns the record's fields (the writer adds `seq`); `progress()` returns a token that changes when
    the rank completes a step (compared by identity: a cheap read of the collector's last finished step). Every
    `poll_s` the thread writes if the token changed, or if `beat_s` has passed since its last write."""

    def __init__(self, path: Path, *, snapshot: Callable[[], dict[str, object]], progress: Callable[[], object],
                 beat_s: float, poll_s: float, on_error: Callable[[str, Exception], None]) -> None:
        if beat_s <= 0 or poll_s <= 0:
            raise ValueError(f"LivenessWriter: beat_s {beat_s} and poll_s {poll_s} must be > 0")
        self.path = path
        self._snapshot = snapshot
        self._progress = progress
        self._beat_s = beat_s
        self._poll_s = min(poll_s, beat_s)
        self._on_error = on_error
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one write at a time: the thread's, or a final one from `Collector.close`
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._size = 0
        self._token: object = None
        """The progress the record last said (`progress()`'s token)."""
        self.seq = 0
        """Records written."""
        self.errors = 0
        """Failed writes."""
        self.write_ns = 0
        """CPU time of the writing thread spent in writes (snapshot, JSON, pwrite), ns: the channel's cost."""

    def stepped(self) -> None:
        """Write the record now, at a step's end, on the training thread (one snapshot, JSON and `pwrite`: 18 us of CPU
        measured on this 2-core machine; the step's own collector cost is ~3 us): a process that ends right after a step
        (`os._exit`, SIGKILL at the next step's start) leaves a record that says it completed that step, where the
        thread's next look (`poll_s` later) would never come. The thread does not write this progress again."""
        if self.write():
            self._token = self._progress()

    def start(self, name: str) -> None:
        self.write()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def write(self, **final: object) -> bool:
        """Write the record now (with `final` fields over the snapshot's); False when it failed. Never raises."""
        with self._lock:
            t0 = time.thread_time_ns()
            try:
                doc = self._snapshot()
                doc.update(final)
                self.seq += 1
                doc[LiveField.SEQ] = self.seq
                frame = encode_frame(doc, self._size)
                fd = self._open()
                os.pwrite(fd, frame, 0)
                self._size = len(frame)
                return True
            except Exception as exc:
                self.errors += 1
                self._close_fd()  # opened again at the next write (the folder may have been removed meanwhile)
                self._on_error("liveness.write", exc)
                return False
            finally:
                self.write_ns += time.thread_time_ns() - t0

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (a final `write` may follow; the file stays open until `close`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        self.stop()
        with self._lock:
            self._close_fd()

    def _open(self) -> int:
        fd = self._fd
        if fd is not None and os.fstat(fd).st_nlink:
            return fd
        self._close_fd()  # deleted under us (a cleaned folder): write a new file where readers look
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # an earlier attempt's longer record must not show past this one's end
        self._fd = fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = 0
        return fd

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _loop(self) -> None:
        self._token = self._progress()
        due = time.monotonic() + self._beat_s
        while not self._stop.wait(self._poll_s):
            try:
                now = time.monotonic()
                current = self._progress()
                if current is not self._token or now >= due:
                    self._token = current
                    due = now + self._beat_s
                    self.write()
            except Exception as exc:  # write() does not raise; a broken progress() must not end the thread
                self._on_error("liveness.loop", exc)
