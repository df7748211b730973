"""The `rankwatch` command: train (the canary job), demo, telemetry (what a run holds), analyze (incidents),
recover (the narrowest safe recovery), and the tools around them."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankwatch.canary.faults import FAULT_HELP
from rankwatch.recovery.decision import MembershipSupport

if TYPE_CHECKING:
    from rankwatch.analytics.analyze import Analysis
    from rankwatch.canary.config import CanaryConfig

DEMO_RUN_DIR = Path("runs/demo")
RUN_DIR_HELP = "a run directory (what `train --run-dir` or `rankwatch torchrun --run-dir` writes)"


def _job_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    """The canary job's flags (`train`, and `manager serve` when it launches the job itself)."""
    p.add_argument("--nproc", type=int, required=required, help="number of ranks")
    p.add_argument("--steps", type=int, required=required, help="training steps")
    p.add_argument("--run-dir", type=Path, required=True, help="where telemetry and checkpoints go")
    p.add_argument("--layout", default="", help="dp=N,tp=N,pp=N (product = --nproc; dp defaults to the rest)")
    p.add_argument("--hosts", type=int, default=1, help="virtual hosts the ranks are spread over")
    p.add_argument("--seed", type=int, default=0, help="seed of the model, data and faults")
    p.add_argument("--fault", action="append", default=[], metavar="SPEC", help=f"inject a fault: {FAULT_HELP}")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save a checkpoint every N steps")
    p.add_argument("--gpu", default="auto", help="GPU sampler: auto | nvml | replay | off")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process-group timeout, seconds")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (part of the numerics)")
    p.add_argument("--fingerprint-every", type=int, default=50, help="fingerprint the training state every N steps")
    p.add_argument("--global-batch", type=int, default=32, help="samples per step across all data-parallel replicas")
    p.add_argument("--no-collector", action="store_true", help="train without telemetry (overhead baseline)")
    p.add_argument("--timeout", type=float, default=None, help="terminate the job after this many seconds")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest usable checkpoint in --run-dir (train on to --steps)")
    p.add_argument("--device-shift", type=int, default=0, metavar="K",
                   help="place local rank l on device slot (l+K) mod ranks-per-host (a restart on other GPUs)")
    p.add_argument("--no-pin-buckets", action="store_true",
                   help="let DDP rebuild its gradient buckets after each process's first backward (a resume with "
                        "dp >= 4 is then not bitwise; replay verification says so)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True) on every rank")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run the canary job on N real ranks with the collector embedded")
    _job_args(p, required=True)
    p.add_argument("--rollup-every", type=float, default=None, metavar="SECONDS",
                   help="run a rollup agent for every virtual host while the job runs: merge each host's new rank "
                        "part files into one host part per table every SECONDS (a monitor of many ranks reads fewer "
                        "files); see `rankwatch rollup`")
    p.add_argument("--supervise", type=int, default=0, metavar="N",
                   help="recover the job up to N times: after each attempt, analyze, decide the narrowest safe "
                        "recovery, preserve evidence and relaunch behind the consistency gate")


def _canary_config(args: argparse.Namespace) -> CanaryConfig:
    from rankwatch.base.topology import Layout
    from rankwatch.canary.config import CanaryConfig
    from rankwatch.canary.faults import Faults

    return CanaryConfig(
        run_dir=args.run_dir,
        steps=args.steps,
        layout=Layout.parse(args.layout, nproc=args.nproc),
        hosts=args.hosts,
        seed=args.seed,
        faults=Faults.parse(args.fault),
        checkpoint_every=args.checkpoint_every,
        gpu=args.gpu,
        pg_timeout_s=args.pg_timeout,
        threads=args.threads,
        fingerprint_every=args.fingerprint_every,
        global_batch=args.global_batch,
        collector=not args.no_collector,
        resume=args.resume,
        device_shift=args.device_shift,
        pin_ddp_buckets=not args.no_pin_buckets,
        deterministic_algorithms=args.deterministic,
    )


def _train(args: argparse.Namespace) -> int:
    from rankwatch.canary.launcher import launch

    if args.rollup_every is not None and args.rollup_every <= 0:
        raise ValueError(f"--rollup-every must be > 0 seconds, got {args.rollup_every}")
    if args.supervise and args.rollup_every is not None:
        raise ValueError("--rollup-every and --supervise: run `rankwatch rollup RUN_DIR --all` beside a supervised job")
    cfg = _canary_config(args)
    print(f"rankwatch train: {cfg.world_size} ranks ({cfg.layout}) on {cfg.hosts} host(s), {cfg.steps} steps -> {cfg.run_dir}")
    for spec in cfg.faults.specs():
        print(f"  fault {spec}")
    if args.supervise:
        from rankwatch.control.manager import supervise

        out = supervise(cfg, launcher=launch, max_recoveries=args.supervise,
                        say=lambda m: print(f"rankwatch recover: {m}", flush=True), timeout_s=args.timeout)
        print(f"rankwatch train: {len(out.records)} recovery(ies); {out.stopped}")
        result = out.final
    else:
        result = launch(cfg, timeout_s=args.timeout, rollup_interval_s=args.rollup_every)
    codes = ", ".join(f"{r}:{c}" for r, c in enumerate(result.exit_codes))
    print(f"rankwatch train: finished in {result.duration_s:.1f}s; exit codes {codes}")
    if result.terminated:
        print(f"rankwatch train: terminated ranks {list(result.terminated)} after a failure")
    for check in result.replay:
        verdict = "held" if check.held else "BROKEN — lineage verdict CHANGED (nondeterministic replay)"
        print(f"rankwatch train: replay verification {verdict}: {check.describe()}")
    if cfg.resume and not result.replay and not result.warnings:
        print("rankwatch train: replay verification: no replayed step was fingerprinted by an earlier attempt "
              "(not checkable)")
    for w in result.warnings:
        print(f"rankwatch train: warning: {w}", file=sys.stderr)
    _say_failed_saves(cfg.run_dir)
    return 0 if result.ok else 1


def _say_failed_saves(run_dir: Path) -> None:
    """The job trained on through failed checkpoint saves: its last lines say so (analytics/saves.py)."""
    import duckdb

    from rankwatch.analytics.errors import AnalyticsError
    from rankwatch.analytics.saves import failed_saves

    try:
        incident = failed_saves(run_dir)
    except (AnalyticsError, OSError, duckdb.Error) as exc:
        print(f"rankwatch train: warning: checkpoint saves not checked: {exc}", file=sys.stderr)
        return
    if incident is not None:
        print(f"rankwatch train: WARNING: {incident.summary}")


