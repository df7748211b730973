"""rankwatch.recovery: the recovery contract any job uses — `Checkpointer` for a training loop's save and resume,
the checkpoint commit protocol and its catalog (a
half-written checkpoint is evidence, never a recovery point), the consistency gate, the tamper-evident lineage, the
determinism inputs, evidence preservation, which checkpoint a resume takes, what a job declares about itself and how
it is launched (`job`), and the words of a recovery decision (`decision`).

Two modules read analytics' incidents and are not re-exported here, so that a training process importing the
contract never loads the analysis stack: the recovery-scope policy (`rankwatch.recovery.policy.decide`) and the
lineage promises judged by replay verification (`rankwatch.recovery.promises`).
"""

from typing import TYPE_CHECKING

from rankwatch.base.lazy import lazy_names

if TYPE_CHECKING:
    from rankwatch.recovery.catalog import Candidate, Manifest, Verdict, choose, list_checkpoints
    from rankwatch.recovery.checkpoint import (
        CheckpointConfig, LoadResult, SaveResult, Staged, commit_checkpoint, load_checkpoint, stage_checkpoint,
    )
    from rankwatch.recovery.checkpointer import Checkpointer, RngScope
    from rankwatch.recovery.decision import (
        Action, CheckpointCatalogView, CheckpointRef, Decision, GateResult, GateVerdict, Idempotency, MembershipSupport,
        ScopeKind, Target, TargetKind,
    )
    from rankwatch.recovery.determinism import DeterminismInputs, pin_ddp_buckets
    from rankwatch.recovery.evidence import EvidenceBundle, preserve_evidence, verify_evidence
    from rankwatch.recovery.gate import Domain, GateOutcome, RankState, run_gate
    from rankwatch.recovery.job import FakeLauncher, Job, JobDeclaration, JobLoader, LaunchResult, Launcher
    from rankwatch.recovery.lineage import Lineage, check_lineage
    from rankwatch.recovery.resume import GateRefused, last_completed_step, preflight

_LAZY = {
    "Action": "decision", "Candidate": "catalog", "CheckpointCatalogView": "decision", "CheckpointConfig":
    "checkpoint", "Checkpointer": "checkpointer", "RngScope": "checkpointer", "CheckpointRef": "decision", "Decision": "decision", "DeterminismInputs": "determinism",
    "Domain": "gate", "EvidenceBundle": "evidence", "FakeLauncher": "job", "GateOutcome": "gate", "GateRefused":
    "resume", "GateResult": "decision", "GateVerdict": "decision", "Idempotency": "decision", "Job": "job",
    "JobDeclaration": "job", "JobLoader": "job", "LaunchResult": "job", "Launcher": "job", "Lineage": "lineage",
    "LoadResult": "checkpoint", "Manifest": "catalog", "MembershipSupport": "decision", "RankState": "gate",
    "SaveResult": "checkpoint", "ScopeKind": "decision", "Target": "decision", "TargetKind": "decision",
    "Verdict": "catalog", "check_lineage": "lineage", "choose": "catalog", "last_completed_step": "resume",
    "list_checkpoints": "catalog", "load_checkpoint": "checkpoint", "pin_ddp_buckets": "determinism", "preflight":
    "resume", "preserve_evidence": "evidence", "run_gate": "gate", "stage_checkpoint": "checkpoint",
    "commit_checkpoint": "checkpoint", "Staged": "checkpoint",
    "verify_evidence": "evidence",
}
"""Name -> the module of this package that defines it, imported on first use: reading a run's lineage or catalog
does not load torch (the checkpoint protocol, the gate and the determinism inputs do)."""

__getattr__ = lazy_names(__name__, _LAZY)

__all__ = [
    "Action", "Candidate", "CheckpointCatalogView", "CheckpointConfig", "CheckpointRef", "Checkpointer", "RngScope", "Decision",
    "DeterminismInputs", "Domain", "EvidenceBundle", "FakeLauncher", "GateOutcome", "GateRefused", "GateResult",
    "GateVerdict", "Idempotency", "Job", "JobDeclaration", "JobLoader", "LaunchResult", "Launcher", "Lineage",
    "LoadResult", "Manifest", "MembershipSupport", "RankState", "SaveResult", "ScopeKind", "Target", "TargetKind",
    "Verdict", "check_lineage", "choose", "last_completed_step", "list_checkpoints", "load_checkpoint",
    "pin_ddp_buckets", "preflight", "preserve_evidence", "run_gate", "Staged", "commit_checkpoint", "stage_checkpoint",
    "verify_evidence",
]
