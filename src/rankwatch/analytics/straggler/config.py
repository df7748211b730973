"""What the straggler detector is tuned by (`StragglerConfig`), and the frame columns it reads."""

from __future__ import annotations

from dataclasses import dataclass

from rankwatch.base.schema import Steps, ThrottleReason


# Frame columns derived by analytics (frames.FRAME_SCHEMAS) rather than written by the collector.
_ROLE, _LATE_NS, _LAST_ARRIVALS = "role", "late_ns", "last_arrivals"
_GROUP, _KIND, _LINKS, _RANKS, _TRANSFER_NS = "group", "kind", "links", "ranks", "transfer_ns"
_R, _S = Steps.RANK.value, Steps.STEP.value

_THERMAL = int(ThrottleReason.SW_THERMAL_SLOWDOWN | ThrottleReason.HW_THERMAL_SLOWDOWN)
_POWER = int(ThrottleReason.SW_POWER_CAP | ThrottleReason.HW_POWER_BRAKE_SLOWDOWN)
_HW = int(ThrottleReason.HW_SLOWDOWN)


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """Thresholds of the straggler and imbalance detector. Excess values are fractions (0.05 = 5 % slower)."""

    score_window: int = 9
    """Steps in the rolling median that is a rank's slowdown score (reported, and used for stage imbalance)."""
    cusum_reference: float = 0.035
    """Excess subtracted per step in the CUSUM: halfway between a benign 2 % slow device and a 5 % fault."""
    cusum_threshold: float = 0.06
    """CUSUM level that fires. With ~1 % per-step noise a 2 %-slow rank reaches it about once in 10^6 steps,
    while a 5 % slowdown reaches it in ~5 steps."""
    cusum_clip: float = 0.03
    """Per-step CUSUM contributions are clipped to +-this, so one wild step cannot fire it alone."""
    sustain_excess: float = 0.03
    """A step counts as elevated for the persistence test when its excess is above this."""
    sustain_window: int = 8
    """Steps looked back on for the persistence test of the subtle rule."""
    sustain_count: int = 6
    """Elevated steps needed among the last `sustain_window` (keeps random per-step skew from firing)."""
    sustain_min: int = 4
    """The fewest elevated steps among the last `sustain_window` the persistence test can ask for in a quiet run
    (see `_fire_table`; half the window)."""
    burst_excess: float = 0.15
    """Excess above which a step counts for the large-slowdown rule."""
    burst_window: int = 4
    """Consecutive steps above `burst_excess` that fire the large-slowdown rule."""
    recur_window: int = 20
    """Steps looked back on by the recurrence rule: intermittent bursts too short for the other rules ..."""
    recur_count: int = 4
    """... fire when at least this many of the last `recur_window` steps are above `burst_excess` (a >= 15 % step
    is a > 10-sigma event at nominal noise, so four in twenty do not happen by chance)."""
    episode_gap: int = 5
    """Consecutive normal steps (excess <= `sustain_excess`) that end an episode."""
    merge_gap: int = 64
    """Episodes of one rank at most this many steps apart are one incident (intermittent bursts)."""
    min_peers: int = 3
    """Roles with fewer ranks than this are compared with the whole job instead (a median of 2 is the mean)."""
    cause_share: float = 0.5
    """Share of a rank's excess that dataloader wait must explain for cause DATALOADER."""
    throttle_share: float = 0.5
    """Share of a slow episode's GPU rows that must carry a slowdown throttle bit for a throttle cause."""
    clock_drop: float = 0.03
    """The SM clock (relative to its max) must be this much below the peers' for a throttle cause."""
    host_share: float = 0.5
    """A host with at least this share (and at least 2) of its ranks slow through dataloader wait is one incident."""
    checkpoint_excess: float = 0.5
    """A rank's own checkpoint time counts as slow when it exceeds the peers' median checkpoint time by this share
    and the excess is at least `checkpoint_min_share` of the peers' median step."""
    checkpoint_min_share: float = 0.1
    """See `checkpoint_excess`."""
    checkpoint_count: int = 2
    """Slow checkpoints a rank needs for a CHECKPOINT_IO incident, however few the run made: one slow save is one
    draw of the storage's noise (a canary run's single save before a fail-stop read 1.8x on one rank)."""
    link_excess: float = 0.25
    """A group's transfer time counts as slow when it exceeds the median of its kind's groups by this share."""
    link_window: int = 5
    """Rolling median window (steps) of a group's transfer-time ratio."""
    stage_excess: float = 0.07
    """A stage is imbalanced when its rolling median compute exceeds the other stages' by this share ..."""
    stage_rank_share: float = 0.8
    """... and at least this share of its ranks are above the other stages' median by half that amount."""
    replica_skew: float = 0.04
    """Data skew: at a median step the replicas' compute factors must lie at least this far from the median
    replica's on average (mean absolute deviation: 4 %; a healthy job's replicas agree within ~1 %, and unlike the
    late replica's lead it does not grow with the number of replicas) ..."""
    replica_skew_ratio: float = 3.0
    """... and by at least this many times the per-step noise of ranks within one replica, so a noisy job whose
    ranks jitter independently (a replica's median of them jitters less than each) never reads as skew."""
    min_steps: int = 10
    """Runs with fewer steps than this are not analyzed (too short to tell persistence from noise)."""
    chance_alpha: float = 1e-3
    """A rank's elevated steps must be this unlikely (Bonferroni over ranks) under the job's base rate of elevated
    rank-steps, or its episodes are chance (random per-step data skew hits every rank now and then)."""
    nominal_noise: float = 0.015
    """Per-step spread of the excess (1.4826 x MAD over all rank-steps) the excess thresholds above are stated for:
    a GPU job's step-to-step jitter. When a run is noisier (CPU ranks sharing cores: 20-40 %), every excess
    threshold scales by measured / nominal, so the rules keep the same false-alarm rate in units of its noise."""
    baseline_steps: int = 15
    """A rank's first this many steps are its baseline: the median excess over them is its device's own speed."""
    baseline_cap: float = 0.05
    """Up to this much of a rank's baseline excess (either sign) is taken as its device's speed and subtracted
    before the rules run: the hardware spread of healthy devices (the slowest of a few hundred sits 3-5 % above
    its peers all run long). Without a change point, a constant offset that small cannot be told from that spread;
    a rank slower than this from its first step still fires with the rest of its excess, and a slowdown that starts
    later is measured against the rank's own baseline. Not scaled with a noisy run's noise: the hardware spread does
    not grow with it (and a live window whose straggler predates it keeps all but this much of its excess)."""
    nominal_transfer_noise: float = 0.03
    """Step-to-step spread of a group's log transfer time that `link_excess` is stated for; scales the same way."""

    def __post_init__(self) -> None:
        for name in ("score_window", "sustain_window", "burst_window", "recur_window", "recur_count", "episode_gap",
                     "link_window", "min_steps", "baseline_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"StragglerConfig.{name}={getattr(self, name)}: must be >= 1")
        if not 1 <= self.sustain_count <= self.sustain_window:
            raise ValueError(f"StragglerConfig.sustain_count={self.sustain_count}: must be in 1..sustain_window")
        if not 1 <= self.sustain_min <= self.sustain_count:
            raise ValueError(f"StragglerConfig.sustain_min={self.sustain_min}: must be in 1..sustain_count")
        if self.merge_gap < 0 or self.min_peers < 2 or self.checkpoint_count < 1:
            raise ValueError("StragglerConfig: merge_gap must be >= 0, min_peers >= 2, checkpoint_count >= 1")
        for name in ("cusum_reference", "cusum_threshold", "cusum_clip", "sustain_excess", "burst_excess",
                     "clock_drop", "checkpoint_excess", "checkpoint_min_share", "link_excess", "stage_excess",
                     "nominal_noise", "nominal_transfer_noise", "baseline_cap", "replica_skew",
                     "replica_skew_ratio"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StragglerConfig.{name}={getattr(self, name)}: must be > 0")
        for name in ("cause_share", "throttle_share", "host_share", "stage_rank_share", "chance_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"StragglerConfig.{name}={getattr(self, name)}: must be in (0, 1]")
