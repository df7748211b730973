"""rankwatch.analytics: DuckDB over the telemetry; the frames detectors read; the detectors; incidents;
localization of recurring faults across runs; liveness in seconds from the ranks' records; and the views people
look at (`analytics.views`). Pure functions from a run's files to typed results; it fails loudly (`errors`)."""

from rankwatch.analytics.analyze import (
    Analysis, AnalysisConfig, analyze, detect_all, ensure_views, render_incidents, write_analysis,
)
from rankwatch.analytics.anomaly import AnomalyConfig, detect_anomalies
from rankwatch.analytics.corruption import CorruptionConfig, detect_corruption
from rankwatch.analytics.divergence import DivergenceConfig, detect_divergence
from rankwatch.analytics.errors import AnalyticsError, RunDirError, SchemaVersionError
from rankwatch.analytics.failstop import FailStopConfig, detect_failstops
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.hardware import HardwareConfig, attribute_device_faults
from rankwatch.analytics.incidents import Cause, Evidence, Incident, IncidentClass, Subject, SubjectKind, read_incidents
from rankwatch.analytics.live import LiveAnalyzer, LiveConfig
from rankwatch.analytics.liveness import LivenessConfig, LivenessMonitor, LivenessView, RankState, same_fault
from rankwatch.analytics.localize import FollowsKind, Localization, QuarantineCandidate, RunObservation, localize
from rankwatch.analytics.queries import load_frames
from rankwatch.analytics.store import RunStore, TableSummary, connect, open_run, table_summaries
from rankwatch.analytics.straggler import StragglerConfig, detect_stragglers

__all__ = [
    "HardwareConfig", "attribute_device_faults", "LivenessConfig", "LivenessMonitor", "LivenessView", "RankState",
    "same_fault", "ensure_views",
    "Analysis", "AnalysisConfig", "AnalyticsError", "AnomalyConfig", "Cause", "CorruptionConfig", "DivergenceConfig",
    "Evidence", "FailStopConfig", "FollowsKind", "Frames", "Incident", "IncidentClass", "LiveAnalyzer", "LiveConfig",
    "Localization",
    "QuarantineCandidate", "RunDirError", "RunObservation", "RunStore", "SchemaVersionError", "StragglerConfig",
    "Subject", "SubjectKind", "TableSummary", "analyze", "connect", "detect_all", "detect_anomalies",
    "detect_corruption", "detect_divergence", "detect_failstops", "detect_stragglers", "load_frames", "localize",
    "open_run", "read_incidents", "render_incidents", "table_summaries", "write_analysis",
]
