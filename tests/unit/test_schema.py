"""The one telemetry schema: names, column enums, a parquet round trip per table, and the generated docs."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rankwatch.base.schema import (
    COLUMNS, GROUP_STRUCT, LOW_PRIORITY, SCHEMA_VERSION, SCHEMA_VERSION_KEY, SLOWDOWN_REASONS, CheckpointPhases,
    Collectives, Events, Fingerprints, Gpu, GroupField, GroupKind, Phases, Steps, Table, ThrottleReason, Topology,
    column_names, render_markdown, schema_for, storage_schema,
)
from rankwatch.base.topology import link_name
from rankwatch.collector.sink import ParquetSink, SinkConfig, partition_dir, rows_to_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"

COLUMN_ENUMS: dict[Table, type[StrEnum]] = {
    Table.STEPS: Steps,
    Table.PHASES: Phases,
    Table.COLLECTIVES: Collectives,
    Table.GPU: Gpu,
    Table.CHECKPOINT_PHASES: CheckpointPhases,
    Table.FINGERPRINTS: Fingerprints,
    Table.EVENTS: Events,
    Table.TOPOLOGY: Topology,
}


def _value(field: pa.Field, i: int) -> object:
    """A non-null value of the field's type; `i` varies it between rows."""
    t = field.type
    if pa.types.is_int32(t):
        return 3 + i
    if pa.types.is_int64(t):
        return 1_700_000_000_000_000_000 + i  # past 2**32: catches a narrowed column
    if pa.types.is_float64(t):
        return 0.1 + i
    if pa.types.is_boolean(t):
        return i % 2 == 0
    if pa.types.is_string(t):
        return f"{field.name}-é-{i}"
    if t == pa.list_(pa.int32()):
        return [0, 1, 2 + i]
    if t == pa.list_(GROUP_STRUCT):
        return [
            {
                GroupField.NAME: "world",
                GroupField.KIND: str(GroupKind.WORLD),
                GroupField.RANKS: [0, 1, 2, 3],
                GroupField.HOSTS: ["host0", "host0", "host1", "host1"],
                GroupField.LINKS: [link_name("host1", "host0")],
            },
            {
                GroupField.NAME: f"tp.pp0.dp{i}",
                GroupField.KIND: str(GroupKind.TP),
                GroupField.RANKS: [0, 1],
                GroupField.HOSTS: ["host0", "host0"],
                GroupField.LINKS: [],
            },
        ]
    raise AssertionError(f"no test value for column {field.name} of type {t}")


def _rows(table: Table) -> list[tuple[object, ...]]:
    """One row with every column set, and one with every nullable column null."""
    schema = storage_schema(table)
    full = tuple(_value(f, 0) for f in schema)
    sparse = tuple(None if f.nullable else _value(f, 1) for f in schema)
    return [full, sparse]


def test_every_table_has_columns_and_a_column_enum() -> None:
    assert set(COLUMNS) == set(Table) == set(COLUMN_ENUMS)


@pytest.mark.parametrize("table", list(Table))
def test_first_column_is_rank(table: Table) -> None:
    assert column_names(table)[0] == "rank"
    assert storage_schema(table).field("rank").type == pa.int32()
    assert not storage_schema(table).field("rank").nullable


@pytest.mark.parametrize("table", list(Table))
def test_column_names_are_unique_and_equal_the_enum(table: Table) -> None:
    names = column_names(table)
    assert len(set(names)) == len(names)
    assert list(names) == [m.value for m in COLUMN_ENUMS[table]]


@pytest.mark.parametrize("table", list(Table))
def test_documented_and_storage_schemas_agree(table: Table) -> None:
    documented, stored = schema_for(table), storage_schema(table)
    assert documented.names == stored.names == list(column_names(table))
    assert documented.types == stored.types
    assert [f.nullable for f in documented] == [f.nullable for f in stored]
    for f in documented:
        assert f.metadata[b"doc"], f"column {table}.{f.name} has no doc"
        assert b"unit" in f.metadata
    for f in stored:
        assert not f.metadata
    for s in (documented, stored):
        assert s.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()


