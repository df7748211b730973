"""The one telemetry schema: every table and column rankwatch writes and reads.

The collector writes rows in the column order given here; analytics reads by these names. No other module
types a table or column name as a loose string. `make docs` renders docs/telemetry.md from it
(`render_markdown`), and a test keeps that file equal to this module. It is long because it is one concept: every
table's columns, their types, units and documentation, and the enums their values come from, owned in one place.

Layout on disk: ``<run>/telemetry/<table>/rank=<r>/part-<n>.parquet`` (hive partitioning on ``rank``; the
files also carry ``rank`` so a single file is self-describing). Every part file carries the key-value
metadata ``rankwatch.schema_version``.

Clocks: ``*_wall_ns`` is ``time.time_ns()`` (comparable across hosts only up to their clock offset);
``*_mono_ns`` is ``time.monotonic_ns()`` (exact within one host, meaningless across hosts).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntFlag, StrEnum

import pyarrow as pa
from rankwatch.base.rundir import TELEMETRY_DIR

SCHEMA_VERSION = 4
READABLE_VERSIONS: tuple[int, ...] = (1, 2, 3, 4)
"""Schema versions analytics reads: a column added in a later version (`ColumnSpec.since`) reads as null from parts
of an earlier one."""
SCHEMA_VERSION_KEY = b"rankwatch.schema_version"
PARTITION_KEY = "rank"


class Table(StrEnum):
    STEPS = "steps"
    PHASES = "phases"
    COLLECTIVES = "collectives"
    GPU = "gpu"
    CHECKPOINT_PHASES = "checkpoint_phases"
    FINGERPRINTS = "fingerprints"
    EVENTS = "events"
    TOPOLOGY = "topology"


class Steps(StrEnum):
    RANK = "rank"
    STEP = "step"
    ATTEMPT = "attempt"
    START_WALL_NS = "start_wall_ns"
    END_WALL_NS = "end_wall_ns"
    START_MONO_NS = "start_mono_ns"
    END_MONO_NS = "end_mono_ns"
    DURATION_NS = "duration_ns"
    COMPUTE_NS = "compute_ns"
    COLLECTIVE_WAIT_NS = "collective_wait_ns"
    DATALOADER_WAIT_NS = "dataloader_wait_ns"
    CHECKPOINT_NS = "checkpoint_ns"
    NUM_COLLECTIVES = "num_collectives"
    LOSS = "loss"
    LOCAL_GRAD_NORM = "local_grad_norm"
    ALL_FINITE = "all_finite"
    DATA_POSITION = "data_position"
    DEVICE_NS = "device_ns"
    DEVICE_COMPUTE_NS = "device_compute_ns"
    DEVICE_COLLECTIVE_NS = "device_collective_ns"
    TOKENS = "tokens"


class Phases(StrEnum):
    RANK = "rank"
    STEP = "step"
    PHASE = "phase"
    START_WALL_NS = "start_wall_ns"
    START_MONO_NS = "start_mono_ns"
    DURATION_NS = "duration_ns"
    DEVICE_DURATION_NS = "device_duration_ns"


class Collectives(StrEnum):
    RANK = "rank"
    STEP = "step"
    SEQ = "seq"
    GROUP_SEQ = "group_seq"
    OP = "op"
    GROUP = "group"
    GROUP_RANKS = "group_ranks"
    PEER = "peer"
    BYTES = "bytes"
    DTYPE = "dtype"
    ASYNC_OP = "async_op"
    ENTER_WALL_NS = "enter_wall_ns"
    ENTER_MONO_NS = "enter_mono_ns"
    EXIT_WALL_NS = "exit_wall_ns"
    EXIT_MONO_NS = "exit_mono_ns"
    DURATION_NS = "duration_ns"
    DEVICE_DURATION_NS = "device_duration_ns"
    DEVICE_START_NS = "device_start_ns"
    STATUS = "status"
    ERROR = "error"


class Gpu(StrEnum):
    RANK = "rank"
    DEVICE_INDEX = "device_index"
    DEVICE_UUID = "device_uuid"
    PCI_BUS_ID = "pci_bus_id"
    SOURCE = "source"
    WALL_NS = "wall_ns"
    MONO_NS = "mono_ns"
    STEP = "step"
    SM_CLOCK_MHZ = "sm_clock_mhz"
    MEM_CLOCK_MHZ = "mem_clock_mhz"
    SM_CLOCK_MAX_MHZ = "sm_clock_max_mhz"
    POWER_W = "power_w"
    POWER_LIMIT_W = "power_limit_w"
    TEMPERATURE_C = "temperature_c"
    GPU_UTIL_PCT = "gpu_util_pct"
    MEM_UTIL_PCT = "mem_util_pct"
    MEM_USED_BYTES = "mem_used_bytes"
    THROTTLE_REASONS = "throttle_reasons"
    ECC_SBE_VOLATILE = "ecc_sbe_volatile"
    ECC_DBE_VOLATILE = "ecc_dbe_volatile"
    ECC_SBE_AGGREGATE = "ecc_sbe_aggregate"
    ECC_DBE_AGGREGATE = "ecc_dbe_aggregate"
    PCIE_REPLAY = "pcie_replay"
    NVLINK_CRC_ERRORS = "nvlink_crc_errors"
    NVLINK_REPLAY_ERRORS = "nvlink_replay_errors"
    NVLINK_RECOVERY_ERRORS = "nvlink_recovery_errors"
    XID_EVENTS = "xid_events"
    RETIRED_PAGES_SBE = "retired_pages_sbe"
    RETIRED_PAGES_DBE = "retired_pages_dbe"
    REMAPPED_ROWS_CORRECTABLE = "remapped_rows_correctable"
    REMAPPED_ROWS_UNCORRECTABLE = "remapped_rows_uncorrectable"
    REMAPPED_ROWS_PENDING = "remapped_rows_pending"


class CheckpointPhases(StrEnum):
    RANK = "rank"
    STEP = "step"
    CHECKPOINT_ID = "checkpoint_id"
    PHASE = "phase"
    START_WALL_NS = "start_wall_ns"
    START_MONO_NS = "start_mono_ns"
    END_WALL_NS = "end_wall_ns"
    END_MONO_NS = "end_mono_ns"
    DURATION_NS = "duration_ns"
    BYTES = "bytes"
    OK = "ok"
    ERROR = "error"


class Fingerprints(StrEnum):
    RANK = "rank"
    STEP = "step"
    ATTEMPT = "attempt"
    WALL_NS = "wall_ns"
    DOMAIN = "domain"
    DOMAIN_RANKS = "domain_ranks"
    PARAM_HASH = "param_hash"
    OPTIM_HASH = "optim_hash"
    RNG_PYTHON_HASH = "rng_python_hash"
    RNG_NUMPY_HASH = "rng_numpy_hash"
    RNG_TORCH_HASH = "rng_torch_hash"
    RNG_CUDA_HASH = "rng_cuda_hash"
    DATA_POSITION = "data_position"
    PARAM_COUNT = "param_count"


class Events(StrEnum):
    RANK = "rank"
    ATTEMPT = "attempt"
    WALL_NS = "wall_ns"
    MONO_NS = "mono_ns"
    KIND = "kind"
    STEP = "step"
    PHASE = "phase"
    EXC_TYPE = "exc_type"
    MESSAGE = "message"
    COLLECTIVE_OP = "collective_op"
    COLLECTIVE_GROUP = "collective_group"
    COLLECTIVE_SEQ = "collective_seq"
    SIGNAL = "signal"
    EXIT_CODE = "exit_code"
    DROPPED_ROWS = "dropped_rows"


class Topology(StrEnum):
    RANK = "rank"
    ATTEMPT = "attempt"
    WORLD_SIZE = "world_size"
    LOCAL_RANK = "local_rank"
    HOST = "host"
    PID = "pid"
    START_WALL_NS = "start_wall_ns"
    BACKEND = "backend"
    DEVICE_INDEX = "device_index"
    DEVICE_UUID = "device_uuid"
    PCI_BUS_ID = "pci_bus_id"
    NUMA_NODE = "numa_node"
    DP = "dp"
    TP = "tp"
    PP = "pp"
    DP_SIZE = "dp_size"
    TP_SIZE = "tp_size"
    PP_SIZE = "pp_size"
    GROUPS = "groups"


class GroupField(StrEnum):
    """Fields of one element of ``topology.groups``."""

    NAME = "name"
    KIND = "kind"
    RANKS = "ranks"
    HOSTS = "hosts"
    LINKS = "links"


class EventKind(StrEnum):
    START = "start"
    HEARTBEAT = "heartbeat"
    EXCEPTION = "exception"
    SIGNAL = "signal"
    EXIT = "exit"
    WARNING = "warning"
    DROPS = "drops"
    RECOVERY = "recovery"
    """A recovery step: the checkpoint a resume chose (and why), a consistency-gate outcome."""
    CHECKPOINT_FAILED = "checkpoint_failed"
    """A save that committed nothing: which rank failed and how, and what became of its partial files (removed,
    bytes freed) — the description of a partial that is not kept."""
    COLLECTIVE_COUNTS = "collective_counts"
    """Written at close when torch's Flight Recorder is on: the message is a JSON object group -> collectives that
    group issued while the collector recorded, by torch's own count (collector/flight.py); what the collectives table
    is checked against (analytics: a partial table is a warning)."""
    NONFINITE = "nonfinite"
    """A fingerprint found non-finite values (NaN, inf) in the rank's own parameters or optimizer state (its local
    shards): the event's step is the fingerprint's; the message says how many in each. Healthy training never holds
    one, and in a fully sharded state no other rank holds a copy to disagree with."""
    GLOBAL_BATCH = "global_batch"
    """Rank 0 of an attempt whose `recovery.Checkpointer` was given `global_batch`: the message is a JSON object
    {"global_batch", "world_size"} the attempt trains with. A restart from step 0 on another world
    reads the previous attempt's to put the batch change in the lineage (no manifest says it then)."""
    REPLAY_BASIS = "replay_basis"
    """Rank 0 of an attempt that undoes a state fault (corruption, divergence): the attempts it replaces are a
    replay reference only before the event's `step`, where the fault may have begun (their later states held it)."""


