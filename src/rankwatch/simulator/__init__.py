"""rankwatch.simulator: synthetic telemetry at scale, in the collector's own schema, with ground-truth labels.

It stands in for trainer + collector when a real job of 2,048 ranks is out of reach: `simulate(SimConfig(...), out)`
writes `<out>/telemetry/...` exactly as real ranks would, plus `<out>/labels.json` naming the incidents an analysis
should find. It complements real canary runs; it does not replace them.
"""

from rankwatch.simulator.config import Scenario, SimConfig, standard_suite
from rankwatch.simulator.faults import parse_sim_fault
from rankwatch.simulator.labels import Labels, read_labels
from rankwatch.simulator.simulate import SimResult, run_scenario, simulate, split_tail

__all__ = [
    "Labels", "Scenario", "SimConfig", "SimResult", "parse_sim_fault", "read_labels", "run_scenario", "simulate",
    "split_tail", "standard_suite",
]
