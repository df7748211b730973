"""The wheel carries every module, each package's public surface is pinned, and the house's arrows point one way."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PKG = SRC / "rankwatch"
NOT_MODULES = {"rankwatch.notebooks.postmortem", "rankwatch.dashboard.app"}
"""Shipped in the wheel but never imported: the post-mortem notebook (a jupytext percent file) runs as a notebook,
the dashboard's entry point as a Streamlit script."""

ROOMS = ("base", "collector", "analytics", "recovery", "control", "canary", "simulator", "dashboard", "notebooks",
         "cli")
"""The house, bottom to top (docs/architecture.md): each room is a package under rankwatch, or the cli module."""

ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "collector": frozenset({"base"}),
    "analytics": frozenset({"base", "collector"}),
    "recovery": frozenset({"base", "collector", "analytics"}),
    "control": frozenset({"base", "collector", "analytics", "recovery"}),
    "canary": frozenset({"base", "collector", "analytics", "recovery", "control"}),
    "simulator": frozenset({"base", "collector", "analytics"}),
    "dashboard": frozenset({"base", "analytics"}),
    "notebooks": frozenset({"base", "analytics"}),
    "cli": frozenset(ROOMS) - {"cli"},
}
"""The arrows: which rooms each room may import (besides itself and the package root, which holds only the version).
No exemption list: a new arrow is a line here, in review."""


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, src: Path, *, names: bool = False) -> Iterator[tuple[int, str]]:
    """(line, imported module) of every import in the file: at module level, inside functions and under
    TYPE_CHECKING alike, relative ones resolved, and `importlib.import_module("...")` with a literal name. With
    `names`, also `module.name` for each name of a `from module import name` (it may be a submodule)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path, src).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            yield node.lineno, base
            if names or _room(base) is None:  # `from rankwatch import canary` imports the package canary
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rankwatch" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ROOMS else None


def layering_violations(src: Path) -> list[str]:
    """Every import of a room its room may not import (see ALLOWED), and every file outside the rooms."""
    out = []
    for path in sorted((src / "rankwatch").rglob("*.py")):
        me = _module_name(path, src)
        mine = _room(me)
        if mine is None:
            if me != "rankwatch":
                out.append(f"{path.relative_to(src)}: in no room of the house")
            continue
        for line, target in _imports(path, src):
            theirs = _room(target)
            if theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
                out.append(f"{path.relative_to(src)}:{line}: {mine} imports {target} ({theirs})")
    return out


def import_cycles(src: Path) -> list[list[str]]:
    """Cycles among rankwatch modules, every import counted (functions and TYPE_CHECKING included)."""
    graph: dict[str, set[str]] = {}
    modules = {_module_name(p, src) for p in (src / "rankwatch").rglob("*.py")}
    for path in (src / "rankwatch").rglob("*.py"):
        me = _module_name(path, src)
        edges = graph.setdefault(me, set())
        for _, target in _imports(path, src, names=True):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # a module's own packages (their __init__ runs first) and the root package are not edges of a cycle
            if target and target != me and target != "rankwatch" and not me.startswith(f"{target}."):
                edges.add(target)
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_import_arrows_point_one_way() -> None:
    """Bottom to top: base -> collector -> analytics -> recovery -> control -> canary; the simulator stands in for
    a job and its collector (base, collector, analytics' incident types for its labels); the dashboard and the
    post-mortem notebook draw analytics' views, side by side; the cli composes everything."""
    assert layering_violations(SRC) == []


def test_the_layering_check_fails_on_a_planted_upward_import(tmp_path: Path) -> None:
    """The check itself can fail: an upward import inside a function, one under TYPE_CHECKING, a relative one and a
    file outside the rooms are each reported; a downward import is not."""
    pkg = tmp_path / "rankwatch"
    for room in ("base", "collector", "analytics", "canary"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "analytics" / "ok.py").write_text("from rankwatch.collector import sink\nfrom rankwatch.base import rundir\n")
    (pkg / "collector" / "bad.py").write_text("def f():\n    from rankwatch.analytics.views import build\n")
    (pkg / "base" / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from rankwatch.canary.config import CanaryConfig\n")
    (pkg / "analytics" / "rel.py").write_text("from ..canary import loop\n")
    (pkg / "analytics" / "rel2.py").write_text("from .. import canary\n")
    (pkg / "stray.py").write_text("")
    found = layering_violations(tmp_path)
    assert found == [
        "rankwatch/analytics/rel.py:1: analytics imports rankwatch.canary (canary)",
        "rankwatch/analytics/rel2.py:1: analytics imports rankwatch.canary (canary)",
        "rankwatch/base/typed.py:3: base imports rankwatch.canary.config (canary)",
        "rankwatch/collector/bad.py:2: collector imports rankwatch.analytics.views (analytics)",
        "rankwatch/stray.py: in no room of the house",
    ], found


def test_no_import_circle() -> None:
    assert import_cycles(SRC) == []


def test_an_import_circle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "rankwatch" / "analytics"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "views.py").write_text("def f():\n    from rankwatch.analytics import analyze\n")
    (pkg / "analyze.py").write_text("from rankwatch.analytics.views import f\n")
    assert import_cycles(tmp_path) == [["rankwatch.analytics.analyze", "rankwatch.analytics.views",
                                        "rankwatch.analytics.analyze"]]


def _source_modules() -> list[str]:
    return sorted(_module_name(p, SRC) for p in PKG.rglob("*.py"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wheel_contains_and_imports_every_module(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rankwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {str(p.relative_to(SRC)) for p in PKG.rglob("*.py")}
    assert expected <= names, sorted(expected - names)
    assert not [n for n in names if n.startswith(("rankwatch/tests/", "tests/", "benchmarks/"))]
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    script = (
        "import importlib, sys; sys.path.insert(0, sys.argv[1]); "
        "mods = sys.argv[2:]; "
        "[importlib.import_module(m) for m in mods]; "
        "import rankwatch; assert rankwatch.__file__.startswith(sys.argv[1]), rankwatch.__file__; print(len(mods))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(target), *_importable()], check=True, capture_output=True, text=True
    )
    assert out.stdout.strip() == str(len(_importable()))


def _importable() -> list[str]:
    return [m for m in _source_modules() if m not in NOT_MODULES and ".screens." not in m]


EXPORTS = {
    "rankwatch.base": {
        "SCHEMA_VERSION", "GroupInfo", "Hosts", "Layout", "RunDir", "RunFileError", "Table", "atomic_write",
        "link_name", "read_launches",
    },
    "rankwatch.collector": {
        "SCHEMA_VERSION", "CheckpointPhaseRecord", "CollectiveTracker", "Collector", "CollectorConfig", "DeviceInfo",
        "CudaDeviceTimer", "DeviceTimer", "FakeDeviceTimer", "Mark",
        "Fingerprint", "GpuMonitor", "GpuSample", "GpuSampler", "GpuUnavailable", "GroupInfo", "MemorySink",
        "NullCollector", "NvmlSampler", "ParquetSink", "ReplaySampler", "Sink", "SinkConfig", "StepRecord", "Table",
        "attach", "detach", "fingerprint", "instrument_distributed", "open_sampler",
        "RollupError", "RollupResult", "list_parts", "rollup_all", "run_agent",
    },
    "rankwatch.analytics": {
        "HardwareConfig", "attribute_device_faults", "LivenessConfig", "LivenessMonitor", "LivenessView", "RankState",
        "same_fault", "ensure_views",
        "Analysis", "AnalysisConfig", "AnalyticsError", "AnomalyConfig", "Cause", "CorruptionConfig",
        "DivergenceConfig", "Evidence", "FailStopConfig", "FollowsKind", "Frames", "Incident", "IncidentClass",
        "LiveAnalyzer", "LiveConfig",
        "Localization", "QuarantineCandidate", "RunDirError", "RunObservation", "RunStore", "SchemaVersionError",
        "StragglerConfig", "Subject", "SubjectKind", "TableSummary", "analyze", "connect", "detect_all",
        "detect_anomalies", "detect_corruption", "detect_divergence", "detect_failstops", "detect_stragglers",
        "load_frames", "localize", "open_run", "read_incidents", "render_incidents", "table_summaries",
        "write_analysis",
    },
    "rankwatch.recovery": {
        "Action", "Candidate", "CheckpointCatalogView", "CheckpointConfig", "CheckpointRef", "Checkpointer", "Decision",
        "DeterminismInputs", "Domain", "EvidenceBundle", "FakeLauncher", "GateOutcome", "GateRefused", "GateResult",
        "GateVerdict", "Idempotency", "Job", "JobDeclaration", "JobLoader", "LaunchResult", "Launcher", "Lineage",
        "LoadResult", "Manifest", "MembershipSupport", "RankState", "RngScope", "SaveResult", "ScopeKind", "Target", "TargetKind",
        "Verdict", "check_lineage", "choose", "last_completed_step", "list_checkpoints", "load_checkpoint",
        "pin_ddp_buckets", "preflight", "preserve_evidence", "run_gate", "Staged", "commit_checkpoint",
        "stage_checkpoint", "verify_evidence",
    },
    "rankwatch.recovery.policy": {
        "DECISION_CASES", "DecisionCase", "DecisionRow", "RecurrenceView", "decide", "decision_rows",
        "hold_on_partial_input", "quarantine_targets", "render_decision_table", "single_run_quarantines",
        "write_decision_doc",
    },
    "rankwatch.control": {
        "AlertConfigError", "AlertMessage", "AlertSender", "AlertTracker", "HttpTransport", "Manager",
        "ManagerService", "MemoryTransport", "Message", "MessageType", "Monitor", "Outbox", "RecoveryPlan",
        "RetryConfig", "Signer", "TrackerConfig", "Transport", "apply", "assess", "decision_message",
        "incident_message", "load_secret", "new_secret", "parse_message", "plan_recovery", "serve", "supervise",
        "write_secret",
    },
    "rankwatch.canary": {
        "CanaryConfig", "CanaryLauncher", "Faults", "ModelConfig", "canary_declaration", "config_from_run", "launch",
        "parse_fault",
    },
    "rankwatch.analytics.views": {
        "FRAME_NAMES", "LIVE_SKEW_NS", "MANIFEST", "VIEWS_VERSION", "Comparability", "IncidentDetail", "RunViews",
        "ViewStore", "ViewSummary", "across_runs", "breakdown", "build_views", "checkpoint_summary",
        "collective_progress", "comparability", "decisions", "fingerprint_summary", "gpu_peers", "grid",
        "heartbeat_age", "heatmap", "incident_detail", "incident_table", "leaderboard", "lineage", "link_summary",
        "live_progress", "observation", "progress_frame", "quarantine", "rank_steps", "recorded_incidents",
        "run_incidents", "stored_views", "telemetry_signature", "timeline", "topology_status", "views_dir",
        "write_views", "PENDING", "STATES", "FailStopStory", "action_text", "duration", "fail_stop_story", "incident_states",
        "is_fail_stop", "local_time", "incident_marks", "Mark", "path_words", "readable", "readable_text", "signal_name", "throttle_names",
    },
    "rankwatch.analytics.liveness": {
        "ExitRecord", "LivenessConfig", "LivenessMonitor", "LivenessView", "OpenCollective", "RankLiveness",
        "RankRecord", "LIVE_ID_TAG", "RankState", "Seen", "classify", "decode_rank_record", "parse_exit_record",
        "same_fault",
    },
    "rankwatch.analytics.straggler": {"StragglerConfig", "detect_stragglers"},
    "rankwatch.analytics.whatif": {
        "Costing", "Graph", "RankSteps", "Replayed", "Share", "WhatIf", "WhatIfInputError", "analyze_graph",
        "build_graph", "parse_steps", "replay", "whatif", "whatif_of",
    },
    "rankwatch.canary.drills": {
        "DRILLS", "REPORT_FILE", "VICTIM", "DrillReport", "DrillSpec", "Tamper", "drill_config", "read_report",
        "reference_fingerprints", "report_json", "report_table", "run_drill", "run_drills", "write_report",
    },
    "rankwatch.dashboard": set(),
    "rankwatch.notebooks": {"NOTEBOOK", "run_postmortem"},
    "rankwatch.simulator": {
        "Labels", "Scenario", "SimConfig", "SimResult", "parse_sim_fault", "read_labels", "run_scenario", "simulate",
        "split_tail", "standard_suite",
    },
}


@pytest.mark.parametrize("package", sorted(EXPORTS))
def test_public_surface_is_pinned(package: str) -> None:
    mod = importlib.import_module(package)
    assert set(mod.__all__) == EXPORTS[package]
    for name in mod.__all__:
        assert hasattr(mod, name), name


def test_every_package_pins_its_surface() -> None:
    packages = {_module_name(p, SRC) for p in PKG.rglob("__init__.py")} - {"rankwatch"}
    assert packages <= set(EXPORTS), sorted(packages - set(EXPORTS))


def test_training_processes_do_not_load_the_analysis_stack() -> None:
    """What a training rank and the canary's launcher import — the collector, the recovery contract, the canary —
    loads neither DuckDB, polars nor scikit-learn, nor analytics or the live loop."""
    code = ("import sys, rankwatch.collector, rankwatch.recovery, rankwatch.canary, rankwatch.canary.loop, "
            "rankwatch.canary.launcher, rankwatch.recovery.checkpointer, rankwatch.recovery.job; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'polars', 'sklearn') "
            "or m.startswith(('rankwatch.analytics', 'rankwatch.control'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_analysis_side_does_not_load_torch() -> None:
    """Analytics, the simulator, the dashboard's data layer and the post-mortem runner read files: none loads torch
    (the collector package imports its torch-bound names on first use)."""
    code = ("import sys, rankwatch.analytics, rankwatch.analytics.views, rankwatch.simulator, rankwatch.dashboard.data, "
            "rankwatch.notebooks, rankwatch.collector; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
    got = subprocess.run([sys.executable, "-c", "import rankwatch.collector as c; print(c.Collector.__module__)"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert got.stdout.strip() == "rankwatch.collector.collector"