class CollectiveStatus(StrEnum):
    OK = "ok"
    ERROR = "error"
    IN_FLIGHT = "in_flight"
    UNTIMED = "untimed"


class CheckpointPhase(StrEnum):
    SNAPSHOT = "snapshot"
    SERIALIZE = "serialize"
    WRITE = "write"
    FSYNC = "fsync"
    PUBLISH = "publish"
    LOAD = "load"
    VERIFY = "verify"


class GroupKind(StrEnum):
    WORLD = "world"
    DP = "dp"
    TP = "tp"
    PP = "pp"
    OTHER = "other"


class LineageKind(StrEnum):
    """What a lineage entry (``<run>/lineage.jsonl``, written by recovery/lineage.py) records."""

    START = "start"
    RESTART = "restart"
    ROLLBACK = "rollback"
    REPLAYED_DATA_RANGE = "replayed_data_range"
    WORLD_SIZE_CHANGE = "world_size_change"
    BATCH_CHANGE = "batch_change"
    """The job's own account of the batch it re-planned on another world where no resume recorded it (a restart
    from step 0 the recovery manager ordered: the manager knows the world, only the job its batch)."""
    LAYOUT_CHANGE = "layout_change"
    DEVICE_REPLACED = "device_replaced"
    DEVICE_QUARANTINED = "device_quarantined"
    CODE_CHANGE = "code_change"
    CONFIG_CHANGE = "config_change"
    REPLAY_VERIFIED = "replay_verified"
    """A resumed attempt's fingerprints of replayed steps were compared with an earlier attempt's: the verdict says
    whether the replay was bitwise (identical) or not (CHANGED, `ChangeReason.NONDETERMINISTIC_REPLAY`)."""


