"""Fault injection for the examples, read from the environment so the training scripts stay as a user writes them.

    faults = Faults.from_env(rank)
    faults.watch(optimizer)          # for the gradient bit flip: a hook before each optimizer step
    for step in range(steps):
        with rw.step(step):
            faults.inject(step, data)
            ...

- ``FAULT_SLEEP_RANK`` / ``FAULT_SLEEP_MS`` (/ ``FAULT_SLEEP_STEP``): that rank sleeps that long inside every step
  (from that step on; default from the start): a straggler;
- ``FAULT_RAISE_RANK`` / ``FAULT_RAISE_STEP``: that rank raises ``RuntimeError("injected fault on rank R at step S")``
  at that step;
- ``FAULT_RNG_SKEW_RANK`` / ``FAULT_RNG_SKEW_STEP``: that rank draws one extra ``torch.rand`` at that step, so its
  global RNG stream departs from its replicas' from then on (a divergence);
- ``FAULT_HANG_RANK`` / ``FAULT_HANG_STEP``: that rank stops making progress inside that step (it sleeps until it
  is stopped; its collector's threads go on beating): a hang its peers then wait for in their next collective;
- ``FAULT_DATA_SKEW_RANK`` / ``FAULT_DATA_SKEW_STEP``: that rank's data stream skips one batch at that step, so its
  data position departs from its replicas' from then on (a divergence);
- ``FAULT_BITFLIP_RANK`` / ``FAULT_BITFLIP_STEP``: at that step, after the backward (after DDP's all-reduce, FSDP2's
  reduce-scatter) and before the optimizer step, that rank flips bit 30 (the top exponent bit of a float32) of the
  first element of the first gradient it holds a piece of: silent corruption of one device's value;
- ``FAULT_DEVICE`` / ``FAULT_DEVICE_STEP``: whichever rank runs on that device (its entry of ``CUDA_VISIBLE_DEVICES``
  at its local rank, as the launcher placed it) raises ``RuntimeError("CUDA error: uncorrectable ECC error
  encountered")`` at that step, in every attempt: a device that keeps failing, whatever rank number it serves.

A fault whose rank (or device) is unset is off. tests/integration/test_real_jobs.py and rankwatch's drills set these.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "")
    return int(text) if text else None


def _device(env: Mapping[str, str]) -> str | None:
    """This process's device as the launcher placed it: its local rank's entry of CUDA_VISIBLE_DEVICES."""
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    local = _int(env, "LOCAL_RANK") or 0
    return visible[local] if local < len(visible) else None


@dataclass(kw_only=True)
class Faults:
    rank: int
    sleep_s: float = 0.0
    """Seconds this rank sleeps inside every step from `sleep_step` on (0: not this rank)."""
    sleep_step: int = 0
    raise_step: int | None = None
    """The step at which this rank raises (None: never)."""
    skew_step: int | None = None
    """The step at which this rank draws one extra random number (None: never)."""
    flip_step: int | None = None
    """The step at which this rank flips a gradient bit before the optimizer step (None: never)."""
    device_step: int | None = None
    """The step at which this rank's device fails (None: not this rank's device)."""
    hang_step: int | None = None
    """The step in which this rank stops making progress (None: never)."""
    data_skew_step: int | None = None
    """The step at which this rank's data stream skips a batch (None: never)."""
    step: int = field(default=-1, init=False)

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> Faults:
        env = os.environ if env is None else env
        sleep_ms = _int(env, "FAULT_SLEEP_MS") or 0
        bad = env.get("FAULT_DEVICE", "")
        return cls(
            rank=rank,
            sleep_s=sleep_ms / 1000 if _int(env, "FAULT_SLEEP_RANK") == rank else 0.0,
            sleep_step=_int(env, "FAULT_SLEEP_STEP") or 0,
            raise_step=_int(env, "FAULT_RAISE_STEP") if _int(env, "FAULT_RAISE_RANK") == rank else None,
            skew_step=_int(env, "FAULT_RNG_SKEW_STEP") if _int(env, "FAULT_RNG_SKEW_RANK") == rank else None,
            flip_step=_int(env, "FAULT_BITFLIP_STEP") if _int(env, "FAULT_BITFLIP_RANK") == rank else None,
            device_step=_int(env, "FAULT_DEVICE_STEP") if bad and _device(env) == bad else None,
            hang_step=_int(env, "FAULT_HANG_STEP") if _int(env, "FAULT_HANG_RANK") == rank else None,
            data_skew_step=_int(env, "FAULT_DATA_SKEW_STEP") if _int(env, "FAULT_DATA_SKEW_RANK") == rank else None,
        )

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook the gradient bit flip in before `optimizer`'s step (nothing when this rank flips none)."""
        if self.flip_step is not None:
            optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.step != self.flip_step:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                local = grad.to_local() if hasattr(grad, "to_local") else grad  # a DTensor's own shard
                if local.numel() and local.dtype == torch.float32:
                    local.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 30)
                    return

    def inject(self, step: int, data: Any = None) -> None:
        """Apply this rank's faults for `step`; call it inside the step, before the batch is drawn from `data` (the
        job's data stream: the data skew draws one batch from it and drops it)."""
        self.step = step
        if step == self.data_skew_step and data is not None:
            next(data)
        if step == self.hang_step:
            while True:  # no progress; the signal that stops the job ends the sleep
                time.sleep(1.0)
        if self.sleep_s and step >= self.sleep_step:
            time.sleep(self.sleep_s)
        if step == self.skew_step:
            torch.rand(1)
        if step == self.raise_step:
            raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
        if step == self.device_step:
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
