"""Faults from outside a canary rank's process: what an operator's tool, a noisy neighbour or a cgroup freezer does
to it, which the rank's own code cannot inject (`faults.Faults` acts from inside).

    with DutyCycle(run_dir, rank=2, stopped_s=0.035, period_s=0.100):
        launch(cfg)

`DutyCycle` stops the rank's process (SIGSTOP: every thread, its collector's too) for `stopped_s` of every
`period_s`, from a thread of the caller, once the rank's pid is in its topology rows (the canary writes them before
it trains), until the block ends or the process is gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from types import TracebackType

from rankwatch.base.rundir import TELEMETRY_DIR

__all__ = ["DutyCycle"]


class DutyCycle:
    def __init__(self, run_dir: Path | str, *, rank: int, stopped_s: float, period_s: float,
                 wait_s: float = 60.0) -> None:
        if not 0 < stopped_s < period_s:
            raise ValueError(f"DutyCycle: stopped_s {stopped_s} must be in (0, period_s {period_s})")
        self.run_dir, self.rank, self.stopped_s, self.period_s, self.wait_s = Path(run_dir), rank, stopped_s, \
            period_s, wait_s
        self.cycles = 0
        """How many times the process was stopped."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"duty-cycle-rank{rank}", daemon=True)

    def __enter__(self) -> DutyCycle:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _pid(self) -> int | None:
        import duckdb

        folder = self.run_dir / TELEMETRY_DIR / "topology" / f"rank={self.rank}"
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                rows = duckdb.execute(f"SELECT pid FROM read_parquet('{folder}/*.parquet')").fetchall()
                if rows:
                    return int(rows[0][0])
            except duckdb.Error:  # not written yet, or being written
                pass
            time.sleep(0.05)
        return None

    def _run(self) -> None:
        pid = self._pid()
        while pid is not None and not self._stop.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                self.cycles += 1
                time.sleep(self.stopped_s)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                return
            self._stop.wait(self.period_s - self.stopped_s)
