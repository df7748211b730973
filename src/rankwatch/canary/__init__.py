"""rankwatch.canary: the reference job — a DDP x tensor x pipeline parallel MLP on real torch.distributed with the
collector embedded, its fault injection (`Faults`), its launcher, and its side of the recovery contract (its config
is a `recovery.job.Job`). One user of the library among many: nothing below it imports it.

The fault drills (`rankwatch.canary.drills`) run the whole live loop on this job; they are not re-exported here, since
they load the analysis stack and a training process must not. The names below are imported on first use: the fault
grammar (`canary.faults`) is torch-free, and the CLI reads it without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rankwatch.base.lazy import lazy_names

if TYPE_CHECKING:
    from rankwatch.canary.config import CanaryConfig, canary_declaration, config_from_run
    from rankwatch.canary.faults import Faults, parse_fault
    from rankwatch.canary.launcher import CanaryLauncher, launch
    from rankwatch.canary.model import ModelConfig

_LAZY = {
    "CanaryConfig": "config", "canary_declaration": "config", "config_from_run": "config",
    "Faults": "faults", "parse_fault": "faults", "CanaryLauncher": "launcher", "launch": "launcher",
    "ModelConfig": "model",
}
"""Name -> the module of this package that defines it, imported on first use."""


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "CanaryConfig", "CanaryLauncher", "Faults", "ModelConfig", "canary_declaration", "config_from_run", "launch",
    "parse_fault",
]
