"""rankwatch.analytics: DuckDB over the telemetry; detectors, incidents and recovery policy build on it."""

from rankwatch.analytics.errors import AnalyticsError, RunDirError, SchemaVersionError
from rankwatch.analytics.store import TableSummary, connect, table_summaries

__all__ = ["AnalyticsError", "RunDirError", "SchemaVersionError", "TableSummary", "connect", "table_summaries"]
