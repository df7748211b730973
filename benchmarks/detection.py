"""Detection quality over the labeled suite of simulated scenarios.

    .venv/bin/python benchmarks/detection.py [--timing cpu|gpu|both] [--only NAME_SUBSTRING] [--keep DIR] [--jobs N]
                                             [--seed-offset K] [--clock auto|cpu]

`--source independent` scores the second source, benchmarks/independent (written apart from the detectors by an
author who never read them: its own step physics and noise model, 31 phenomena and 14 clean controls per split, 64 to
2,048 ranks, both timings). The seed rule: `--split tune` (seeds 100,000..199,999) may be run, read and tuned on;
`--split heldout` (seeds 900,000..999,999) is run only to report a figure, never while tuning detectors, and its
per-scenario misses are not read to change them. A figure worth reporting is the held-out one. A held-out split is
spent once its misses were printed: a detector change after that is found and checked on tune-range seeds and
measured on the next fresh split, never on a spent one again: `heldout` was spent on 2026-12-01, then `heldout2`
(seeds 800,000..899,999), then `heldout3` (seeds 700,000..799,999), then `heldout4` (seeds 600,000..699,999) on
2026-12-02, then `heldout5` (seeds 500,000..599,999), `heldout6` (400,000..499,999) and `heldout7` (300,000..399,999)
on 2026-12-03, then `heldout8` (200,000..299,999) on 2026-12-03 (a later session); the next fresh split is seeds
0..99,999 (add it to `independent.suite.SPLITS`).

`--extra KIND:LAYOUTS[:COUNT]` (repeatable; with `--split tune` only) scores ad-hoc tune-range scenarios in place of
the split's: COUNT (default: one per layout) scenarios of KIND, over the layouts in turn (DPxTPxPP, comma-separated),
100..300 steps, each in every timing asked for. Their seeds are 160,000 + 1,000 x (KIND's place among the source's
kinds, sorted) + the scenario's index: in the tune range, apart from the tune split's own (100,000..100,137). E.g.

    .venv/bin/python benchmarks/detection.py --source independent --split tune \
        --extra failstop_launcher_kill:32x4x1,16x4x2,64x2x1,8x4x4:8 --keep /tmp/extra --jobs 1

`--clock cpu` is the control: analysis reads the CPU-side figures only, as a detector that ignores the device
columns would; on gpu timing it must FAIL (the CUDA job's straggler is invisible there).

For every scenario of `simulator.standard_suite()` and each timing (cpu: gloo semantics; gpu: a CUDA job's, where
only the device columns carry the straggler signal) it simulates the run, analyzes it exactly as `rankwatch analyze`
does (clock auto), and matches the incidents against the scenario's ground-truth labels:

- an incident matches a label when the class is the same and the subject is the same or the ranks overlap;
- per class: precision = matched incidents / incidents, recall = matched labels / labels, F1;
- localization accuracy = matched labels whose incident names the exact subject (kind and id) / matched labels; a
  slow-link label of the independent source also lists the links no transfer of its run can tell apart from it
  (`indistinguishable`: every link slowing exactly the same rings and stage-to-stage sends, from the generator's
  world, not from the detectors). Where that set has more than one link the pair is beyond the data, and an incident
  naming exactly that set ('a<->b | c<->d ...') localizes it; a larger or smaller set, or a wrong pair, does not.
  The report counts those labels and how many the pair itself localized. A replica of one rank is that rank:
  `replica:dp=k` and `rank:N` name the same subject when N is replica k's only rank (the two sources name it
  differently, and a detector may use either);
- detection latency = detection_step - labeled onset step, for matched stragglers;
- false incidents on clean controls = every incident raised in a scenario that expects none;
- cause accuracy = matched stragglers whose incident names the labeled cause / matched stragglers with a known
  cause; in gpu mode its host_stall / device_slow part says whether a host-thread stall and a slow GPU are told apart;
- quarantines: the devices the recovery policy takes out of placement from each run's incidents alone
  (`recovery.single_run_quarantines`: no gate, no recurrence, so only device faults with direct hardware evidence).
  A *wrongful* quarantine is a quarantined device no label of its run marks `device_fault`; a *missed* one is a
  `device_fault` label whose device is not quarantined. Labels without the key are not device faults.

Targets (issue 3), in each timing: F1 >= 0.95 per class, localization >= 0.95, no incident on any clean control,
stragglers detected within 10 steps of onset; in gpu mode also host_stall vs device_slow cause accuracy >= 0.95.
Issue 14 adds: no wrongful quarantine, and >= 90 % of the device-fault labels quarantined.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rankwatch.analytics.analyze import analyze
from rankwatch.analytics.frames import Clock
from rankwatch.analytics.incidents import Incident
from rankwatch.recovery.decision import TargetKind
from rankwatch.recovery.policy import single_run_quarantines

from independent import Scenario as IndependentScenario  # benchmarks/independent, beside this script
from independent import generate as generate_independent, scenarios as independent_scenarios
from independent.suite import SPLITS
from rankwatch.simulator import Scenario, simulate, standard_suite
from rankwatch.simulator.config import Timing

TARGET_F1 = 0.95
TARGET_LOCALIZATION = 0.95
TARGET_LATENCY_STEPS = 10
TARGET_DEVICE_CAUSE = 0.95
TARGET_QUARANTINED = 0.90
_DEVICE_CAUSES = frozenset({"host_stall", "device_slow"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    scenario: str
    timing: str
    """cpu | gpu (a `Timing` for the simulator source)."""
    ranks: int
    steps: int
    expected: tuple[dict[str, Any], ...]
    incidents: tuple[dict[str, Any], ...]
    seconds_simulate: float
    seconds_analyze: float


def _run_one(scenario: Scenario, root: Path, clock: Clock = Clock.AUTO) -> Outcome:
    out = root / str(scenario.config.timing) / scenario.name
    t0 = time.perf_counter()
    simulate(scenario.config, out)
    t1 = time.perf_counter()
    incidents = analyze(out, clock=clock).incidents
    t2 = time.perf_counter()
    labels = json.loads((out / "labels.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return Outcome(
        scenario=scenario.name, timing=scenario.config.timing, ranks=labels["ranks"], steps=labels["steps"], expected=tuple(labels["expected"]),
        incidents=tuple(i.to_dict() for i in incidents), seconds_simulate=t1 - t0, seconds_analyze=t2 - t1,
    )


def _run_independent(scenario: Any, root: Path, timing: str, clock: Clock = Clock.AUTO, keep: bool = False) -> Outcome:
    """`_run_one` for a scenario of the independent source (benchmarks/independent: written apart from the
    detectors, with its own physics and noise model). With `keep` the run stays under `root`, and a run already
    there from the same seed is analyzed again without generating it anew (generation is most of a suite's time)."""
    t0 = time.perf_counter()
    out = root / timing / scenario.name
    if not (keep and _generated(out, scenario.seed, timing)):
        shutil.rmtree(out, ignore_errors=True)
        out = generate_independent(scenario, root / timing, timing)
    t1 = time.perf_counter()
    incidents = analyze(out, clock=clock).incidents
    t2 = time.perf_counter()
    labels = json.loads((out / "labels.json").read_text())
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return Outcome(
        scenario=scenario.name, timing=timing, ranks=labels["ranks"], steps=labels["steps"],
        expected=tuple(labels["expected"]), incidents=tuple(i.to_dict() for i in incidents),
        seconds_simulate=t1 - t0, seconds_analyze=t2 - t1,
    )


def _generated(run: Path, seed: int, timing: str) -> bool:
    """Whether `run` holds a complete independent run of `seed` in `timing` (its labels are written last)."""
    try:
        labels = json.loads((run / "labels.json").read_text())
    except (OSError, ValueError):
        return False
    return labels.get("seed") == seed and labels.get("timing") == timing


def _localized(label: dict[str, Any], inc: dict[str, Any]) -> bool:
    """The incident names the label's subject, or — for a link the data cannot tell apart from others — exactly the
    set of links indistinguishable from it (see the module docstring)."""
    if (label["subject_kind"], str(label["subject"])) == (inc["subject_kind"], str(inc["subject"])):
        return True
    one = {label["subject_kind"], inc["subject_kind"]} == {"rank", "replica"}
    if one and [int(r) for r in label["ranks"]] == [int(r) for r in inc["ranks"]] and len(label["ranks"]) == 1:
        rank = label if label["subject_kind"] == "rank" else inc
        return str(rank["subject"]) == str(int(label["ranks"][0]))
    tied = sorted(str(x) for x in label.get("indistinguishable") or ())
    return (label["subject_kind"] == inc["subject_kind"] == "link" and len(tied) > 1
            and sorted(str(inc["subject"]).split(" | ")) == tied)


def _matches(label: dict[str, Any], inc: dict[str, Any]) -> bool:
    if label["class"] != inc["class"]:
        return False
    same_subject = (label["subject_kind"], str(label["subject"])) == (inc["subject_kind"], str(inc["subject"]))
    return same_subject or bool(set(label["ranks"]) & set(inc["ranks"]))


@dataclass
class _Tally:
    labels: int = 0
    found: int = 0
    incidents: int = 0
    true_incidents: int = 0
    localized: int = 0

    def f1(self) -> tuple[float, float, float]:
        p = self.true_incidents / self.incidents if self.incidents else 1.0
        r = self.found / self.labels if self.labels else 1.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)


