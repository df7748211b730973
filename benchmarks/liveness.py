"""Kill, freeze or hang one rank of a live 4-rank canary: how soon `LivenessMonitor` names it.

    .venv/bin/python benchmarks/liveness.py [--kills 5] [--stops 2] [--hangs 2] [--layout dp=2,tp=2]
                                            [--heartbeat 1.0] [--poll 0.1] [--seed 0] [--json OUT] [--keep DIR]

Each trial launches a fresh canary (`canary.launcher.launch` on a thread of this process: gloo ranks on CPU, the tests'
small model, collectors with the default 5 s part-file interval and a `--heartbeat` s heartbeat, a 60 s process-group
timeout) and polls a `LivenessMonitor` on its run directory every `--poll` s from the main thread, as `rankwatch watch`
would. A randomly chosen rank is hit once its liveness record shows a randomly drawn step (10..40) completed; its pid
is read from that record, as an outside tool would:

- kill: SIGKILL. Delay = from the signal to the first poll whose incidents hold a FAIL_STOP naming the rank (the
  issue's target: <= 1 s median, <= 3 s p99). `detectable` is the incident's own `detection_wall_ns` less the kill:
  when the channels made it knowable, whatever the poll cadence.
- stop: SIGSTOP (the process freezes, its liveness thread with it). Delay to the FAIL_STOP naming it (LOST), in
  seconds and heartbeat intervals, and from its last progress (its record's last completed step's end).
- hang: `Faults().hang(rank, step)` (its training thread blocks at the start of the step; heartbeats go on). Delay
  from its last progress to the HANG naming it, in heartbeat intervals (target: <= 3).

The job is then stopped (the launcher's `stop` event: SIGTERM, SIGKILL after 2 s). Percentiles are nearest-rank: with
fewer than 100 trials p99 is the worst. Also measured: the CPU cost of one rank-record write (`LivenessWriter.write`
on a real collector's snapshot, `--writes` times) and each rank's write rate in the canary (its record's `seq` over
its age). Exit status 1 when a fault was not named within `--deadline` s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rankwatch.analytics.incidents import IncidentClass, SubjectKind
from rankwatch.analytics.liveness import LivenessMonitor, LivenessView
from rankwatch.base.topology import Layout
from rankwatch.canary import CanaryConfig, Faults, launch
from rankwatch.canary.model import ModelConfig
from rankwatch.collector import Collector, CollectorConfig, MemorySink
from rankwatch.recovery.job import LaunchResult

SMALL = ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2)


@dataclass(frozen=True, kw_only=True, slots=True)
class Trial:
    kind: str
    rank: int
    step: int
    named: bool
    delay_s: float | None
    """From the fault (signal sent) to the poll that named it; None for hangs (no outside instant)."""
    detectable_s: float | None
    """From the fault to the incident's `detection_wall_ns`."""
    since_progress_heartbeats: float | None
    """From the rank's last progress to the poll that named it, in heartbeat intervals."""
    incident: str
    writes_per_s: float


def _config(run_dir: Path, args: argparse.Namespace, faults: Faults) -> CanaryConfig:
    layout = Layout.parse(args.layout, nproc=math.prod(int(p.split("=")[1]) for p in args.layout.split(",")))
    return CanaryConfig(run_dir=run_dir, steps=1_000_000, layout=layout, faults=faults, gpu="replay",
                        pg_timeout_s=60.0, heartbeat_interval_s=args.heartbeat, gpu_interval_s=1.0, model=SMALL,
                        fingerprint_every=0)


def _poll_until(monitor: LivenessMonitor, poll_s: float, deadline_s: float, done: Any) -> LivenessView | None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        t0 = time.monotonic()
        view = monitor.poll()
        if done(view):
            return view
        time.sleep(max(0.0, poll_s - (time.monotonic() - t0)))
    return None


def _named(view: LivenessView, rank: int, klass: IncidentClass) -> str | None:
    for i in view.incidents:
        if i.klass is klass and i.subject.kind is SubjectKind.RANK and i.subject.id == str(rank):
            return i.id
    return None


