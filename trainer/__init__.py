"""rankwatch.trainer: the reference canary job, checkpoint saving, fault injection and the launcher."""

from rankwatch.trainer.canary import CanaryConfig
from rankwatch.trainer.faults import Faults, parse_fault
from rankwatch.trainer.launch import LaunchResult, launch
from rankwatch.trainer.model import ModelConfig
from rankwatch.trainer.parallel import Hosts, Layout

__all__ = ["CanaryConfig", "Faults", "Hosts", "LaunchResult", "Layout", "ModelConfig", "launch", "parse_fault"]