@dataclass
class Score:
    """One timing's figures over the suite."""

    tallies: dict[str, _Tally]
    localization: float
    controls: int
    clean_false: list[str]
    latencies: list[int]
    causes: tuple[int, int]
    """(matched stragglers naming the labeled cause, matched stragglers with a known labeled cause)"""
    device_causes: tuple[int, int]
    """The same over host_stall / device_slow labels only (gpu mode)."""
    misses: list[str]
    device_faults: int = 0
    """Labels marked `device_fault`."""
    wrongful: list[str] = field(default_factory=list)
    """'scenario: device' per quarantined device no label of its run marks device_fault."""
    missed_quarantines: list[str] = field(default_factory=list)
    """'scenario: device' per device_fault label whose device the policy did not quarantine."""
    link_sets: tuple[int, int] = (0, 0)
    """(matched slow-link labels localized by naming exactly their indistinguishable set, matched slow-link labels
    whose set has more than one link)."""

    def failures(self) -> list[str]:
        out = [f"{k}: F1 {t.f1()[2]:.3f} < {TARGET_F1}" for k, t in sorted(self.tallies.items())
               if (t.labels or t.incidents) and t.f1()[2] < TARGET_F1]
        if self.localization < TARGET_LOCALIZATION:
            out.append(f"localization {self.localization:.3f} < {TARGET_LOCALIZATION}")
        if self.clean_false:
            out.append(f"{len(self.clean_false)} incidents on clean controls")
        if self.latencies and max(self.latencies) > TARGET_LATENCY_STEPS:
            out.append(f"straggler latency max {max(self.latencies)} > {TARGET_LATENCY_STEPS}")
        right, total = self.device_causes
        if total and right / total < TARGET_DEVICE_CAUSE:
            out.append(f"host_stall/device_slow cause accuracy {right}/{total} < {TARGET_DEVICE_CAUSE}")
        if self.wrongful:
            out.append(f"{len(self.wrongful)} wrongful quarantines")
        quarantined = self.device_faults - len(self.missed_quarantines)
        if self.device_faults and quarantined / self.device_faults < TARGET_QUARANTINED:
            out.append(f"device faults quarantined {quarantined}/{self.device_faults} < {TARGET_QUARANTINED}")
        return out


