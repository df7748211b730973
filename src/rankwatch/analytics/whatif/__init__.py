"""What-if analysis: what a run's slowness cost, and to whom (`analysis` defines the figures, `graph` the replay,
`build` the graph from a run).

    rankwatch whatif RUN [--steps A:B] [--attempt N] [--json]

`whatif(run_dir)` reads one attempt's steps, collectives, dataloader waits and checkpoint phases, builds each rank's
program, replays it as measured and with chosen durations made ideal, and returns the `WhatIf`: the job's slowdown S
= T / T_ideal and what fixing each rank, stage, kind of work, collective op and group would save.

The default window is every step each rank of the attempt completed, less the first (its lazy initialization is
no one's slowness) when there are more than three.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

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


def whatif(run_dir: Path | str, *, steps: tuple[int, int] | None = None, attempt: int | None = None) -> WhatIf:
    """The what-if of one attempt of a run over a window of steps (module docstring). `WhatIfInputError` (a
    ValueError) when the run holds no such steps, or not on every rank."""
    from rankwatch.analytics.store import connect

    return whatif_of(connect(run_dir), run_dir=run_dir, steps=steps, attempt=attempt).whatif


@dataclass(frozen=True, slots=True)
class Replayed:
    """A window's what-if and the `Costing` it came from (to cost other subjects: an incident's impact)."""

    whatif: WhatIf
    costing: Costing


def whatif_of(con: duckdb.DuckDBPyConnection, *, run_dir: Path | str, steps: tuple[int, int] | None = None,
              attempt: int | None = None, max_ops: int | None = None, rank_subjects: int | None = None,
              named: Sequence[int] = ()) -> Replayed:
    """`whatif` over a connection that already has the run's tables (an analysis' store), with its `Costing`.
    With `max_ops`, a default window whose collectives exceed it keeps only its latest steps that fit (a warning
    says which); `rank_subjects` and `named` bound the ranks costed one by one (`analyze_graph`)."""
    from rankwatch.analytics import queries
    from rankwatch.base.schema import Table

    tables = queries._tables(con)
    missing = [t for t in (Table.STEPS, Table.COLLECTIVES) if t not in tables]
    if missing:
        raise WhatIfInputError(f"{run_dir}: no {' or '.join(str(t) for t in missing)} recorded: nothing to replay")
    all_steps = queries._frame(con, "SELECT rank, attempt, step, start_mono_ns, end_mono_ns, "
                               "coalesce(checkpoint_ns, 0) AS checkpoint_ns, device_compute_ns FROM steps")
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
    if rows["device_compute_ns"].null_count() < rows.height:
        warnings.append("the run has device timing; the what-if reads the CPU clock, where a CUDA job's host times "
                        "are enqueueing (a device-timed replay is not built yet)")
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
    data = _spans(con, "SELECT rank, start_mono_ns AS s, start_mono_ns + duration_ns AS e FROM phases "
                       "WHERE phase = 'data'", Table.PHASES in tables)
    ckpt = _spans(con, "SELECT rank, start_mono_ns AS s, end_mono_ns AS e FROM checkpoint_phases",
                  Table.CHECKPOINT_PHASES in tables)
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
    graph = build_graph(per_rank, kinds)
    costing = Costing(graph, stage_of=stage_of, host_of=host_of)
    return Replayed(whatif=analyze_graph(graph, stage_of=stage_of, measured_ns=measured, first_step=min(window),
                                         last_step=max(window), attempt=attempt, warnings=warnings, host_of=host_of,
                                         rank_subjects=rank_subjects, named=named, costing=costing),
                    costing=costing)


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
