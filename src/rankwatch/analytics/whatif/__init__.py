"""What-if analysis: what a run's slowness cost, and to whom (`analysis` defines the figures, `graph` the replay,
`build` the graph from a run).

    rankwatch whatif RUN [--steps A:B] [--attempt N] [--json]

`whatif(run_dir)` reads one attempt's steps, collectives, dataloader waits and checkpoint phases, builds each rank's
program, replays it as measured and with chosen durations made ideal, and returns the `WhatIf`: the job's slowdown S
= T / T_ideal and what fixing each rank, stage, kind of work, collective op and group would save.

The default window is every step each rank of the attempt completed, less the first (its lazy initialization is
no one's slowness) when there are more than three.

On a device-timed run (a CUDA job: every rank's steps carry `device_ns`, `queries.run_clock`) the CPU's times are
enqueueing, and the replay reads each rank's device instead: its steps laid end to end on its device's clock
(`steps.device_ns`), each collective where its device reached it (`collectives.device_start_ns`, from the step's
start event) for as long as its device spent in it (`device_duration_ns`). A rank's work between two operations is
then what its device did (or idled, waiting for its host: a host stall or a dataloader wait is the device's idle
time, and costs the job as much), all counted as compute: the dataloader and checkpoint phases carry no device start
to place them. Collectives without device events (a compiled graph's, read from the Flight Recorder) are their
ranks' compute, with a warning; a step where some rank's operation has no resolved device events is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from rankwatch.analytics.frames import Clock
from rankwatch.analytics.whatif.analysis import Costing, Share, WhatIf, analyze_graph
from rankwatch.analytics.whatif.build import RankSteps, WhatIfInputError, build_graph
from rankwatch.analytics.whatif.graph import Graph, replay

__all__ = ["Costing", "Graph", "RankSteps", "Replayed", "Share", "WhatIf", "WhatIfInputError", "analyze_graph", "build_graph", "replay",
           "parse_steps", "whatif", "whatif_of"]


def parse_steps(text: str) -> tuple[int, int]:
    """'A:B' (inclusive) as (A, B); ValueError naming the text otherwise."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected FIRST:LAST, two step numbers") from None
    if a < 0 or b < a:
        raise ValueError(f"--steps {text!r}: expected 0 <= FIRST <= LAST")
    return a, b


def whatif(run_dir: Path | str, *, steps: tuple[int, int] | None = None, attempt: int | None = None,
           clock: Clock | None = None) -> WhatIf:
    """The what-if of one attempt of a run over a window of steps (module docstring). `WhatIfInputError` (a
    ValueError) when the run holds no such steps, or not on every rank. `clock` None: the run's
    (`queries.run_clock`)."""
    from rankwatch.analytics.store import connect

    return whatif_of(connect(run_dir), run_dir=run_dir, steps=steps, attempt=attempt, clock=clock).whatif


@dataclass(frozen=True, slots=True)
class Replayed:
    """A window's what-if and the `Costing` it came from (to cost other subjects: an incident's impact)."""

    whatif: WhatIf
    costing: Costing