def quarantine_outcome(expected: tuple[dict[str, Any], ...],
                       incidents: tuple[dict[str, Any], ...]) -> tuple[list[str], list[str], int]:
    """(wrongly quarantined devices, device-fault devices not quarantined, device-fault labels) of one run: the
    quarantines are the policy's own, from the run's incidents alone."""
    parsed = []
    for i in incidents:
        try:
            parsed.append(Incident.from_dict(i))
        except ValueError:  # a harness's placeholder for an analysis that raised: it quarantines nothing
            continue
    targets = single_run_quarantines(parsed)
    quarantined = {t.id for t in targets if t.kind is TargetKind.DEVICE}
    faulty = [str(lab.get("device") or lab["subject"]) for lab in expected if lab.get("device_fault")]
    wrongful = sorted(quarantined - set(faulty))
    missed = [d for d in faulty if d not in quarantined]
    return wrongful, missed, len(faulty)


def score(outcomes: list[Outcome]) -> Score:
    tallies: dict[str, _Tally] = {}
    latencies: list[int] = []
    clean_false: list[str] = []
    misses: list[str] = []
    causes = [0, 0]
    device_causes = [0, 0]
    link_sets = [0, 0]
    wrongful: list[str] = []
    missed_q: list[str] = []
    device_faults = 0
    for o in outcomes:
        bad_q, miss_q, n_faults = quarantine_outcome(o.expected, o.incidents)
        wrongful += [f"{o.scenario}: {d}" for d in bad_q]
        missed_q += [f"{o.scenario}: {d}" for d in miss_q]
        device_faults += n_faults
        if not o.expected:
            clean_false += [f"{o.scenario}: {i['class']} {i['subject_kind']}:{i['subject']} — {i['summary']}" for i in o.incidents]
        used: set[int] = set()
        for label in o.expected:
            t = tallies.setdefault(label["class"], _Tally())
            t.labels += 1
            hit = next((k for k, inc in enumerate(o.incidents) if k not in used and _matches(label, inc)), None)
            if hit is None:
                misses.append(f"{o.scenario}: missed {label['class']} {label['subject_kind']}:{label['subject']}")
                continue
            used.add(hit)
            inc = o.incidents[hit]
            t.found += 1
            if len(label.get("indistinguishable") or ()) > 1:
                link_sets[1] += 1
                link_sets[0] += _localized(label, inc) and " | " in str(inc["subject"])
            if _localized(label, inc):
                t.localized += 1
            else:
                misses.append(f"{o.scenario}: {label['class']} localized to {inc['subject_kind']}:{inc['subject']}, "
                              f"expected {label['subject_kind']}:{label['subject']}")
            if label["class"] == "straggler" and inc["detection_step"] is not None and label["onset_step"] is not None:
                latencies.append(int(inc["detection_step"]) - int(label["onset_step"]))
                if latencies[-1] > TARGET_LATENCY_STEPS:
                    misses.append(f"{o.scenario}: straggler {inc['subject_kind']}:{inc['subject']} detected at step "
                                  f"{inc['detection_step']}, {latencies[-1]} steps after its onset "
                                  f"{label['onset_step']}")
            if label["class"] == "straggler" and label["cause"] != "unknown":
                right = inc["cause"] == label["cause"]
                causes[0] += right
                causes[1] += 1
                if label["cause"] in _DEVICE_CAUSES:
                    device_causes[0] += right
                    device_causes[1] += 1
                if not right:
                    misses.append(f"{o.scenario}: straggler cause {inc['cause']}, expected {label['cause']}")
        for k, inc in enumerate(o.incidents):
            t = tallies.setdefault(inc["class"], _Tally())
            t.incidents += 1
            if k in used:
                t.true_incidents += 1
            elif o.expected:
                misses.append(f"{o.scenario}: extra {inc['class']} {inc['subject_kind']}:{inc['subject']} — {inc['summary']}")
    found = sum(t.found for t in tallies.values())
    localization = sum(t.localized for t in tallies.values()) / found if found else 1.0
    return Score(tallies=tallies, localization=localization, controls=sum(1 for o in outcomes if not o.expected),
                 clean_false=clean_false, latencies=latencies, causes=(causes[0], causes[1]),
                 device_causes=(device_causes[0], device_causes[1]), misses=misses, device_faults=device_faults,
                 wrongful=wrongful, missed_quarantines=missed_q, link_sets=(link_sets[0], link_sets[1]))