def _lineage(args: argparse.Namespace) -> int:
    import json

    from rankwatch.recovery.promises import evaluate

    v = evaluate(args.run_dir)
    if args.json:
        doc = {
            "comparability": str(v.comparability), "reasons": [str(r) for r in v.reasons],
            "entries": [e.body() | {"hash": e.hash} for e in v.entries],
            "promises": [{"seq": p.seq, "kind": str(p.kind), "attempt": p.attempt, "status": str(p.status),
                          "since_step": p.since_step, "fields": list(p.fields), "why": p.why} for p in v.promises],
            "warnings": list(v.warnings),
        }
        print(json.dumps(doc, indent=2))
        return 0
    if not v.entries:
        print(f"rankwatch lineage: {args.run_dir}: no lineage entries — the run was never resumed, replayed or "
              "changed; nothing was promised")
        return 0
    reasons = f" ({', '.join(map(str, v.reasons))})" if v.reasons else ""
    print(f"rankwatch lineage: {args.run_dir}: {len(v.entries)} entries, chain verified; run {v.comparability}{reasons}")
    print(f"{'seq':>4}  {'kind':<20} {'attempt':>7}  {'steps':<11} {'verdict':<27} text")
    for e in v.entries:
        d = e.details
        steps = f"{d.from_step}..{d.to_step}" if d.from_step is not None or d.to_step is not None else ""
        attempt = "" if d.attempt is None else str(d.attempt)
        verdict = str(e.verdict.comparability) + (f" ({','.join(map(str, e.verdict.reasons))})" if e.verdict.reasons else "")
        print(f"{e.seq:>4}  {str(e.kind):<20} {attempt:>7}  {steps:<11} {verdict:<27} {d.text}")
    print("promises:")
    for p in v.promises:
        since = f" since step {p.since_step} ({', '.join(p.fields)})" if p.since_step is not None else ""
        print(f"  seq {p.seq} {p.kind}: {p.status}{since}: {p.why}")
    for w in v.warnings:
        print(f"rankwatch lineage: warning: {w}", file=sys.stderr)
    return 0


def _print_summary(run_dir: Path) -> None:
    from rankwatch.analytics.store import table_summaries

    warnings: list[str] = []
    summaries = table_summaries(run_dir, warnings=warnings)
    for w in warnings:
        print(f"rankwatch telemetry: warning: {w}", file=sys.stderr)
    print(f"telemetry: {run_dir.resolve() / 'telemetry'}")
    print(f"  {'table':<18} {'rows':>9} {'ranks':>6} {'files':>6} {'KiB':>8}")
    for s in summaries:
        print(f"  {s.table:<18} {s.rows:>9} {s.ranks:>6} {s.files:>6} {s.bytes / 1024:>8.1f}")


def _demo(args: argparse.Namespace) -> int:
    from rankwatch.base.topology import Layout
    from rankwatch.canary.config import CanaryConfig
    from rankwatch.canary.faults import Faults
    from rankwatch.canary.launcher import launch

    run_dir: Path = args.run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    faults = Faults().slow(rank=5, from_step=100, delay_s=0.03).throttle(rank=2, from_step=150, delay_s=0.02)
    cfg = CanaryConfig(
        run_dir=run_dir,
        steps=args.steps,
        layout=Layout(dp=2, tp=2, pp=2),
        hosts=2,
        seed=0,
        faults=faults,
        checkpoint_every=100,
        gpu="replay",
    )
    print(f"rankwatch demo: 8 ranks (dp=2,tp=2,pp=2) on 2 virtual hosts, {cfg.steps} steps, gloo on CPU")
    print("  injected: " + "; ".join(faults.specs()))
    result = launch(cfg, timeout_s=600)
    print(f"  finished in {result.duration_s:.1f}s, exit codes {list(result.exit_codes)}")
    _print_summary(run_dir)
    print()
    _analyze_run(run_dir, progress=False)
    _print_recovery(cfg)
    notebook = _demo_postmortem(run_dir)
    if not args.drill:
        _print_dashboard([run_dir], notebook)
        return 0 if result.ok and notebook is not None else 1
    print()
    print("the live loop: the recovery manager as a service launches a 4-rank canary, a monitor sends it signed alerts, "
          "rank 1 is SIGKILLed from outside; detected, decided, restarted from a checkpoint, checked bitwise against "
          "a fault-free run (`rankwatch drill --all` runs every drill)")
    drilled = _run_drills(["sigkill"], Path(args.drill_dir), who="rankwatch demo drill")
    runs = [run_dir]
    drill_run = Path(args.drill_dir) / "sigkill" / "run"
    if drill_run.is_dir():
        from rankwatch.analytics.analyze import ensure_views

        try:
            ensure_views(drill_run)  # the dashboard opens it at once
            runs.append(drill_run)
        except ValueError as exc:
            print(f"rankwatch demo: the drill's run has no views: {exc}", file=sys.stderr)
    _print_dashboard(runs, notebook)
    return 0 if result.ok and drilled == 0 and notebook is not None else 1


def _demo_postmortem(run_dir: Path) -> Path | None:
    """Execute the post-mortem notebook on the demo run (an .ipynb and its HTML beside the run's analysis)."""
    from rankwatch.notebooks.runner import run_postmortem

    out = run_dir / "postmortem.ipynb"
    print()
    print("post-mortem: executing notebooks/postmortem.py on the run ...", flush=True)
    try:
        run_postmortem(run_dir, out=out, html=out.with_suffix(".html"))
    except ValueError as exc:
        print(f"rankwatch demo: post-mortem failed: {exc}", file=sys.stderr)
        return None
    return out


def _print_dashboard(runs: list[Path], notebook: Path | None) -> None:
    print()
    if notebook is not None:
        print(f"the post-mortem notebook, executed: {notebook} (and {notebook.with_suffix('.html')})")
    print("the incident dashboard on the demo run" + (" and the drill's run" if len(runs) > 1 else "") + ":")
    exe = Path(sys.executable).parent / "rankwatch"  # the venv's command, where the venv is not activated
    cmd = os.path.relpath(exe) if exe.exists() else "rankwatch"
    print(f"  {cmd} dashboard {' '.join(str(r) for r in runs)}    # then open http://127.0.0.1:8501/")


