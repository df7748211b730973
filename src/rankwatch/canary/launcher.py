"""Launch N canary ranks as real processes and watch them.

Ranks are spawned with ``torch.multiprocessing.start_processes(..., join=False)`` and joined by polling. When a
rank fails, the survivors get `failure_grace_s` to fail on their own (so they record which collective broke
under them); then the launcher sends SIGTERM (the collector records it and flushes) and, after `term_grace_s`,
SIGKILL. A rendezvous TCPStore lives in the launcher, on a port the OS picks. The moment the launcher sees a rank's
process end it writes <run>/live/exit-<r>.json (`_ExitRecords`), the host agent's half of the liveness channel
(docs/liveness.md).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.multiprocessing as mp

from rankwatch.base.rundir import append_launch
from rankwatch.base.topology import Hosts
from rankwatch.canary.config import CanaryConfig
from rankwatch.canary.loop import run_rank
from rankwatch.collector.liveness import write_exit_record
from rankwatch.collector.rollup import rollup_all, run_agent
from rankwatch.recovery.job import LaunchResult, Launcher
from rankwatch.recovery.resume import preflight

if TYPE_CHECKING:
    from rankwatch.analytics.replay import ReplayCheck

__all__ = ["CanaryLauncher", "launch", "record_launch"]

log = logging.getLogger("rankwatch.canary")


class CanaryLauncher(Launcher):
    """`launch` as the recovery manager's `Launcher`."""

    def __call__(self, job: CanaryConfig, *, stop: threading.Event, on_start: Callable[[tuple[int, ...]], None],
                 **kw: Any) -> LaunchResult:
        return launch(job, stop=stop, on_start=on_start, **kw)


def record_launch(cfg: CanaryConfig) -> int:
    """Append this launch to <run>/run.json; returns its attempt number."""
    return append_launch(cfg.run_dir, cfg.launch_record())


