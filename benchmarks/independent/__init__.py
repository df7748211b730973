"""A second, independent source of labeled telemetry: its own physics and noise model, written apart from the
detectors and from `rankwatch.simulator`, so a detector's figure on it measures what it learned about training
jobs rather than about its own simulator. See `suite` for the scenarios, their seed split and `generate`."""

from .suite import HELDOUT2_SEEDS, HELDOUT_SEEDS, TUNE_SEEDS, Scenario, generate, scenarios

__all__ = ["HELDOUT2_SEEDS", "HELDOUT_SEEDS", "TUNE_SEEDS", "Scenario", "generate", "scenarios"]