def _print_recovery(cfg: CanaryConfig) -> None:
    """What the recovery manager decides for the incidents just written (a dry run: nothing touched)."""
    from rankwatch.analytics.incidents import read_incidents
    from rankwatch.base.rundir import INCIDENTS_JSON, RunDir
    from rankwatch.control.manager import catalog_view, plan_recovery, write_plan

    incidents = read_incidents(RunDir(Path(cfg.run_dir)).analysis / INCIDENTS_JSON)
    plan = plan_recovery(incidents, job=cfg.declaration(), catalog=catalog_view(Path(cfg.run_dir), cfg.layout))
    write_plan(Path(cfg.run_dir), plan)
    print()
    print(f"recovery (dry run; `rankwatch recover {cfg.run_dir} --apply` carries it out):")
    for d in plan.decided:
        print(f"  {d.incident.klass} {d.incident.subject}: {d.decision.action} — {d.decision.reasons[0]}")
    print(f"  {plan.lines()[-1]}")


def _analyze_run(run_dir: Path, *, as_json: bool = False, window: int | None = None, anomaly: bool = True,
                 progress: bool = True, clock: str = "auto") -> int:
    from rankwatch.analytics.analyze import AnalysisConfig, analyze, render_incidents, write_analysis
    from rankwatch.analytics.frames import Clock
    from rankwatch.base.rundir import ANALYSIS_DIR
    import json

    from rankwatch.analytics.incidents import to_json

    def say(msg: str) -> None:
        if progress:
            print(f"  .. {msg}", file=sys.stderr, flush=True)

    analysis = analyze(run_dir, config=AnalysisConfig(window_steps=window, anomaly=anomaly, views=True), progress=say,
                       clock=Clock(clock))
    for w in analysis.warnings:
        print(f"rankwatch analyze: warning: {w}", file=sys.stderr)
    try:
        saved: tuple[Path, Path] | None = write_analysis(analysis)
    except OSError as exc:  # a full disk: the answer is still printed, only not saved
        saved = None
        print(f"rankwatch analyze: warning: could not save the analysis under {run_dir / ANALYSIS_DIR} "
              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", file=sys.stderr)
    if as_json:  # the warnings ride along: a consumer of the JSON alone must not take them for a healthy run
        doc = json.loads(to_json(analysis.incidents))
        doc["warnings"] = list(analysis.warnings)
        print(json.dumps(doc, indent=2))
        return 0
    took = sum(s for _, s in analysis.seconds)
    print(f"rankwatch analyze: {run_dir}: {analysis.ranks} ranks, {_steps_text(analysis)}, "
          f"{len(analysis.incidents)} incident(s) in {took:.1f}s")
    print(render_incidents(analysis.incidents, width=terminal_width()))
    _say_recorded(run_dir, {i.id for i in analysis.incidents})
    if saved is not None:
        print(f"written: {saved[0]} and {saved[1].name}")
    return 0


def _say_recorded(run_dir: Path, seen: set[str]) -> None:
    """Incidents only the recovery records carry (a fail-stop the live loop recovered: the final telemetry shows a
    completed attempt), with what became of each: an analysis that says "no incidents" must not hide them."""
    from rankwatch.analytics import views
    from rankwatch.analytics.errors import RunDirError

    try:
        recorded = [i for i in views.recorded_incidents(run_dir) if i.id not in seen]
        states = views.incident_states(recorded, views.decisions(run_dir), str(run_dir)) if recorded else None
    except RunDirError as exc:
        print(f"rankwatch analyze: warning: the recovery records could not be read: {exc}", file=sys.stderr)
        return
    if states is None:
        return
    import textwrap

    width = terminal_width()
    print(f"recovered live, recorded by the recovery manager ({len(recorded)}):")
    for inc, row in zip(recorded, states.iter_rows(named=True)):
        print(f"  {inc.klass} {inc.subject} in step {inc.onset_step} (attempt {inc.attempt}): {row['state']}")
        for label in ("decision", "next_step"):
            print(textwrap.fill(f"{label.replace('_', ' ')}: {row[label]}", width=width, initial_indent="    ",
                                subsequent_indent="      "))


def terminal_width() -> int:
    """Columns to fit tables to: the terminal's, or $COLUMNS, else 120 (output to a file or a pipe)."""
    return shutil.get_terminal_size((120, 24)).columns


def _steps_text(analysis: Analysis) -> str:
    if analysis.first_step < 0:
        return "no completed step"
    return f"steps {analysis.first_step}..{analysis.last_step}"


def _say_warnings(command: str, warnings: Sequence[str]) -> None:
    for w in warnings:
        print(f"rankwatch {command}: warning: {w}", file=sys.stderr)


def _analyze(args: argparse.Namespace) -> int:
    return _analyze_run(args.run_dir, as_json=args.json, window=args.window, anomaly=not args.no_anomaly,
                        progress=not args.quiet, clock=args.clock)


def _print_result(command: str, doc: dict[str, Any] | None, lines: list[str]) -> int:
    """Print a result as JSON (`doc`, where --json asked for it) or as its lines, the first naming the command."""
    import json

    if doc is not None:
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(f"rankwatch {command}: {line}" if i == 0 else line for i, line in enumerate(lines)))
    return 0


def _whatif(args: argparse.Namespace) -> int:
    from rankwatch.analytics.whatif import parse_steps, whatif

    result = whatif(args.run_dir, steps=parse_steps(args.steps) if args.steps else None, attempt=args.attempt)
    return _print_result("whatif", result.to_dict() if args.json else None, result.describe())


def _goodput(args: argparse.Namespace) -> int:
    from rankwatch.analytics.goodput import goodput

    result = goodput(args.run_dir)
    return _print_result("goodput", result.to_dict() if args.json else None, result.describe())


def _advise(args: argparse.Namespace) -> int:
    from rankwatch.analytics.costs import DEFAULT_RANKS, advise, measured_costs

    result = advise(measured_costs(args.run_dirs), device_mtbf_hours=args.mtbf_hours,
                    ranks=args.ranks or DEFAULT_RANKS)
    return _print_result("advise", result.to_dict() if args.json else None, result.describe())