class Comparability(StrEnum):
    """Whether a recovered run's trajectory is expected to be bitwise what it would have been without the fault."""

    BITWISE_IDENTICAL_EXPECTED = "bitwise_identical_expected"
    CHANGED = "changed"


class ChangeReason(StrEnum):
    """Why a trajectory changed."""

    ORDERING = "ordering"
    """Reduction or sample order differs (different reduction tree, resharded sampler, pipeline schedule)."""
    BATCH_COMPOSITION = "batch_composition"
    """Which samples form a (micro)batch or go to which replica differs."""
    NUMERICS = "numerics"
    """Kernels, math splits or code differ, so values may differ in the last bits or more."""
    HARDWARE = "hardware"
    """A different physical device, whose kernels or autotuned choices may differ."""
    NONDETERMINISTIC_REPLAY = "nondeterministic_replay"
    """A replayed step's fingerprint differs from the one an earlier attempt recorded for the same step."""
    DETERMINISM_INPUTS = "determinism_inputs"
    """A setting that decides the numerics changed between attempts (thread counts, deterministic-algorithms flag,
    DDP bucket settings, backend, library versions)."""


class ThrottleReason(IntFlag):
    """NVML clocks-event (throttle) reason bits, as ``nvmlClocksEventReason*`` defines them."""

    GPU_IDLE = 0x1
    APPLICATIONS_CLOCKS_SETTING = 0x2
    SW_POWER_CAP = 0x4
    HW_SLOWDOWN = 0x8
    SYNC_BOOST = 0x10
    SW_THERMAL_SLOWDOWN = 0x20
    HW_THERMAL_SLOWDOWN = 0x40
    HW_POWER_BRAKE_SLOWDOWN = 0x80
    DISPLAY_CLOCK_SETTING = 0x100


#: Throttle bits that mean the device runs slower than asked for a reason outside the job.
SLOWDOWN_REASONS = (
    ThrottleReason.SW_POWER_CAP
    | ThrottleReason.HW_SLOWDOWN
    | ThrottleReason.SW_THERMAL_SLOWDOWN
    | ThrottleReason.HW_THERMAL_SLOWDOWN
    | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN
)


@dataclass(frozen=True, slots=True)
class ColumnSpec:
    name: str
    type: pa.DataType
    unit: str
    doc: str
    nullable: bool = False
    since: int = 1
    """Schema version that added the column (it reads as null from parts of an earlier version)."""

    def field(self) -> pa.Field:
        return pa.field(
            self.name,
            self.type,
            nullable=self.nullable,
            metadata={b"unit": self.unit.encode(), b"doc": self.doc.encode()},
        )


def _c(name: StrEnum, type_: pa.DataType, unit: str, doc: str, nullable: bool = False, *, since: int = 1) -> ColumnSpec:
    return ColumnSpec(str(name), type_, unit, doc, nullable, since)


_I32, _I64, _F64, _STR, _BOOL = pa.int32(), pa.int64(), pa.float64(), pa.string(), pa.bool_()
_RANKS = pa.list_(pa.int32())
_RANK_DOC = "global rank of the process that wrote the row"
_ATTEMPT_DOC = "incarnation of this rank: 0 for the first start, +1 for each restart into the same run"

GROUP_STRUCT = pa.struct(
    [
        pa.field(GroupField.NAME, _STR),
        pa.field(GroupField.KIND, _STR),
        pa.field(GroupField.RANKS, _RANKS),
        pa.field(GroupField.HOSTS, pa.list_(_STR)),
        pa.field(GroupField.LINKS, pa.list_(_STR)),
    ]
)

