"""The independent scenario suite: labeled runs drawn from seeds split into a tuning and a held-out set.

Seed ranges (disjoint; a scenario's seed decides its layout, magnitudes, onsets and noise):

- ``tune``: seeds 100_000 .. 199_999 (`TUNE_SEEDS`). Those tuning detectors may look at these runs.
- ``heldout``: seeds 900_000 .. 999_999 (`HELDOUT_SEEDS`). Never run these while tuning; their figure is the one
  reported. Spent: run once (2026-12-01) and its misses printed; a fix made after that run (found and checked on
  tune-range seeds) is measured on the next fresh split, not on this one again.
- ``heldout2``: seeds 800_000 .. 899_999 (`HELDOUT2_SEEDS`), the held-out split for the figure after that (spent).
- ``heldout3``: seeds 700_000 .. 799_999 (`HELDOUT3_SEEDS`), spent likewise.
- ``heldout4``: seeds 600_000 .. 699_999 (`HELDOUT4_SEEDS`), the fresh one.

Each split holds every phenomenon of `phenomena.KINDS` `PER_KIND` times and `CLEAN` clean controls (no expected
incident, benign variation only), on 64..2048 ranks (mostly 64..256; `BIG` runs of 1024..2048).

    from independent import scenarios, generate
    for sc in scenarios("tune", "cpu"):
        run_dir = generate(sc, "/tmp/runs")      # writes /tmp/runs/<sc.name>/{telemetry/..., labels.json}
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import phenomena
from .noise import add_benign, healthy
from .tables import Builder, write_tables
from .timeline import simulate
from .world import World

TUNE_SEEDS = range(100_000, 200_000)
HELDOUT_SEEDS = range(900_000, 1_000_000)
HELDOUT2_SEEDS = range(800_000, 900_000)
HELDOUT3_SEEDS = range(700_000, 800_000)
HELDOUT4_SEEDS = range(600_000, 700_000)
HELDOUT5_SEEDS = range(500_000, 600_000)
HELDOUT6_SEEDS = range(400_000, 500_000)
HELDOUT7_SEEDS = range(300_000, 400_000)
HELDOUT8_SEEDS = range(200_000, 300_000)
SPLITS = {"tune": TUNE_SEEDS, "heldout": HELDOUT_SEEDS, "heldout2": HELDOUT2_SEEDS, "heldout3": HELDOUT3_SEEDS,
          "heldout4": HELDOUT4_SEEDS, "heldout5": HELDOUT5_SEEDS, "heldout6": HELDOUT6_SEEDS,
          "heldout7": HELDOUT7_SEEDS, "heldout8": HELDOUT8_SEEDS}
TIMINGS = ("cpu", "gpu")
PER_KIND = 4
CLEAN = 14
BIG = 5
LABELS_VERSION = 1


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    seed: int
    kind: str
    """A `phenomena.KINDS` key, or "clean"."""
    dp: int
    tp: int
    pp: int
    steps: int
    timing: str

    @property
    def ranks(self) -> int:
        return self.dp * self.tp * self.pp


def _layout(rng: np.random.Generator, kind: str, big: bool) -> tuple[int, int, int, int]:
    need_dp, need_pp, need_tp = phenomena.NEEDS.get(kind, (1, 1, 1))
    for _ in range(200):
        n = int(rng.choice([1024, 2048])) if big else int(rng.choice([64, 64, 128, 128, 192, 256, 256]))
        tp = int(rng.choice([1, 2, 4, 8, 8]))
        pp = int(rng.choice([1, 1, 2, 4]))
        if n % (tp * pp):
            continue
        dp = n // (tp * pp)
        if dp >= max(need_dp, 2 if kind.startswith("slow_link") else 1) and pp >= need_pp and tp >= need_tp:
            steps = int(rng.integers(100, 140)) if big else int(rng.integers(100, 301))
            return dp, tp, pp, steps
    raise AssertionError(f"no layout for {kind}")


def scenarios(split: str, timing: str) -> list[Scenario]:
    """The scenarios of a split for a timing mode (the same layouts and phenomena for both modes)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    seeds = SPLITS[split]
    kinds = [k for k in phenomena.KINDS for _ in range(PER_KIND)] + ["clean"] * CLEAN
    picker = np.random.default_rng([seeds.start, 17])
    big = set(picker.choice(len(kinds), size=BIG, replace=False).tolist())
    out = []
    for i, kind in enumerate(kinds):
        seed = seeds.start + i
        dp, tp, pp, steps = _layout(np.random.default_rng([seed, 3]), kind, i in big)
        out.append(Scenario(name=f"{split}-{i:03d}-{kind}-n{dp * tp * pp}", seed=seed, kind=kind, dp=dp, tp=tp,
                            pp=pp, steps=steps, timing=timing))
    return out


def generate(scenario: Scenario, out_dir: str | Path, timing: str | None = None) -> Path:
    """Write the scenario's run under `out_dir/<name>` (telemetry and labels.json); returns the run directory."""
    timing = timing or scenario.timing
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    rng = np.random.default_rng([scenario.seed, 1])
    world = World(scenario.dp, scenario.tp, scenario.pp, scenario.seed)
    skew = float(rng.uniform(0.08, 0.2)) if scenario.kind == "imbalance_data_skew" else 0.0
    draw = healthy(world, scenario.steps, timing, rng, skew_cv=skew)
    if skew:
        draw.benign.append(f"per-replica sequence-length skew, cv {skew:.2f} per step (the dominant spread)")
    add_benign(draw, rng, heavy=scenario.kind == "clean" and scenario.seed % 3 == 0)
    if scenario.kind != "clean":
        phenomena.KINDS[scenario.kind](draw, rng)
    sim = simulate(draw.plan, np.random.default_rng([scenario.seed, 2]))
    builder = Builder(draw, sim, scenario.seed, np.random.default_rng([scenario.seed, 4]))
    tables = builder.build()
    run = Path(out_dir) / scenario.name
    run.mkdir(parents=True, exist_ok=True)
    write_tables(str(run), tables)
    labels = {
        "version": LABELS_VERSION, "scenario": scenario.name, "ranks": world.n, "steps": scenario.steps,
        "layout": world.layout, "hosts": world.n_hosts, "timing": timing, "seed": scenario.seed,
        "kind": scenario.kind, "expected": draw.labels, "benign": draw.benign,
    }
    (run / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    return run


def describe(scenario: Scenario) -> dict[str, object]:
    return asdict(scenario)
