"""The analytics error tree. Every error is a ValueError whose one-line message names the file and the problem.

    ValueError
    └── AnalyticsError
        ├── RunDirError          the run directory or one of its files is missing, empty or unreadable
        └── SchemaVersionError   a part file was written with a schema version this rankwatch does not read
"""

from __future__ import annotations


class AnalyticsError(ValueError):
    """Base of analytics errors."""


class RunDirError(AnalyticsError):
    """The run directory or one of its files is missing, empty or unreadable."""


class SchemaVersionError(AnalyticsError):
    """A part file carries a schema version this rankwatch does not read."""