COLUMNS: dict[Table, tuple[ColumnSpec, ...]] = {
    Table.STEPS: (
        _c(Steps.RANK, _I32, "", _RANK_DOC),
        _c(Steps.STEP, _I64, "step", "training step (global, 0-based)"),
        _c(Steps.ATTEMPT, _I32, "", _ATTEMPT_DOC),
        _c(Steps.START_WALL_NS, _I64, "ns", "wall clock at step start"),
        _c(Steps.END_WALL_NS, _I64, "ns", "wall clock at step end (the monotonic end plus the step's wall − monotonic offset at its start)"),
        _c(Steps.START_MONO_NS, _I64, "ns", "monotonic clock at step start"),
        _c(Steps.END_MONO_NS, _I64, "ns", "monotonic clock at step end"),
        _c(Steps.DURATION_NS, _I64, "ns", "end - start"),
        _c(
            Steps.COMPUTE_NS,
            _I64,
            "ns",
            "duration minus collective wait, dataloader wait and checkpoint time: the rank's own work",
        ),
        _c(
            Steps.COLLECTIVE_WAIT_NS,
            _I64,
            "ns",
            "time the training thread was blocked in collectives: the full duration of blocking calls plus, "
            "for asynchronous ones (DDP gradient buckets), the exposed tail after the last bucket was ready",
        ),
        _c(Steps.DATALOADER_WAIT_NS, _I64, "ns", "time blocked waiting for the next batch"),
        _c(Steps.CHECKPOINT_NS, _I64, "ns", "time spent in checkpoint phases inside this step"),
        _c(Steps.NUM_COLLECTIVES, _I32, "count", "collectives entered during the step"),
        _c(Steps.LOSS, _F64, "", "loss on this rank (null where the rank has none, e.g. early pipeline stages)", True),
        _c(
            Steps.LOCAL_GRAD_NORM,
            _F64,
            "",
            "L2 norm of this rank's local gradients before the gradient all-reduce (after it replicas agree "
            "and a corrupted local computation is invisible); null if not measured",
            True,
        ),
        _c(Steps.ALL_FINITE, _BOOL, "", "loss and local gradient norm are finite (true when not measured)"),
        _c(Steps.DATA_POSITION, _I64, "samples", "data position after the step (samples consumed)", True),
        _c(
            Steps.DEVICE_NS,
            _I64,
            "ns",
            "device time of the step: between the CUDA events recorded on the compute stream at step start and end, "
            "resolved after the fact (null on CPU, or when the events were dropped unresolved)",
            True,
            since=3,
        ),
        _c(
            Steps.DEVICE_COMPUTE_NS,
            _I64,
            "ns",
            "the rank's own work on the device: device_ns minus the device time of the step spent inside collectives "
            "(it includes time the device waited for its own host to enqueue work); null on CPU",
            True,
            since=3,
        ),
        _c(
            Steps.DEVICE_COLLECTIVE_NS,
            _I64,
            "ns",
            "device time of the step inside collectives (the union of their device intervals): in a blocking "
            "collective the early ranks' kernels wait for the late rank's, so the late rank shows the least; null on CPU",
            True,
            since=3,
        ),
        _c(
            Steps.TOKENS,
            _I64,
            "count",
            "the work in this rank's batch for the step as the job counts it (`StepRecord.tokens`: tokens, or whatever "
            "its compute scales with, e.g. non-padding tokens of a variable-length batch); what tells data skew from "
            "a rank's own noise where every data-parallel replica is one rank; null when the job does not set it",
            True,
            since=4,
        ),
    ),
    Table.PHASES: (
        _c(Phases.RANK, _I32, "", _RANK_DOC),
        _c(Phases.STEP, _I64, "step", "training step"),
        _c(Phases.PHASE, _STR, "", "phase name given by the job (forward, backward, optimizer, ...)"),
        _c(Phases.START_WALL_NS, _I64, "ns", "wall clock at phase start (monotonic start plus the step's wall − monotonic offset)"),
        _c(Phases.START_MONO_NS, _I64, "ns", "monotonic clock at phase start"),
        _c(Phases.DURATION_NS, _I64, "ns", "phase duration on the training thread's clock (on CUDA: the time to "
           "enqueue the phase's work, plus any device synchronization inside it)"),
        _c(Phases.DEVICE_DURATION_NS, _I64, "ns", "device time between CUDA events at phase start and end on the "
           "compute stream; null on CPU or when unresolved", True, since=3),
    ),
    Table.COLLECTIVES: (
        _c(Collectives.RANK, _I32, "", _RANK_DOC),
        _c(Collectives.STEP, _I64, "step", "training step the collective was issued in (-1 outside a step)"),
        _c(Collectives.SEQ, _I32, "", "order of the collective within the step on this rank (0-based; -1 outside a step "
                                      "and for untimed rows)"),
        _c(
            Collectives.GROUP_SEQ,
            _I64,
            "",
            "order of the collective within its process group since the rank started (0-based); ranks of one "
            "group issue collectives in the same order, so (group, group_seq) matches one operation across ranks. "
            "Negative on untimed rows: minus torch's collective_seq_id for the group (the Flight Recorder's), the same "
            "on every member",
        ),
        _c(Collectives.OP, _STR, "", "operation: all_reduce, all_gather, reduce_scatter, broadcast, send, recv, barrier"),
        _c(Collectives.GROUP, _STR, "", "process-group name (see topology.groups)"),
        _c(Collectives.GROUP_RANKS, _RANKS, "", "global ranks of the group's members"),
        _c(Collectives.PEER, _I32, "", "global peer rank of a point-to-point send or recv", True),
        _c(Collectives.BYTES, _I64, "bytes", "payload size on this rank"),
        _c(Collectives.DTYPE, _STR, "", "element type of the payload"),
        _c(Collectives.ASYNC_OP, _BOOL, "", "issued asynchronously (e.g. a DDP gradient bucket)"),
        _c(Collectives.ENTER_WALL_NS, _I64, "ns", "wall clock when the rank entered the collective (monotonic entry plus the step's wall − monotonic offset: one clock read on the hot path)"),
        _c(Collectives.ENTER_MONO_NS, _I64, "ns", "monotonic clock when the rank entered the collective"),
        _c(Collectives.EXIT_WALL_NS, _I64, "ns", "wall clock when it completed (derived as enter_wall_ns is); null while in flight", True),
        _c(Collectives.EXIT_MONO_NS, _I64, "ns", "monotonic clock when it completed; null while in flight", True),
        _c(
            Collectives.DURATION_NS,
            _I64,
            "ns",
            "time inside (exit - enter): in a blocking collective the early ranks wait for the late one, "
            "so the late rank shows the shortest time; null while in flight",
            True,
        ),
        _c(
            Collectives.DEVICE_DURATION_NS,
            _I64,
            "ns",
            "device time between CUDA events around the operation on the stream it ran on (NCCL's stream for "
            "asynchronous work), resolved after the fact: as on the CPU, the late rank shows the least; null on CPU",
            True,
        ),
        _c(
            Collectives.DEVICE_START_NS,
            _I64,
            "ns",
            "device time from the step's start event to the operation's start event: how far into its step this "
            "rank's device reached the operation (arrival evidence on the device clock); null on CPU or outside a step",
            True,
            since=3,
        ),
        _c(
            Collectives.STATUS,
            _STR,
            "",
            "ok | error | in_flight | untimed. An in_flight row is a snapshot of a collective still open when its "
            "part file was written; a later ok/error row with the same (rank, group, group_seq) supersedes it, "
            "and where none follows the rank never left the collective. An untimed row is a collective no wrapper "
            "saw (a compiled graph's, a C++ caller's), read from torch's Flight Recorder: entered at its enqueue "
            "time, its exit and duration null (device_duration_ns where NCCL timed it)",
        ),
        _c(Collectives.ERROR, _STR, "", "exception type and message when status is error", True),
    ),
    Table.GPU: (
        _c(Gpu.RANK, _I32, "", "rank whose sampler read the device"),
        _c(Gpu.DEVICE_INDEX, _I32, "", "device index on the host"),
        _c(Gpu.DEVICE_UUID, _STR, "", "device UUID (stable across ranks and restarts; follows the physical GPU)"),
        _c(Gpu.PCI_BUS_ID, _STR, "", "PCI bus id of the device"),
        _c(Gpu.SOURCE, _STR, "", "nvml (real device) or replay (replayed or simulated series)"),
        _c(Gpu.WALL_NS, _I64, "ns", "wall clock of the sample"),
        _c(Gpu.MONO_NS, _I64, "ns", "monotonic clock of the sample"),
        _c(Gpu.STEP, _I64, "step", "training step in progress when sampled (-1 outside a step)"),
        _c(Gpu.SM_CLOCK_MHZ, _I32, "MHz", "current SM clock", True),
        _c(Gpu.MEM_CLOCK_MHZ, _I32, "MHz", "current memory clock", True),
        _c(Gpu.SM_CLOCK_MAX_MHZ, _I32, "MHz", "maximum SM clock of the device", True),
        _c(Gpu.POWER_W, _F64, "W", "board power draw", True),
        _c(Gpu.POWER_LIMIT_W, _F64, "W", "enforced power limit", True),
        _c(Gpu.TEMPERATURE_C, _F64, "°C", "GPU core temperature", True),
        _c(Gpu.GPU_UTIL_PCT, _F64, "%", "fraction of time a kernel ran over the last sample period", True),
        _c(Gpu.MEM_UTIL_PCT, _F64, "%", "fraction of time device memory was read or written", True),
        _c(Gpu.MEM_USED_BYTES, _I64, "bytes", "device memory in use", True),
        _c(
            Gpu.THROTTLE_REASONS,
            _I64,
            "bitmask",
            "NVML clocks-event reasons (schema.ThrottleReason): 0x4 power cap, 0x8 HW slowdown, 0x20 SW thermal, "
            "0x40 HW thermal, 0x80 power brake",
            True,
        ),
        _c(Gpu.ECC_SBE_VOLATILE, _I64, "count", "corrected (single-bit) ECC errors since driver load", True),
        _c(Gpu.ECC_DBE_VOLATILE, _I64, "count", "uncorrected (double-bit) ECC errors since driver load", True),
        _c(Gpu.ECC_SBE_AGGREGATE, _I64, "count", "corrected ECC errors over the device's life", True),
        _c(Gpu.ECC_DBE_AGGREGATE, _I64, "count", "uncorrected ECC errors over the device's life", True),
        _c(Gpu.PCIE_REPLAY, _I64, "count", "PCIe replay counter", True),
        _c(Gpu.NVLINK_CRC_ERRORS, _I64, "count", "NVLink CRC (flit + data) errors summed over links", True),
        _c(Gpu.NVLINK_REPLAY_ERRORS, _I64, "count", "NVLink replay errors summed over links", True),
        _c(Gpu.NVLINK_RECOVERY_ERRORS, _I64, "count", "NVLink recovery errors summed over links", True),
        _c(Gpu.XID_EVENTS, _RANKS, "", "XID error codes reported since the previous sample (empty if none)"),
        _c(Gpu.RETIRED_PAGES_SBE, _I32, "count", "pages retired for multiple single-bit errors", True),
        _c(Gpu.RETIRED_PAGES_DBE, _I32, "count", "pages retired for double-bit errors", True),
        _c(Gpu.REMAPPED_ROWS_CORRECTABLE, _I32, "count", "rows remapped for correctable errors (A100+)", True),
        _c(Gpu.REMAPPED_ROWS_UNCORRECTABLE, _I32, "count", "rows remapped for uncorrectable errors (A100+)", True),
        _c(Gpu.REMAPPED_ROWS_PENDING, _BOOL, "", "a row remap is pending a GPU reset", True),
    ),
    Table.CHECKPOINT_PHASES: (
        _c(CheckpointPhases.RANK, _I32, "", _RANK_DOC),
        _c(CheckpointPhases.STEP, _I64, "step", "training step the checkpoint holds"),
        _c(CheckpointPhases.CHECKPOINT_ID, _STR, "", "checkpoint identifier (its directory name)"),
        _c(
            CheckpointPhases.PHASE,
            _STR,
            "",
            "snapshot | serialize | write | fsync | publish | load | verify (schema.CheckpointPhase)",
        ),
        _c(CheckpointPhases.START_WALL_NS, _I64, "ns", "wall clock at phase start"),
        _c(CheckpointPhases.START_MONO_NS, _I64, "ns", "monotonic clock at phase start"),
        _c(CheckpointPhases.END_WALL_NS, _I64, "ns", "wall clock at phase end"),
        _c(CheckpointPhases.END_MONO_NS, _I64, "ns", "monotonic clock at phase end"),
        _c(CheckpointPhases.DURATION_NS, _I64, "ns", "phase duration"),
        _c(CheckpointPhases.BYTES, _I64, "bytes", "bytes this rank handled in the phase", True),
        _c(CheckpointPhases.OK, _BOOL, "", "the phase completed without error"),
        _c(CheckpointPhases.ERROR, _STR, "", "exception type and message when not ok", True),
    ),
    Table.FINGERPRINTS: (
        _c(Fingerprints.RANK, _I32, "", _RANK_DOC),
        _c(Fingerprints.STEP, _I64, "step", "step after which the state was fingerprinted"),
        _c(Fingerprints.ATTEMPT, _I32, "", "launch attempt that trained the step (a replayed step is fingerprinted "
           "once per attempt, and the attempts are compared); null in version-1 parts, which did not record it",
           since=2),
        _c(Fingerprints.WALL_NS, _I64, "ns", "wall clock when fingerprinted"),
        _c(
            Fingerprints.DOMAIN,
            _STR,
            "",
            "consistency domain: ranks that must hold bitwise-identical parameters and optimizer state "
            "(data-parallel replicas of one shard)",
        ),
        _c(Fingerprints.DOMAIN_RANKS, _RANKS, "", "global ranks of the consistency domain"),
        _c(Fingerprints.PARAM_HASH, _STR, "hex", "XXH3-64 of all parameters (names, dtypes, shapes, bytes)"),
        _c(Fingerprints.OPTIM_HASH, _STR, "hex", "XXH3-64 of the optimizer state tensors and scalars"),
        _c(Fingerprints.RNG_PYTHON_HASH, _STR, "hex", "XXH3-64 of random.getstate()"),
        _c(Fingerprints.RNG_NUMPY_HASH, _STR, "hex", "XXH3-64 of numpy's global RNG state"),
        _c(Fingerprints.RNG_TORCH_HASH, _STR, "hex", "XXH3-64 of torch's CPU RNG state"),
        _c(Fingerprints.RNG_CUDA_HASH, _STR, "hex", "XXH3-64 of the CUDA RNG states; null without CUDA", True),
        _c(Fingerprints.DATA_POSITION, _I64, "samples", "global data position (samples consumed by the job)", True),
        _c(Fingerprints.PARAM_COUNT, _I64, "count", "number of parameter elements hashed"),
    ),
    Table.EVENTS: (
        _c(Events.RANK, _I32, "", _RANK_DOC),
        _c(Events.ATTEMPT, _I32, "", _ATTEMPT_DOC),
        _c(Events.WALL_NS, _I64, "ns", "wall clock of the event"),
        _c(Events.MONO_NS, _I64, "ns", "monotonic clock of the event"),
        _c(Events.KIND, _STR, "", "start | heartbeat | exception | signal | exit | warning | drops | recovery | checkpoint_failed (schema.EventKind)"),
        _c(Events.STEP, _I64, "step", "step in progress or last completed (null before the first)", True),
        _c(Events.PHASE, _STR, "", "phase in progress", True),
        _c(Events.EXC_TYPE, _STR, "", "exception type (exception events)", True),
        _c(Events.MESSAGE, _STR, "", "human-readable detail", True),
        _c(Events.COLLECTIVE_OP, _STR, "", "collective in progress (exception and heartbeat events)", True),
        _c(Events.COLLECTIVE_GROUP, _STR, "", "its process group", True),
        _c(Events.COLLECTIVE_SEQ, _I64, "", "its group_seq", True),
        _c(Events.SIGNAL, _I32, "", "signal number (signal events)", True),
        _c(Events.EXIT_CODE, _I32, "", "exit code (exit events)", True),
        _c(Events.DROPPED_ROWS, _I64, "count", "rows the collector dropped so far: its writer fell behind, or writes kept failing (a full disk)", True),
    ),
    Table.TOPOLOGY: (
        _c(Topology.RANK, _I32, "", _RANK_DOC),
        _c(Topology.ATTEMPT, _I32, "", _ATTEMPT_DOC),
        _c(Topology.WORLD_SIZE, _I32, "count", "number of ranks in the job"),
        _c(Topology.LOCAL_RANK, _I32, "", "rank within its host"),
        _c(Topology.HOST, _STR, "", "host name (virtual host label when hosts are simulated)"),
        _c(Topology.PID, _I64, "", "operating-system process id, for outside tools that signal ranks"),
        _c(Topology.START_WALL_NS, _I64, "ns", "wall clock when the rank started"),
        _c(Topology.BACKEND, _STR, "", "torch.distributed backend (gloo, nccl)"),
        _c(Topology.DEVICE_INDEX, _I32, "", "device index on the host (null on CPU-only ranks)", True),
        _c(Topology.DEVICE_UUID, _STR, "", "device UUID", True),
        _c(Topology.PCI_BUS_ID, _STR, "", "device PCI bus id", True),
        _c(Topology.NUMA_NODE, _I32, "", "NUMA node of the device (or of the process when CPU-only)", True),
        _c(Topology.DP, _I32, "", "data-parallel coordinate"),
        _c(Topology.TP, _I32, "", "tensor-parallel coordinate"),
        _c(Topology.PP, _I32, "", "pipeline-parallel coordinate (stage)"),
        _c(Topology.DP_SIZE, _I32, "count", "data-parallel degree"),
        _c(Topology.TP_SIZE, _I32, "count", "tensor-parallel degree"),
        _c(Topology.PP_SIZE, _I32, "count", "pipeline-parallel degree"),
        _c(
            Topology.GROUPS,
            pa.list_(GROUP_STRUCT),
            "",
            "process groups this rank belongs to: name, kind (world|dp|tp|pp|other), member ranks, their "
            "hosts in ring order, and the inter-host links the group crosses ('hostA<->hostB', sorted)",
        ),
    ),
}

