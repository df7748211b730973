"""Telemetry rows for hand-built run directories (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

from typing import Any

from rankwatch.base.schema import COLUMNS, Table

__all__ = ["schema_row"]


def schema_row(table: Table, **values: Any) -> tuple[Any, ...]:
    """A row of `table` in schema order: the given values, None for the other nullable columns, and a loud error for
    a missing non-nullable column or an unknown one."""
    out = []
    for c in COLUMNS[table]:
        if c.name in values:
            out.append(values.pop(c.name))
        elif c.nullable:
            out.append(None)
        else:
            raise AssertionError(f"test row for {table} lacks non-nullable column {c.name}")
    assert not values, f"unknown columns {sorted(values)} for {table}"
    return tuple(out)
