"""Collectives no wrapper saw, read from torch's Flight Recorder (`collector.backfill`): which entries the collector's
own operations own, when the writer reads the ring buffer at all, and the rows it makes of the rest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from rankwatch.base.schema import CollectiveStatus, Table, column_names
from rankwatch.collector.backfill import Backfill, Interval, op_name, uncovered
from rankwatch.collector.flight import Dump, Entry

_US = 1_000
_COLS = column_names(Table.COLLECTIVES)


def entry(seq: int, at_us: int, *, group: str = "0", pg_id: str = "0", op: str = "all_reduce") -> Entry:
    return Entry(seq=seq, op=op, created_ns=at_us * _US, nbytes=64, group=group, pg_id=pg_id, dtype="BFloat16")


def named(c10d: str) -> str | None:
    return {"0": "world", "1": "tp0"}.get(c10d)


def test_a_blocking_call_owns_what_it_enqueued_and_nothing_after_it_returned() -> None:
    got = uncovered([entry(1, 105), entry(2, 110), entry(3, 211), entry(4, 300)],
                    [Interval("world", 100 * _US, 200 * _US)], named)
    assert [e.seq for e in got] == [3, 4]  # 1 and 2: one call enqueued both (all_gather_object); 3: 11 µs after


def test_an_asynchronous_operation_owns_one_entry_even_while_it_stays_open() -> None:
    ivs = [Interval("world", 100 * _US, 900 * _US, asynchronous=True), Interval("world", 120 * _US, None, True)]
    got = uncovered([entry(1, 101), entry(2, 121), entry(3, 130), entry(4, 500)], ivs, named)
    assert [e.seq for e in got] == [3, 4]  # compiled collectives enqueued while both waited for their wait


def test_an_open_blocking_call_owns_everything_after_it_and_groups_are_apart() -> None:
    ivs = [Interval("world", 100 * _US, None)]
    got = uncovered([entry(1, 150), entry(2, 160, group="1", pg_id="1"), entry(3, 170, group="9", pg_id="9")],
                    ivs, named)
    assert [e.seq for e in got] == [2]  # 3: a group this rank's collector does not know


@pytest.mark.parametrize(("profiling", "op"), [
    ("gloo:all_reduce", "all_reduce"), ("gloo:_allgather_base", "all_gather"),
    ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"), ("nccl:ALLTOALL_BASE", "all_to_all"),
    ("gloo:broadcast", "broadcast"), ("nccl:coalesced", "coalesced")])
def test_operation_names_are_the_tables(profiling: str, op: str) -> None:
    assert op_name(profiling) == op


class FakeRecorder:
    """The Flight Recorder's two reads: pg_status alone, and the whole buffer (`ring` holds `size` entries)."""

    def __init__(self, size: int = 100) -> None:
        self.entries: list[Entry] = []
        self.size = size
        self.dumps = 0

    def add(self, e: Entry) -> None:
        self.entries = (self.entries + [e])[-self.size:]

    def status(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.pg_id] = max(out.get(e.pg_id, 0), e.seq)
        return out

    def dump(self) -> Dump:
        self.dumps += 1
        return Dump(entries=tuple(self.entries), last=self.status())


def row(group: str, enter_us: int, exit_us: int, *, op: str = "all_reduce", asynchronous: bool = False) -> tuple:
    values = dict.fromkeys(_COLS)
    values.update(group=group, op=op, enter_wall_ns=enter_us * _US, exit_wall_ns=exit_us * _US,
                  async_op=asynchronous, status=str(CollectiveStatus.OK))
    return tuple(values[c] for c in _COLS)


def backfill(fr: FakeRecorder, pending: list[Interval] | None = None, *, ring: int = 2000,
             share: float = 1.0) -> Backfill:
    return Backfill(rank=3, groups=lambda: {"0": ("world", (0, 1, 2, 3))}, pending=lambda: list(pending or ()),
                    ring=ring, share=share, status=fr.status, dump=fr.dump)


def test_collectives_the_collector_recorded_cost_no_read_of_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRecorder()
    now = [1_000_000]
    monkeypatch.setattr("rankwatch.collector.backfill.time.time_ns", lambda: now[0] * _US)
    b = backfill(fr, ring=4)
    for k in (1, 2, 3):  # the group's id is learned from its entries: one read, once the ring is 3/4 full
        fr.add(entry(k, 1_000_000 + 30 * k))
        b.note([row("world", 1_000_000 + 30 * k - 5, 1_000_000 + 30 * k + 10)], [])
        assert b.rows(None) == [] and fr.dumps == (k == 3)
    now[0] = 1_000_100
    for k in range(4, 9):
        fr.add(entry(k, now[0] + 10))
        b.note([row("world", now[0] + 5, now[0] + 20)], [])
        now[0] += 100
        assert b.rows(None) == []
    assert fr.dumps == 1 and b.found == 0