SCHEMAS: dict[Table, pa.Schema] = {
    table: pa.schema(
        [c.field() for c in cols], metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()}
    )
    for table, cols in COLUMNS.items()
}

#: What part files carry: the same columns without the per-field docs (which would cost ~KiBs per file).
STORAGE_SCHEMAS: dict[Table, pa.Schema] = {
    table: pa.schema(
        [pa.field(c.name, c.type, nullable=c.nullable) for c in cols],
        metadata={SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()},
    )
    for table, cols in COLUMNS.items()
}

#: Tables whose rows may be dropped first when the writer falls behind; the rest are evidence.
LOW_PRIORITY: frozenset[Table] = frozenset({Table.GPU, Table.PHASES})


def schema_for(table: Table) -> pa.Schema:
    """The documented schema of a table (field metadata carries unit and meaning)."""
    return SCHEMAS[table]


def storage_schema(table: Table, version: int = SCHEMA_VERSION) -> pa.Schema:
    """The schema part files are written with (by default), or were written with under an earlier readable version:
    the columns that version had."""
    if version == SCHEMA_VERSION:
        return STORAGE_SCHEMAS[table]
    if version not in READABLE_VERSIONS:
        raise ValueError(f"schema version {version} is not one this rankwatch reads ({READABLE_VERSIONS})")
    return pa.schema(
        [pa.field(c.name, c.type, nullable=c.nullable) for c in COLUMNS[table] if c.since <= version],
        metadata={SCHEMA_VERSION_KEY: str(version).encode()},
    )


