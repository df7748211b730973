"""rankwatch.trainer: the reference canary job, the checkpoint commit protocol and catalog, lineage, fault
injection and the launcher."""

from rankwatch.trainer.canary import CanaryConfig
from rankwatch.trainer.catalog import Candidate, choose, list_checkpoints
from rankwatch.trainer.checkpoint import CheckpointConfig, LoadResult, SaveResult, load_checkpoint, save_checkpoint
from rankwatch.trainer.evidence import EvidenceBundle, preserve_evidence, verify_evidence
from rankwatch.trainer.faults import Faults, parse_fault
from rankwatch.trainer.launch import LaunchResult, launch
from rankwatch.trainer.lineage import Lineage
from rankwatch.trainer.model import ModelConfig
from rankwatch.trainer.parallel import Hosts, Layout

__all__ = [
    "CanaryConfig", "Candidate", "CheckpointConfig", "EvidenceBundle", "Faults", "Hosts", "LaunchResult", "Layout", "Lineage",
    "LoadResult", "ModelConfig", "SaveResult", "choose", "launch", "list_checkpoints", "load_checkpoint", "parse_fault",
    "preserve_evidence", "save_checkpoint", "verify_evidence",
]
