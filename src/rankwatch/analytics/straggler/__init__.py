"""Stragglers and imbalance: who holds the others back, and whether it is a device fault or the job's design.

In a blocking collective everyone waits for the last rank to arrive, so the straggler is the rank with the
SHORTEST collective wait; collective time never identifies it. This detector looks at each rank's own work
instead (compute, which excludes collective, dataloader and checkpoint time, plus dataloader wait) and compares
it step by step with its role peers (same pipeline stage, which should do the same work):

    excess[r, s] = own_ns[r, s] / (median peer compute_ns + median peer dataloader_wait_ns at step s) - 1

so 0.10 means rank r was 10 % slower than its median peer at step s. On the device clock (`Frames.clock`, a CUDA
run) compute_ns is the device time of the rank's own work: the training thread's clock sees only enqueueing and a
wait at the sync point that is the same on every rank. There a slow rank's cause also says whether its host thread
held the device (its CPU phases ran longer than its peers': HOST_STALL) or the device itself was slower
(DEVICE_SLOW), unless throttle bits or dataloader wait explain it. A rank's slowdown score is the rolling
median of `excess` over the last `score_window` steps. Per-step noise (~1 %) and per-device spread (~0.5 %) make
single steps meaningless, so an incident needs persistence, tested two ways:

* subtle: a one-sided CUSUM of `excess - cusum_reference` (per-step contributions clipped so a few wild steps
  cannot fire it) reaches `cusum_threshold`, and at least `sustain_count` of the last `sustain_window` steps are
  above `sustain_excess` (down to `sustain_min` in a quiet run, noise at most nominal, where fewer such steps are
  already beyond chance at the job's own rate of elevated rank-steps). The CUSUM's reference sits between the
  benign spread (a device 2 % slow all run long) and the smallest fault worth reporting (5 %); its change point
  (the step after it last stood at 0) is the onset.
* large: every one of the last `burst_window` steps is above `burst_excess` (fast detection of big slowdowns).

Then the episode runs until `episode_gap` steps in a row are back to normal; episodes of one rank at most
`merge_gap` steps apart (intermittent bursts), or with the rank's median excess between them above half the sustain
level (it never came back to its own speed), merge into one incident. Subjects above the rank: a host whose
ranks are slow through dataloader wait (one HOST incident), an inter-host link whose crossing groups transfer
slower than the other groups of their kind (one LINK incident), a pipeline stage whose median compute exceeds the
other stages' (IMBALANCE, STAGE), and random per-step data skew between replicas, a different one late each step
(IMBALANCE, JOB).
"""

from __future__ import annotations

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Incident
from rankwatch.analytics.straggler.config import StragglerConfig, _S
from rankwatch.analytics.straggler.excess import _baselined, _fire_table, _noise, _own_table, _scaled
from rankwatch.analytics.straggler.imbalance import _data_skew, _stage_imbalance, _token_skew
from rankwatch.analytics.straggler.links import _slow_links
from rankwatch.analytics.straggler.ranks import _checkpoint_stragglers, _group_hosts, _rank_incidents

__all__ = ["StragglerConfig", "detect_stragglers"]


def detect_stragglers(frames: Frames, config: StragglerConfig = StragglerConfig()) -> tuple[Incident, ...]:
    """Straggler (rank, host, link) and imbalance (stage, job) incidents of a run, most severe first within kind."""
    if frames.steps.height == 0 or frames.last_step - int(frames.steps[_S].min()) + 1 < config.min_steps:  # type: ignore[arg-type]
        return ()
    own = _own_table(frames, config)
    factor = _noise(_baselined(own, config.baseline_steps, None)) / config.nominal_noise
    config = _scaled(config, factor)
    table = _fire_table(_baselined(own, config.baseline_steps, config.baseline_cap), config, quiet=factor <= 1.0)
    incidents: list[Incident] = []
    stage = _stage_imbalance(table, config)
    incidents.extend(stage)
    skew = _data_skew(table, config) or _token_skew(frames, config)
    ranks = _rank_incidents(frames, table, config, skew_found=bool(skew))
    incidents.extend(_group_hosts(frames, ranks, config))
    incidents.extend(_checkpoint_stragglers(frames, table, config, already={i.ranks[0] for i in ranks}))
    incidents.extend(_slow_links(frames, config))
    incidents.extend(skew)
    return tuple(incidents)