def column_names(table: Table) -> tuple[str, ...]:
    return tuple(c.name for c in COLUMNS[table])


def added_after(table: Table, version: int) -> tuple[ColumnSpec, ...]:
    """The columns of `table` that parts of schema `version` lack (added by a later version)."""
    return tuple(c for c in COLUMNS[table] if c.since > version)


def render_markdown() -> str:
    """docs/telemetry.md, generated from this module."""
    out = [
        "# Telemetry schema",
        "",
        f"Schema version: **{SCHEMA_VERSION}** (parquet key-value metadata `{SCHEMA_VERSION_KEY.decode()}`).",
        "",
        "Generated by `make docs` from `base/schema.py`; a test keeps the two equal.",
        "",
        f"Layout: `<run>/{TELEMETRY_DIR}/<table>/{PARTITION_KEY}=<r>/part-<n>.parquet`, hive-partitioned on "
        f"`{PARTITION_KEY}`. Part files are written under a temporary name and renamed, so a reader never sees "
        "a half-written file. Clocks: `*_wall_ns` is `time.time_ns()` (comparable across hosts only up to "
        "their clock offset), `*_mono_ns` is `time.monotonic_ns()` (exact within one host only).",
        "",
        "Host rollups (optional: `rankwatch rollup`, or `rankwatch train --rollup-every S`): an agent per host "
        "merges its ranks' new part files into one part per table, "
        f"`<run>/{TELEMETRY_DIR}/<table>/_rollup/host=<h>/part-<n>.parquet`, with the same columns "
        f"(`{PARTITION_KEY}` is a column of every part file, so both layouts read alike). The commit point is the "
        "host folder's `_manifest.json` (written under a temporary name, fsynced, renamed): per rank, the highest "
        "rank part number it covers and those below it that it does not (cut short, another schema version). A host "
        "part no manifest lists is an orphan and never read; covered rank parts are deleted only `--keep` seconds "
        "(120 by default) after the manifest that covers them was published, and never a rank's newest part. A host "
        "part's footer key `rankwatch.rollup.covers` lists `[rank, rank part number, rows]` in row order, so a live "
        "reader that already read some of those rank parts skips exactly their rows. Readers list rank parts first "
        "and manifests second, so no row is read twice or missed at any instant (`collector/rollup.py`).",
        "",
    ]
    out += [
        "Readable versions: " + ", ".join(str(v) for v in READABLE_VERSIONS) + ". A column added by a later version "
        "(the *since* column below) reads as null from an earlier version's parts.",
        "",
        _CLOCKS_DOC,
        "",
    ]
    for table, cols in COLUMNS.items():
        low = " Low priority: dropped first when the writer falls behind." if table in LOW_PRIORITY else ""
        out += [f"## `{table}`", "", f"{_TABLE_DOCS[table]}{low}", ""]
        out += ["| column | type | unit | nullable | since | meaning |", "|---|---|---|---|---|---|"]
        for c in cols:
            doc = c.doc.replace("|", "\\|")
            out.append(f"| `{c.name}` | {c.type} | {c.unit} | {'yes' if c.nullable else 'no'} | {c.since} | {doc} |")
        out.append("")
    return "\n".join(out)


