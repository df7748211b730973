"""The GPU timing layer: what a CUDA job's training thread sees of a step whose work ran on the device.

Under `Timing.GPU` the step loop's trace is the device's timeline: compute kernels, NCCL kernels that wait for their
peers, a device that idles while its host waits for data or stalls. The training thread only enqueues that work: each
collective call returns after its launch latency, each phase takes its enqueue time, and the thread blocks once per
step, in the optimizer, until the job's slowest device is done (`model._sync`). `_gpu_view` derives that CPU view and
keeps the device timeline beside it, so the tables carry CPU columns without the straggler signal and device columns
with it (base/schema.py, "Which clock carries the signal").
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rankwatch.simulator.model import (
    _BWD1, _BWD2, _DP, _FWD1, _FWD2, _OPT, _RECV_B, _RECV_F, _SEND_B, _SEND_F, _TP_B, _TP_F, _Trace,
)

_LAUNCH_NS = 25_000.0
"""Median CPU time of one NCCL call: the launch, not the transfer."""
_LAUNCH_SIGMA = 0.35
_ENQUEUE = 0.06
"""Host time to enqueue a phase's kernels, as a fraction of the phase's nominal device time: the host runs ahead."""


def _gpu_view(tr: _Trace, nominal: np.ndarray, rng: np.random.Generator) -> _Trace:
    """The trace with the training thread's clock in start/end/enter/exit (what the CPU columns record) and the
    device's in dev_enter/dev_exit/dev_end; `nominal` (N,) is each rank's nominal compute ns per step.

    The thread's enqueue time depends only on its own host (the same on a slow GPU), a host stall delays it, and
    an operation whose device side never completes (a peer is gone) stays open on the CPU too."""
    assert tr.dev_end is not None, "the step loop ran without gpu=True"
    S, n = tr.start.shape
    lat = rng.lognormal(np.log(_LAUNCH_NS), _LAUNCH_SIGMA, (S, 7, n))
    host = _ENQUEUE * nominal[None, :] * rng.lognormal(0.0, 0.05, (S, n))
    enter = np.full((S, 7, n), np.nan)
    exit_ = np.full((S, 7, n), np.nan)
    with np.errstate(invalid="ignore"):
        arrived = np.isfinite(tr.enter)
        completed = np.isfinite(tr.exit)
    cpu = tr.start + tr.dl + tr.stall

    def launch(slot: int) -> None:
        nonlocal cpu
        on = tr.applies[slot][None, :]
        enter[:, slot] = np.where(on, np.where(arrived[:, slot], cpu, np.inf), np.nan)
        done = cpu + lat[:, slot]
        exit_[:, slot] = np.where(on, np.where(completed[:, slot], done, np.inf), np.nan)
        cpu = np.where(on, done, cpu)

    fwd_start = tr.start + tr.dl
    launch(_RECV_F)
    cpu = cpu + _FWD1 * host
    launch(_TP_F)
    cpu = cpu + _FWD2 * host
    launch(_SEND_F)
    fwd_end = cpu
    launch(_RECV_B)
    cpu = cpu + _BWD1 * host
    launch(_TP_B)
    cpu = cpu + _BWD2 * host
    launch(_SEND_B)
    launch(_DP)
    bwd_end = cpu
    with np.errstate(invalid="ignore"):
        # the sync point is after the optimizer's enqueue; it never comes before it
        end = np.maximum(tr.end, bwd_end + _OPT * host + tr.ckpt)
        phases = np.stack([tr.dl, fwd_end - fwd_start, bwd_end - fwd_end, end - tr.ckpt - bwd_end])
    return replace(tr, end=end, enter=enter, exit=exit_, dev_enter=tr.enter, dev_exit=tr.exit, cpu_phases=phases)