def _simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from rankwatch.base.topology import Layout
    from rankwatch.simulator import SimConfig, parse_sim_fault, simulate
    from rankwatch.simulator.config import Timing

    layout = Layout.parse(args.layout, nproc=args.ranks, flag="--ranks")
    cfg = SimConfig(name=args.name, layout=layout, hosts=args.hosts, steps=args.steps, seed=args.seed,
                    checkpoint_every=args.checkpoint_every, fingerprint_every=args.fingerprint_every,
                    phases=not args.no_phases, timing=Timing(args.timing))
    cfg = replace(cfg, faults=tuple(parse_sim_fault(f, cfg) for f in args.fault))  # seconds and slots need the run
    print(f"rankwatch simulate: {layout.world_size} ranks ({layout}) on {args.hosts} hosts, {args.steps} steps, "
          f"{args.timing} timing -> {args.out}")
    result = simulate(cfg, args.out, progress=lambda line: print(f"  .. {line}", file=sys.stderr, flush=True))
    rows = sum(result.rows.values())
    print(f"  wrote {rows} rows in {result.elapsed_s:.1f}s; ground truth: {args.out / 'labels.json'}")
    for label in result.labels.expected:
        print(f"  expect {label.klass} {label.subject_kind}:{label.subject} from step {label.onset_step} ({label.cause})")
    return 0


def _localize(args: argparse.Namespace) -> int:
    from rankwatch.analytics.analyze import input_warnings, observe_run
    from rankwatch.analytics.localize import localize

    with input_warnings() as warnings:
        observations = [observe_run(r) for r in args.run_dirs]
    _say_warnings("localize", warnings)
    verdicts = localize(observations)
    print(f"rankwatch localize: {len(observations)} run(s)")
    if not verdicts:
        print("no recurring incidents to localize")
    for v in verdicts:
        print(f"{v.klass}: follows {v.follows}{' ' + v.subject if v.subject else ''} "
              f"({v.occurrences} of {v.observations} runs) — {v.summary}")
        for q in v.quarantine:
            print(f"  quarantine candidate: {q.kind} {q.id} ({q.occurrences} of {q.runs_observed} runs, "
                  f"confidence {q.confidence:.2f}): {q.reason}")
    return 0


def job_from_run(run_dir: Path) -> Any:
    """The job the run's latest launch recorded: a command the recovery manager launched (`control.command`), else
    the canary's config. ValueError naming the run file when it records neither."""
    from rankwatch.base.rundir import read_launches
    from rankwatch.control.command import COMMAND_JOB, CommandJob

    launches = read_launches(run_dir)
    if launches and any(r.get("job") == COMMAND_JOB for r in launches):
        return CommandJob.from_run(run_dir)
    from rankwatch.canary.config import config_from_run

    return config_from_run(run_dir)


def _launcher_of(job: Any) -> Any:
    from rankwatch.control.command import CommandJob, CommandLauncher

    if isinstance(job, CommandJob):
        return CommandLauncher()
    from rankwatch.canary.launcher import CanaryLauncher

    return CanaryLauncher()


def _watch(args: argparse.Namespace) -> int:
    from rankwatch.control.monitor import Monitor

    Monitor(args.run_dir, window=args.window, every=args.every, poll=args.poll, anomaly=not args.no_anomaly,
            webhook=args.webhook, secret_file=args.secret_file, load_job=job_from_run).run(count=args.count)
    return 0


def _drill(args: argparse.Namespace) -> int:
    from rankwatch.canary.drills import DRILLS
    from rankwatch.canary.drills.targets import CANARY, example_target

    target = example_target(args.example) if args.example else CANARY
    names = [n for n in DRILLS if n in target.drills]
    if args.list:
        width = max(len(n) for n in names)
        for name in names:
            print(f"{name:<{width}}  {target.fault_of(name)}")
        return 0
    if args.all == bool(args.names):
        raise ValueError(f"name drills or give --all, not both (drills: {', '.join(names)})")
    unknown = [n for n in args.names if n not in names]
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], names, n=1)
        where = f" for {target.name}" if args.example else ""
        raise ValueError(f"unknown drill '{unknown[0]}'{where}" + (f" (did you mean '{near[0]}'?)" if near else "")
                         + "; `rankwatch drill --list` shows them")
    return _run_drills(names if args.all else list(args.names), Path(args.workdir), target=target)


def _run_drills(names: list[str], workdir: Path, *, who: str = "rankwatch drill", target: Any = None) -> int:
    """The drills in turn, progress lines as they go, then the report table and where report.json is."""
    import time

    from rankwatch.canary.drills import REPORT_FILE, report_table, run_drills, write_report
    from rankwatch.canary.drills.targets import CANARY

    t0 = time.monotonic()
    reports = run_drills(names, workdir, say=lambda m: print(f"[{time.monotonic() - t0:6.1f}s] {m}", flush=True),
                         target=target or CANARY)
    path = write_report(workdir / REPORT_FILE, reports)
    print(report_table(reports))
    print(f"{who}: {sum(r.passed for r in reports)} of {len(reports)} passed; report in {path}")
    return 0 if all(r.passed for r in reports) else 1


def _webhook_secret(args: argparse.Namespace) -> int:
    from rankwatch.control.signer import write_secret

    write_secret(args.file)
    print(f"rankwatch webhook-secret: wrote a new secret to {args.file} (mode 0600); give the same file to "
          "`rankwatch watch --secret-file` and `rankwatch manager serve --secret-file`")
    return 0


def _checkpoints(args: argparse.Namespace) -> int:
    from rankwatch.base.rundir import CHECKPOINT_DIR
    from rankwatch.recovery.catalog import list_checkpoints

    if not args.run_dir.is_dir():
        raise ValueError(f"{args.run_dir}: not a run directory (does not exist)")
    folder = args.run_dir / CHECKPOINT_DIR
    if folder.exists() and not folder.is_dir():  # else it would read as "no checkpoint was ever taken"
        raise ValueError(f"{folder}: not a folder — the checkpoint catalog cannot be read")
    candidates = list_checkpoints(args.run_dir, verify=args.verify)
    how = "sizes and SHA-256 checked" if args.verify else "sizes checked (--verify also checks SHA-256)"
    print(f"rankwatch checkpoints: {args.run_dir}: {len(candidates)} candidate(s), {how}")
    for c in candidates:
        print(f"  {c.path.name:<22} step {c.step:>8}  {c.verdict:<12} {c.reason}")
    usable = [c for c in candidates if c.usable]
    print(f"newest usable: {usable[0].path.name}" if usable else "no usable checkpoint")
    return 0