def test_a_compiled_collective_becomes_an_untimed_row_of_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRecorder()
    now = [1_000_000]
    monkeypatch.setattr("rankwatch.collector.backfill.time.time_ns", lambda: now[0] * _US)
    b = backfill(fr)
    b.closing = True  # read now (otherwise: once the ring is 3/4 full, or the first missed one is 30 s old)
    fr.add(entry(1, 1_000_010))  # the job's own all_reduce, recorded
    fr.add(entry(2, 1_000_050, op="_allgather_base"))  # a compiled graph's, in step 7
    fr.add(entry(3, 1_000_150))  # one in step 8, still running
    b.note([row("world", 1_000_005, 1_000_020)], [(1_000_000 * _US, 1_000_100 * _US, 7)])
    now[0] = 1_000_200
    got = [dict(zip(_COLS, r)) for r in b.rows((8, 1_000_120 * _US))]
    assert [(r["rank"], r["step"], r["seq"], r["group_seq"], r["op"], r["group"], r["group_ranks"], r["dtype"],
             r["status"], r["enter_wall_ns"], r["exit_wall_ns"], r["duration_ns"]) for r in got] == [
        (3, 7, -1, -2, "all_gather", "world", (0, 1, 2, 3), "bfloat16", "untimed", 1_000_050 * _US, None, None),
        (3, 8, -1, -3, "all_reduce", "world", (0, 1, 2, 3), "bfloat16", "untimed", 1_000_150 * _US, None, None)]
    now[0] = 1_000_300
    assert b.rows(None) == []  # each once


def test_an_entry_after_the_steps_the_writer_knows_of_waits_for_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRecorder()
    now = [1_000_000]
    monkeypatch.setattr("rankwatch.collector.backfill.time.time_ns", lambda: now[0] * _US)
    b = backfill(fr)
    b.closing = True
    fr.add(entry(1, 1_000_150))  # in step 8, which ended after the writer took the finished steps
    fr.add(entry(2, 1_000_450))  # between steps 8 and 9: outside any step
    b.note([], [(1_000_000 * _US, 1_000_100 * _US, 7)])
    now[0] = 1_000_500
    assert b.rows((9, 1_000_480 * _US)) == []
    b.note([], [(1_000_120 * _US, 1_000_400 * _US, 8)])
    now[0] = 1_000_600
    assert [(r[1], r[3]) for r in b.rows((9, 1_000_480 * _US))] == [(8, -1), (-1, -2)]


def test_entries_that_left_the_ring_before_a_read_are_counted_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRecorder(size=3)
    now = [1_000_000]
    monkeypatch.setattr("rankwatch.collector.backfill.time.time_ns", lambda: now[0] * _US)
    b = backfill(fr, ring=3)
    for k in range(1, 9):
        fr.add(entry(k, 1_000_000 + 10 * k))
    now[0] = 1_000_200
    assert b.rows(None) == []  # after every step the writer knows of: the next look may know its step
    assert [(r[1], r[3]) for r in b.rows(None, final=True)] == [(-1, -6), (-1, -7), (-1, -8)]
    assert b.lost == 5


def test_an_operation_not_yet_written_still_owns_its_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRecorder()
    now = [1_000_000]
    monkeypatch.setattr("rankwatch.collector.backfill.time.time_ns", lambda: now[0] * _US)
    b = backfill(fr, pending=[Interval("world", 1_000_040 * _US, None)])  # the training thread is inside it
    fr.add(entry(1, 1_000_010))
    fr.add(entry(2, 1_000_041))
    now[0] = 1_000_100
    assert [dict(zip(_COLS, r))["group_seq"] for r in b.rows(None, final=True)] == [-1]