def test_group_struct_fields_are_the_group_field_enum() -> None:
    assert [GROUP_STRUCT.field(i).name for i in range(GROUP_STRUCT.num_fields)] == [m.value for m in GroupField]
    assert storage_schema(Table.TOPOLOGY).field(Topology.GROUPS).type == pa.list_(GROUP_STRUCT)


@pytest.mark.parametrize("table", list(Table))
def test_full_rows_round_trip_through_parquet(table: Table, tmp_path: Path) -> None:
    rows = _rows(table)
    expected = [dict(zip(column_names(table), r)) for r in rows]
    path = tmp_path / f"{table}.parquet"
    pq.write_table(rows_to_table(table, rows), path)
    back = pq.read_table(path)
    assert back.schema.equals(storage_schema(table))
    assert back.to_pylist() == expected


def test_topology_groups_read_back_as_named_struct_fields(tmp_path: Path) -> None:
    path = tmp_path / "topology.parquet"
    pq.write_table(rows_to_table(Table.TOPOLOGY, _rows(Table.TOPOLOGY)), path)
    groups = pq.read_table(path).column(Topology.GROUPS).to_pylist()[0]
    assert [set(g) for g in groups] == [set(GroupField)] * 2
    assert groups[0][GroupField.LINKS] == ["host0<->host1"]
    assert groups[1][GroupField.RANKS] == [0, 1]


@pytest.mark.parametrize("table", list(Table))
def test_part_files_carry_the_schema_version(table: Table, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path, 5, SinkConfig(flush_interval_s=60.0))
    for r in _rows(table):
        sink.append(table, (5,) + r[1:])
    sink.close()
    (part,) = partition_dir(tmp_path, table, 5).glob("part-*.parquet")
    meta = pq.read_schema(part).metadata
    assert meta[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert pq.read_table(part).num_rows == 2


def test_docs_match_the_schema_module() -> None:
    assert DOCS.exists(), "docs/telemetry.md is missing: run `make docs`"
    assert DOCS.read_text(encoding="utf-8") == render_markdown(), (
        "docs/telemetry.md is stale: run `make docs`"
    )


def test_rendered_docs_name_every_table_and_column() -> None:
    text = render_markdown()
    for table in Table:
        assert f"## `{table}`" in text
        for name in column_names(table):
            assert f"| `{name}` |" in text
    assert f"**{SCHEMA_VERSION}**" in text


def test_link_name_is_order_independent() -> None:
    assert link_name("host0", "host1") == link_name("host1", "host0") == "host0<->host1"
    assert link_name("b", "a") == "a<->b"


def test_slowdown_reasons() -> None:
    for bit in (
        ThrottleReason.SW_THERMAL_SLOWDOWN,
        ThrottleReason.HW_THERMAL_SLOWDOWN,
        ThrottleReason.SW_POWER_CAP,
        ThrottleReason.HW_POWER_BRAKE_SLOWDOWN,
        ThrottleReason.HW_SLOWDOWN,
    ):
        assert bit in SLOWDOWN_REASONS
    for bit in (
        ThrottleReason.GPU_IDLE,
        ThrottleReason.APPLICATIONS_CLOCKS_SETTING,
        ThrottleReason.SYNC_BOOST,
        ThrottleReason.DISPLAY_CLOCK_SETTING,
    ):
        assert not bit & SLOWDOWN_REASONS
    assert int(ThrottleReason.HW_THERMAL_SLOWDOWN) == 0x40 and int(ThrottleReason.SW_POWER_CAP) == 0x4


def test_low_priority_tables_are_samples_not_evidence() -> None:
    assert LOW_PRIORITY == frozenset({Table.GPU, Table.PHASES})
