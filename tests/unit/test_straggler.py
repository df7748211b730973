"""The straggler and imbalance detector on hand-built frames with seeded noise like the simulator's:
per-step lognormal noise (sigma 1 %) and per-rank hardware factors (+-0.5 %)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pytest

from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, SubjectKind
from rankwatch.analytics.straggler import StragglerConfig, detect_stragglers
from rankwatch.base.schema import ThrottleReason
from rankwatch.base.topology import link_name

STEP_NS = 100_000_000  # 100 ms of compute per step


@dataclass
class Job:
    """A synthetic run: `compute`, `dl`, `ck` are [rank, step] arrays in ns that tests edit before `frames()`."""

    ranks: int = 64
    steps: int = 300
    pp: int = 2
    hosts: int = 8
    seed: int = 0
    tp: int = 1
    """Ranks per replica-stage: rank = stage * (ranks / pp) + dp * tp + tp index."""
    compute: np.ndarray = field(init=False)
    dl: np.ndarray = field(init=False)
    ck: np.ndarray = field(init=False)
    throttle: np.ndarray = field(init=False)
    clock: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        hw = rng.uniform(-0.005, 0.005, size=(self.ranks, 1))
        noise = rng.lognormal(0.0, 0.01, size=(self.ranks, self.steps))
        self.compute = STEP_NS * (1 + hw) * noise
        self.dl = rng.uniform(0.5e6, 1.5e6, size=(self.ranks, self.steps))
        self.ck = np.zeros((self.ranks, self.steps))
        self.throttle = np.zeros((self.ranks, self.steps), dtype=np.int64)
        self.clock = np.full((self.ranks, self.steps), 1980.0)
        self.rng = rng

    def slow(self, rank: int, factor: float, start: int = 0, end: int | None = None) -> None:
        self.compute[rank, start:end] *= factor

    def host_of(self, rank: int) -> str:
        return f"host{rank // (self.ranks // self.hosts)}"

    def stage_of(self, rank: int) -> int:
        return rank // (self.ranks // self.pp)

    def replica_of(self, rank: int) -> int:
        return rank % (self.ranks // self.pp) // self.tp

    def skew_replicas(self, cv: float) -> None:
        """Every replica's batch content varies per step: all its ranks (every stage and shard) slower or faster
        together by a lognormal factor of spread `cv`."""
        replicas = self.ranks // self.pp // self.tp
        f = self.rng.lognormal(0.0, cv, size=(replicas, self.steps))
        self.compute *= f[[self.replica_of(r) for r in range(self.ranks)]]

    def frames(self, **extra: pl.DataFrame) -> Frames:
        r, s = np.meshgrid(np.arange(self.ranks), np.arange(self.steps), indexing="ij")
        own = self.compute + self.dl + self.ck
        wait = own.max(axis=0, keepdims=True) - own + 2e6
        duration = own + wait
        end = np.cumsum(duration.max(axis=0))[None, :].repeat(self.ranks, axis=0).astype(np.int64)
        steps = pl.DataFrame({
            "rank": r.ravel(), "step": s.ravel(), "attempt": 0,
            "compute_ns": self.compute.ravel().astype(np.int64), "dataloader_wait_ns": self.dl.ravel().astype(np.int64),
            "checkpoint_ns": self.ck.ravel().astype(np.int64), "collective_wait_ns": wait.ravel().astype(np.int64),
            "duration_ns": duration.ravel().astype(np.int64), "end_wall_ns": end.ravel(),
        })
        topology = pl.DataFrame({
            "rank": np.arange(self.ranks), "world_size": self.ranks,
            "host": [self.host_of(i) for i in range(self.ranks)],
            "pp": [self.stage_of(i) for i in range(self.ranks)],
            "dp": [self.replica_of(i) for i in range(self.ranks)],
            "role": [f"pp={self.stage_of(i)}" for i in range(self.ranks)],
            "device_uuid": [f"GPU-{i}" for i in range(self.ranks)],
        })
        gpu = pl.DataFrame({
            "rank": r.ravel(), "step": s.ravel(), "samples": 1, "sm_clock_mhz": self.clock.ravel(),
            "sm_clock_max_mhz": 1980.0, "throttle_reasons": self.throttle.ravel(),
        })
        lateness = pl.DataFrame({  # the rank everyone waited for is the latest and waited least
            "rank": r.ravel(), "step": s.ravel(), "ops": 4, "wait_ns": wait.ravel().astype(np.int64),
            "late_ns": (own - own.min(axis=0, keepdims=True)).ravel().astype(np.int64),
            "last_arrivals": (own == own.max(axis=0, keepdims=True)).ravel().astype(np.int32) * 4,
        })
        return Frames.build(steps=steps, topology=topology, gpu=gpu, lateness=lateness, **extra)  # type: ignore[arg-type]


def _timing(inc: Incident, true_onset: int) -> tuple[int, int]:
    """(onset error, detection delay) of an incident against the injected onset."""
    assert inc.onset_step is not None and inc.detection_step is not None
    return abs(inc.onset_step - true_onset), inc.detection_step - true_onset


@pytest.mark.parametrize("seed", range(4))
def test_subtle_five_percent_straggler_found_early_with_its_onset(seed: int) -> None:
    job = Job(seed=seed)
    job.slow(37, 1.05, start=120)
    incs = detect_stragglers(job.frames())
    assert [(i.klass, i.subject.kind, i.subject.id) for i in incs] == [(IncidentClass.STRAGGLER, SubjectKind.RANK, "37")]
    inc = incs[0]
    err, delay = _timing(inc, 120)
    assert err <= 3 and 0 <= delay <= 10
    assert inc.detection_wall_ns is not None and inc.cause is Cause.UNKNOWN
    assert 0.5 < inc.confidence <= 1.0


@pytest.mark.parametrize("seed", range(4))
def test_benign_two_percent_slow_hardware_is_no_incident(seed: int) -> None:
    job = Job(seed=seed, steps=1000)
    job.slow(5, 1.02)
    assert detect_stragglers(job.frames()) == ()


def test_intermittent_bursts_are_one_incident() -> None:
    job = Job(seed=3)
    for start in range(60, 300, 40):
        job.slow(12, 1.30, start=start, end=start + 8)
    incs = detect_stragglers(job.frames())
    assert len(incs) == 1 and incs[0].subject.id == "12"
    err, delay = _timing(incs[0], 60)
    assert err <= 1 and delay <= 10
    assert "bursts" in incs[0].summary


@pytest.mark.parametrize("seed", range(4))
def test_a_slowdown_that_eases_below_the_sustain_level_for_a_while_is_still_one_incident(seed: int) -> None:
    # 6 % slow, then 2 % for 100 steps (most steps under the 3 % sustain level: the episode ends, and the next
    # begins more than `merge_gap` steps later), then 6 % again: the rank never came back to its own speed.
    job = Job(seed=seed)
    job.slow(20, 1.06, start=60, end=100)
    job.slow(20, 1.02, start=100, end=200)
    job.slow(20, 1.06, start=200)
    incs = detect_stragglers(job.frames())
    assert [(i.subject.kind, i.subject.id) for i in incs] == [(SubjectKind.RANK, "20")]
    err, delay = _timing(incs[0], 60)
    assert err <= 3 and delay <= 10


@pytest.mark.parametrize("seed", range(3))
def test_two_slowdowns_with_a_return_to_speed_between_are_two_incidents(seed: int) -> None:
    job = Job(seed=seed)
    job.slow(20, 1.06, start=60, end=100)
    job.slow(20, 1.06, start=200)
    incs = detect_stragglers(job.frames())
    assert [(i.subject.id, i.onset_step is not None and abs(i.onset_step - o) <= 3) for i, o in
            zip(incs, (60, 200))] == [("20", True), ("20", True)]


def test_a_heavy_tailed_straggler_in_a_quiet_run_is_caught_within_ten_steps() -> None:
    # From step 100 rank 30 is barely slow on 40 % of its steps and 4-15 % slow on the rest (5-6 % on average):
    # 5 of 8 steps elevated, which at this run's noise (1 %) is far beyond chance, but short of 6 of 8.
    delays = []
    for seed in range(8):
        job = Job(seed=seed)
        rng = np.random.default_rng([seed, 9])
        n = job.steps - 100
        job.compute[30, 100:] *= 1 + np.where(rng.random(n) < 0.4, 0.005, rng.uniform(0.04, 0.15, n))
        incs = detect_stragglers(job.frames())
        assert [i.subject.id for i in incs] == ["30"]
        delays.append(_timing(incs[0], 100)[1])
    assert sum(d <= 10 for d in delays) >= 6, delays


def test_late_onset_is_caught_within_ten_steps() -> None:
    job = Job(seed=4, steps=400)
    job.slow(50, 1.08, start=370)
    (inc,) = detect_stragglers(job.frames())
    err, delay = _timing(inc, 370)
    assert inc.subject.id == "50" and err <= 3 and delay <= 10


def test_thermal_throttle_cause_from_gpu_bits_and_lowered_clock() -> None:
    job = Job(seed=5)
    job.slow(9, 1.15, start=100)
    job.throttle[9, 100:] = int(ThrottleReason.HW_THERMAL_SLOWDOWN)
    job.clock[9, 100:] = 1700.0
    (inc,) = detect_stragglers(job.frames())
    assert inc.subject.id == "9" and inc.cause is Cause.THERMAL_THROTTLE
    assert any(e.source == "gpu" and e.rows for e in inc.evidence)


def test_power_cap_cause() -> None:
    job = Job(seed=6)
    job.slow(40, 1.2, start=50)
    job.throttle[40, 50:] = int(ThrottleReason.SW_POWER_CAP)
    job.clock[40, 50:] = 1500.0
    (inc,) = detect_stragglers(job.frames())
    assert inc.cause is Cause.POWER_THROTTLE


def test_throttle_bit_on_a_rank_that_is_not_slow_is_benign() -> None:
    job = Job(seed=7)
    job.throttle[3, :] = int(ThrottleReason.SW_POWER_CAP)
    job.clock[3, :] = 1800.0
    assert detect_stragglers(job.frames()) == ()


def test_dataloader_rank() -> None:
    job = Job(seed=8)
    job.dl[20, 150:] += 0.12 * STEP_NS
    (inc,) = detect_stragglers(job.frames())
    assert inc.subject == inc.subject.__class__(kind=SubjectKind.RANK, id="20") and inc.cause is Cause.DATALOADER


def test_host_dataloader_is_one_host_incident() -> None:
    job = Job(seed=9)
    for r in range(24, 32):  # host3
        job.dl[r, 80:] += 0.10 * STEP_NS
    incs = detect_stragglers(job.frames())
    assert [(i.subject.kind, i.subject.id, i.cause) for i in incs] == [(SubjectKind.HOST, "host3", Cause.DATALOADER)]
    err, delay = _timing(incs[0], 80)
    assert incs[0].ranks == tuple(range(24, 32)) and err <= 3 and delay <= 10


def _pp_groups(job: Job, slow: tuple[str, str] | None, start: int) -> dict[str, pl.DataFrame]:
    """pp groups {r, r + 32} of a 2-stage job crossing host h <-> h+4, and their per-step transfer times."""
    rng = np.random.default_rng(11)
    half = job.ranks // 2
    names, links, ranks = [], [], []
    for r in range(half):
        names.append(f"pp.dp{r // 4}.tp{r % 4}")
        ranks.append([r, r + half])
        links.append([link_name(job.host_of(r), job.host_of(r + half))])
    groups = pl.DataFrame({"group": names, "kind": "pp", "ranks": ranks,
                           "hosts": [[job.host_of(a), job.host_of(b)] for a, b in ranks], "links": links})
    t = rng.lognormal(np.log(3e6), 0.05, size=(len(names), job.steps))
    if slow is not None:
        for g, (lk,) in enumerate(links):
            if lk == link_name(*slow):
                t[g, start:] *= 2.0
    gi, si = np.meshgrid(np.arange(len(names)), np.arange(job.steps), indexing="ij")
    gt = pl.DataFrame({"group": [names[i] for i in gi.ravel()], "kind": "pp", "step": si.ravel(), "ops": 2,
                       "bytes": 1 << 20, "transfer_ns": t.ravel().astype(np.int64)})
    return {"groups": groups, "group_transfer": gt}


def test_slow_link_is_one_link_incident_and_no_rank_incidents() -> None:
    job = Job(seed=10)
    incs = detect_stragglers(job.frames(**_pp_groups(job, ("host1", "host5"), 90)))
    assert len(incs) == 1
    (inc,) = incs
    assert (inc.subject.kind, inc.subject.id, inc.cause) == (SubjectKind.LINK, "host1<->host5", Cause.SLOW_LINK)
    assert inc.ranks == tuple(range(8, 16)) + tuple(range(40, 48))
    err, delay = _timing(inc, 90)
    assert err <= 3 and delay <= 10


def test_no_link_incident_without_a_slow_link() -> None:
    job = Job(seed=10)
    assert detect_stragglers(job.frames(**_pp_groups(job, None, 0))) == ()


def _small_groups(job: Job, slow_from: int, bursty: dict[str, float]) -> dict[str, pl.DataFrame]:
    """A canary-sized layout on 4 hosts of 2 ranks: dp groups {0,2},{1,3} cross host0<->host1 and {4,6},{5,7}
    host2<->host3; pp groups {0,4},{1,5} cross host0<->host2 and {2,6},{3,7} host1<->host3. host0<->host1 is 8x slower
    from `slow_from`; each group in `bursty` is 5x slower in bursts of its own (a preempted rank on a crowded host)
    covering that share of the run."""
    rng = np.random.default_rng(job.seed)
    spec = {"dp.pp0.tp0": (0, 2), "dp.pp0.tp1": (1, 3), "dp.pp1.tp0": (4, 6), "dp.pp1.tp1": (5, 7),
            "pp.dp0.tp0": (0, 4), "pp.dp0.tp1": (1, 5), "pp.dp1.tp0": (2, 6), "pp.dp1.tp1": (3, 7)}
    names = list(spec)
    links = [[link_name(job.host_of(a), job.host_of(b))] for a, b in spec.values()]
    groups = pl.DataFrame({"group": names, "kind": [n[:2] for n in names], "ranks": [list(v) for v in spec.values()],
                           "hosts": [[job.host_of(a), job.host_of(b)] for a, b in spec.values()], "links": links})
    t = rng.lognormal(np.log(2e6), 0.3, size=(len(names), job.steps))
    for g, name in enumerate(names):
        if links[g] == [link_name("host0", "host1")]:
            t[g, slow_from:] *= 8.0
        burst = np.zeros(job.steps, dtype=bool)
        while burst.mean() < bursty.get(name, 0.0):
            start = int(rng.integers(0, job.steps - 12))
            burst[start:start + int(rng.integers(8, 13))] = True
        t[g, burst] *= 5.0
    gi, si = np.meshgrid(np.arange(len(names)), np.arange(job.steps), indexing="ij")
    gt = pl.DataFrame({"group": [names[i] for i in gi.ravel()], "kind": [names[i][:2] for i in gi.ravel()],
                       "step": si.ravel(), "ops": 1, "bytes": 1 << 17, "transfer_ns": t.ravel().astype(np.int64)})
    return {"groups": groups, "group_transfer": gt}


@pytest.mark.parametrize("seed", [50, 51, 52])
def test_groups_slow_by_noise_at_steps_of_their_own_neither_hide_the_slow_link_nor_make_one(seed: int) -> None:
    """Measured on a canary on two busy cores: a dp group on the healthy link slow by noise for a fifth of the run made
    the kind's 'other groups' half slow and hid the slow link; both pp groups of another link, each noisy at steps of
    its own, were blamed in its place. A link slows its groups at the same steps; noise does not."""
    job = Job(seed=seed, ranks=8, hosts=4, steps=80)
    frames = job.frames(**_small_groups(job, 30, {"dp.pp1.tp1": 0.2, "pp.dp0.tp0": 0.2, "pp.dp0.tp1": 0.2}))
    links = [i for i in detect_stragglers(frames) if i.subject.kind is SubjectKind.LINK]
    assert [(i.subject.id, i.cause) for i in links] == [("host0<->host1", Cause.SLOW_LINK)], links
    err, delay = _timing(links[0], 30)
    assert err <= 3 and delay <= 10


def test_stage_imbalance_is_a_stage_incident_and_no_rank_incident() -> None:
    job = Job(seed=12, pp=4)
    for r in range(32, 48):
        job.slow(r, 1.3)
    incs = detect_stragglers(job.frames())
    assert [(i.klass, i.subject.kind, i.subject.id, i.cause) for i in incs] == [
        (IncidentClass.IMBALANCE, SubjectKind.STAGE, "pp=2", Cause.STAGE_IMBALANCE)]
    assert incs[0].ranks == tuple(range(32, 48))


def test_random_data_skew_is_one_job_imbalance() -> None:
    """Each step the batches of two random replicas (of 8, each 8 shards x 4 stages) are 30 % longer: one
    IMBALANCE."""
    job = Job(seed=13, ranks=256, hosts=32, pp=4, tp=8)
    for s in range(job.steps):
        late = set(job.rng.choice(8, size=2, replace=False).tolist())
        for r in range(job.ranks):
            if job.replica_of(r) in late:
                job.compute[r, s] *= 1.3
    incs = detect_stragglers(job.frames())
    assert [(i.klass, i.subject.kind, i.cause) for i in incs] == [(IncidentClass.IMBALANCE, SubjectKind.JOB, Cause.DATA_SKEW)]
    assert len(incs[0].ranks) > 100


def test_one_rank_at_a_time_much_slower_is_jitter_not_data_skew() -> None:
    """A random rank 15-50 % slow at each step (a pause, a page fault) is no batch effect: the ranks of its replica
    work on the same batch and were not slower. Neither skew nor a straggler."""
    job = Job(seed=14, ranks=256, hosts=32, pp=4, tp=4)
    for s in range(job.steps):
        job.compute[job.rng.integers(job.ranks), s] *= job.rng.uniform(1.15, 1.5)
    assert detect_stragglers(job.frames()) == ()


def test_checkpoint_stall_on_every_rank_is_benign() -> None:
    job = Job(seed=14)
    for s in range(25, job.steps, 50):
        job.ck[:, s] = 5 * STEP_NS * job.rng.lognormal(0, 0.05, size=job.ranks)
        job.dl[:, s + 1] += 0.3 * STEP_NS  # the input pipeline catches up after the stall, on everyone
    assert detect_stragglers(job.frames()) == ()


def test_slow_checkpoint_of_one_rank_is_checkpoint_io() -> None:
    job = Job(seed=15)
    for s in range(25, job.steps, 50):
        job.ck[:, s] = 2 * STEP_NS * job.rng.lognormal(0, 0.05, size=job.ranks)
        job.ck[17, s] *= 3
    incs = detect_stragglers(job.frames())
    assert [(i.subject.id, i.cause) for i in incs] == [("17", Cause.CHECKPOINT_IO)]
    assert incs[0].onset_step == 25 and incs[0].detection_step == 75


def test_clean_run_has_no_incident() -> None:
    job = Job(seed=16, ranks=256, hosts=32, steps=300, pp=4)
    assert detect_stragglers(job.frames()) == ()


def test_the_straggler_is_not_the_rank_with_the_longest_collective_wait() -> None:
    job = Job(seed=17)
    job.slow(44, 1.10, start=30)
    frames = job.frames()
    (inc,) = detect_stragglers(frames)
    waits = frames.steps.filter(pl.col("step") >= 30).group_by("rank").agg(pl.col("collective_wait_ns").sum())
    longest = int(waits.sort("collective_wait_ns").get_column("rank")[-1])
    shortest = int(waits.sort("collective_wait_ns").get_column("rank")[0])
    assert inc.subject.id == "44" and longest != 44 and shortest == 44
    assert any(e.source == "lateness" and e.rows for e in inc.evidence)


def test_too_short_or_empty_runs_have_no_incident() -> None:
    assert detect_stragglers(Frames.build()) == ()
    job = Job(steps=5)
    job.slow(1, 2.0)
    assert detect_stragglers(job.frames()) == ()


@pytest.mark.parametrize("kw", [{"sustain_count": 9}, {"sustain_min": 7}, {"score_window": 0}, {"cusum_threshold": 0.0},
                                {"host_share": 1.5}, {"min_peers": 1}])
def test_config_validation(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="StragglerConfig"):
        StragglerConfig(**kw)  # type: ignore[arg-type]


def test_batch_skew_shared_within_replicas_is_one_job_imbalance_and_keeps_a_subtle_straggler_visible() -> None:
    """Sequence-length skew makes every rank of a replica slow or fast together (10 % per step); against stage peers
    in other replicas each rank looks 10 % off at random. The replica factor is taken out: the skew is one IMBALANCE
    (job, data_skew) and a 7 % straggler starting at step 150 is still found, with nobody else."""
    job = Job(seed=21, ranks=128, pp=2, tp=4, hosts=16)
    job.skew_replicas(0.10)
    job.slow(45, 1.07, start=150)
    incs = detect_stragglers(job.frames())
    got = sorted((i.klass, i.subject.kind, i.subject.id, i.cause) for i in incs)
    assert got == [(IncidentClass.IMBALANCE, SubjectKind.JOB, "job", Cause.DATA_SKEW),
                   (IncidentClass.STRAGGLER, SubjectKind.RANK, "45", Cause.UNKNOWN)], got
    strag = next(i for i in incs if i.klass is IncidentClass.STRAGGLER)
    err, delay = _timing(strag, 150)
    assert err <= 3 and delay <= 10


def test_one_replica_late_at_every_step_is_not_data_skew() -> None:
    """The late replica must change from step to step: a replica whose batches are always the longest is no skew."""
    job = Job(seed=22, ranks=128, pp=2, tp=4, hosts=16)
    job.skew_replicas(0.01)
    for r in range(job.ranks):
        job.compute[r] *= 1 + 0.3 * (job.replica_of(r) == 3) + 0.1 * job.replica_of(r) / 16
    assert not [i for i in detect_stragglers(job.frames()) if i.cause is Cause.DATA_SKEW]


def test_noisy_ranks_jittering_independently_are_not_data_skew() -> None:
    """CPU ranks sharing cores jitter 25 % each, independently: a replica's median of them jitters less than each
    rank, so the replicas' spread never reads as skew."""
    job = Job(seed=23, ranks=64, pp=2, tp=4, hosts=8)
    job.compute *= job.rng.lognormal(0.0, 0.25, size=job.compute.shape)
    assert detect_stragglers(job.frames()) == ()