def _evidence(args: argparse.Namespace) -> int:
    from rankwatch.analytics.errors import AnalyticsError
    from rankwatch.analytics.incidents import read_incidents
    from rankwatch.analytics.store import check_run
    from rankwatch.base.rundir import INCIDENTS_JSON, RunDir
    from rankwatch.recovery.catalog import list_checkpoints
    from rankwatch.recovery.evidence import preserve_evidence

    path = RunDir(args.run_dir).analysis / INCIDENTS_JSON
    if not path.exists():
        raise ValueError(f"{path}: no analysis yet — run `rankwatch analyze {args.run_dir}` first")
    try:  # damaged telemetry is still evidence: it is preserved as it is, and said
        _say_warnings("evidence", check_run(args.run_dir)[1])
    except AnalyticsError as exc:
        _say_warnings("evidence", [f"{exc} — preserved as it is"])
    try:
        recorded = read_incidents(path)
    except ValueError as exc:
        raise ValueError(str(exc) if str(path) in str(exc) else f"{path}: {exc}") from None
    except (TypeError, AttributeError) as exc:  # JSON of another shape than an incidents file
        raise ValueError(f"{path}: not a readable incidents file ({type(exc).__name__}: {exc})") from None
    incidents = [i for i in recorded if not args.incident or i.id in args.incident]
    unknown = set(args.incident) - {i.id for i in incidents}
    if unknown:
        raise ValueError(f"{path}: no incident {', '.join(sorted(unknown))}")
    ckpts = [c.path.name.removeprefix(".").removesuffix(".tmp") for c in list_checkpoints(args.run_dir, verify=False)]
    for inc in incidents:
        b = preserve_evidence(args.run_dir, incident_id=inc.id, ranks=inc.ranks, checkpoint_ids=ckpts,
                              note=f"{inc.klass} {inc.subject}: {inc.summary}")
        print(f"{inc.id}: {len(b.files)} file(s), {b.bytes / 2**20:.1f} MiB in {b.path}"
              + (f"; {len(b.missing)} missing" if b.missing else ""))
    if not incidents:
        print("no incidents: nothing to preserve")
    return 0


def _recover(args: argparse.Namespace) -> int:
    from rankwatch.analytics.analyze import input_warnings
    from rankwatch.base.rundir import RunDir
    from rankwatch.control.manager import apply, assess, recurrence_from

    cfg = job_from_run(args.run_dir)
    if args.continue_on is not None:
        from rankwatch.control.manager import continue_on

        ok, lines = continue_on(cfg, args.continue_on)
        print(f"rankwatch recover: can {args.run_dir} go on with {args.continue_on} of its {cfg.world_size} ranks? "
              f"{'yes' if ok else 'no'}")
        for line in lines:
            print(f"  {line}")
        return 0 if ok else 1
    with input_warnings() as warnings:  # what the analyses behind the plan left out or could not see
        recurrence = recurrence_from([args.run_dir, *args.history]) if args.history else None
        plan = assess(args.run_dir, layout=cfg.layout, job=cfg.declaration(), recurrence=recurrence)
    _say_warnings("recover", warnings)
    print(f"rankwatch recover: {args.run_dir}: {len(plan.decided)} new incident(s)"
          + (f", {len(plan.skipped)} already handled or older than the latest launch" if plan.skipped else ""))
    for line in plan.lines():
        print(f"  {line}")
    if not args.apply:
        if plan.relaunch or plan.quarantines:
            print("dry run: nothing touched (--apply carries it out)")
        return 0
    rec = apply(cfg, plan, launcher=_launcher_of(cfg), say=lambda m: print(f"rankwatch recover: {m}", flush=True),
                timeout_s=args.timeout)
    print(f"rankwatch recover: {rec.id}: {rec.outcome}; record in {RunDir(args.run_dir).recovery_record(rec.id)}")
    return 0 if rec.ok else 1


def _rollup_parser(sub: argparse._SubParsersAction) -> None:
    from rankwatch.collector.rollup import DEFAULT_KEEP_S

    p = sub.add_parser("rollup", help="host agent: merge each host's new rank part files into one part per table")
    p.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    p.add_argument("--host", action="append", default=[], metavar="H", help="roll up this host's ranks (repeatable)")
    p.add_argument("--all", action="store_true", help="every host in the run's topology")
    p.add_argument("--interval", type=float, default=30.0, metavar="SECONDS", help="seconds between rounds")
    p.add_argument("--once", action="store_true", help="one round, then exit")
    p.add_argument("--keep", type=float, default=DEFAULT_KEEP_S, metavar="SECONDS",
                   help="delete covered rank parts only this long after the rollup that covers them was published")
    p.add_argument("--no-delete", action="store_true", help="leave covered rank parts in place")


def _rollup(args: argparse.Namespace) -> int:
    from rankwatch.collector.rollup import RollupResult, run_agent

    if bool(args.host) == args.all:
        raise ValueError("give --host H (repeatable) or --all")
    rounds = 0

    def report(results: list[RollupResult]) -> None:
        nonlocal rounds
        rounds += 1
        for r in results:
            for w in r.warnings:
                print(f"rankwatch rollup: warning: {w}", file=sys.stderr)
            if r.rank_parts or args.host:
                deleted = sum(t.deleted for t in r.tables)
                print(f"  {r.host}: {r.rank_parts} rank part(s) of {len(r.ranks)} rank(s) -> {r.host_parts} host "
                      f"part(s), {deleted} covered rank part(s) deleted ({r.seconds:.2f}s)")
        print(f"rankwatch rollup: round {rounds}: {len(results)} host(s), "
              f"{sum(r.rank_parts for r in results)} rank part(s) rolled up", flush=True)

    run_agent(args.run_dir, args.host or None, interval_s=args.interval, rounds=1 if args.once else None,
              delete=not args.no_delete, keep_s=args.keep, report=report)
    return 0


