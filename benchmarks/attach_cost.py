"""What `collector.attach()` costs a job, with torch's Flight Recorder on: per collective on the training thread, the
projection to real step times, and ON vs OFF wall time per step of the three examples under `rankwatch torchrun`.

    .venv/bin/python benchmarks/attach_cost.py             # full run, ~8 min on 2 cores
    .venv/bin/python benchmarks/attach_cost.py --quick     # every part, briefly (tests/unit/test_attach_cost.py)
    .venv/bin/python benchmarks/attach_cost.py --examples ddp_gpt --blocks 4   # one example's ON vs OFF only

Per collective (world size 1, gloo, torch threads 1; one process with the Flight Recorder on,
TORCH_FR_BUFFER_SIZE=2000 as `rankwatch torchrun` sets it, one with it off)
    `attach()` wraps torch.distributed's functions (collector/instrument.py). In one process, steps of N = 100
    ``all_reduce`` calls of a 1 KiB tensor, each step inside ``rw.step(i)``, alternate in ABBA quads between the
    wrapped function (ON: what the job calls once attached) and the function saved before attaching (OFF: the same
    call unrecorded). A step's cost is the training thread's CPU clock (`time.thread_time_ns`): preemption on the
    shared machine does not count. b = (ON − OFF) / N, the median over quads, with a 95 % bootstrap interval. The
    Flight Recorder's own cost per collective (torch's, not rankwatch's) is the OFF arm's per-collective CPU in the
    process with it on less the one with it off.

Per step
    a = the training thread's CPU of an empty ``with rw.step(i)`` (the attached collector) against a bare loop
    iteration, ABBA quads, median.

Projection
    overhead = (a + b·N) / step time, for 0.1, 0.5 and 2 s steps with 100 and 1,000 collectives; the interval is the
    bootstrap interval of b (a's is small beside it). Target: ≤ 0.3 % at a 0.5 s step with 1,000 collectives.
    The collector's background threads (writer, heartbeat) run off the critical path: benchmarks/collector_cost.py
    measures them.

ON vs OFF, the examples
    Each of examples/ddp_gpt.py, fsdp2_transformer.py and fsdp_tp_2d.py (--tp 2) under `rankwatch torchrun
    --standalone --nproc-per-node P` (P = 2 by default: a core per rank on this machine), Flight Recorder on in both
    arms; OFF is the same command with RANKWATCH_DISABLE=1 (`attach` returns a NullCollector and patches nothing).
    Launches one at a time, ABBA within a block and BAAB in the next; the time per step is the example's own figure
    (rank 0's wall time from the end of its warm-up to its last step, printed as "time per step: ..."). Overhead per
    block = (ON₁ + ON₂) / (OFF₁ + OFF₂) − 1, mean over blocks with its 95 % t interval. The examples fingerprint
    their state every 10 steps (their default): that is part of ON.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collector_cost import Interval, _percentile_interval, _verdict, t_interval  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = (("ddp_gpt", ()), ("fsdp2_transformer", ()), ("fsdp_tp_2d", ("--tp", "2")))
TARGET_PROJECTED_PCT = 0.3
TARGET_AT = (0.5, 1000)
STEPS_S = (0.1, 0.5, 2.0)
COLLECTIVES = (100, 1000)
_FIGURES = "FIGURES "


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    quads: int
    collectives: int
    bootstrap: int
    blocks: int
    steps: int
    nproc: int


FULL = Plan(quads=300, collectives=100, bootstrap=1000, blocks=3, steps=80, nproc=2)
QUICK = Plan(quads=20, collectives=100, bootstrap=200, blocks=1, steps=12, nproc=2)


# ----------------------------------------------------------------------------------- in one process (a child)


def _child(quads: int, collectives: int, out: str) -> None:
    """Measure in this process (its Flight Recorder setting came with its environment); write the figures to `out`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        bare = dist.all_reduce
        from rankwatch.collector.attach import attach, detach

        rw = attach(f"{tmp}/run", env={"RANK": "0", "WORLD_SIZE": "1"})
        wrapped = dist.all_reduce
        assert wrapped is not bare, "attach did not wrap dist.all_reduce"
        x = torch.ones(256)  # 1 KiB
        clock = time.thread_time_ns
        step = 0

        def collectives_step(fn: object) -> int:
            nonlocal step
            step += 1
            t0 = clock()
            with rw.step(step):
                for _ in range(collectives):
                    fn(x)  # type: ignore[operator]
            return clock() - t0

        def empty_step(on: bool) -> int:
            nonlocal step
            step += 1
            t0 = clock()
            if on:
                with rw.step(step):
                    pass
            return clock() - t0

        for _ in range(10):  # warm-up
            collectives_step(wrapped)
            collectives_step(bare)
        def abba(q: int, on_step: object, off_step: object) -> tuple[int, int]:
            """(ON, OFF) training-thread ns of one quad: ON OFF OFF ON, or OFF ON ON OFF on odd quads."""
            on = off = 0
            for arm in ((True, False, False, True) if q % 2 == 0 else (False, True, True, False)):
                if arm:
                    on += on_step()  # type: ignore[operator]
                else:
                    off += off_step()  # type: ignore[operator]
            return on, off

        per: list[tuple[float, float]] = []  # (ON − OFF per collective, OFF per collective), ns, per quad
        steps: list[float] = []
        for q in range(quads):
            on, off = abba(q, lambda: collectives_step(wrapped), lambda: collectives_step(bare))
            per.append(((on - off) / 2 / collectives, off / 2 / collectives))
            e_on, e_off = abba(q, lambda: empty_step(True), lambda: empty_step(False))
            steps.append((e_on - e_off) / 2)
        errors = rw.errors if hasattr(rw, "errors") else 0
        detach()
        dist.destroy_process_group()
    Path(out).write_text(repr({"per": per, "steps": steps, "errors": errors}))


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    """What one measuring process found: per quad (ON − OFF, OFF) ns per collective, per quad ON − OFF ns of an
    empty step, and the collector's internal errors."""

    per: list[tuple[float, float]]
    steps: list[float]
    errors: int