@pytest.mark.parametrize("seed", range(3))
def test_a_device_four_percent_slow_all_run_is_its_speed_not_a_straggler(seed: int) -> None:
    """A healthy device's hardware spread: 4 % slower than its peers from the first step to the last, no change
    point. Measured against its own baseline it is no incident, while the same device slowing by another 8 % at
    step 150 is a straggler from then on."""
    job = Job(seed=30 + seed)
    job.slow(9, 1.04)
    assert detect_stragglers(job.frames()) == ()
    job.slow(9, 1.08, start=150)
    (inc,) = detect_stragglers(job.frames())
    err, delay = _timing(inc, 150)
    assert inc.subject.id == "9" and err <= 3 and delay <= 10
    effect = float(re.search(r"computes ([0-9.]+)% slower", inc.summary).group(1))  # type: ignore[union-attr]
    assert 10.0 < effect < 14.5  # the excess over the peers as measured (1.04 * 1.08), not over its own baseline


def test_a_rank_much_slower_from_its_first_step_is_still_a_straggler() -> None:
    job = Job(seed=33)
    job.slow(20, 1.25)
    (inc,) = detect_stragglers(job.frames())
    assert inc.subject.id == "20" and inc.onset_step is not None and inc.onset_step <= 3


def _ring_groups(job: Job, slow: tuple[str, str] | None, on: list[tuple[int, int]],
                 hiccups: tuple[int, ...] = ()) -> dict[str, pl.DataFrame]:
    """Two data-parallel rings over every host (both crossing every ring-neighbour link) and one intra-host tp group
    per host; transfers 3x slower while `slow` is on (`on`: [start, end) episodes), and every group 2.5x slower on
    the `hiccups` steps (a network-wide stall)."""
    rng = np.random.default_rng(12)
    hosts = [f"host{h}" for h in range(job.hosts)]
    ring = sorted({link_name(hosts[h], hosts[(h + 1) % job.hosts]) for h in range(job.hosts)})
    per = job.ranks // job.hosts
    names = ["dp.tp0", "dp.tp1"] + [f"tp.h{h}" for h in range(job.hosts)]
    kinds = ["dp", "dp"] + ["tp"] * job.hosts
    ranks = [list(range(0, job.ranks, 2)), list(range(1, job.ranks, 2))] + [
        list(range(h * per, (h + 1) * per)) for h in range(job.hosts)]
    links = [ring, ring] + [[] for _ in range(job.hosts)]
    groups = pl.DataFrame({"group": names, "kind": kinds, "ranks": ranks, "hosts": [hosts] * 2 + [[h] for h in hosts],
                           "links": links}, schema_overrides={"links": pl.List(pl.String)})
    t = rng.lognormal(np.log(3e6), 0.03, size=(len(names), job.steps))
    if slow is not None:
        for a, b in on:
            t[:2, a:b] *= 3.0
    for s in hiccups:
        t[:, s] *= 2.5
    gi, si = np.meshgrid(np.arange(len(names)), np.arange(job.steps), indexing="ij")
    gt = pl.DataFrame({"group": [names[i] for i in gi.ravel()], "kind": [kinds[i] for i in gi.ravel()],
                       "step": si.ravel(), "ops": 2, "bytes": 1 << 20, "transfer_ns": t.ravel().astype(np.int64)})
    return {"groups": groups, "group_transfer": gt}


def test_an_on_off_slow_link_every_ring_crosses_is_found_against_the_rings_own_history() -> None:
    """Every data-parallel ring crosses every link, so comparing rings with each other sees nothing; against their own
    history (network-wide hiccups divided out by the intra-host groups) the on-off episodes stand out. The ring's
    links cannot be told apart: one incident names them all, with the reason."""
    job = Job(seed=40, hosts=8)
    incs = detect_stragglers(job.frames(**_ring_groups(job, ("host2", "host3"), [(60, 75), (100, 112), (150, 165)],
                                                       hiccups=(20, 45, 130))))
    (inc,) = incs
    assert (inc.subject.kind, inc.cause) == (SubjectKind.LINK, Cause.SLOW_LINK)
    assert link_name("host2", "host3") in inc.subject.id.split(" | ") and len(inc.subject.id.split(" | ")) == 8
    assert "cannot tell apart" in inc.summary
    assert inc.onset_step is not None and 58 <= inc.onset_step <= 62


def test_network_hiccups_on_every_group_are_no_slow_link() -> None:
    job = Job(seed=41, hosts=8)
    assert detect_stragglers(job.frames(**_ring_groups(job, None, [], hiccups=(20, 21, 45, 90, 91, 92, 130)))) == ()
