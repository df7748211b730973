"""The frames detectors read: one polars DataFrame per question, loaded from a run by `queries.load_frames`.

Detectors are pure functions of a `Frames` bundle. Each frame's columns and dtypes are fixed here
(`FRAME_SCHEMAS`); `Frames.build(...)` fills every frame not given with an empty frame of the right schema, so
tests can build exactly the frames a detector needs. Times are int64 ns; steps are int64.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum

import polars as pl


class Clock(StrEnum):
    """Which clock the timing frames were read from (the `_CLOCKS_DOC` table in base/schema.py).

    On CPU (gloo) the training thread's clock sees all the work; on CUDA it only sees enqueueing and the wait at a
    sync point, and the device columns carry the signal. AUTO picks DEVICE when every rank's steps carry device
    columns, CPU when none does, and CPU with a warning when some do (CPU figures are never compared with device
    figures)."""

    AUTO = "auto"
    CPU = "cpu"
    DEVICE = "device"

_I32, _I64, _F64, _STR, _BOOL = pl.Int32, pl.Int64, pl.Float64, pl.String, pl.Boolean

FRAME_SCHEMAS: dict[str, dict[str, pl.DataType | type[pl.DataType]]] = {
    # One row per rank: its latest start (attempt). role = 'pp=<stage>': ranks of one role should behave alike.
    "topology": {
        "rank": _I32, "attempt": _I32, "world_size": _I32, "host": _STR, "local_rank": _I32, "pid": _I64,
        "device_uuid": _STR, "dp": _I32, "tp": _I32, "pp": _I32, "dp_size": _I32, "tp_size": _I32,
        "pp_size": _I32, "role": _STR, "start_wall_ns": _I64,
    },
    # One row per distinct process group: kind is world|dp|tp|pp|other, links the inter-host links it crosses.
    "groups": {
        "group": _STR, "kind": _STR, "ranks": pl.List(_I32), "hosts": pl.List(_STR), "links": pl.List(_STR),
    },
    # One row per rank per completed step (latest attempt wins where a step repeats). On the device clock,
    # compute_ns is the device time of the rank's own work (steps.device_compute_ns) and collective_wait_ns the device
    # time inside collectives (steps.device_collective_ns); null where the rank's device events were dropped.
    "steps": {
        "rank": _I32, "attempt": _I32, "step": _I64, "start_wall_ns": _I64, "end_wall_ns": _I64,
        "duration_ns": _I64, "compute_ns": _I64, "collective_wait_ns": _I64, "dataloader_wait_ns": _I64,
        "checkpoint_ns": _I64, "loss": _F64, "local_grad_norm": _F64, "all_finite": _BOOL, "data_position": _I64,
        "tokens": _I64,
    },
    # One row per rank per step: clock-free lateness in blocking collectives, from completed operations matched
    # across the group by (group, group_seq). In a blocking collective the early members wait for the last one, so
    # the LAST to arrive waits least: late_ns sums, over the step's operations, (longest wait of any member - this
    # rank's wait), largest for the rank everyone waited for. last_arrivals counts operations it arrived last to.
    "lateness": {
        "rank": _I32, "step": _I64, "ops": _I32, "wait_ns": _I64, "late_ns": _I64, "last_arrivals": _I32,
    },
    # Device clock only: per rank per step, how much longer than its stage peers' median the rank's host thread took
    # in the step's phases (CPU phase durations, positive parts summed over phases, less the stage's median of that
    # sum). On CUDA a phase's CPU time is enqueueing, except where the thread waits at a sync point, where the late
    # rank waits least: a host stall shows here, a slow device does not.
    "host": {"rank": _I32, "step": _I64, "host_excess_ns": _I64},
    # One row per inter-host link per step: effective bandwidth of the operations of groups crossing it.
    # transfer_ns per operation = the shortest member's time inside (the last arriver waits only for the transfer).
    "links": {
        "link": _STR, "kind": _STR, "step": _I64, "ops": _I32, "bytes": _I64, "transfer_ns": _I64,
        "gbps": _F64,
    },
    # One row per group kind per step per group: median transfer time of its operations (see links).
    "group_transfer": {
        "group": _STR, "kind": _STR, "step": _I64, "ops": _I32, "bytes": _I64, "transfer_ns": _I64,
    },
    # One row per rank per step that has GPU samples: means of the step's samples, OR of throttle bits, and the
    # largest value of each cumulative error counter seen so far (so deltas between steps are new errors).
    "gpu": {
        "rank": _I32, "device_uuid": _STR, "step": _I64, "samples": _I32, "sm_clock_mhz": _F64,
        "sm_clock_max_mhz": _F64, "power_w": _F64, "power_limit_w": _F64, "temperature_c": _F64,
        "gpu_util_pct": _F64, "throttle_reasons": _I64, "ecc_sbe_volatile": _I64, "ecc_dbe_volatile": _I64,
        "pcie_replay": _I64, "nvlink_errors": _I64, "xid_events": pl.List(_I32), "retired_pages": _I64,
        "remapped_rows": _I64,
    },
    # One row per rank per checkpoint phase.
    "checkpoints": {
        "rank": _I32, "step": _I64, "checkpoint_id": _STR, "phase": _STR, "start_wall_ns": _I64,
        "end_wall_ns": _I64, "duration_ns": _I64, "bytes": _I64, "ok": _BOOL,
    },
    # Fingerprint rows as written (schema.Fingerprints).
    "fingerprints": {
        "rank": _I32, "step": _I64, "attempt": _I32, "wall_ns": _I64, "domain": _STR, "domain_ranks": pl.List(_I32),
        "param_hash": _STR, "optim_hash": _STR, "rng_python_hash": _STR, "rng_numpy_hash": _STR,
        "rng_torch_hash": _STR, "rng_cuda_hash": _STR, "data_position": _I64, "param_count": _I64,
    },
    # Fingerprints of (rank, step)s that more than one attempt trained (a replay after a rollback): every attempt's
    # latest row, so replay verification can compare them.
    "replays": {
        "rank": _I32, "step": _I64, "attempt": _I32, "wall_ns": _I64, "domain": _STR, "domain_ranks": pl.List(_I32),
        "param_hash": _STR, "optim_hash": _STR, "rng_python_hash": _STR, "rng_numpy_hash": _STR,
        "rng_torch_hash": _STR, "rng_cuda_hash": _STR, "data_position": _I64, "param_count": _I64,
    },
    # Lifecycle events except heartbeats (start, exception, signal, exit, warning, drops).
    "events": {
        "rank": _I32, "attempt": _I32, "wall_ns": _I64, "kind": _STR, "step": _I64, "phase": _STR,
        "exc_type": _STR, "message": _STR, "collective_op": _STR, "collective_group": _STR,
        "collective_seq": _I64, "signal": _I32, "exit_code": _I32,
    },
    # One row per rank (latest attempt): how far it got and when it was last heard from.
    # last_heartbeat_wall_ns is null when the rank wrote no heartbeat; last_step is -1 before the first step.
    "liveness": {
        "rank": _I32, "attempt": _I32, "last_step": _I64, "last_step_end_wall_ns": _I64,
        "last_heartbeat_wall_ns": _I64, "last_seen_wall_ns": _I64, "heartbeat_step": _I64,
        "first_seen_wall_ns": _I64,
    },
    # Collectives a rank entered and never left: the latest in_flight snapshot not superseded by an ok/error row.
    "open_collectives": {
        "rank": _I32, "step": _I64, "op": _STR, "group": _STR, "group_ranks": pl.List(_I32), "group_seq": _I64,
        "peer": _I32, "enter_wall_ns": _I64,
    },
    # Collectives that ended in an error on a rank (a peer vanished, a timeout).
    "collective_errors": {
        "rank": _I32, "step": _I64, "op": _STR, "group": _STR, "group_ranks": pl.List(_I32), "group_seq": _I64,
        "exit_wall_ns": _I64, "error": _STR, "enter_wall_ns": _I64,
    },
    # How each rank's process ended as its launcher's side saw it (the exit records `rankwatch torchrun`'s host agent
    # writes, latest attempt only: `analytics.liveness.records.ExitRecord`); empty where no agent wrote them.
    "exits": {
        "rank": _I32, "attempt": _I32, "wall_ns": _I64, "exit_code": _I32, "signal": _I32, "outside_signal": _I32,
        "outside_signal_wall_ns": _I64,
    },
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Frames:
    """Everything detectors read about one run (or the window of it being analyzed).

    `end_wall_ns` is the newest wall-clock time anywhere in the run's telemetry: "now" for a post-mortem.
    `heartbeat_interval_ns` is the collector's heartbeat period (silence for several periods = gone or stuck).
    """

    topology: pl.DataFrame
    groups: pl.DataFrame
    steps: pl.DataFrame
    lateness: pl.DataFrame
    links: pl.DataFrame
    group_transfer: pl.DataFrame
    gpu: pl.DataFrame
    checkpoints: pl.DataFrame
    fingerprints: pl.DataFrame
    events: pl.DataFrame
    liveness: pl.DataFrame
    open_collectives: pl.DataFrame
    collective_errors: pl.DataFrame
    end_wall_ns: int
    heartbeat_interval_ns: int = 1_000_000_000
    replays: pl.DataFrame = field(default_factory=lambda: conform("replays", None))
    host: pl.DataFrame = field(default_factory=lambda: conform("host", None))
    exits: pl.DataFrame = field(default_factory=lambda: conform("exits", None))
    clock: Clock = Clock.CPU
    """The clock `steps`, `lateness`, `links` and `group_transfer` were read from (never AUTO)."""

    @classmethod
    def build(cls, *, end_wall_ns: int = 0, heartbeat_interval_ns: int = 1_000_000_000, clock: Clock = Clock.CPU,
              **frames: pl.DataFrame) -> Frames:
        """A bundle from the given frames; every frame not given is empty. Given frames are cast to their schema
        (missing columns added as nulls, extra columns dropped), so a test names only the columns it cares about."""
        unknown = set(frames) - set(FRAME_SCHEMAS)
        if unknown:
            raise ValueError(f"Frames.build: unknown frame(s) {sorted(unknown)}; known: {sorted(FRAME_SCHEMAS)}")
        out = {name: conform(name, frames.get(name)) for name in FRAME_SCHEMAS}
        return cls(end_wall_ns=end_wall_ns, heartbeat_interval_ns=heartbeat_interval_ns, clock=clock, **out)

    @property
    def world_size(self) -> int:
        if self.topology.height:
            return int(self.topology["world_size"].max())  # type: ignore[arg-type]
        return int(self.steps["rank"].n_unique()) if self.steps.height else 0

    @property
    def first_step(self) -> int:
        return int(self.steps["step"].min()) if self.steps.height else -1  # type: ignore[arg-type]

    @property
    def last_step(self) -> int:
        return int(self.steps["step"].max()) if self.steps.height else -1  # type: ignore[arg-type]


def conform(name: str, df: pl.DataFrame | None) -> pl.DataFrame:
    """`df` with exactly the columns of frame `name`, in order and cast; None -> an empty frame."""
    schema = FRAME_SCHEMAS[name]
    if df is None:
        return pl.DataFrame(schema=schema)
    cols = []
    for col, dtype in schema.items():
        if col in df.columns:
            cols.append(pl.col(col).cast(dtype))
        else:
            cols.append(pl.lit(None, dtype=dtype).alias(col))
    return df.select(cols)


def frame_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Frames) if f.name in FRAME_SCHEMAS)