def _measure(quads: int, collectives: int, flight_recorder: bool) -> Measured:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_FR_BUFFER_SIZE"}
    env["OMP_NUM_THREADS"] = "1"
    if flight_recorder:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/figures"
        done = subprocess.run([sys.executable, __file__, "--child", str(quads), str(collectives), out], env=env,
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise SystemExit(f"attach_cost: the measuring process failed:\n{done.stderr[-2000:]}")
        import ast

        doc = ast.literal_eval(Path(out).read_text())
        return Measured(per=[(float(d), float(o)) for d, o in doc["per"]], steps=[float(v) for v in doc["steps"]],
                        errors=int(doc["errors"]))


def _median_interval(values: list[float], resamples: int, seed: int = 0) -> Interval:
    rng = random.Random(seed)
    boot = [statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)]
    return _percentile_interval(statistics.median(values), boot, len(values))


# ------------------------------------------------------------------------------------------ the examples


def _example_step_ms(example: str, extra: tuple[str, ...], *, on: bool, steps: int, nproc: int, tmp: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAULT_")}
    env.update(OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="2000")
    if not on:
        env["RANKWATCH_DISABLE"] = "1"
    run_dir = tmp / f"{example}-{'on' if on else 'off'}-{time.monotonic_ns()}"
    done = subprocess.run(
        [sys.executable, "-m", "rankwatch.cli", "torchrun", "--run-dir", str(run_dir), "--standalone",
         "--nproc-per-node", str(nproc), str(ROOT / "examples" / f"{example}.py"), "--steps", str(steps), *extra],
        env=env, capture_output=True, text=True, timeout=600)
    found = re.findall(r"time per step: ([0-9.]+) ms", done.stdout + done.stderr)
    if not found:
        raise SystemExit(f"attach_cost: {example} ({'ON' if on else 'OFF'}) failed (exit {done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-2000:]}")
    if done.returncode != 0:  # trained to the end and printed its figure; a rank aborted in gloo's teardown
        _ABORTED.append(f"{example} {'ON' if on else 'OFF'}")
    return float(found[-1])


_ABORTED: list[str] = []
"""Launches that printed their figure and then ended non-zero (a rank's SIGABRT in gloo's teardown, "terminate
called without an active exception": seen without rankwatch too, about 1 launch in 50 after the examples' final
barrier)."""


def _examples(plan: Plan, only: list[str] | None = None) -> dict[str, tuple[Interval, float, float]]:
    """example -> (overhead % over blocks, mean ON ms, mean OFF ms)."""
    result: dict[str, tuple[Interval, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for example, extra in EXAMPLES:
            if only and example not in only:
                continue
            overheads: list[float] = []
            ons: list[float] = []
            offs: list[float] = []
            for block in range(plan.blocks):
                order = (True, False, False, True) if block % 2 == 0 else (False, True, True, False)
                on = off = 0.0
                for arm in order:
                    ms = _example_step_ms(example, extra, on=arm, steps=plan.steps, nproc=plan.nproc, tmp=Path(tmp))
                    (ons if arm else offs).append(ms)
                    if arm:
                        on += ms
                    else:
                        off += ms
                overheads.append((on / off - 1) * 100)
            result[example] = (t_interval(overheads), statistics.mean(ons), statistics.mean(offs))
    return result


# ------------------------------------------------------------------------------------------ the table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="every part, briefly")
    p.add_argument("--blocks", type=int, help="ABBA blocks of example launches (default 3)")
    p.add_argument("--examples", nargs="+", choices=[e for e, _ in EXAMPLES], metavar="EXAMPLE",
                   help="only the ON vs OFF launches of these examples (no per-collective part)")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(int(args.child[0]), int(args.child[1]), args.child[2])
        return 0
    if args.examples:
        plan = QUICK if args.quick else FULL
        if args.blocks:
            plan = replace(plan, blocks=args.blocks)
        print("| figure | value |")
        print("|---|---|")
        for example, (overhead, on_ms, off_ms) in _examples(plan, args.examples).items():
            print(f"| ON vs OFF wall time per step, {example}, {plan.nproc} ranks, {plan.blocks} ABBA block(s) of "
                  f"{plan.steps}-step launches: ON / OFF ms, overhead % (95 % t interval) | "
                  f"{on_ms:.2f} / {off_ms:.2f}, {overhead.fmt()} |")
        print(f"| launches that ended non-zero after their figure (gloo teardown) | {', '.join(_ABORTED) or 'none'} |")
        return 0
    plan = QUICK if args.quick else FULL
    if args.blocks:
        plan = replace(plan, blocks=args.blocks)
    started = time.monotonic()
    fr_on = _measure(plan.quads, plan.collectives, True)
    fr_off = _measure(plan.quads, plan.collectives, False)
    b = _median_interval([d / 1e3 for d, _ in fr_on.per], plan.bootstrap)
    per_off_fr = _median_interval([d / 1e3 for d, _ in fr_off.per], plan.bootstrap)
    bare_fr = statistics.median(o for _, o in fr_on.per) / 1e3
    bare_nofr = statistics.median(o for _, o in fr_off.per) / 1e3
    a = _median_interval([v / 1e3 for v in fr_on.steps], plan.bootstrap)
    rows: list[tuple[str, str]] = [
        ("critical path per collective, b: attached − bare all_reduce, training-thread CPU µs (Flight Recorder on; "
         f"median over {plan.quads} quads of {plan.collectives}-collective steps, 95 % bootstrap)", b.fmt()),
        ("critical path per collective, b, Flight Recorder off, µs", per_off_fr.fmt()),
        ("bare all_reduce (1 KiB, gloo, world 1), training-thread CPU µs: Flight Recorder off / on (torch's own cost)",
         f"{bare_nofr:.2f} / {bare_fr:.2f} ({bare_fr - bare_nofr:+.2f})"),
        ("critical path per step, a: an empty `with rw.step(i)`, µs", a.fmt()),
    ]
    target = None
    for step_s in STEPS_S:
        for n in COLLECTIVES:
            pct = Interval(mean=(a.mean + b.mean * n) / (step_s * 1e6) * 100,
                           low=(a.mean + b.low * n) / (step_s * 1e6) * 100,
                           high=(a.mean + b.high * n) / (step_s * 1e6) * 100, n=b.n)
            rows.append((f"projected overhead, {step_s:g} s step × {n:,} collectives, %", pct.fmt(3)))
            if (step_s, n) == TARGET_AT:
                target = pct
    errors = fr_on.errors + fr_off.errors
    examples = _examples(plan)
    for example, (overhead, on_ms, off_ms) in examples.items():
        rows.append((f"ON vs OFF wall time per step, {example}, {plan.nproc} ranks, {plan.blocks} ABBA block(s) of "
                     f"{plan.steps}-step launches: ON / OFF ms, overhead % (95 % t interval)",
                     f"{on_ms:.2f} / {off_ms:.2f}, {overhead.fmt()}"))
    rows.append(("launches that ended non-zero after their figure (gloo teardown)",
                 ", ".join(_ABORTED) if _ABORTED else "none"))
    rows.append(("collector internal errors (in process)", str(errors)))
    assert target is not None
    rows.append((f"target: projected 0.5 s step × 1,000 collectives ≤ {TARGET_PROJECTED_PCT} %",
                 _verdict(target, TARGET_PROJECTED_PCT)))
    print("| figure | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\n{time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