def test_reads_wait_for_their_budget_and_the_last_call_reads_whatever_it_costs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fr = FakeRecorder()
    now = [1_000_000]
    monkeypatch.setattr("rankwatch.collector.backfill.time.time_ns", lambda: now[0] * _US)
    b = backfill(fr, ring=4, share=1e-9)  # a read of ~µs buys the next one hours later
    for k in (1, 2, 3):
        fr.add(entry(k, now[0] + 10))
    now[0] += 100
    assert len(b.rows(None, final=True)) == 3 and fr.dumps == 1
    for k in (4, 5, 6, 7):
        fr.add(entry(k, now[0] + 10 * k))
    for minutes in (1, 2):  # due (3/4 of the ring, then 30 s late), but over budget
        now[0] += minutes * 60_000_000
        assert b.rows(None) == [] and fr.dumps == 1
    b.closing = True
    assert [r[3] for r in b.rows(None, final=True)] == [-4, -5, -6, -7] and fr.dumps == 2


def test_a_rank_in_none_of_its_own_operations_waits_in_the_oldest_collective_torch_has_not_completed() -> None:
    fr = FakeRecorder()
    b = backfill(fr)
    assert b.waiting(lambda: {}) is None
    assert b.waiting(lambda: {"0": (41, 42)}) is None  # a group no entry has named yet: nothing said
    b.closing = True
    fr.add(entry(40, 1_000_000))
    b.rows(None, final=True)  # learns the id from the entries
    b._ids["1"] = "1"
    b._groups["1"] = ("tp0", (0, 1))
    assert b.waiting(lambda: {"0": (41, 42), "1": (7, 7)}) == ("tp0", (0, 1), 7)
    assert b.waiting(lambda: {"0": (41, 42)}) == ("world", (0, 1, 2, 3), 41)


_COMPILED = """
import json, sys
from datetime import timedelta
import torch, torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from rankwatch.collector.attach import attach
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1] + "/store", 1), rank=0, world_size=1,
                        timeout=timedelta(seconds=10))
rw = attach(sys.argv[1] + "/run", env={"RANK": "0", "WORLD_SIZE": "1"})

def f(x):
    y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
    z = y.sin() + 1
    dist.all_reduce(z)
    return z.cos()

g = torch.compile(f, backend="aot_eager", fullgraph=True)
for step in range(3):
    with rw.step(step):
        h = funcol.all_reduce(torch.ones(3), "sum", dist.group.WORLD)  # waited after the compiled call
        g(torch.ones(8))
        dist.all_reduce(torch.ones(3) + h)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_a_compiled_graphs_collectives_are_recorded_once_each(tmp_path: Path) -> None:
    """A job whose step runs a compiled graph (torch.compile, fullgraph) between collectives of its own, the Flight
    Recorder on (a fresh interpreter: torch reads its size once): every collective torch counted is in the table
    once, the compiled ones untimed, in their steps."""
    done = subprocess.run([sys.executable, "-c", _COMPILED, str(tmp_path)], capture_output=True, timeout=170,
                          env={**__import__("os").environ, "TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    rows = pl.read_parquet(sorted((tmp_path / "run" / "telemetry" / "collectives").glob("*/*.parquet")))
    events = pl.read_parquet(sorted((tmp_path / "run" / "telemetry" / "events").glob("*/*.parquet")))
    counts = [json.loads(m) for m in events.filter(pl.col("kind") == "collective_counts")["message"].to_list()]
    assert counts == [{"world": 12}], counts
    assert rows["group_seq"].n_unique() == rows.height == 12
    per_step = rows.group_by("step", "status").len().sort("step", "status")
    assert per_step.rows() == [(s, st, 2) for s in range(3) for st in ("ok", "untimed")], per_step
    untimed = rows.filter(pl.col("status") == "untimed")
    assert (untimed["group_seq"] < 0).all() and untimed["duration_ns"].is_null().all()
    assert set(untimed["op"].to_list()) == {"all_reduce"} and set(untimed["bytes"].to_list()) == {32}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_benchmark_prints_its_figures_and_the_table_holds_what_torch_counted() -> None:
    from support import assert_rows, benchmark_table

    table = benchmark_table("backfill_cost.py", "--steps", "3", "--share", "1", timeout_s=170)
    assert_rows(table, ("eager (", "compiled (", "a look that reads nothing", "table at close"))
    close = next(line for line in table if line.startswith("| table at close"))
    rows, distinct = close.split("| ")[2].split(";")[0].split(", ")
    assert rows == distinct and f'"pg0":{rows}' in close, close
    reads = [line for line in table if line.startswith(("| compiled: reads of", "| at close"))]
    made = sum(int(line.split("| ")[2].split("; ")[1]) for line in reads)
    assert made == 40, reads  # 3 steps x 10 compiled all-reduces and the 10 of the warm-up call