def _ratio(pair: tuple[int, int]) -> str:
    return f"{pair[0] / pair[1]:.3f} ({pair[0]}/{pair[1]})" if pair[1] else "-"


def report(scores: dict[Any, Score]) -> int:
    """Print the per-class table of every timing side by side, then each timing's misses; 1 if a target is missed."""
    modes = list(scores)
    klasses = sorted({k for s in scores.values() for k in s.tallies})
    cell = f"{'labels':>6} {'found':>5} {'incid.':>6} {'prec':>6} {'recall':>6} {'F1':>6} {'local.':>6}"
    width = len(cell)
    print("\n" + " " * 15 + " | ".join(f"{'timing ' + str(m):^{width}}" for m in modes))
    print(f"{'class':<14} " + " | ".join(cell for _ in modes))
    for klass in klasses:
        cells = []
        for m in modes:
            t = scores[m].tallies.get(klass, _Tally())
            p, r, f1 = t.f1()
            loc = t.localized / t.found if t.found else 1.0
            mark = "*" if (t.labels or t.incidents) and f1 < TARGET_F1 else " "
            cells.append(f"{t.labels:>6} {t.found:>5} {t.incidents:>6} {p:>6.3f} {r:>6.3f} {f1:>5.3f}{mark} {loc:>6.3f}")
        print(f"{klass:<14} " + " | ".join(cells))
    print("(* = F1 below target)\n")
    rows = [
        (f"localization (target >= {TARGET_LOCALIZATION})", lambda s: f"{s.localization:.3f}"),
        ("false incidents on clean controls (target 0)", lambda s: f"{len(s.clean_false)} of {s.controls} controls"),
        (f"straggler latency median / max (target <= {TARGET_LATENCY_STEPS})",
         lambda s: f"{statistics.median(s.latencies):.0f} / {max(s.latencies)} over {len(s.latencies)}"
         if s.latencies else "-"),
        ("straggler cause accuracy (known causes)", lambda s: _ratio(s.causes)),
        (f"host_stall vs device_slow (target >= {TARGET_DEVICE_CAUSE})", lambda s: _ratio(s.device_causes)),
        ("links beyond the data: named as their exact set", lambda s: _ratio(s.link_sets)),
        ("wrongful quarantines (target 0)", lambda s: str(len(s.wrongful))),
        (f"device faults quarantined (target >= {TARGET_QUARANTINED})",
         lambda s: _ratio((s.device_faults - len(s.missed_quarantines), s.device_faults))),
    ]
    for name, fmt in rows:
        print(f"{name:<58} " + " | ".join(f"{fmt(scores[m]):<24}" for m in modes))
    failed = False
    for m in modes:
        s = scores[m]
        fails = s.failures()
        failed |= bool(fails)
        print(f"\ntiming {m}: {'FAIL: ' + '; '.join(fails) if fails else 'PASS'}")
        for line in s.clean_false + s.misses:
            print(f"  {line}")
        for line in s.wrongful:
            print(f"  wrongful quarantine {line}")
        for line in s.missed_quarantines:
            print(f"  missed quarantine {line}")
    print("\nverdict:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timing", choices=("cpu", "gpu", "both"), default="both",
                    help="clock semantics to simulate: gloo (cpu), CUDA (gpu) or both, scored side by side")
    ap.add_argument("--only", default="", help="run scenarios whose name contains this")
    ap.add_argument("--keep", type=Path, default=None,
                    help="simulate into this folder and keep the runs (default: a temp folder); with --source "
                         "independent, runs already there from the same seed are analyzed again, not regenerated")
    ap.add_argument("--jobs", type=int, default=2, help="scenarios in parallel")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="add this to every scenario's seed: the same faults over fresh noise (a held-out draw)")
    ap.add_argument("--clock", choices=("auto", "cpu"), default="auto",
                    help="the clock analysis reads: auto (the device's where every rank has it), or cpu — the control "
                         "that shows a CPU-only detector blind on gpu timing (expected to FAIL there)")
    ap.add_argument("--source", choices=("sim", "independent"), default="sim",
                    help="sim: simulator.standard_suite() (written beside the detectors); independent: "
                         "benchmarks/independent (written apart from them), with --split")
    ap.add_argument("--split", choices=tuple(SPLITS), default="tune",
                    help="independent source only: tune seeds (may be looked at while tuning) or held-out seeds "
                         "(run only for the reported figure, never while tuning)")
    ap.add_argument("--extra", action="append", default=[], metavar="KIND:LAYOUTS[:COUNT]",
                    help="independent source, tune split only: score COUNT fresh tune-range scenarios of KIND over "
                         "the layouts DPxTPxPP[,...] instead of the split's (repeatable; see the docstring)")
    args = ap.parse_args()
    modes = [Timing.CPU, Timing.GPU] if args.timing == "both" else [Timing(args.timing)]
    if args.source == "independent":
        return _independent_main(args, [str(m) for m in modes])
    base = [s for s in standard_suite() if args.only in s.name]
    if not base:
        print(f"no scenario name contains {args.only!r}")
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="rankwatch-detection-"))
    sizes = sorted({s.config.world_size for s in base})
    print(f"{len(base)} scenarios x {len(modes)} timing(s), {min(sizes)}..{max(sizes)} ranks, "
          f"{sum(1 for s in base if s.name.startswith('clean'))} clean controls; simulating into {root}")
    suite = [Scenario(name=s.name, config=replace(s.config, seed=s.config.seed + args.seed_offset, timing=m))
             for m in modes for s in base]
    n = len(suite)
    return _run_suite(args, [str(m) for m in modes], root, 36, _run_one, suite, [root] * n, [Clock(args.clock)] * n)