def _trial(kind: str, index: int, root: Path, args: argparse.Namespace, rng: random.Random) -> Trial:
    run_dir = root / f"{kind}-{index}"
    rank = rng.randrange(4)
    step = rng.randint(10, 40)
    faults = Faults().hang(rank=rank, step=step) if kind == "hang" else Faults()
    cfg = _config(run_dir, args, faults)
    hb = args.heartbeat
    stop = threading.Event()
    out: list[LaunchResult] = []
    launcher = threading.Thread(target=lambda: out.append(launch(cfg, stop=stop, term_grace_s=2.0, timeout_s=300)),
                                daemon=True)
    launcher.start()
    monitor = LivenessMonitor(run_dir)
    klass = IncidentClass.HANG if kind == "hang" else IncidentClass.FAIL_STOP
    fault_ns: int | None = None
    try:
        if kind != "hang":
            ready = _poll_until(monitor, 0.02, args.deadline + 120, lambda v: (r := v.rank(rank)) is not None
                                and r.last_step is not None and r.last_step >= step)
            if ready is None:
                raise SystemExit(f"{kind} trial {index}: rank {rank} never reached step {step}")
            pid = ready.rank(rank).pid  # type: ignore[union-attr]
            assert pid is not None
            fault_ns = time.time_ns()
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        found = _poll_until(monitor, args.poll, args.deadline + (120 if kind == "hang" else 0),
                            lambda v: _named(v, rank, klass) is not None)
        if found is None:
            return Trial(kind=kind, rank=rank, step=step, named=False, delay_s=None, detectable_s=None,
                         since_progress_heartbeats=None, incident="", writes_per_s=0.0)
        incident = next(i for i in found.incidents if i.id == _named(found, rank, klass))
        record = monitor._records[rank]
        progress = record.progress_wall_ns
        writes = record.seq / max(1e-9, (record.wall_ns - record.started_wall_ns) / 1e9)
        return Trial(
            kind=kind, rank=rank, step=step, named=True,
            delay_s=(found.now_ns - fault_ns) / 1e9 if fault_ns is not None else None,
            detectable_s=((incident.detection_wall_ns - fault_ns) / 1e9
                          if fault_ns is not None and incident.detection_wall_ns is not None else None),
            since_progress_heartbeats=(found.now_ns - progress) / 1e9 / hb,
            incident=f"{incident.id} {incident.cause}: {incident.summary[:110]}", writes_per_s=writes,
        )
    finally:
        stop.set()
        launcher.join(60)


def _write_cost(n: int) -> float:
    """CPU us of one rank-record write: a real collector's snapshot, JSON, one pwrite."""
    with tempfile.TemporaryDirectory() as tmp:
        c = Collector(CollectorConfig(run_dir=Path(tmp), heartbeat_interval_s=3600.0, liveness_poll_s=3600.0,
                                      handle_sigterm=False), rank=0, world_size=4, host="host0", sink=MemorySink())
        c.start()
        for i in range(3):
            with c.step(i):
                pass
        live = c._live
        assert live is not None
        for _ in range(100):
            live.write()
        live.write_ns, seq = 0, live.seq
        for _ in range(n):
            live.write()
        cost = live.write_ns / (live.seq - seq) / 1e3
        c.close(exit_code=0)
    return cost


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--stops", type=int, default=2)
    p.add_argument("--hangs", type=int, default=2)
    p.add_argument("--layout", default="dp=2,tp=2")
    p.add_argument("--heartbeat", type=float, default=1.0, help="collector heartbeat interval, s")
    p.add_argument("--poll", type=float, default=0.1, help="monitor poll interval, s")
    p.add_argument("--deadline", type=float, default=30.0, help="s a fault may take to be named")
    p.add_argument("--writes", type=int, default=2000, help="writes timed for the per-write cost")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the trials and the summary here")
    p.add_argument("--keep", type=Path, help="keep the run directories here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    cost = _write_cost(args.writes)
    print(f"rank-record write: {cost:.1f} us CPU each ({args.writes} writes)", flush=True)
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for kind, n in (("kill", args.kills), ("stop", args.stops), ("hang", args.hangs)):
            for i in range(n):
                t = _trial(kind, i, root, args, rng)
                trials.append(t)
                delay = "-" if t.delay_s is None else f"{t.delay_s:.2f} s"
                det = "-" if t.detectable_s is None else f"{t.detectable_s:.2f} s"
                past = "-" if t.since_progress_heartbeats is None else f"{t.since_progress_heartbeats:.2f}"
                print(f"{kind:<4} #{i} rank {t.rank} step {t.step:>2}: named={t.named} delay {delay} "
                      f"(detectable {det}), {past} heartbeats past its last progress, {t.writes_per_s:.1f} writes/s"
                      f" | {t.incident}", flush=True)
    summary: dict[str, Any] = {"write_cpu_us": round(cost, 2), "heartbeat_s": args.heartbeat, "poll_s": args.poll}
    for kind in ("kill", "stop", "hang"):
        mine = [t for t in trials if t.kind == kind]
        if not mine:
            continue
        delays = [t.delay_s for t in mine if t.delay_s is not None]
        hbs = [t.since_progress_heartbeats for t in mine if t.since_progress_heartbeats is not None]
        row: dict[str, Any] = {"trials": len(mine), "named": sum(t.named for t in mine)}
        if delays:
            row.update(delay_median_s=round(statistics.median(delays), 3), delay_p99_s=round(_pct(delays, 0.99), 3))
        if hbs:
            row.update(heartbeats_median=round(statistics.median(hbs), 2), heartbeats_p99=round(_pct(hbs, 0.99), 2))
        summary[kind] = row
        print(f"{kind}: {row}")
    rates = [t.writes_per_s for t in trials if t.named]
    if rates:
        summary["writes_per_s_median"] = round(statistics.median(rates), 1)
        print(f"writes per rank per s (median): {summary['writes_per_s_median']} -> "
              f"{summary['writes_per_s_median'] * cost / 1e4:.3f} % of a core per rank")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "trials": [asdict(t) for t in trials]}, indent=2))
    sys.exit(0 if all(t.named for t in trials) else 1)


if __name__ == "__main__":
    main()