_CLOCKS_DOC = """## Which clock carries the signal: CPU (gloo) and GPU (CUDA, NCCL)

On CPU a collective blocks the training thread, so the thread's clock sees all the work. On CUDA the thread only
enqueues kernels and NCCL collectives and blocks at the next synchronization point, where it waits for its own GPU
*and* every peer its collectives wait on: the slow GPU's time shows up on every rank there. The collector's
`DeviceTimer` (`collector/device.py`) records CUDA events from a pool and resolves them on the writer thread; the
training thread never synchronizes the device for telemetry.

| question | CPU run (gloo) | GPU run (CUDA) |
|---|---|---|
| the rank's own work | `steps.compute_ns` | `steps.device_compute_ns` (`compute_ns` is about equal on every rank) |
| time waiting for peers | `steps.collective_wait_ns`, `collectives.duration_ns` | `steps.device_collective_ns`, `collectives.device_duration_ns` (`duration_ns` is launch latency) |
| who arrived last at a collective | least `collectives.duration_ns` per (group, group_seq) | least `collectives.device_duration_ns` per (group, group_seq); `device_start_ns` says how far into its step the device got there |
| input pipeline | `steps.dataloader_wait_ns` | `steps.dataloader_wait_ns` (host side on both) |
| host thread stalls vs slow device | not separable: both are the thread's time | a host stall shows in the CPU `phases.duration_ns` of the phase it hit *and* in device time (the GPU waited); a slow device only in `device_*` |
| link bandwidth | `collectives.bytes` / `duration_ns` of the last arrival | `bytes` / `device_duration_ns` of the last arrival |
| GPU health | `gpu` (NVML) | `gpu` (NVML) |

Analytics uses the device columns where every rank of the run carries them and the CPU ones where none does; a run
that mixes both is analysed on the CPU clock only, with a warning (device figures are never compared with CPU ones)."""


_TABLE_DOCS: dict[Table, str] = {
    Table.STEPS: "One row per rank per training step.",
    Table.PHASES: "One row per named phase (forward, backward, optimizer, ...) of a step.",
    Table.COLLECTIVES: (
        "One row per collective or point-to-point operation a rank completed, plus `in_flight` snapshots "
        "of operations still open when a part file was written, so a rank that died or hung inside a "
        "collective still shows where it was."
    ),
    Table.GPU: "Timestamped NVML samples, one row per device per sample.",
    Table.CHECKPOINT_PHASES: "One row per checkpoint phase per rank.",
    Table.FINGERPRINTS: "State fingerprints every N steps: what ranks of one consistency domain must agree on.",
    Table.EVENTS: "Lifecycle events: start, heartbeats, exceptions, signals, exit, collector warnings and drops.",
    Table.TOPOLOGY: "One row per rank start: where the rank lives, its parallel coordinates and groups.",
}


