"""The words of a recovery decision: what the policy (`recovery.policy.decide`) takes in and what it gives out.

Inputs: the consistency gate's answer (`GateResult`), what the job declares (`Idempotency`, `MembershipSupport`) and
the checkpoint catalog as the commit protocol sees it (`CheckpointCatalogView`). Outputs: a `Decision` — an `Action`
on a `Target` within a `ScopeKind`, the path it took through the policy's gates, its reasons and what lineage must
record (`LineageNote`).

Torch-free and analytics-free: the training side (the gate, the job's declaration), the live loop and the policy all
use these nouns; the policy's rule and branches are described in `recovery.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from rankwatch.base.schema import ChangeReason, Comparability, LineageKind


class GateVerdict(StrEnum):
    AGREE = "agree"
    """Every rank asked answered, and all agree on step, model, optimizer, RNG and data position."""
    DISAGREE = "disagree"
    """Every rank asked answered, and some disagree on at least one field."""
    UNKNOWN = "unknown"
    """The gate could not run, or not every rank asked answered."""


class StateField(StrEnum):
    STEP = "step"
    MODEL = "model"
    OPTIMIZER = "optimizer"
    RNG = "rng"
    DATA_POSITION = "data_position"


@dataclass(frozen=True, kw_only=True, slots=True)
class GateResult:
    """The consistency gate's answer for the affected consistency domain."""

    verdict: GateVerdict
    domain: str
    """Name of the consistency domain the gate checked (the unit the job rolls back together)."""
    ranks: tuple[int, ...]
    """Ranks that answered the gate; for a fail-stop, the survivors."""
    spans_job: bool
    """True when the domain is every rank of the job (a synchronous job has one domain)."""
    disagreeing: tuple[int, ...] = ()
    """DISAGREE only: the ranks whose fingerprint differs from the majority."""
    fields: tuple[StateField, ...] = ()
    """DISAGREE only: the fields that differ."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(sorted(set(self.ranks))))
        object.__setattr__(self, "disagreeing", tuple(sorted(set(self.disagreeing))))
        if not self.domain:
            raise ValueError("gate result: empty domain name")
        if self.verdict is GateVerdict.DISAGREE:
            if not self.disagreeing or not self.fields:
                raise ValueError(f"gate {self.domain}: DISAGREE needs the disagreeing ranks and fields")
            if not set(self.disagreeing) <= set(self.ranks):
                raise ValueError(f"gate {self.domain}: disagreeing ranks {self.disagreeing} not among {self.ranks}")
        elif self.disagreeing or self.fields:
            raise ValueError(f"gate {self.domain}: {self.verdict} carries disagreeing ranks or fields")


class Idempotency(StrEnum):
    IDEMPOTENT = "idempotent"
    """Re-running the failed operation from the agreed state gives the same result (e.g. an out-of-place collective
    on unchanged inputs, a checkpoint write to a fresh path)."""
    NOT_IDEMPOTENT = "not_idempotent"
    """Re-running may double-apply (an in-place all-reduce that may have partly run, an optimizer step)."""
    UNKNOWN = "unknown"
    """Not declared; treated as not idempotent."""


class MembershipSupport(StrEnum):
    """What membership change the job's algorithm supports, as declared by the job. A job that supports both spares
    and a reconfigurable dp group declares SPARE_REPLACEMENT, the smaller change."""

    FIXED_SHAPES = "fixed_shapes"
    """Tensor/pipeline shapes or the world size are fixed: no member may be dropped or swapped in place."""
    SPARE_REPLACEMENT = "spare_replacement"
    """A spare can take a rank's place 1:1 (world size and layout unchanged), receiving state from a dp peer."""
    PURE_DP_RECONFIGURABLE_BATCH = "pure_dp_reconfigurable_batch"
    """Pure data parallel: a dp replica can be dropped and the dp group rebuilt, the batch re-split over fewer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRef:
    id: str
    step: int
    """The last step whose update the checkpoint contains."""

    def __post_init__(self) -> None:
        if not self.id or self.step < 0:
            raise ValueError(f"checkpoint ref {self.id!r} at step {self.step}: needs an id and a step >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointCatalogView:
    """Checkpoints as the commit protocol sees them."""

    committed: tuple[CheckpointRef, ...] = ()
    """Committed and integrity-verified checkpoints (any order): the only recovery points."""
    partial: int = 0
    """Candidates with missing shards or no commit marker: evidence, never recovery points."""
    corrupt: int = 0
    """Candidates whose integrity check failed: evidence, never recovery points."""

    def __post_init__(self) -> None:
        if self.partial < 0 or self.corrupt < 0:
            raise ValueError(f"checkpoint catalog: negative counts partial={self.partial} corrupt={self.corrupt}")
        ids = [c.id for c in self.committed]
        if len(set(ids)) != len(ids):
            raise ValueError(f"checkpoint catalog: duplicate committed ids in {ids}")

    def newest(self, *, before_step: int | None = None) -> CheckpointRef | None:
        """The newest committed checkpoint, or the newest whose step is < `before_step`."""
        usable = [c for c in self.committed if before_step is None or c.step < before_step]
        return max(usable, key=lambda c: (c.step, c.id), default=None)


class Action(StrEnum):
    RETRY_OPERATION = "retry_operation"
    REBUILD_GROUP = "rebuild_group"
    RESTART_REPLICA = "restart_replica"
    ROLLBACK_DOMAIN = "rollback_domain"
    RESTART_JOB = "restart_job"
    QUARANTINE = "quarantine"
    OBSERVE = "observe"


class TargetKind(StrEnum):
    CHECKPOINT = "checkpoint"
    OPERATION = "operation"
    GROUP = "group"
    SPARE = "spare"
    DEVICE = "device"
    HOST = "host"
    LINK = "link"


@dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    kind: TargetKind
    id: str
    step: int | None = None
    """CHECKPOINT only: the checkpoint's step."""

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}" + (f"@{self.step}" if self.step is not None else "")


class ScopeKind(StrEnum):
    NONE = "none"
    """Nothing in the running job is touched."""
    RANKS = "ranks"
    DOMAIN = "domain"
    JOB = "job"


# Lineage vocabulary, shared with recovery/lineage.py through the schema module: the lineage entry kinds a
# decision obliges the recovery manager to append are `LineageKind` values.
LineageRecord = LineageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class LineageNote:
    """What lineage must record for this decision and whether the run stays comparable to what it would have been."""

    comparability: Comparability
    changed: tuple[ChangeReason, ...] = ()
    """Non-empty exactly when CHANGED."""
    records: tuple[LineageRecord, ...] = ()
    why: str = ""

    def __post_init__(self) -> None:
        if (self.comparability is Comparability.CHANGED) != bool(self.changed):
            raise ValueError(f"lineage note: {self.comparability} with change reasons {self.changed}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    action: Action
    target: Target | None
    """What the action acts on; None for OBSERVE and for RESTART_JOB from step 0."""
    scope: ScopeKind
    ranks: tuple[int, ...]
    """The ranks touched, as far as known (empty for JOB scope without a gate to list them)."""
    path: tuple[str, ...]
    """The gates the decision passed through, in order, ending in '-> <what>'."""
    reasons: tuple[str, ...]
    lineage: LineageNote
    also: tuple[Decision, ...] = ()
    """Secondary decisions carried out alongside (a quarantine next to a rollback, the membership change that fills
    a lost rank)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(sorted(set(self.ranks))))
        if not self.path or not self.reasons:
            raise ValueError(f"decision {self.action}: needs a path and at least one reason")