def _run_suite(args: argparse.Namespace, modes: list[str], root: Path, width: int, run: Any, *columns: list[Any]) -> int:
    """Run `run` over the argument `columns` in parallel, print a line per outcome, and score each timing."""
    t0 = time.perf_counter()
    by_mode: dict[str, list[Outcome]] = {m: [] for m in modes}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for o in pool.map(run, *columns):
            status = "clean" if not o.expected else ",".join(sorted({e["class"] for e in o.expected}))
            got = ",".join(f"{i['class']}:{i['subject_kind']}:{i['subject']}" for i in o.incidents) or "-"
            print(f"  {o.timing:<3} {o.scenario:<{width}} {o.ranks:>5} ranks {o.steps:>4} steps  expect {status:<20} "
                  f"got {got}  ({o.seconds_simulate:.1f}+{o.seconds_analyze:.1f}s)", flush=True)
            by_mode[o.timing].append(o)
    print(f"suite took {time.perf_counter() - t0:.0f}s")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return report({m: score(by_mode[m]) for m in modes})


_EXTRA_SEED = 160_000
_EXTRA_STEPS = (100, 160, 220, 300, 140, 250)


def extra_scenarios(spec: str, timing: str) -> list[Any]:
    """The tune-range scenarios of one `--extra KIND:LAYOUTS[:COUNT]` in `timing` (see the module docstring)."""
    kinds = sorted({sc.kind for sc in independent_scenarios("tune", timing)})
    kind, _, rest = spec.partition(":")
    layouts_text, _, count_text = rest.partition(":")
    if kind not in kinds:
        raise ValueError(f"--extra {spec!r}: unknown kind {kind!r}; kinds: {', '.join(kinds)}")
    try:
        layouts = [tuple(int(x) for x in lay.split("x")) for lay in layouts_text.split(",")]
        count = int(count_text) if count_text else len(layouts)
    except ValueError:
        raise ValueError(f"--extra {spec!r}: layouts are DPxTPxPP[,...] and COUNT an integer") from None
    if any(len(lay) != 3 or min(lay) < 1 for lay in layouts) or not 1 <= count <= 1_000:
        raise ValueError(f"--extra {spec!r}: each layout is DPxTPxPP of positive sizes, COUNT in 1..1000")
    base = _EXTRA_SEED + 1_000 * kinds.index(kind)
    return [
        IndependentScenario(name=f"extra-{i:03d}-{kind}-n{dp * tp * pp}", seed=base + i, kind=kind, dp=dp, tp=tp, pp=pp,
                            steps=_EXTRA_STEPS[i % len(_EXTRA_STEPS)], timing=timing)
        for i in range(count) for dp, tp, pp in [layouts[i % len(layouts)]]
    ]