def _manager_parser(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("manager", help="the recovery manager as a service (signed alerts in, recoveries out)")
    msub = m.add_subparsers(dest="manager_command", required=True)
    sv = msub.add_parser("serve", help="serve POST /alerts (Standard Webhooks signed), /alertmanager (evidence "
                                       "only), GET /status; launch the canary when --nproc/--steps are given, or "
                                       "any job's command given after `--`",
                         usage="rankwatch manager serve --run-dir RUN --secret-file F [options] [-- COMMAND ...]")
    _job_args(sv, required=False)
    sv.add_argument("--membership", default=str(MembershipSupport.FIXED_SHAPES),
                    choices=[str(m) for m in MembershipSupport],
                    help="with a command: the membership change the job's algorithm supports (fixed_shapes: FSDP, "
                         "TP, PP, or any job that has not said; pure_dp_reconfigurable_batch: pure data parallel "
                         "whose batch is re-planned over fewer replicas)")
    sv.add_argument("--devices", default="", metavar="LIST",
                    help="with a command: the GPUs (indices or UUIDs, spares included) its ranks may use, given to it "
                         "as CUDA_VISIBLE_DEVICES off the quarantine list")
    sv.add_argument("--host-list", default="", metavar="LIST",
                    help="with a command that takes a host list where it says {hosts} (srun --nodelist={hosts}, "
                         "--rdzv-endpoint={first_host}:29500): the hosts it may run on, spares included; a "
                         "quarantined host is left out for the next spare")
    sv.add_argument("--nodes", type=int, default=1, metavar="N", help="with --host-list: how many of them the job runs on")
    sv.add_argument("--listen", default="127.0.0.1:8787", metavar="HOST:PORT", help="loopback by default")
    sv.add_argument("--secret-file", type=Path, required=True, help="the webhook secret (one line, whsec_...)")
    sv.add_argument("--token-file", type=Path, default=None,
                    help="bearer token an Alertmanager sends to /alertmanager (without it that path refuses all)")
    sv.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                    help="the service's log lines at this level and above")


def _manager(args: argparse.Namespace) -> int:
    from rankwatch.control.service import serve

    command = list(getattr(args, "job_command", None) or [])
    if command and args.nproc is not None:
        raise ValueError("give the canary's --nproc/--steps or a command after `--`, not both")
    if (args.nproc is None) != (args.steps is None):
        raise ValueError("--nproc and --steps go together (both: launch the job; neither: act on the run as "
                         "<run>/run.json last recorded it)")
    job: Any = None
    if command:
        from rankwatch.base.topology import Layout
        from rankwatch.control.command import CommandJob

        job = CommandJob.from_args(args.run_dir, command, layout=Layout.parse(args.layout) if args.layout else None,
                                   membership=MembershipSupport(args.membership),
                                   devices=[d.strip() for d in args.devices.split(",") if d.strip()],
                                   hosts=[h.strip() for h in args.host_list.split(",") if h.strip()], nodes=args.nodes)
    elif args.nproc is not None:
        job = _canary_config(args)
    launch_kw = {"timeout_s": args.timeout} if args.timeout is not None else None
    launcher = _launcher_of(job if job is not None else _recorded_job(args.run_dir))
    return serve(args.run_dir, launcher=launcher, load_job=job_from_run, listen=args.listen,
                 secret_file=args.secret_file, token_file=args.token_file, job=job, launch_kw=launch_kw,
                 log_level=args.log_level)


def _telemetry(args: argparse.Namespace) -> int:
    _print_summary(args.run_dir)
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from rankwatch.dashboard.serve import serve

    return serve(args.run_dirs, port=args.port, address=args.address)


def _postmortem(args: argparse.Namespace) -> int:
    from rankwatch.notebooks.runner import run_postmortem

    out = run_postmortem(args.run_dir, out=args.out, incident=args.incident, html=args.html,
                         progress=lambda m: print(f"  .. {m}", file=sys.stderr, flush=True))
    print(f"rankwatch postmortem: {out}" + (f" and {args.html}" if args.html else ""))
    return 0


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes (a test's capture, a redirected stream)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def configure_logging(level: str) -> None:
    """One handler (stderr) for the whole `rankwatch` logger tree, at `level`: what `--log-level` sets. Called again,
    it replaces its handler (one line per record, never two)."""
    root = logging.getLogger("rankwatch")
    for h in [h for h in root.handlers if getattr(h, "rankwatch_cli", False)]:
        root.removeHandler(h)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    handler.rankwatch_cli = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())


def _torchrun(argv: Sequence[str]) -> int:
    """`rankwatch torchrun ...`: torchrun's own arguments, so not parsed by argparse here (control/torchrun.py)."""
    from rankwatch.control.torchrun import exec_torchrun

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rankwatch torchrun [--run-dir DIR] [torchrun options] SCRIPT [script args]\n\n"
              "torchrun with rankwatch's host agent beside every rank (exit status and signal recorded the moment a\n"
              f"rank ends) and RANKWATCH_RUN_DIR set for collector.attach(). torchrun's own options: torchrun --help")
        return 0
    try:
        exec_torchrun(argv)
    except (ValueError, OSError) as exc:
        print(f"rankwatch torchrun: error: {exc}", file=sys.stderr)
        return 2
    return 0  # not reached: torchrun replaced this process


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help with every flag's default shown (argparse's ArgumentDefaultsHelpFormatter), none for a flag without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


_SAYS_IT_STARTED = {"recover": "reading the run, analysing it and deciding", "lineage": "verifying the lineage and "
                    "judging its promises against the replayed fingerprints", "localize": "reading every run's incidents"}
"""Commands that take seconds before their first line (their imports and their reading) and have no progress of their
own: a line on stderr at once when stderr is a terminal (a person waiting), so it never sits silent; a pipe or a log
keeps its one line per outcome."""
_READS_RUNS = frozenset({"telemetry", "analyze", "checkpoints", "evidence", "recover", "lineage", "rollup",
                         "dashboard", "postmortem", "localize", "whatif", "goodput", "advise"})
"""Commands whose runs must exist and be runs."""

ALIASES = {"analyse": "analyze"}
"""Other spellings a command answers to (the dashboard's "analyse" button says it that way)."""