# -- liveness: <run>/live/ -------------------------------------------------------------------------------------------
# Not parquet: one small JSON object per rank (and per ended rank process), replaced in place, so a monitor learns of a
# dead or stuck rank within a heartbeat instead of a part-file interval. collector/liveness.py writes the rank records,
# the launcher (canary/launcher.py, each host's agent) the exit records; analytics/liveness/ reads both.
# docs/liveness.md describes the channel.

LIVE_VERSION = 1
"""Version of both record kinds (their `version` field)."""
RANK_RECORD_PREFIX = "rank-"
RANK_RECORD_SUFFIX = ".live"
EXIT_RECORD_PREFIX = "exit-"
EXIT_RECORD_SUFFIX = ".json"
LIVE_HEADER_BYTES = 16
"""A rank record file is one frame, rewritten in place at offset 0 (one `pwrite`, no rename: a rename over a file
costs about 1 ms on ext4, an in-place write a few us): ``"%08x %06d " % (crc32(body), len(body))``, then `body`, the
record as UTF-8 JSON, then spaces up to the file's length (a shorter record does not truncate the file). A reader
that finds the CRC wrong read a write in progress and reads again, or keeps the record it had."""


class LiveState(StrEnum):
    """What a rank's collector says of itself in its liveness record."""

    RUNNING = "running"
    """Started; training or about to (no `last_step` yet)."""
    EXITING = "exiting"
    """`Collector.close` began, with `exit_code` (0: training ended normally); flushing telemetry."""
    EXITED = "exited"
    """`Collector.close` finished; nothing more is written."""


class LiveField(StrEnum):
    """Fields of the record in ``<run>/live/rank-<r>.live`` (framed as `LIVE_HEADER_BYTES` says). Written at the
    end of each completed step (by the training thread) and by the rank's liveness thread (collector/liveness.py) at
    least twice per heartbeat interval. Times are `time.time_ns()`."""

    VERSION = "version"
    RANK = "rank"
    WORLD_SIZE = "world_size"
    ATTEMPT = "attempt"
    """Incarnation of the rank (`steps.attempt`): a record of an earlier attempt says nothing of the current one."""
    PID = "pid"
    HOST = "host"
    STATE = "state"
    """A `LiveState`."""
    SEQ = "seq"
    """+1 at every write of this process (a monitor sees a record change on its own clock, whatever the writer's)."""
    WALL_NS = "wall_ns"
    """When the record was written: the rank's last sign of life (its liveness thread runs while training is stuck;
    a frozen (SIGSTOP) or dead process writes no more)."""
    HEARTBEAT_NS = "heartbeat_ns"
    """The collector's heartbeat interval, ns: the unit a monitor's thresholds count in."""
    STARTED_WALL_NS = "started_wall_ns"
    """When the collector started."""
    LAST_STEP = "last_step"
    """Last step completed (null before the first)."""
    LAST_STEP_WALL_NS = "last_step_wall_ns"
    """When the last completed step ended: the rank's last progress."""
    STEP_NS = "step_ns"
    """Median duration of recently completed steps (null before the first): how long a step may take."""
    STEP = "step"
    """The step in progress (null between steps)."""
    STEP_START_WALL_NS = "step_start_wall_ns"
    PHASE = "phase"
    """The named phase in progress (`Collector.phase`), or ``checkpoint.<phase>`` inside `Collector.checkpoint_phase`;
    null outside both."""
    PHASE_START_WALL_NS = "phase_start_wall_ns"
    """Start of a checkpoint phase in progress (null otherwise): saves may take far longer than steps."""
    COLLECTIVE_OP = "collective_op"
    """The collective open the longest at the write (null: none). In an exiting record after an exception: the one
    the exception came from, if any."""
    COLLECTIVE_GROUP = "collective_group"
    COLLECTIVE_SEQ = "collective_seq"
    """Its sequence number in its group (`collectives.group_seq`)."""
    COLLECTIVE_PEER = "collective_peer"
    """Its peer rank, for a point-to-point operation."""
    COLLECTIVE_WALL_NS = "collective_wall_ns"
    """When the rank entered it."""
    COLLECTIVE_RANKS = "collective_ranks"
    """Its group's ranks, once it has been open the lesser of `CollectorConfig.inflight_after_s` and a heartbeat
    interval (null before: a large group's list is not written at every step); always in an exiting record."""
    EXIT_CODE = "exit_code"
    """The code given to `Collector.close` (exiting and exited records)."""
    SIGNAL = "signal"
    """The signal the collector handled (SIGTERM), if that is why it closed."""
    EXC_TYPE = "exc_type"
    """Type of the exception recorded by `Collector.exception`, if any."""
    MESSAGE = "message"
    """Its message, the first 300 characters (peers' messages may name the rank that went away)."""


class ExitField(StrEnum):
    """Fields of ``<run>/live/exit-<r>.json``, a JSON object: written once by the launcher's side of the rank's host
    (the process's parent, which sees it end at once) when the rank's process ends, under a temporary name and renamed
    (`os.replace`), so a reader sees all of it or nothing."""

    VERSION = "version"
    RANK = "rank"
    WORLD_SIZE = "world_size"
    ATTEMPT = "attempt"
    PID = "pid"
    HOST = "host"
    WALL_NS = "wall_ns"
    """When the launcher saw the process end (within its poll interval of the end)."""
    EXIT_CODE = "exit_code"
    """Exit status (null when a signal ended it)."""
    SIGNAL = "signal"
    """The signal that ended it (null for an exit)."""
    OUTSIDE_SIGNAL = "outside_signal"
    """The first signal the rank's host side received from outside (the launcher's SIGTERM to the worker's process
    group, an operator's kill) before the process ended; null when none came: the process ended on its own, or by a
    signal sent to it alone (a SIGKILL of that one process). Written by `rankwatch torchrun`'s host agent."""
    OUTSIDE_SIGNAL_NS = "outside_signal_ns"
    """When that signal arrived (wall clock, ns)."""