def _independent_main(args: argparse.Namespace, modes: list[str]) -> int:
    if args.extra and args.split != "tune":
        print("--extra draws tune-range seeds: it goes with --split tune only")
        return 2
    try:
        pool = {m: ([sc for spec in args.extra for sc in extra_scenarios(spec, m)] if args.extra
                    else independent_scenarios(args.split, m)) for m in modes}
    except ValueError as exc:
        print(exc)
        return 2
    chosen = {m: [sc for sc in pool[m] if args.only in sc.name] for m in modes}
    if not any(chosen.values()):
        print(f"no scenario name contains {args.only!r}")
        return 2
    root = args.keep or Path(tempfile.mkdtemp(prefix="rankwatch-detection-independent-"))
    n = sum(len(v) for v in chosen.values())
    what = f"{len(args.extra)} --extra set(s)" if args.extra else f"{args.split} split"
    print(f"independent source, {what}: {n} runs over {len(modes)} timing(s); generating into {root}")
    jobs = [(sc, m) for m in modes for sc in chosen[m]]
    return _run_suite(args, modes, root, 48, _run_independent, [sc for sc, _ in jobs], [root] * len(jobs),
                      [m for _, m in jobs], [Clock(args.clock)] * len(jobs), [args.keep is not None] * len(jobs))

if __name__ == "__main__":
    sys.exit(main())