def launch(
    cfg: CanaryConfig,
    *,
    failure_grace_s: float | None = None,
    term_grace_s: float = 5.0,
    timeout_s: float | None = None,
    poll_s: float = 0.1,
    rollup_interval_s: float | None = None,
    stop: threading.Event | None = None,
    on_start: Callable[[tuple[int, ...]], None] | None = None,
) -> LaunchResult:
    """Run the canary on `cfg.world_size` ranks and wait for them.

    `failure_grace_s` defaults to the process-group timeout plus 5 s; `timeout_s` bounds the whole run. With
    `rollup_interval_s`, a rollup agent merges each virtual host's new rank part files into host parts at that
    interval while the job runs, and once more after it ends (`collector.rollup`).

    `stop`, when set from another thread (a recovery manager that was told of a fail-stop or hang), ends the job at
    once: SIGTERM to every rank still running (the collector records it and flushes), SIGKILL after `term_grace_s`;
    those ranks are in `terminated` and `stopped` is True. `on_start` is called with the ranks' pids once they are
    spawned (rank order)."""
    run_dir = Path(cfg.run_dir)
    if cfg.resume:
        preflight(run_dir)  # a bad run directory fails here, before anything is created or appended
    elif run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a directory")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, attempt=record_launch(cfg))
    grace = cfg.pg_timeout_s + 5.0 if failure_grace_s is None else failure_grace_s
    store = dist.TCPStore("127.0.0.1", 0, cfg.world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=max(30.0, cfg.pg_timeout_s)))
    start = time.monotonic()
    agent = _RollupAgent(run_dir, rollup_interval_s) if rollup_interval_s else None
    ctx = mp.start_processes(run_rank, args=(cfg, store.port), nprocs=cfg.world_size, join=False, start_method="spawn")
    procs = ctx.processes
    pids = tuple(p.pid for p in procs)
    exits = _ExitRecords(run_dir, cfg, procs)
    if on_start is not None:
        on_start(tuple(int(p) for p in pids))
    stopped = False
    first_failure: float | None = None
    terminated: list[int] = []
    sent_term_at: float | None = None
    try:
        while True:
            exits.see()
            codes = [p.exitcode for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(c not in (None, 0) for c in codes):
                first_failure = now
            deadline_hit = timeout_s is not None and now - start > timeout_s
            stop_hit = stop is not None and stop.is_set()
            stopped = stopped or (stop_hit and sent_term_at is None)
            if sent_term_at is None and ((first_failure is not None and now - first_failure > grace) or deadline_hit
                                         or stop_hit):
                for r, p in enumerate(procs):
                    if p.exitcode is None:
                        terminated.append(r)
                        _signal(p.pid, signal.SIGTERM)
                sent_term_at = now
            if sent_term_at is not None and now - sent_term_at > term_grace_s:
                for p in procs:
                    if p.exitcode is None:
                        _signal(p.pid, signal.SIGKILL)
                for p in procs:
                    p.join(5.0)
                break
            time.sleep(poll_s)
    except BaseException:
        for p in procs:
            if p.exitcode is None:
                _signal(p.pid, signal.SIGKILL)
        raise
    finally:
        for p in procs:
            p.join(1.0)
        exits.see()
        del store
        if agent is not None:
            agent.close()
    duration = time.monotonic() - start
    checks: tuple[ReplayCheck, ...] = ()
    warnings: list[str] = []
    if cfg.resume:
        from rankwatch.recovery.promises import record_replay_verification  # the analysis stack, launcher only

        try:
            checks = record_replay_verification(run_dir, cfg.attempt)
        except ValueError as exc:
            warnings.append(f"replay verification not recorded: {exc}")
    return LaunchResult(
        run_dir=run_dir,
        exit_codes=tuple(p.exitcode for p in procs),
        pids=pids,
        duration_s=duration,
        terminated=tuple(terminated),
        replay=checks,
        warnings=tuple(warnings),
        stopped=stopped,
    )


class _ExitRecords:
    """The launcher's side of each (virtual) host, as far as liveness goes: the moment it sees a rank's process end
    it writes <run>/live/exit-<r>.json (`collector.liveness.write_exit_record`), so a monitor learns of the exit within
    the launcher's poll interval instead of a heartbeat timeout. One launcher stands for every virtual host's agent
    here; a real deployment runs one per host, each for its own ranks. A failed write is logged once and the job goes
    on."""

    def __init__(self, run_dir: Path, cfg: CanaryConfig, procs: list[Any]) -> None:
        self._run_dir = run_dir
        self._cfg = cfg
        self._procs = procs
        self._hosts = Hosts(count=cfg.hosts, world_size=cfg.world_size)
        self._written: set[int] = set()
        self._warned = False

    def see(self) -> None:
        for rank, p in enumerate(self._procs):
            code = p.exitcode
            if code is None or rank in self._written:
                continue
            self._written.add(rank)
            try:
                write_exit_record(self._run_dir, rank=rank, world_size=self._cfg.world_size, attempt=self._cfg.attempt,
                                  pid=p.pid, host=self._hosts.host_of(rank), returncode=code)
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning("rankwatch launcher: exit record of rank %d not written: %s", rank, exc)


class _RollupAgent:
    """The rollup agents of every virtual host, on one background thread of the launcher. A failed round is logged
    and retried at the next; it never stops the job."""

    def __init__(self, run_dir: Path, interval_s: float) -> None:
        self._run_dir = run_dir
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rankwatch-rollup", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                run_agent(self._run_dir, None, interval_s=self._interval_s, stop=self._stop)
            except Exception as exc:  # e.g. no telemetry yet; the job must not notice
                log.debug("rankwatch rollup agent: %s", exc)
                self._stop.wait(self._interval_s)

    def close(self) -> None:
        """Stop the loop, then roll up what the ranks wrote last."""
        self._stop.set()
        self._thread.join()
        try:
            rollup_all(self._run_dir)
        except Exception as exc:
            log.warning("rankwatch rollup agent: final round failed: %s", exc)


def _signal(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