def whatif_of(con: duckdb.DuckDBPyConnection, *, run_dir: Path | str, steps: tuple[int, int] | None = None,
              attempt: int | None = None, max_ops: int | None = None, rank_subjects: int | None = None,
              named: Sequence[int] = (), clock: Clock | None = None) -> Replayed:
    """`whatif` over a connection that already has the run's tables (an analysis' store), with its `Costing`.
    With `max_ops`, a default window whose collectives exceed it keeps only its latest steps that fit (a warning
    says which); `rank_subjects` and `named` bound the ranks costed one by one (`analyze_graph`). `clock`: the
    clock to replay (None: the run's, `queries.run_clock`; a run that mixes device-timed and CPU ranks is replayed
    on the CPU clock, with a warning)."""
    from rankwatch.analytics import queries
    from rankwatch.base.schema import Table

    tables = queries._tables(con)
    missing = [t for t in (Table.STEPS, Table.COLLECTIVES) if t not in tables]
    if missing:
        raise WhatIfInputError(f"{run_dir}: no {' or '.join(str(t) for t in missing)} recorded: nothing to replay")
    all_steps = queries._frame(con, "SELECT rank, attempt, step, start_mono_ns, end_mono_ns, "
                               "coalesce(checkpoint_ns, 0) AS checkpoint_ns, device_ns FROM steps")
    if clock is None or clock is Clock.AUTO:
        clock, _ = queries.run_clock(con)
    if all_steps.height == 0:
        raise WhatIfInputError(f"{run_dir}: no step completed: nothing to replay")
    if attempt is None:
        attempt = int(all_steps["attempt"].max())  # type: ignore[arg-type]
    rows = all_steps.filter(pl.col("attempt") == attempt)
    if rows.height == 0:
        raise WhatIfInputError(f"{run_dir}: attempt {attempt} completed no step")
    ranks = sorted(rows["rank"].unique().to_list())
    done = {r: set(rows.filter(pl.col("rank") == r)["step"].to_list()) for r in ranks}
    common = set.intersection(*done.values())
    if steps is not None:
        first, last = steps
        window = set(range(first, last + 1))
        short = [r for r in ranks if not window <= done[r]]
        if short:
            raise WhatIfInputError(f"{run_dir}: steps {first}..{last} of attempt {attempt} were not all completed by "
                                   f"ranks {short}")
    else:
        if not common:
            raise WhatIfInputError(f"{run_dir}: no step of attempt {attempt} was completed by every rank")
        first, last = min(common), max(common)
        if last - first + 1 > 3:
            first += 1
        window = {s for s in common if first <= s <= last}
    warnings: list[str] = []
    if max_ops is not None and steps is None:
        window = _fit(con, window, max_ops, warnings)
    device = clock is Clock.DEVICE
    if not device and rows["device_ns"].null_count() < rows.height:
        warnings.append("the run has device timing on some ranks only; the what-if reads the CPU clock, where a CUDA "
                        "job's host times are enqueueing")
    rows = rows.filter(pl.col("step").is_in(sorted(window))).sort("rank", "step")
    topo = queries.attempt_topology(con).filter(pl.col("attempt") == attempt)
    stage_of = {r: 0 for r in ranks}
    host_of = {r: "" for r in ranks}
    for t in topo.iter_rows(named=True):
        if t["rank"] in stage_of and t["pp"] is not None:
            stage_of[int(t["rank"])] = int(t["pp"])
        if t["rank"] in host_of and t["host"] is not None:
            host_of[int(t["rank"])] = str(t["host"])
    kinds = {str(g["group"]): str(g["kind"]) for g in queries.groups(con).iter_rows(named=True)}
    ckpt = _spans(con, "SELECT rank, start_mono_ns AS s, end_mono_ns AS e FROM checkpoint_phases",
                  Table.CHECKPOINT_PHASES in tables)
    if device:
        per_rank, measured = _on_device(con, rows, ranks, window, ckpt, stage_of, host_of, warnings)
    else:
        data = _spans(con, "SELECT rank, start_mono_ns AS s, start_mono_ns + duration_ns AS e FROM phases "
                           "WHERE phase = 'data'", Table.PHASES in tables)  # the device clock does not place them
        per_rank, measured = _on_cpu(con, rows, ranks, window, attempt, data, ckpt, stage_of, host_of, warnings)
    graph = build_graph(per_rank, kinds, shared_clock=not device)
    costing = Costing(graph, stage_of=stage_of, host_of=host_of, shared_cpu=not device)
    replayed = per_rank[0].steps["step"].to_list()  # the window less the steps a device replay left out
    return Replayed(whatif=analyze_graph(graph, stage_of=stage_of, measured_ns=measured, first_step=min(replayed),
                                         last_step=max(replayed), attempt=attempt, warnings=warnings, host_of=host_of,
                                         rank_subjects=rank_subjects, named=named, costing=costing,
                                         clock=str(clock)),
                    costing=costing)


_Spans = dict[int, list[tuple[int, int]]]