def _finish(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every subcommand's own help opens with the line its parent lists it with, and shows its flags' defaults."""
    parser.formatter_class = _Formatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                if not child.description and listed.get(name):
                    child.description = listed[name]
                _finish(child)
    return parser


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def _unknown_command(parser: argparse.ArgumentParser, raw: list[str]) -> str | None:
    """One line for a first word that is no command (with the nearest one, if any is near), before argparse's."""
    import difflib

    if not raw or raw[0].startswith("-"):
        return None
    names = _commands(parser)
    if raw[0] in names:
        return None
    near = difflib.get_close_matches(raw[0], names, n=1, cutoff=0.6)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return f"rankwatch: error: unknown command '{raw[0]}'{hint}; `rankwatch --help` lists them"


_SIM_FAULT_HELP = (
    "train's spelling, keys and units (delays in seconds): slow:rank=,from=,delay=,until=,period=,burst=; "
    "exit:rank=,step=,code=; kill:rank=,step=,signal=; hang:rank=,step=; "
    "bitflip:rank=,step=,target=,bit=,param=,index=; skew_rng:rank=,step=; skew_data:rank=,step=,offset=; "
    "throttle:rank=,from=,delay=,until=,reason=; "
    "bad_device:host=,index=,from=,delay=,until=,reason=; gpu_slow:rank=,from=,factor=,until= (simulate also takes "
    "in_collective= on exit and kill, alive=,killed=,kill_after= on hang, hardware= on bitflip); simulate only: "
    "slow_link:hosts=,from=,factor=; dataloader:rank=,from=,delay=,until=,period=,burst=; "
    "host_dataloader:host=,from=,delay=; stage_imbalance:stage=,from=,factor=; data_skew:count=,from=,factor=; "
    "vanish:rank=,step=,in_collective=,killed=; divergence:step=,field=,ranks=,replica=,offset=; "
    "corruption:rank=,step=,kind=,hardware=,factor=,duration=; slow_hardware:rank=,factor=; throttle_bit_only:rank=; "
    "steady_counters:rank=,sbe=,pcie_replay=; train only: nudge, freeze, failing_device, device_error"
)
"""simulator.faults.SIM_FAULT_HELP, spelled out: importing the simulator takes seconds (test_cli pins the two)."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (`main` parses with it; tests walk it)."""
    from rankwatch import __version__

    parser = argparse.ArgumentParser(prog="rankwatch", description="telemetry and straggler detection for distributed PyTorch")
    parser.add_argument("--version", action="version", version=f"rankwatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub)
    sub.add_parser("torchrun", help="torchrun with rankwatch beside every rank: rankwatch torchrun [--run-dir DIR] "
                                    "[torchrun options] SCRIPT [args]", add_help=False)
    d = sub.add_parser("demo", help="run the canary on 8 ranks with a slow rank and a throttled GPU")
    d.add_argument("--steps", type=int, default=300, help="training steps")
    d.add_argument("--run-dir", type=Path, default=DEMO_RUN_DIR, help="where the demo's run is written")
    d.add_argument("--drill-dir", type=Path, default=Path("runs/demo-drill"),
                   help="where the closing kill drill runs (its reference run, the drill's run, report.json)")
    d.add_argument("--no-drill", dest="drill", action="store_false", help="skip the closing kill drill")
    t = sub.add_parser("telemetry", help="what a run's telemetry holds (rows per table)")
    t.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    a = sub.add_parser("analyze", aliases=["analyse"],
                       help="find stragglers, fail-stops, hangs, divergence and corruption in a run")
    a.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    a.add_argument("--json", action="store_true", help="print the incidents as JSON instead of a table")
    a.add_argument("--window", type=int, default=None, metavar="STEPS", help="analyze only the latest STEPS steps")
    a.add_argument("--no-anomaly", action="store_true", help="skip the anomaly model")
    a.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a.add_argument("--clock", choices=("auto", "cpu", "device"), default="auto",
                   help="read timing from the CPU or the device (CUDA event) columns; auto: the device's where every "
                        "rank has them")
    wi = sub.add_parser("whatif", help="what the run's slowness cost: its steps replayed with durations made ideal")
    wi.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    wi.add_argument("--steps", default=None, metavar="A:B", help="the window (inclusive); default: every step each "
                    "rank of the attempt completed, less the first")
    wi.add_argument("--attempt", type=int, default=None, help="the attempt (default: the latest)")
    wi.add_argument("--json", action="store_true", help="print the figures as JSON")
    gp = sub.add_parser("goodput", help="where a run's wall time went: effective training, lost work, detection, "
                        "decision, relaunch, restore, checkpoint pauses, straggler slowdown")
    gp.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    gp.add_argument("--json", action="store_true", help="print the figures as JSON")
    ad = sub.add_parser("advise", help="checkpoint-interval advice from the runs' measured save and restore costs "
                        "and failure rate, at 2,048 and 16,384 ranks")
    ad.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="runs of the job to measure")
    ad.add_argument("--mtbf-hours", type=float, default=None, metavar="H",
                    help="a per-device MTBF, scaled to each rank count (default: the runs' interruptions per "
                         "rank-hour)")
    ad.add_argument("--ranks", type=int, nargs="+", default=None, metavar="N",
                    help="rank counts to advise for (default: 2048 16384; the runs' own is always shown)")
    ad.add_argument("--json", action="store_true", help="print the advice as JSON")
    sim = sub.add_parser("simulate", help="write synthetic telemetry at scale with ground-truth labels")
    sim.add_argument("--ranks", type=int, required=True, help="ranks of the simulated job")
    sim.add_argument("--hosts", type=int, required=True, help="hosts the ranks are spread over")
    sim.add_argument("--layout", default="", help="dp=N,tp=N,pp=N (product = --ranks)")
    sim.add_argument("--steps", type=int, required=True, help="training steps")
    sim.add_argument("--out", type=Path, required=True, help="the run directory to write")
    sim.add_argument("--fault", action="append", default=[], metavar="SPEC", help=f"inject a fault: {_SIM_FAULT_HELP}")
    sim.add_argument("--seed", type=int, default=0, help="seed of the noise and the faults")
    sim.add_argument("--name", default="sim", help="the run's name in its labels")
    sim.add_argument("--checkpoint-every", type=int, default=0, help="a checkpoint every N steps (0: none)")
    sim.add_argument("--fingerprint-every", type=int, default=50, help="state fingerprints every N steps")
    sim.add_argument("--no-phases", action="store_true", help="skip the (low-priority) phases table")
    sim.add_argument("--timing", choices=("cpu", "gpu"), default="cpu",
                     help="clock semantics: cpu = gloo (collectives block the thread), gpu = CUDA/NCCL (the thread "
                          "only enqueues; device columns carry the straggler signal)")
    w = sub.add_parser("watch", help="live: re-analyze the latest window of a run as new part files appear")
    w.add_argument("run_dir", type=Path, help=RUN_DIR_HELP + " (it may not exist yet)")
    w.add_argument("--window", type=int, default=20, metavar="STEPS", help="analyze the latest STEPS steps")
    w.add_argument("--every", type=float, default=5.0, metavar="SECONDS", help="re-analyze this often")
    w.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0 = run until Ctrl-C)")
    w.add_argument("--no-anomaly", action="store_true", help="skip the anomaly model")
    w.add_argument("--poll", type=float, default=0.2, metavar="SECONDS",
                   help="read the ranks' liveness records this often (fail-stops and hangs in seconds, not at the "
                        "part-file cadence)")
    w.add_argument("--webhook", default=None, metavar="URL",
                   help="send each new incident, its resolution and each recovery decision to URL as a signed "
                        "Alertmanager-v4 webhook (durable outbox in <run>/alerts/)")
    w.add_argument("--secret-file", type=Path, default=None, help="the webhook secret (see `rankwatch webhook-secret`)")
    ws = sub.add_parser("webhook-secret", help="write a new webhook signing secret to FILE (never overwrites)")
    ws.add_argument("file", type=Path, help="where to write the secret (must not exist)")
    ck = sub.add_parser("checkpoints", help="every checkpoint candidate with its verdict (committed, partial, corrupt)")
    ck.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    ck.add_argument("--verify", action="store_true", help="read every byte and check SHA-256, not only sizes")
    ev = sub.add_parser("evidence", help="copy the telemetry, events, topology and manifests behind incidents into <run>/evidence/<id>/")
    ev.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    ev.add_argument("--incident", action="append", default=[], metavar="ID", help="only these incidents (default: all)")
    lo = sub.add_parser("localize", help="does a recurring fault follow a device, a rank, a host or a link?")
    lo.add_argument("run_dirs", type=Path, nargs="+", help="runs (or restarts) of one job")
    rc = sub.add_parser("recover", help="decide the narrowest safe recovery for a run's new incidents (--apply: do it)")
    rc.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    rc.add_argument("--apply", action="store_true", help="preserve evidence, quarantine, retire and relaunch")
    rc.add_argument("--history", type=Path, nargs="*", default=[], metavar="RUN",
                    help="other runs of the job, for recurrence (does a fault follow a device, host or link?)")
    rc.add_argument("--timeout", type=float, default=None, help="terminate a relaunch after this many seconds")
    rc.add_argument("--continue-on", type=int, default=None, metavar="N",
                    help="only answer: can the job go on with N ranks (a membership change it declared), and if "
                         "so on what conditions")
    li = sub.add_parser("lineage", help="a run's lineage: every entry, and whether each bitwise promise was checked "
                                        "and held")
    li.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    li.add_argument("--json", action="store_true", help="print the entries and promises as JSON")
    _rollup_parser(sub)
    _manager_parser(sub)
    dr = sub.add_parser("drill", help="fault drills on a live canary or example job: inject a fault, time detection, decision and "
                                      "recovery through the manager service, check the result bitwise")
    dr.add_argument("names", nargs="*", metavar="NAME",
                    help="drills to run, by name (`--list` shows every one and what it does; a name may repeat: one "
                         "row each)")
    dr.add_argument("--all", action="store_true", help="every drill, in the order `--list` shows")
    dr.add_argument("--list", action="store_true", help="list every drill with what it injects, and exit")
    dr.add_argument("--example", default=None, metavar="NAME",
                    help="drill a job rankwatch did not write instead of the canary: ddp_gpt, fsdp2_transformer or "
                         "fsdp_tp_2d under examples/ (or a path to one), owned by the manager by its command line")
    dr.add_argument("--workdir", type=Path, default=Path("runs/drills"),
                    help="the drills' runs, the cached reference run and report.json")
    db = sub.add_parser("dashboard", help="the incident dashboard (Streamlit) over one or more runs, on 127.0.0.1")
    db.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="the runs to show")
    db.add_argument("--port", type=int, default=8501, help="the port to serve on")
    db.add_argument("--address", default="127.0.0.1", help="bind address (default loopback only)")
    pm = sub.add_parser("postmortem", help="execute the post-mortem notebook on a run (an .ipynb, optionally HTML)")
    pm.add_argument("run_dir", type=Path, help=RUN_DIR_HELP)
    pm.add_argument("--incident", default=None, metavar="ID", help="the incident to explain (default: the most "
                                                                     "consequential)")
    pm.add_argument("--out", type=Path, required=True, help="the executed notebook (.ipynb)")
    pm.add_argument("--html", type=Path, default=None, help="also write it as HTML")
    return _finish(parser)


