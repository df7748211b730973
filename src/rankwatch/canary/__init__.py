"""rankwatch.canary: the reference job — a DDP x tensor x pipeline parallel MLP on real torch.distributed with the
collector embedded, its fault injection (`Faults`), its launcher, and its side of the recovery contract (its config
is a `recovery.job.Job`). One user of the library among many: nothing below it imports it.

The fault drills (`rankwatch.canary.drills`) run the whole live loop on this job; they are not re-exported here, since
they load the analysis stack and a training process must not.
"""

from rankwatch.canary.config import CanaryConfig, canary_declaration, config_from_run
from rankwatch.canary.faults import Faults, parse_fault
from rankwatch.canary.launch import CanaryLauncher, launch
from rankwatch.canary.model import ModelConfig

__all__ = [
    "CanaryConfig", "CanaryLauncher", "Faults", "ModelConfig", "canary_declaration", "config_from_run", "launch",
    "parse_fault",
]
