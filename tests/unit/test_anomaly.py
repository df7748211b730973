"""The anomaly model: nothing on benign variation, one UNCLASSIFIED incident for a pattern no class covers, ranks
covered by known incidents not reported again, the same answer every time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pytest

from rankwatch.analytics.anomaly import AnomalyConfig, Feature, detect_anomalies
from rankwatch.analytics.frames import Frames
from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.base.schema import ThrottleReason
from rankwatch.base.topology import link_name

TP, PP, PER_HOST = 8, 4, 8
BENIGN_SLOW_RANK, THROTTLE_BIT_RANK, SBE_RANK, PCIE_RANK = 5, 3, 11, 12


@dataclass(frozen=True, kw_only=True, slots=True)
class Odd:
    """From step `start` to `stop` (exclusive) rank `rank` waits `wait_x` times as long in collectives, computes
    `compute_x` times as long, and runs `hotter_c` degrees hotter."""

    rank: int
    start: int
    stop: int
    wait_x: float = 1.0
    compute_x: float = 1.0
    hotter_c: float = 0.0
    waiting_peers: tuple[int, ...] = ()
    """Ranks that wait for it: their collective wait grows by the extra compute time."""
    loader_ns: float = 0.0
    """Extra dataloader wait per step of `rank`, or of the `loader_held` ranks instead where those are given: they
    arrive late at the collective and wait that much less in it (lockstep), the step takes as long as before."""
    loader_held: tuple[int, ...] = ()


def _groups(n_ranks: int, hosts: list[str]) -> pl.DataFrame:
    dp = n_ranks // (TP * PP)

    def rank_of(d: int, t: int, p: int) -> int:
        return (p * dp + d) * TP + t

    rows = []

    def add(kind: str, name: str, members: list[int]) -> None:
        ring = [hosts[m] for m in members]
        links = sorted({link_name(a, b) for a, b in zip(ring, ring[1:] + ring[:1]) if a != b})
        rows.append({"group": name, "kind": kind, "ranks": members, "hosts": sorted(set(ring)), "links": links})

    for p in range(PP):
        for t in range(TP):
            add("dp", f"dp.pp{p}.tp{t}", [rank_of(d, t, p) for d in range(dp)])
        for d in range(dp):
            add("tp", f"tp.pp{p}.dp{d}", [rank_of(d, t, p) for t in range(TP)])
    for d in range(dp):
        for t in range(TP):
            add("pp", f"pp.dp{d}.tp{t}", [rank_of(d, t, p) for p in range(PP)])
    return pl.DataFrame(rows, schema={"group": pl.String, "kind": pl.String, "ranks": pl.List(pl.Int32),
                                      "hosts": pl.List(pl.String), "links": pl.List(pl.String)})


def synth(n_ranks: int = 256, n_steps: int = 300, *, seed: int = 0, odd: Odd | None = None,
          wait_ns: float = 30e6, wait_cv: float = 0.01) -> Frames:
    """A run with benign variation only: ~1 % lognormal per-step noise, stage-dependent step times, rank 5 2 %
    slower throughout, a 2 s checkpoint stall on every rank every 100 steps, an SW power cap bit on a GPU that is
    not slow, steady nonzero ECC single-bit and PCIe replay counters, GPUs that differ a little in temperature and
    power. Collective waits are `wait_ns` with a lognormal spread of `wait_cv` (gloo on busy CPUs: tens of %). `odd`
    adds one unusual pattern."""
    rng = np.random.default_rng(seed)
    dp = n_ranks // (TP * PP)
    ranks = np.arange(n_ranks)
    pp_of = ranks // (TP * dp)
    hosts = [f"host{r // PER_HOST}" for r in ranks]
    topology = pl.DataFrame({
        "rank": ranks, "attempt": 0, "world_size": n_ranks, "host": hosts, "local_rank": ranks % PER_HOST,
        "device_uuid": [f"GPU-{r:04d}" for r in ranks], "dp": (ranks // TP) % dp, "tp": ranks % TP, "pp": pp_of,
        "role": [f"pp={p}" for p in pp_of],
    })
    rank = np.repeat(ranks, n_steps)
    step = np.tile(np.arange(n_steps), n_ranks)
    shape = rank.shape

    def noise() -> np.ndarray:
        return rng.lognormal(0.0, 0.01, shape)

    compute = 100e6 * (1 + 0.05 * pp_of[rank]) * noise() * np.where(rank == BENIGN_SLOW_RANK, 1.02, 1.0)
    loader = 3e6 * noise()
    wait = wait_ns * rng.lognormal(0.0, wait_cv, shape)
    checkpoint = np.where(step % 100 == 99, 2e9, 0.0)
    temperature = 60 + rng.normal(0, 2, n_ranks)[rank] + rng.normal(0, 0.5, shape)
    power = 500 * (1 + 0.02 * rng.normal(0, 1, n_ranks))[rank] * noise()
    clock = 1980 * (1 - 0.002 * np.abs(rng.normal(0, 1, shape)))
    if odd is not None:
        during = (step >= odd.start) & (step < odd.stop)
        at = during & (rank == odd.rank)
        extra = compute * (odd.compute_x - 1)
        wait = np.where(at, wait * odd.wait_x, wait)
        temperature = np.where(at, temperature + odd.hotter_c, temperature)
        peers = during & np.isin(rank, odd.waiting_peers)
        wait = np.where(peers, wait + np.median(extra[at]), wait)
        compute = np.where(at, compute + extra, compute)
        held = during & np.isin(rank, odd.loader_held) if odd.loader_held else at
        loader = np.where(held, loader + odd.loader_ns, loader)
        if odd.loader_held:
            wait = np.where(held, np.maximum(wait - odd.loader_ns, 0.0), wait)
    steps = pl.DataFrame({
        "rank": rank, "step": step, "duration_ns": (compute + loader + wait + checkpoint).astype(np.int64),
        "compute_ns": compute.astype(np.int64), "collective_wait_ns": wait.astype(np.int64),
        "dataloader_wait_ns": loader.astype(np.int64), "checkpoint_ns": checkpoint.astype(np.int64),
    })
    gpu = pl.DataFrame({
        "rank": rank, "step": step, "samples": 1, "sm_clock_mhz": clock, "sm_clock_max_mhz": 1980.0,
        "power_w": power, "power_limit_w": 700.0, "temperature_c": temperature,
        "throttle_reasons": np.where(rank == THROTTLE_BIT_RANK, int(ThrottleReason.SW_POWER_CAP), 0),
        "ecc_sbe_volatile": np.where(rank == SBE_RANK, 7, 0), "ecc_dbe_volatile": 0,
        "pcie_replay": np.where(rank == PCIE_RANK, 3, 0), "nvlink_errors": 0, "retired_pages": 0, "remapped_rows": 0,
    })
    return Frames.build(topology=topology, groups=_groups(n_ranks, hosts), steps=steps, gpu=gpu)


def _straggler(rank: int, onset: int) -> Incident:
    return Incident(klass=IncidentClass.STRAGGLER, subject=Subject(kind=SubjectKind.RANK, id=str(rank)),
                    ranks=(rank,), onset_step=onset, detection_step=onset + 5, confidence=0.9, cause=Cause.UNKNOWN,
                    summary=f"rank {rank} slow")


@pytest.mark.parametrize("seed", [0, 1])
def test_benign_variation_raises_nothing(seed: int) -> None:
    assert detect_anomalies(synth(seed=seed)) == ()


def test_unexplained_pattern_is_one_unclassified_incident_on_that_rank() -> None:
    # 50 steps: two whole windows (160..199) and half of one; a window half in the pattern has a median between the
    # two levels and the spread of both, so it is not evidence, and persistence needs two windows
    frames = synth(odd=Odd(rank=77, start=150, stop=200, wait_x=2.0, hotter_c=25.0))
    (inc,) = detect_anomalies(frames)
    assert inc.klass is IncidentClass.UNCLASSIFIED
    assert inc.cause is Cause.UNKNOWN
    assert inc.subject == Subject(kind=SubjectKind.RANK, id="77")
    assert inc.ranks == (77,)
    assert inc.onset_step is not None and inc.detection_step is not None
    assert 140 <= inc.onset_step <= 170
    assert inc.onset_step < inc.detection_step <= 200
    assert Feature.TEMPERATURE in inc.fields and Feature.COLLECTIVE_WAIT in inc.fields
    assert Feature.COMPUTE not in inc.fields
    (ev,) = inc.evidence
    row = dict(zip(ev.columns, next(r for r in ev.rows if r[ev.columns.index("feature")] == Feature.TEMPERATURE)))
    assert row["value"] - row["peer_median"] > 20
    assert 0.5 <= inc.confidence <= 0.9


def test_short_blip_below_persistence_is_not_reported() -> None:
    # one window of 2.2x collective wait (z ~ 11 < extreme_z) is not confirmed; the same for 40 steps is
    assert detect_anomalies(synth(odd=Odd(rank=30, start=100, stop=120, wait_x=2.2))) == ()
    (inc,) = detect_anomalies(synth(odd=Odd(rank=30, start=100, stop=140, wait_x=2.2)))
    assert inc.ranks == (30,) and Feature.COLLECTIVE_WAIT in inc.fields


def test_waiting_less_for_data_than_the_peers_is_no_anomaly_waiting_more_is() -> None:
    # CI, 4 ranks on two busy cores: three in-process loaders were preempted (2 ms of a 12 ms step) and the model
    # flagged the fourth, which was not. Here rank 12's stage peers wait 40 ms more for data for 40 steps and as much
    # less in the (noisy) collective; rank 12 does neither
    stage0 = tuple(r for r in range(64) if r != 12)
    noisy = {"wait_ns": 60e6, "wait_cv": 0.5}
    assert detect_anomalies(synth(**noisy)) == ()
    held = Odd(rank=12, start=100, stop=140, loader_ns=40e6, loader_held=stage0)
    assert detect_anomalies(synth(odd=held, **noisy)) == ()
    (inc,) = detect_anomalies(synth(odd=Odd(rank=12, start=100, stop=140, loader_ns=40e6), **noisy))
    assert inc.ranks == (12,) and Feature.DATALOADER_WAIT in inc.fields


def test_gpu_environment_alone_raises_nothing() -> None:
    # a GPU 25 °C hotter for 60 steps on a rank that is not slower is benign (like a throttle bit on a fast rank)
    assert detect_anomalies(synth(odd=Odd(rank=30, start=100, stop=160, hotter_c=25.0))) == ()


def test_known_incident_covers_its_rank_and_the_peers_waiting_for_it() -> None:
    # rank 40 computes 30 % longer from step 120; its tensor-parallel group (ranks 40..47) waits for it
    odd = Odd(rank=40, start=120, stop=300, compute_x=1.3, waiting_peers=tuple(range(41, 48)))
    frames = synth(odd=odd)
    unexplained = detect_anomalies(frames)
    assert {i.ranks[0] for i in unexplained} >= {40}
    assert detect_anomalies(frames, known=[_straggler(40, onset=121)]) == ()
    # a known incident elsewhere, or one that starts long after, explains nothing here
    assert {i.ranks[0] for i in detect_anomalies(frames, known=[_straggler(7, onset=120)])} >= {40}
    assert {i.ranks[0] for i in detect_anomalies(frames, known=[_straggler(40, onset=250)])} >= {40}


def test_new_hard_errors_are_an_anomaly_steady_counters_are_not() -> None:
    frames = synth()
    gpu = frames.gpu.with_columns(
        pl.when((pl.col("rank") == 9) & (pl.col("step") >= 210)).then(1).otherwise(0).alias("ecc_dbe_volatile"))
    (inc,) = detect_anomalies(Frames.build(topology=frames.topology, groups=frames.groups, steps=frames.steps, gpu=gpu))
    assert inc.ranks == (9,) and inc.fields == (Feature.NEW_HARD_ERRORS,)
    assert inc.onset_step == 200 and inc.detection_step == 219


def test_deterministic() -> None:
    frames = synth(odd=Odd(rank=77, start=150, stop=190, wait_x=2.0, hotter_c=25.0))
    cfg = AnomalyConfig(fit_windows=1000)
    assert detect_anomalies(frames, config=cfg) == detect_anomalies(frames, config=cfg)


def test_empty_frames_and_bad_config() -> None:
    assert detect_anomalies(Frames.build()) == ()
    with pytest.raises(ValueError, match="z_threshold"):
        AnomalyConfig(z_threshold=20.0, extreme_z=10.0)


def _busy_cores(seed: int, *, n_steps: int = 40, slow: int | None = None, slow_x: float = 1.0) -> Frames:
    """4 ranks in lockstep on 2 busy cores (the CPU canary under CI load): a step computes 3 ms on a core, or 4 ms
    more when its process waited for one (at random, 45 % of steps, each rank on its own); `slow` computes `slow_x`
    times as long. The window median of such a mixture jumps between the two levels from one window to the next."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(4)
    topology = pl.DataFrame({"rank": ranks, "attempt": 0, "world_size": 4, "host": [f"host{r // 2}" for r in ranks],
                             "local_rank": ranks % 2, "device_uuid": [f"cpu-{r}" for r in ranks], "dp": ranks,
                             "tp": 0, "pp": 0, "role": "pp=0"})
    rank, step = np.repeat(ranks, n_steps), np.tile(np.arange(n_steps), 4)
    compute = 3e6 * rng.lognormal(0.0, 0.1, rank.shape) + np.where(rng.random(rank.shape) < 0.45, 4e6, 0.0)
    if slow is not None:
        compute = np.where(rank == slow, compute * slow_x, compute)
    t = pl.DataFrame({"step": step, "t": compute}).with_columns(pl.col("t").max().over("step").alias("m"))
    wait = (t["m"] - t["t"]).to_numpy() + 0.2e6
    steps = pl.DataFrame({"rank": rank, "step": step, "compute_ns": compute.astype(np.int64),
                          "collective_wait_ns": wait.astype(np.int64), "dataloader_wait_ns": 1_000_000,
                          "duration_ns": (compute + wait + 1e6).astype(np.int64), "checkpoint_ns": 0})
    return Frames.build(topology=topology, steps=steps)


def test_scheduling_noise_on_busy_cores_is_no_anomaly() -> None:
    # CI: a 4-rank canary's rank 3 had a window-0 median compute 52 % above its peers' (z 18.4, confirmed at once),
    # while step by step against the peers it was 8 % slower in a spread of 24 %. Each step is compared with the
    # peers at that step, and a window's median with its own standard error; the old code flags 40 of 200 seeds
    assert [s for s in range(30) if detect_anomalies(_busy_cores(s))] == []
    # a rank four times as slow in the same noise still stands out
    assert sum(bool(detect_anomalies(_busy_cores(s, slow=2, slow_x=4.0))) for s in range(20)) >= 14