def _recorded_job(run_dir: Path) -> Any:
    """The job the run recorded, or None (no run file yet, or one that records no launch)."""
    try:
        return job_from_run(run_dir)
    except ValueError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["torchrun"]:
        return _torchrun(raw[1:])
    command: list[str] = []
    if raw[:2] == ["manager", "serve"] and "--" in raw:  # the job's own command line, not parsed here
        at = raw.index("--")
        raw, command = raw[:at], raw[at + 1:]
    parser = build_parser()
    unknown = _unknown_command(parser, raw)
    if unknown is not None:
        print(unknown, file=sys.stderr)
        return 2
    args = parser.parse_args(raw)
    args.job_command = command
    args.command = ALIASES.get(args.command, args.command)
    if args.command in _READS_RUNS:  # at once, before the command's imports (seconds) and its work
        from rankwatch.base.rundir import run_dir_problem

        for run in ([args.run_dir] if hasattr(args, "run_dir") else list(args.run_dirs)):
            problem = run_dir_problem(run)
            if problem is not None:
                print(f"rankwatch {args.command}: error: {problem}", file=sys.stderr)
                return 2
    configure_logging(getattr(args, "log_level", "warning"))
    if args.command in _SAYS_IT_STARTED and sys.stderr.isatty() and not getattr(args, "json", False):
        print(f"rankwatch {args.command}: {_SAYS_IT_STARTED[args.command]} …", file=sys.stderr, flush=True)
    handlers = {"train": _train, "demo": _demo, "telemetry": _telemetry, "analyze": _analyze, "simulate": _simulate,
                "localize": _localize, "watch": _watch, "checkpoints": _checkpoints,
                "evidence": _evidence, "recover": _recover, "rollup": _rollup, "lineage": _lineage,
                "manager": _manager, "webhook-secret": _webhook_secret, "drill": _drill,
                "dashboard": _dashboard, "postmortem": _postmortem, "whatif": _whatif, "goodput": _goodput,
                "advise": _advise}
    try:
        return handlers[args.command](args)
    except ValueError as exc:  # bad input: one line, no traceback
        print(f"rankwatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
