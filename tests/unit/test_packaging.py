"""The wheel carries every module, and each package's public surface is pinned."""

from __future__ import annotations

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["collector", "analytics", "trainer", "dashboard", "notebooks", "simulator"]
NOT_MODULES = {"rankwatch.notebooks.postmortem", "rankwatch.dashboard.app"}
"""Shipped in the wheel but never imported: the post-mortem notebook (a jupytext percent file) runs as a notebook,
the dashboard's entry point as a Streamlit script."""


TOP_MODULES = ("cli", "monitor", "drills")
"""Modules at the package's top (above collector, analytics and trainer: they compose them)."""


def _source_modules() -> list[str]:
    mods = ["rankwatch", *(f"rankwatch.{m}" for m in TOP_MODULES)]
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).glob("*.py")):
            mods.append(f"rankwatch.{pkg}" if f.name == "__init__.py" else f"rankwatch.{pkg}.{f.stem}")
    return mods


@pytest.mark.timeout(300)
def test_wheel_contains_and_imports_every_module(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("rankwatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {m.replace(".", "/") + ("/__init__.py" if m.count(".") < 2 and m.removeprefix("rankwatch.") not in TOP_MODULES else ".py") for m in _source_modules()}
    assert expected <= names, sorted(expected - names)
    pages = {f"rankwatch/dashboard/pages/{f.name}" for f in (ROOT / "dashboard" / "pages").glob("*.py")}
    assert pages and pages <= names, sorted(pages - names)  # Streamlit page scripts: shipped, run by the app
    assert not [n for n in names if n.startswith("rankwatch/tests/")]
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
    return [m for m in _source_modules() if m not in NOT_MODULES]


EXPORTS = {
    "rankwatch.collector": {
        "SCHEMA_VERSION", "CheckpointPhaseRecord", "CollectiveTracker", "Collector", "CollectorConfig", "DeviceInfo",
        "CudaDeviceTimer", "DeviceTimer", "FakeDeviceTimer", "Mark",
        "Fingerprint", "GpuMonitor", "GpuSample", "GpuSampler", "GpuUnavailable", "GroupInfo", "MemorySink",
        "NullCollector", "NvmlSampler", "ParquetSink", "ReplaySampler", "Sink", "SinkConfig", "StepRecord", "Table",
        "fingerprint", "instrument_distributed", "open_sampler",
        "RollupError", "RollupResult", "list_parts", "rollup_all", "run_agent",
    },
    "rankwatch.analytics": {
        "AlertConfigError", "AlertSender", "AlertTracker", "Outbox", "HardwareConfig", "attribute_device_faults",
        "LivenessConfig", "LivenessMonitor", "LivenessView", "RankState", "same_fault",
        "Action", "CheckpointCatalogView", "CheckpointRef", "Decision", "GateResult", "GateVerdict", "Idempotency",
        "MembershipSupport", "RecurrenceView", "decide",
        "Analysis", "AnalysisConfig", "AnalyticsError", "AnomalyConfig", "Cause", "CorruptionConfig",
        "DivergenceConfig", "Evidence", "FailStopConfig", "FollowsKind", "Frames", "Incident", "IncidentClass",
        "LiveAnalyzer", "LiveConfig",
        "Localization", "QuarantineCandidate", "RunDirError", "RunObservation", "RunStore", "SchemaVersionError",
        "StragglerConfig", "Subject", "SubjectKind", "TableSummary", "analyze", "connect", "detect_all",
        "detect_anomalies", "detect_corruption", "detect_divergence", "detect_failstops", "detect_stragglers",
        "load_frames", "localize", "open_run", "read_incidents", "render_incidents", "table_summaries",
        "write_analysis",
    },
    "rankwatch.trainer": {
        "CanaryConfig", "Candidate", "CheckpointConfig", "EvidenceBundle", "Faults", "Hosts", "LaunchResult",
        "Layout", "Lineage", "LoadResult", "ModelConfig", "SaveResult", "choose", "launch", "list_checkpoints",
        "load_checkpoint", "parse_fault", "preserve_evidence", "save_checkpoint", "verify_evidence",
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


_TAKE_ANALYTICS = ("manager.py", "service.py", "promises.py")
"""The trainer modules that may import analytics (the acting side's receivers of its results)."""


def test_import_arrows_point_one_way() -> None:
    """Arrows point one way: trainer -> collector, analytics -> collector; the simulator stands in for trainer +
    collector and labels with analytics' incident types; nothing but the cli and benchmarks import the simulator;
    nothing imports dashboard or notebooks, and the post-mortem notebook uses analytics alone. The trainer modules that take analytics' results are the recovery manager (the
    acting side receives incidents and decisions), its HTTP service (it verifies the signed alerts analytics sends)
    and the promise checker (lineage promises judged by analytics'
    replay verification); the training processes never load the analysis stack."""
    top = ("rankwatch.dashboard", "rankwatch.notebooks")
    everything = ("rankwatch.trainer", "rankwatch.analytics", "rankwatch.simulator", *top)
    for pkg, banned in (("collector", everything),
                        ("analytics", ("rankwatch.trainer", "rankwatch.simulator", *top)),
                        ("trainer", ("rankwatch.analytics", "rankwatch.simulator", *top)),
                        ("simulator", top),
                        # the post-mortem rebuilds a run from analytics' calls only; the dashboard draws analytics'
                        # views (the two are consumers side by side, neither imports the other)
                        ("notebooks", ("rankwatch.trainer", "rankwatch.simulator", "rankwatch.dashboard")),
                        ("dashboard", ("rankwatch.simulator", "rankwatch.notebooks"))):
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text()
            for b in banned:
                if (pkg, b) == ("trainer", "rankwatch.analytics") and f.name in _TAKE_ANALYTICS:
                    continue
                assert f"import {b}" not in text and f"from {b}" not in text, f"{f} imports {b}"


def test_training_processes_do_not_load_the_analysis_stack() -> None:
    code = ("import sys, rankwatch.trainer, rankwatch.trainer.canary, rankwatch.trainer.launch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('duckdb', 'polars', 'sklearn') "
            "or m.startswith('rankwatch.analytics')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
