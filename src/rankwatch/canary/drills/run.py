"""Running a drill: the manager service launches the canary, a monitor watches it and sends signed alerts, the fault
is injected, and the chain is checked end to end against a fault-free reference run."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rankwatch.analytics.incidents import Incident, IncidentClass, SubjectKind
from rankwatch.base.rundir import RunDir, read_recovery_records
from rankwatch.canary.drills.report import REPORT_FILE, DrillReport, seconds_text, write_report
from rankwatch.canary.drills.specs import DRILLS, FAULT_AFTER, DrillSpec, Tamper
from rankwatch.canary.drills.targets import CANARY, DrillTarget
from rankwatch.control.monitor import Monitor
from rankwatch.recovery.decision import Action


REFERENCE_DIR = "reference"


REFERENCE_FILE = "reference.json"


_FP_FIELDS = ("param_hash", "optim_hash", "rng_python_hash", "rng_numpy_hash", "rng_torch_hash", "data_position")




def _final_fingerprints(run_dir: Path, fields: Sequence[str] = _FP_FIELDS) -> dict[str, Any]:
    """{"step": the last fingerprinted step, "ranks": {rank: {field: value}}} (the latest row of each rank)."""
    from rankwatch.analytics.queries import fingerprints
    from rankwatch.analytics.store import connect

    fp = fingerprints(connect(run_dir))
    if fp.height == 0:
        raise ValueError(f"{run_dir}: no fingerprints")
    last = int(fp["step"].max())  # type: ignore[arg-type]
    rows = fp.filter(fp["step"] == last).to_dicts()
    return {"step": last, "ranks": {str(r["rank"]): {k: r.get(k) for k in fields} for r in rows}}


def reference_fingerprints(workdir: Path, *, say: Callable[[str], None], target: DrillTarget = CANARY
                           ) -> dict[str, Any]:
    """The fault-free reference run's final fingerprints: run once per workdir and target (<workdir>/reference for
    the canary, reference-<example> for an example), then read from its cache (reference*.json)."""
    tag = "" if target is CANARY else f"-{target.name.split(':', 1)[-1]}"
    cache = workdir / REFERENCE_FILE.replace(".json", f"{tag}.json")
    if cache.is_file():
        try:
            doc: dict[str, Any] = json.loads(cache.read_text())
            if doc.get("steps") == target.steps and doc.get("target", CANARY.name) == target.name:
                return doc
        except ValueError:
            pass
    run_dir = workdir / f"{REFERENCE_DIR}{tag}"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    say(f"reference: a fault-free run of {target.what} ({target.steps} steps) in {run_dir}")
    t0 = time.monotonic()
    result = target.launcher()(target.job(run_dir, None), stop=threading.Event(), on_start=lambda pids: None,
                               **target.launch_kw)
    if not result.ok:
        raise RuntimeError(f"{run_dir}: the reference run failed (exit codes {list(result.exit_codes)})")
    doc = {"steps": target.steps, "target": target.name, **_final_fingerprints(run_dir, target.compared)}
    cache.write_text(json.dumps(doc, indent=2) + "\n")
    say(f"reference: done in {time.monotonic() - t0:.1f}s, final fingerprints at step {doc['step']}")
    return doc


class _Clock:
    """The fault's instant on both clocks."""

    def __init__(self) -> None:
        self.mono: float | None = None
        self.wall_ns: int | None = None

    def mark(self, wall_ns: int | None = None) -> None:
        now_wall, now_mono = time.time_ns(), time.monotonic()
        self.wall_ns = now_wall if wall_ns is None else wall_ns
        self.mono = now_mono - (now_wall - self.wall_ns) / 1e9

    def since_wall(self, wall_ns: int | None) -> float | None:
        return None if wall_ns is None or self.wall_ns is None else (wall_ns - self.wall_ns) / 1e9


