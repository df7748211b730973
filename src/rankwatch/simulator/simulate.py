"""Synthetic telemetry: a run directory with the collector's exact schema, plus its ground truth.

    simulate(SimConfig(layout=Layout(dp=4, tp=2, pp=2), hosts=4, steps=200,
                       faults=(Straggler(rank=5, from_step=100, slow=0.1),)), Path("/tmp/sim"))

writes ``<out>/telemetry/<table>/rank=<r>/part-000000.parquet`` for every table, and ``<out>/labels.json``: the
incidents a perfect detector raises (``expected``) and the benign variation it must stay quiet about (``benign``).
The time model is in `model`, the faults in `faults`, the tables in `tables`, the ground truth in `labels`;
``SimConfig(timing=Timing.GPU)`` records a CUDA job's clocks instead of gloo's (`timing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rankwatch.base.rundir import LABELS_FILE, TELEMETRY_DIR, atomic_write
from rankwatch.base.schema import Table
from rankwatch.simulator.config import Scenario, SimConfig, Timing
from rankwatch.simulator.labels import Labels, labels_for
from rankwatch.simulator.model import _Topo, _inputs, _lifecycle, _nominal, _step_loop
from rankwatch.simulator.tables import _Builder, _write_parts
from rankwatch.simulator.timing import _gpu_view


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    out: Path
    labels: Labels
    rows: Mapping[Table, int]
    """Rows written per table."""
    elapsed_s: float


def simulate(cfg: SimConfig, out: Path, *, progress: Callable[[str], None] = lambda _: None) -> SimResult:
    """Write the run `cfg` describes to `out` (telemetry/ and labels.json); `out` must not hold telemetry yet.
    `progress` hears a line per stage (the step model, then each table written)."""
    t0 = time.perf_counter()
    out = Path(out)
    if (out / TELEMETRY_DIR).exists():
        raise ValueError(f"{out}: already holds {TELEMETRY_DIR}/; simulate into a fresh directory")
    topo = _Topo(cfg)
    rng = np.random.default_rng([cfg.seed, 0x51A])
    inp = _inputs(cfg, topo, rng)
    progress(f"modelling {cfg.steps} steps of {topo.n} ranks")
    gpu = cfg.timing is Timing.GPU
    tr = _step_loop(cfg, topo, rng, inp.comp, inp.dl, inp.ckpt, inp.link_mult, inp.stop, inp.stuck_dp, inp.stall,
                    gpu=gpu)
    if gpu:
        tr = _gpu_view(tr, _nominal(cfg, topo), rng)
    life = _lifecycle(cfg, topo, tr, rng)
    b = _Builder(cfg, topo, tr, life, inp, rng)
    builders: list[tuple[Table, Callable[[], pa.Table]]] = [
        (Table.TOPOLOGY, b.topology), (Table.STEPS, b.steps), (Table.COLLECTIVES, b.collectives),
        (Table.EVENTS, b.events), (Table.GPU, b.gpu), (Table.FINGERPRINTS, b.fingerprints),
        (Table.CHECKPOINT_PHASES, b.checkpoint_phases),
    ]
    if cfg.phases:
        builders.append((Table.PHASES, b.phases))
    rows: dict[Table, int] = {}
    for table, build in builders:  # collectives before events: heartbeats name the collective a rank is stuck in
        progress(f"writing {table} ({time.perf_counter() - t0:.1f}s)")
        data = build()
        rows[table] = data.num_rows
        _write_parts(out, table, data, topo.n)
        del data
    labels = labels_for(cfg, sorted(inp.skewed))
    atomic_write(out / LABELS_FILE, labels.to_json(), durable=False)
    return SimResult(out=out, labels=labels, rows=rows, elapsed_s=time.perf_counter() - t0)


def run_scenario(scenario: Scenario, out: Path) -> SimResult:
    return simulate(scenario.config, out)


def split_tail(run_dir: Path, from_step: int, staging: Path) -> int:
    """Split every part file of a simulated run at `from_step`: rows of earlier steps (and rows without a step)
    stay in the part, rows from `from_step` on go to a next part file written under `staging` at the same relative
    path. Moving `staging`'s files into the run afterwards is what a live run does: new part files appear.
    Returns the number of tail parts written."""
    written = 0
    for part in sorted((run_dir / TELEMETRY_DIR).glob("*/rank=*/part-*.parquet")):
        data = pq.read_table(part)
        if "step" not in data.column_names:
            continue
        late = pc.fill_null(pc.greater_equal(data.column("step"), from_step), False)
        head, tail = data.filter(pc.invert(late)), data.filter(late)
        if tail.num_rows == 0:
            continue
        meta = data.schema.metadata
        nxt = part.with_name(f"part-{int(part.stem.split('-')[1]) + 1:06d}.parquet")
        target = staging / nxt.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(tail.replace_schema_metadata(meta), target, compression="zstd")
        atomic_write(part, lambda tmp: pq.write_table(head.replace_schema_metadata(meta), tmp, compression="zstd"),
                     durable=False)  # simulated: made again from its seed
        written += 1
    return written
