"""A generated run for the dashboard, post-mortem and views tests: simulated telemetry with a straggler, a
fail-stop-free history, checkpoints and fingerprints; analysed (views stored); a dry-run recovery plan decided by
the real recovery manager; a lineage entry. Building one takes a few seconds."""

from __future__ import annotations

from pathlib import Path

from rankwatch.analytics.analyze import AnalysisConfig, analyze, write_analysis
from rankwatch.base.schema import Comparability, LineageKind
from rankwatch.base.topology import Layout
from rankwatch.canary.config import canary_declaration
from rankwatch.control.manager import plan_recovery, write_plan
from rankwatch.recovery.decision import CheckpointCatalogView
from rankwatch.recovery.lineage import Details, Lineage, NewEntry, Verdict, lineage_path
from rankwatch.simulator import SimConfig, parse_sim_fault, simulate

LAYOUT = Layout(dp=4, tp=2, pp=2)
STRAGGLER = 5


def analyzed_run(out: Path, *, steps: int = 300, faults: tuple[str, ...] = (f"gpu_slow:rank={STRAGGLER},from=100,factor=1.3",),
                 seed: int = 3) -> Path:
    """Simulate, analyse with views, decide a dry-run plan, and start a lineage: the run a user opens."""
    cfg = SimConfig(name="views", layout=LAYOUT, hosts=4, steps=steps, seed=seed, checkpoint_every=100,
                    faults=tuple(parse_sim_fault(f) for f in faults))
    simulate(cfg, out)
    analysis = analyze(out, config=AnalysisConfig(views=True))
    write_analysis(analysis)
    plan = plan_recovery(analysis.incidents, job=canary_declaration(LAYOUT), catalog=CheckpointCatalogView(committed=()))
    write_plan(out, plan)
    Lineage(lineage_path(out)).append(NewEntry(kind=LineageKind.START, verdict=Verdict(
        comparability=Comparability.BITWISE_IDENTICAL_EXPECTED, reasons=(), note="first launch"), details=Details(
        text="simulated run")))
    return out