def _wait(pred: Callable[[], bool], timeout_s: float, what: str,
          failed: Sequence[BaseException] = ()) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if failed:
            raise RuntimeError(f"the monitor failed while waiting for {what}: {failed[0]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.02)


def _steps(run_dir: Path) -> list[tuple[int, int, int, int]]:
    """(attempt, min step, max step, first end wall ns) per attempt."""
    from rankwatch.analytics.store import connect

    return [tuple(int(x) for x in r) for r in connect(run_dir).execute(  # type: ignore[misc]
        "SELECT attempt, min(step), max(step), min(end_wall_ns) FROM steps GROUP BY attempt ORDER BY attempt"
    ).fetchall()]


def _kill_once_quarantined(rank: int, manager: Any, monitor: Monitor, clock: _Clock, run_dir: Path,
                           failed: Sequence[BaseException], *, say: Callable[[str], None], name: str) -> None:
    """Wait until the quarantine decision is done and the list names something, SIGKILL `rank`, and wait for the
    monitor to see it; the clock restarts at the kill (stopped and training-again times count from it)."""
    from rankwatch.control.manager import quarantined

    _wait(lambda: bool(quarantined(run_dir)) and (manager.status()["last_decision"] or {}).get("state") == "done",
          60, "the quarantine applied", failed)
    listed = ", ".join(f"{e.kind}:{e.id}" for e in quarantined(run_dir))
    pid = int(manager.status()["job"]["pids"][rank])
    os.kill(pid, signal.SIGKILL)
    clock.mark()
    say(f"drill {name}: quarantined {listed}; sent SIGKILL to rank {rank} (pid {pid})")
    _wait(lambda: any(s.incident.klass is IncidentClass.FAIL_STOP and str(s.incident.subject) == f"rank:{rank}"
                      and s.at >= clock.mono - 0.5 for s in list(monitor.seen)),  # type: ignore[operator]
          60, f"fail_stop rank:{rank} detected", failed)


def _off_quarantine(run_dir: Path, attempt: int) -> str | None:
    """None when no rank of `attempt` sat on a quarantined device, else which did."""
    import polars as pl

    from rankwatch.analytics.queries import attempt_topology
    from rankwatch.analytics.store import connect
    from rankwatch.control.manager import placed_topology, quarantined

    bad = {e.id for e in quarantined(run_dir) if e.kind == "device"}
    topo = placed_topology(run_dir, attempt_topology(connect(run_dir)))
    rows = topo.filter(pl.col("attempt") == attempt).sort("rank").select("rank", "device_uuid").iter_rows()
    on = [f"rank {r} on {u}" for r, u in rows if u in bad]
    return "; ".join(on) if on else None


def _save_failed(run_dir: Path) -> bool:
    """A save of attempt 0 committed nothing (its `checkpoint_failed` events)."""
    from rankwatch.analytics.store import connect

    return bool(connect(run_dir).execute(
        "SELECT count(*) FROM events WHERE kind = 'checkpoint_failed' AND attempt = 0").fetchall()[0][0])


def _lineage_why(run_dir: Path) -> str:
    from rankwatch.recovery.promises import evaluate

    try:
        v = evaluate(run_dir)
    except ValueError as exc:
        return f"lineage unreadable: {exc}"
    return f"lineage: {v.comparability}" + (f" ({', '.join(map(str, v.reasons))})" if v.reasons else "")


def _decision_messages(monitor: Monitor) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for body in monitor.sent_bodies():
        doc = json.loads(body)
        if doc.get("type") == "decision" and doc.get("rankwatch", {}).get("decision"):
            out.append(doc["rankwatch"])
    return out


def run_drill(name: str, workdir: Path, *, say: Callable[[str], None] = print,
              reference: Mapping[str, Any] | None = None, folder: str | None = None,
              target: DrillTarget = CANARY) -> DrillReport:
    """Run one drill (see the module docstring) on `target` in <workdir>/<folder or name> (replaced), against the
    cached reference run. ValueError for an unknown drill name, or one the target cannot take."""
    from rankwatch.control.service import ManagerService
    from rankwatch.control.signer import write_secret

    spec = DRILLS.get(name)
    if spec is None or name not in target.drills:
        raise ValueError(f"unknown drill {name!r} for {target.name} (drills: {', '.join(target.drills)})")
    if name in target.unpinned:
        spec = dataclasses.replace(spec, resume_from=None)
    if name in target.classes:
        spec = dataclasses.replace(spec, classes=target.classes[name])
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ref = reference if reference is not None else reference_fingerprints(workdir, say=say, target=target)
    base = workdir / (folder or name)
    if base.exists():
        import shutil

        shutil.rmtree(base)
    base.mkdir()
    run_dir = base / "run"
    secret_file = base / "webhook.secret"
    secret = write_secret(secret_file)
    cfg = target.job(run_dir, spec)
    clock = _Clock()
    stop = threading.Event()
    lines: list[str] = []

    def note(msg: str) -> None:
        lines.append(msg)

    partial: dict[str, Any] = {"name": name, "fault": target.fault_of(name), "run_dir": str(run_dir),
                               "job": target.name}
    say(f"drill {name}: {target.fault_of(name)}; {target.what}, {target.steps} steps in {run_dir}")
    with _environ(spec.env), ManagerService(run_dir, secret=secret, job=cfg, launcher=target.launcher(),
                                            load_job=target.load_job, launch_kw=target.launch_kw) as svc:
        watcher: threading.Thread | None = None
        try:
            # the monitor starts on a run that has begun recording (before, its part-file side has nothing to read)
            _wait(lambda: svc.manager.status()["job"]["state"] == "running" and RunDir(run_dir).telemetry.is_dir(),
                  90, "the job running")
            monitor = Monitor(run_dir, window=20, every=1.0, poll=0.1, webhook=f"{svc.url}/alerts",
                              secret_file=secret_file, load_job=target.load_job, say=note, warn=note)
            failed: list[BaseException] = []

            def watch() -> None:
                try:
                    monitor.run(stop=stop)
                except BaseException as exc:  # noqa: BLE001 - reported as the drill's failure
                    failed.append(exc)
                    note(f"monitor failed: {type(exc).__name__}: {exc}")

            watcher = threading.Thread(target=watch, name="rankwatch-drill-monitor", daemon=True)
            watcher.start()
            report = _drive(spec, target, svc, monitor, clock, run_dir, ref, partial, say, failed)
        except (TimeoutError, RuntimeError, ValueError) as exc:
            report = DrillReport(**partial, passed=False, reason=f"{type(exc).__name__}: {exc}")
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(30.0)
    (base / "monitor.log").write_text("\n".join(lines) + "\n")
    say(f"drill {name}: {report.verdict}: {report.reason}")
    return report


@contextmanager
def _environ(pairs: Sequence[tuple[str, str]]) -> Iterator[None]:
    """os.environ with `pairs` set (the ranks are spawned: they inherit it), restored after."""
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tamper(run_dir: Path, how: Tamper, rank: int) -> str:
    """Spoil the newest committed checkpoint on disk; one line saying what was done. RuntimeError when there is
    none to spoil."""
    from rankwatch.base.rundir import CHECKPOINT_DIR
    from rankwatch.recovery.catalog import MANIFEST

    found = sorted(p for p in (run_dir / CHECKPOINT_DIR).glob("step-*") if (p / MANIFEST).is_file())
    if not found:
        raise RuntimeError(f"{run_dir / CHECKPOINT_DIR}: no committed checkpoint to tamper with")
    ckpt = found[-1]
    if how is Tamper.MANIFEST:
        path = ckpt / MANIFEST
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return f"cut {path} from {len(data)} to {len(data) // 2} bytes"
    shards = sorted(ckpt.glob(f"rank-{rank:05d}*"))
    if not shards:
        raise RuntimeError(f"{ckpt}: no per-rank state file of rank {rank}")
    path = shards[0]
    with path.open("r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"flipped the byte at offset {path.stat().st_size // 2} of {path}"


def _tcp_connections(pid: int) -> list[tuple[str, str]]:
    """(local "addr:port", remote "addr:port") of every established IPv4 TCP connection of process `pid` (its
    socket inodes in /proc/<pid>/fd matched against /proc/net/tcp)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def addr(hexed: str) -> str:
        ip, port = hexed.split(":")
        return ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)) + f":{int(port, 16)}"

    out = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) > 9 and f[9] in inodes and f[3] == "01":  # 01: ESTABLISHED
            out.append((addr(f[1]), addr(f[2])))
    return out


def _cut_connections(pid: int) -> str:
    """Destroy every established TCP connection of `pid` (iproute2's `ss -K`, the kernel's sock_destroy): the
    process sees its sockets aborted, its peers a reset. "<n> connection(s)"; RuntimeError when there is none or
    `ss` cannot (no iproute2, a kernel without INET_DIAG_DESTROY, no CAP_NET_ADMIN)."""
    import shutil
    import subprocess

    ss = shutil.which("ss")
    if ss is None:
        raise RuntimeError("the partition drill needs `ss` (iproute2: apt-get install -y iproute2)")
    conns = _tcp_connections(pid)
    if not conns:
        raise RuntimeError(f"pid {pid}: no established TCP connection to cut")
    for local, remote in conns:
        subprocess.run([ss, "-K", "src", local, "dst", remote], capture_output=True, text=True, timeout=10, check=False)
    left = set(_tcp_connections(pid)) & set(conns)
    if left:
        raise RuntimeError(f"pid {pid}: `ss -K` did not destroy {len(left)} of its {len(conns)} connection(s) (a "
                           f"kernel without CONFIG_INET_DIAG_DESTROY, or no CAP_NET_ADMIN)")
    return f"{len(conns)} TCP connection(s)"


def _exit_wall_ns(run_dir: Path, rank: int) -> int | None:
    """The wall clock of the launcher's exit record of `rank` (live/exit-<r>.json), None before it exists."""
    from rankwatch.analytics.liveness import parse_exit_record
    from rankwatch.collector.liveness import exit_record_path

    try:
        return parse_exit_record(json.loads(exit_record_path(run_dir, rank).read_text())).wall_ns
    except (OSError, ValueError):
        return None


def _step_end_wall_ns(monitor: Monitor, rank: int) -> int | None:
    """When the monitor first saw `rank`'s last progress (its latest completed step), on the wall clock."""
    view = monitor.view
    r = None if view is None else view.rank(rank)
    return None if view is None or r is None or r.idle_ns is None else view.now_ns - r.idle_ns


def _victim_step(monitor: Monitor, rank: int) -> int | None:
    view = monitor.view
    r = None if view is None else view.rank(rank)
    return None if r is None else r.last_step


def _drive(spec: DrillSpec, target: DrillTarget, svc: Any, monitor: Monitor, clock: _Clock, run_dir: Path, ref: Mapping[str, Any],
           partial: dict[str, Any], say: Callable[[str], None], failed: list[BaseException]) -> DrillReport:
    manager = svc.manager
    first = spec.after if spec.signal is not None or spec.cut else FAULT_AFTER - 2
    _wait(lambda: (_victim_step(monitor, spec.rank) or -1) >= first, 120, f"rank {spec.rank} at step {first}", failed)
    if spec.signal is not None:
        if spec.tamper is not None:
            say(f"drill {spec.name}: {_tamper(run_dir, spec.tamper, spec.rank)}")
        pid = int(manager.status()["job"]["pids"][spec.rank])
        os.kill(pid, spec.signal)
        clock.mark()
        say(f"drill {spec.name}: sent {signal.Signals(spec.signal).name} to rank {spec.rank} (pid {pid}) after step "
            f"{_victim_step(monitor, spec.rank)}")
    elif spec.cut:
        pid = int(manager.status()["job"]["pids"][spec.rank])
        cut = _cut_connections(pid)
        clock.mark()
        say(f"drill {spec.name}: reset {cut} of rank {spec.rank} (pid {pid}) after step "
            f"{_victim_step(monitor, spec.rank)}")
    elif spec.classes[0] is IncidentClass.HANG:  # in-job hang: its instant is the last step the rank completed
        _wait(lambda: (_victim_step(monitor, spec.rank) or -1) >= FAULT_AFTER, 60, f"rank {spec.rank} stuck", failed)
        clock.mark(_step_end_wall_ns(monitor, spec.rank))
        say(f"drill {spec.name}: rank {spec.rank} stuck after step {FAULT_AFTER}")
    elif spec.classes[0] is IncidentClass.FAIL_STOP:  # in-job exit or error: its instant is the launcher's exit record
        _wait(lambda: _exit_wall_ns(run_dir, spec.rank) is not None, 60, f"rank {spec.rank}'s exit record", failed)
        clock.mark(_exit_wall_ns(run_dir, spec.rank))
        say(f"drill {spec.name}: rank {spec.rank} exited")
    else:  # a slow, throttle, flip or skew fault: its instant is when the monitor saw the rank complete its step
        at = FAULT_AFTER if spec.fault_step is None else spec.fault_step
        _wait(lambda: (_victim_step(monitor, spec.rank) or -1) >= at, 60, f"rank {spec.rank} past step {at}", failed)
        clock.mark()
        say(f"drill {spec.name}: rank {spec.rank} completed step {at} with the fault")
    assert clock.mono is not None
    subject = f"rank:{spec.rank}"

    def named(inc: Incident) -> bool:
        if spec.device:
            return inc.subject.kind is SubjectKind.DEVICE and spec.rank in inc.ranks
        return str(inc.subject) == subject

    def detection() -> Any:
        return next((s for s in list(monitor.seen) if s.incident.klass in spec.classes and named(s.incident)
                     and s.at >= clock.mono - 0.5), None)  # type: ignore[operator]

    wanted = f"rank {spec.rank}'s device" if spec.device else subject
    _wait(lambda: detection() is not None, 60, f"{'/'.join(spec.classes)} {wanted} detected", failed)
    seen = detection()
    subject = str(seen.incident.subject)
    partial.update(detected=f"{seen.incident.klass} {subject}", detect_s=round(seen.at - clock.mono, 3))
    say(f"drill {spec.name}: detected {seen.incident.klass} {subject} after {partial['detect_s']:.2f}s "
        f"({seen.source})")

    def decided() -> dict[str, Any] | None:
        for d in manager.db.decisions():
            if d["incident"] == seen.incident.id or (spec.relaunch and d["action"] != "observe"):
                return dict(d)
        return None

    _wait(lambda: decided() is not None, 60, "a decision accepted by the service", failed)
    dec = decided()
    assert dec is not None
    scope = next((m.get("scope") for m in _decision_messages(monitor) if m.get("decision_id") == dec["decision_id"]),
                 None)
    partial.update(decision=f"{dec['action']} ({scope or '-'})", decision_s=clock.since_wall(dec["received_ns"]))
    say(f"drill {spec.name}: decision {partial['decision']} accepted after {seconds_text(partial['decision_s'])}s")
    if spec.then_kill is not None:
        _kill_once_quarantined(spec.then_kill, manager, monitor, clock, run_dir, failed, say=say, name=spec.name)

    ended: list[int] = []

    def over() -> bool:
        st = manager.status()
        if not ended and st["attempts"] and st["attempts"][0]["exit_codes"] is not None:
            ended.append(time.time_ns())  # the fault's attempt is over (every rank gone): the job stopped
        # a fault that recurs fails attempts on the way: only the job's end counts
        # and a relaunching drill ends relaunched: the decision about a kill may not have reached the service yet when
        # the one before it (bad_device's quarantine) is done and the killed attempt already over
        decision = (st["last_decision"] or {}).get("state")
        return st["job"]["state"] in (("finished",) if spec.recurs else ("finished", "failed")) and (
            not spec.relaunch or decision == "failed" or decision == "done" and len(st["attempts"]) >= 2 + spec.recurs)

    _wait(over, 240 + 150 * spec.recurs, "the job finished", failed)
    if spec.relaunch and ended:
        partial["stopped_s"] = clock.since_wall(ended[0])
    time.sleep(0.5)
    status = manager.status()
    attempts = status["attempts"]
    partial["attempts"] = len(attempts)
    steps = _steps(run_dir)
    recs = read_recovery_records(run_dir)
    rec: dict[str, Any] | None = dict(recs[0].doc) if recs else None
    ours: list[dict[str, Any]] = []
    if spec.relaunch:
        if rec is not None:
            partial["recovery"] = f"{rec['id']}: {rec['outcome']}"
            ours = [d for d in rec["decisions"] if d["class"] in spec.classes and d["subject"] == subject]
            gate = next((p for d in ours for p in d["path"] if str(p).startswith("gate")), None)
            partial["gate"] = gate
        if len(attempts) >= 2:
            partial["resume_from"] = attempts[-1]["resume_from"]
        if len(steps) >= 2:
            partial["training_again_s"] = clock.since_wall(steps[-1][3])
            partial["steps_lost"] = max(0, steps[0][2] + 1 - steps[-1][1])
    else:
        partial["steps_lost"] = 0
    if partial.get("training_again_s") is not None:
        say(f"drill {spec.name}: stopped after {seconds_text(partial.get('stopped_s'))}s, training again after "
            f"{partial['training_again_s']:.2f}s ({partial['steps_lost']} step(s) lost)")

    def fail(why: str) -> DrillReport:
        return DrillReport(**partial, passed=False, reason=why)

    if status["job"]["state"] != "finished":
        return fail(f"the job ended {status['job']['state']}")
    if spec.relaunch:
        if not dec["action"] or dec["action"] == "observe":
            return fail(f"the decision was {dec['action']}, not a relaunch")
        expected = 2 if spec.then_kill is not None else 1 + spec.recurs  # (the quarantine's record, then the relaunch's)
        if len(recs) > expected:
            return fail(f"{len(recs)} recoveries for {expected} fault(s): " + "; ".join(
                f"{r['id']} ({', '.join(d['class'] + ' ' + d['subject'] for d in r['decisions'])}: {r['outcome']})"
                for r in (dict(p.doc) for p in recs)))
        if spec.then_kill is not None:
            if rec is None or rec["outcome"] != "quarantined" or not rec["quarantined"]:
                return fail("the device fault's recovery record did not quarantine it")
            rec = dict(recs[-1].doc) if len(recs) == 2 else None
            if rec is not None:
                partial["recovery"] = f"{rec['id']}: {rec['outcome']}"
            ours = [d for d in (rec or {}).get("decisions", []) if d["class"] == IncidentClass.FAIL_STOP]
        if spec.recurs:
            if len(recs) != expected:
                return fail(f"{len(recs)} recoveries: the fault was to come back {spec.recurs} time(s) before it "
                            "was localized")
            docs = [dict(p.doc) for p in recs]
            if not docs[1].get("reshuffle"):
                return fail(f"{docs[1]['id']} did not move the ranks off the device the fault recurred on")
            rec = docs[-1]
            partial["recovery"] = f"{rec['id']}: {rec['outcome']}"
            if not rec["quarantined"]:
                return fail(f"{rec['id']}: the fault recurred under other rank numbers and nothing was quarantined")
            ours = [d for d in rec["decisions"] if d["class"] in spec.classes]
            gate = next((p for d in ours for p in d["path"] if str(p).startswith("gate")), None)
            partial["gate"] = gate
        if rec is None or rec["outcome"] != "recovered":
            return fail("no recovery record" if rec is None else f"{rec['id']}: outcome {rec['outcome']}")
        if not ours:
            return fail(f"{rec['id']} does not name {'/'.join(spec.classes)} {subject}")
        if spec.actions and dec["action"] not in spec.actions:
            return fail(f"the decision was {dec['action']}, not {' or '.join(spec.actions)}")
        if len(attempts) < 2 or attempts[-1]["resume_from"] is None:
            return fail("the new attempt did not resume from a checkpoint")
        if (spec.then_kill is not None or spec.recurs) and (on := _off_quarantine(run_dir, len(attempts) - 1)) is not None:
            return fail(f"the relaunch was placed on the quarantine list: {on}")
        if spec.resume_from is not None and attempts[-1]["resume_from"] != spec.resume_from:
            return fail(f"the new attempt resumed from {attempts[-1]['resume_from']}, not {spec.resume_from} (the "
                        f"newest checkpoint a sound recovery may use)")
    else:
        allowed = spec.actions or (Action.OBSERVE,)
        if dec["action"] not in allowed:
            return fail(f"the decision was {dec['action']}, not {' or '.join(allowed)}")
        if dec["action"] == Action.QUARANTINE and (rec is None or not rec["quarantined"]):
            return fail("a quarantine decision, but no recovery record quarantined anything")
        if len(attempts) != 1:
            return fail(f"{len(attempts)} attempts: the job was restarted")
    if spec.env and not _save_failed(run_dir):
        return fail("the save fault never fired: no checkpoint_failed event in attempt 0")
    final = _final_fingerprints(run_dir, target.compared)
    same = final["step"] == ref["step"] and final["ranks"] == ref["ranks"]
    partial["bitwise"] = same
    if not same:
        differ = sorted({k for r, fp in final["ranks"].items() for k, v in fp.items()
                         if ref["ranks"].get(r, {}).get(k) != v})
        return fail(f"final fingerprints (step {final['step']}) differ from the reference's (step {ref['step']}: "
                    f"{', '.join(differ) or 'ranks'}); {_lineage_why(run_dir)}")
    why = f"final fingerprints at step {final['step']} bitwise equal to the reference run"
    if spec.resume_from is not None and rec is not None:
        why += f"; resumed from {spec.resume_from}, retired: {', '.join(rec['retired']) or 'none'}"
    return DrillReport(**partial, passed=True, reason=why)


def run_drills(names: Iterable[str], workdir: Path, *, say: Callable[[str], None] = print,
               target: DrillTarget = CANARY) -> tuple[DrillReport, ...]:
    """Each drill in turn on `target` against one reference run; the report written to <workdir>/report.json after
    each."""
    names = list(names)
    for n in names:
        if n not in target.drills:
            raise ValueError(f"unknown drill {n!r} for {target.name} (drills: {', '.join(target.drills)})")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    ref = reference_fingerprints(workdir, say=say, target=target)
    out: list[DrillReport] = []
    for i, n in enumerate(names):
        again = names[:i].count(n)  # a repeated drill keeps each run: <name>, <name>-2, ...
        out.append(run_drill(n, workdir, say=say, reference=ref, folder=f"{n}-{again + 1}" if again else None,
                             target=target))
        write_report(workdir / REPORT_FILE, out)
    return tuple(out)