def _on_cpu(con: duckdb.DuckDBPyConnection, rows: pl.DataFrame, ranks: list[int], window: set[int], attempt: int,
            data: _Spans, ckpt: _Spans, stage_of: dict[int, int], host_of: dict[int, str],
            warnings: list[str]) -> tuple[list[RankSteps], float]:
    """Each rank's window on its training thread's clock, and the window's measured span (the module docstring)."""
    from rankwatch.analytics import queries

    colls = queries._frame(con, 'SELECT rank, op, "group", group_ranks, peer, bytes, async_op, enter_mono_ns, '
                           "exit_mono_ns, enter_wall_ns, exit_wall_ns FROM collectives WHERE exit_mono_ns IS NOT NULL "
                           "AND enter_mono_ns IS NOT NULL AND enter_wall_ns IS NOT NULL AND exit_wall_ns IS NOT NULL "
                           f"AND (step BETWEEN {min(window) - 1} AND {max(window)} OR step < 0)")
    if queries.has_untimed(con):  # a compiled graph's collectives: blocking, ending as their last member arrives
        untimed = queries._frame(con, f"""
            SELECT rank, op, "group", group_ranks, NULL::INTEGER AS peer, bytes, false AS async_op, enter_mono_ns,
                   enter_mono_ns + (last_ns - enter_wall_ns) AS exit_mono_ns, enter_wall_ns, last_ns AS exit_wall_ns
            FROM ({queries.untimed_arrivals_sql()})
            WHERE attempt = {attempt} AND step BETWEEN {min(window) - 1} AND {max(window)}""")
        if untimed.height:
            colls = pl.concat([colls, untimed], how="vertical_relaxed")
    colls = _without_save_groups(colls, ckpt, warnings)
    per_rank: list[RankSteps] = []
    measured = 0.0
    for r in ranks:
        mine = rows.filter(pl.col("rank") == r)
        lo, hi = int(mine["start_mono_ns"].min()), int(mine["end_mono_ns"].max())  # type: ignore[arg-type]
        measured = max(measured, float(hi - lo))
        ops = colls.filter((pl.col("rank") == r) & (pl.col("enter_mono_ns") >= lo) & (pl.col("enter_mono_ns") <= hi))
        per_rank.append(RankSteps(
            rank=r, stage=stage_of[r], host=host_of[r], steps=mine.select("step", "start_mono_ns", "end_mono_ns", "checkpoint_ns"),
            collectives=ops, data=[(s, e) for s, e in data.get(r, []) if lo <= s <= hi],
            checkpoint=[(s, e) for s, e in ckpt.get(r, []) if lo <= s <= hi]))
    return per_rank, measured


def _on_device(con: duckdb.DuckDBPyConnection, rows: pl.DataFrame, ranks: list[int], window: set[int],
               ckpt: _Spans, stage_of: dict[int, int], host_of: dict[int, str],
               warnings: list[str]) -> tuple[list[RankSteps], float]:
    """Each rank's window on its device's clock (module docstring): steps end to end from 0, each operation at its
    step's origin plus its device start. The measured span is the slowest rank's summed device step time."""
    from rankwatch.analytics import queries

    lo_step, hi_step = min(window), max(window)
    colls = queries._frame(con, f"""
        SELECT rank, step, op, "group", group_ranks, peer, bytes, async_op, status, enter_mono_ns, exit_mono_ns,
               device_start_ns, device_duration_ns
        FROM collectives WHERE step BETWEEN {lo_step} AND {hi_step} AND status IN ('ok', 'untimed')""")
    bounds = rows.group_by("rank").agg(pl.col("start_mono_ns").min().alias("lo"), pl.col("end_mono_ns").max().alias("hi"))
    colls = (colls.join(bounds, on="rank")  # this attempt's: entered inside the rank's window on its host clock
             .filter((pl.col("enter_mono_ns") >= pl.col("lo")) & (pl.col("enter_mono_ns") <= pl.col("hi")))
             .drop("lo", "hi"))
    untimed = colls.filter(pl.col("status") == "untimed").height
    if untimed:
        warnings.append(f"{untimed:,} collectives of the window have no device events (a compiled graph's, read from "
                        "the Flight Recorder): counted as their ranks' compute on the device clock")
    colls = colls.filter(pl.col("status") == "ok")
    unplaced = colls.filter(pl.col("device_start_ns").is_null() | pl.col("device_duration_ns").is_null())
    # `rows` holds every rank's steps of the window: a step goes where some rank's step or operation is unresolved
    dropped = set(rows.filter(pl.col("device_ns").is_null())["step"].to_list()) | set(unplaced["step"].to_list())
    if dropped:
        warnings.append(f"{len(dropped)} step(s) of the window left out of the device-clock replay: some rank's step "
                        f"or collective has no resolved device events (steps {_few(sorted(dropped))})")
    kept = sorted(window - dropped)
    if not kept:
        raise WhatIfInputError("what-if: no step of the window has resolved device events on every rank")
    rows = rows.filter(pl.col("step").is_in(kept))
    colls = colls.filter(pl.col("step").is_in(kept))
    colls = _without_save_groups(colls, ckpt, warnings)  # on the host clock: where a save's own group ran
    per_rank: list[RankSteps] = []
    measured = 0.0
    for r in ranks:
        mine = rows.filter(pl.col("rank") == r).sort("step")
        dev = mine["device_ns"].cast(pl.Int64)
        origin = dev.cum_sum() - dev
        steps = pl.DataFrame({"step": mine["step"], "start_mono_ns": origin, "end_mono_ns": origin + dev,
                              "checkpoint_ns": pl.Series([0] * mine.height, dtype=pl.Int64)})
        measured = max(measured, float(dev.sum()))
        ops = (colls.filter(pl.col("rank") == r)
               .join(steps.select("step", pl.col("start_mono_ns").alias("origin")), on="step")
               .with_columns(enter=pl.col("origin") + pl.col("device_start_ns"))
               .with_columns(exit=pl.col("enter") + pl.col("device_duration_ns"))
               .select("op", "group", "group_ranks", "peer", "bytes", "async_op",
                       pl.col("enter").alias("enter_mono_ns"), pl.col("exit").alias("exit_mono_ns"),
                       pl.col("enter").alias("enter_wall_ns"), pl.col("exit").alias("exit_wall_ns")))
        per_rank.append(RankSteps(rank=r, stage=stage_of[r], host=host_of[r], steps=steps, collectives=ops, data=[],
                                  checkpoint=[]))
    return per_rank, measured


