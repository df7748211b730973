"""Fault injection for the examples, read from the environment so the training scripts stay as a user writes them.

    faults = Faults.from_env(rank)
    for step in range(steps):
        with rw.step(step):
            faults.inject(step)
            ...

- ``FAULT_SLEEP_RANK`` / ``FAULT_SLEEP_MS``: that rank sleeps that long inside every step (a straggler);
- ``FAULT_RAISE_RANK`` / ``FAULT_RAISE_STEP``: that rank raises ``RuntimeError("injected fault on rank R at step S")``
  at that step;
- ``FAULT_RNG_SKEW_RANK`` / ``FAULT_RNG_SKEW_STEP``: that rank draws one extra ``torch.rand`` at that step, so its
  global RNG stream departs from its replicas' from then on (a divergence).

A fault whose rank is unset is off. tests/integration/test_real_jobs.py sets these.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "")
    return int(text) if text else None


@dataclass(frozen=True, kw_only=True)
class Faults:
    rank: int
    sleep_s: float = 0.0
    """Seconds this rank sleeps inside every step (0: not this rank)."""
    raise_step: int | None = None
    """The step at which this rank raises (None: never)."""
    skew_step: int | None = None
    """The step at which this rank draws one extra random number (None: never)."""

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> Faults:
        env = os.environ if env is None else env
        sleep_ms = _int(env, "FAULT_SLEEP_MS") or 0
        return cls(
            rank=rank,
            sleep_s=sleep_ms / 1000 if _int(env, "FAULT_SLEEP_RANK") == rank else 0.0,
            raise_step=_int(env, "FAULT_RAISE_STEP") if _int(env, "FAULT_RAISE_RANK") == rank else None,
            skew_step=_int(env, "FAULT_RNG_SKEW_STEP") if _int(env, "FAULT_RNG_SKEW_RANK") == rank else None,
        )

    def inject(self, step: int) -> None:
        """Apply this rank's faults for `step`; call it inside the step."""
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if step == self.skew_step:
            torch.rand(1)
        if step == self.raise_step:
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
