"""The analytics error tree. Every error is a ValueError whose one-line message names the file and the problem.

    ValueError
    └── AnalyticsError
        ├── RunDirError          the run directory or one of its files is missing, empty or unreadable
        │   └── NoDataError      the run holds no rows at all: there is nothing to analyze, not "no incidents"
        ├── SchemaVersionError   a part file was written with a schema version this rankwatch does not read
        ├── PartSchemaError      a part file's columns or column types differ from its table's schema
        └── DamagedDataError     rows that cannot be what the collector wrote: a rank column that is not the
                                 rank folder's, a row key stored twice (a copied part), a negative duration
"""

from __future__ import annotations


class AnalyticsError(ValueError):
    """Base of analytics errors."""


class RunDirError(AnalyticsError):
    """The run directory or one of its files is missing, empty or unreadable."""


class NoDataError(RunDirError):
    """The run's telemetry holds no rows: an answer from it would read as "nothing happened"."""


class SchemaVersionError(AnalyticsError):
    """A part file carries a schema version this rankwatch does not read."""


class PartSchemaError(AnalyticsError):
    """A part file's columns or their types are not its table's (an extra, missing or renamed column, another
    type): its values could mean something else, so the run is not read."""


class DamagedDataError(AnalyticsError):
    """Rows no collector writes: a rank column other than the rank folder, one row key in several rows (a part
    copied, or filed twice), a negative duration or step. Counting them would make healthy ranks look slow."""