def _few(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:8])) + ("…" if len(steps) > 8 else "")


def _without_save_groups(colls: pl.DataFrame, ckpt: dict[int, list[tuple[int, int]]],
                         warnings: list[str]) -> pl.DataFrame:
    """`colls` less the groups a checkpoint save uses for itself: most of a group's operations inside its ranks'
    checkpoint phases. An asynchronous save (DCP's `async_save`) runs its collectives on a process group of its own
    from a thread beside training, which the training thread never waits for; a rank's program is its training
    thread's, and a save's collectives woven into it would make each rank wait where it did not (and, issued in
    another order on each rank, wait forever). A synchronous save's time is already the checkpoint's work."""
    if not ckpt or colls.height == 0:
        return colls
    inside = np.zeros(colls.height, dtype=bool)
    ranks, enters, exits = (colls[c].to_numpy() for c in ("rank", "enter_mono_ns", "exit_mono_ns"))
    for r, spans in ckpt.items():
        mine = np.flatnonzero(ranks == r)
        for s, e in spans:
            inside[mine] |= (enters[mine] >= s) & (exits[mine] <= e)
    share = (colls.with_columns(pl.Series("inside", inside)).group_by("group")
             .agg(pl.col("inside").mean().alias("share"), pl.len().alias("n")))
    saves = share.filter(pl.col("share") > 0.5).sort("group")
    if saves.height == 0:
        return colls
    warnings.extend(f"group {g}'s {n} collectives left out: {s:.0%} of them ran inside checkpoint saves (the save's "
                    f"own group, beside training)" for g, n, s in saves.select("group", "n", "share").iter_rows())
    return colls.filter(~pl.col("group").is_in(saves["group"].to_list()))


def _fit(con: duckdb.DuckDBPyConnection, window: set[int], max_ops: int, warnings: list[str]) -> set[int]:
    """The latest steps of `window` whose collectives number at most `max_ops` (at least one step)."""
    counts = dict(con.execute("SELECT step, count(*) FROM collectives GROUP BY step").fetchall())  # every attempt's:
    # a bound, not a count
    kept: list[int] = []
    total = 0
    for s in sorted(window, reverse=True):
        total += int(counts.get(s, 0))
        if kept and total > max_ops:
            break
        kept.append(s)
    if len(kept) < len(window):
        ops = sum(int(counts.get(s, 0)) for s in window)
        warnings.append(f"the what-if replays steps {min(kept)}..{max(kept)} only: the window's {ops:,} collective "
                        f"operations exceed the {max_ops:,} it replays")
    return set(kept)


def _spans(con: object, sql: str, present: bool) -> dict[int, list[tuple[int, int]]]:
    if not present:
        return {}
    out: dict[int, list[tuple[int, int]]] = {}
    for rank, s, e in con.execute(sql).fetchall():  # type: ignore[attr-defined]
        if s is not None and e is not None:
            out.setdefault(int(rank), []).append((int(s), int(e)))
    return out
