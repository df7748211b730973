"""The independent labeled-telemetry source (benchmarks/independent): valid runs, consistent labels, determinism,
disjoint seed splits and the physics a real collector would record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rankwatch.analytics.store import check_run
from rankwatch.base.schema import SCHEMA_VERSION, SCHEMA_VERSION_KEY, Table, storage_schema

from detection import _localized  # benchmarks/ is on the tests' path (pyproject: pythonpath)
from independent import HELDOUT2_SEEDS, HELDOUT_SEEDS, TUNE_SEEDS, Scenario, generate, phenomena, scenarios
from independent.noise import healthy
from independent.suite import SPLITS
from independent.tables import Builder
from independent.timeline import simulate
from independent.world import World

ROOT = Path(__file__).resolve().parents[2]

CLASSES = {"straggler", "fail_stop", "hang", "divergence", "corruption", "imbalance"}
KINDS = {"rank", "device", "host", "link", "stage", "replica", "domain", "job"}
SMALL_KINDS = ["clean", "failstop_vanished", "failstop_exception", "failstop_launcher_kill", "hang_collective",
               "hang_step", "transient_freeze", "device_sbe_rising", "div_rng", "straggler_dataloader_host"]


def _small(kind: str, timing: str, seed: int = 123_456) -> Scenario:
    return Scenario(name=f"t-{kind}-{timing}", seed=seed, kind=kind, dp=4, tp=2, pp=2, steps=60, timing=timing)


def _arrow(run: Path, table: Table) -> pa.Table:
    parts = sorted((run / "telemetry" / str(table)).glob("rank=*/part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


def _read(run: Path, table: Table) -> dict[str, np.ndarray]:
    t = _arrow(run, table)
    return {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("timing", ["cpu", "gpu"])
@pytest.mark.parametrize("kind", SMALL_KINDS)
def test_runs_are_readable_typed_and_labeled(tmp_path: Path, kind: str, timing: str) -> None:
    run = generate(_small(kind, timing), tmp_path, timing)
    check_run(run)  # raises on damage
    for table in Table:
        for part in (run / "telemetry" / str(table)).glob("rank=*/part-*.parquet"):
            schema = pq.read_schema(part)
            expected = storage_schema(table)
            assert [(f.name, f.type) for f in schema] == [(f.name, f.type) for f in expected], part
            assert schema.metadata[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    labels = json.loads((run / "labels.json").read_text())
    assert labels["version"] == 1 and labels["ranks"] == 16 and labels["layout"] == "dp=4,tp=2,pp=2"
    assert (labels["expected"] == []) == (kind == "clean")
    for lab in labels["expected"]:
        assert lab["class"] in CLASSES and lab["subject_kind"] in KINDS
        assert lab["ranks"] and all(0 <= r < 16 for r in lab["ranks"])
        assert 0 <= lab["onset_step"] < labels["steps"]
        if lab["subject_kind"] == "rank":
            assert lab["ranks"] == [int(lab["subject"])]
        if lab["subject_kind"] == "link":
            a, b = lab["subject"].split("<->")
            assert a < b
        if lab.get("device_fault"):
            assert lab["device"].startswith("GPU-")


@pytest.mark.timeout(60)
def test_generation_is_deterministic(tmp_path: Path) -> None:
    sc = _small("straggler_intermittent", "cpu", seed=777)
    a = generate(sc, tmp_path / "a")
    b = generate(sc, tmp_path / "b")
    for table in (Table.STEPS, Table.COLLECTIVES, Table.EVENTS, Table.GPU, Table.FINGERPRINTS):
        assert _arrow(a, table).equals(_arrow(b, table)), table
    assert (a / "labels.json").read_text() == (b / "labels.json").read_text()


@pytest.mark.timeout(30)
def test_suite_splits_and_coverage() -> None:
    assert not set(TUNE_SEEDS) & set(HELDOUT_SEEDS)
    assert not (set(TUNE_SEEDS) | set(HELDOUT_SEEDS)) & set(HELDOUT2_SEEDS)
    spans = sorted((r.start, r.stop, name) for name, r in SPLITS.items())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # no two splits share a seed
    for timing in ("cpu", "gpu"):
        tune, held = scenarios("tune", timing), scenarios("heldout", timing)
        assert {s.seed for s in tune} <= set(TUNE_SEEDS) and {s.seed for s in held} <= set(HELDOUT_SEEDS)
        for split in (tune, held):
            assert len(split) >= 100 and len({s.name for s in split}) == len(split)
            kinds = [s.kind for s in split]
            assert all(kinds.count(k) >= 4 for k in phenomena.KINDS) and kinds.count("clean") >= 12
            assert all(64 <= s.ranks <= 2048 for s in split)
            assert sum(s.ranks >= 1024 for s in split) >= 3
            assert sum(s.ranks <= 256 for s in split) >= 0.8 * len(split)
    assert [s.dp for s in scenarios("tune", "cpu")] != [s.dp for s in scenarios("heldout", "cpu")]
    with pytest.raises(ValueError):
        scenarios("train", "cpu")


def test_every_split_is_disjoint_from_the_others() -> None:
    ranges = list(SPLITS.values())
    assert len(ranges) >= 5
    for i, a in enumerate(ranges):
        assert all(not set(a) & set(b) for b in ranges[i + 1:])


@pytest.mark.parametrize(("dp", "tp", "pp"), [(16, 4, 1), (8, 4, 2), (4, 4, 4), (16, 1, 8), (32, 2, 1)])
def test_a_slow_link_candidate_carries_traffic_and_its_label_names_what_the_data_cannot_tell_apart(
    dp: int, tp: int, pp: int
) -> None:
    w = World(dp, tp, pp, 5)
    traffic = w.link_traffic()
    assert w.inter_host_links() and all(traffic[link] for link in w.inter_host_links())
    for link in w.inter_host_links():
        tied = w.indistinguishable_links(link)
        assert link in tied and all(traffic[t] == traffic[link] for t in tied)
        if any(x.startswith("send ") for x in traffic[link]):
            assert tied == [link]  # a stage-to-stage send crosses this link alone: the pair is in the data
    if pp == 1:  # every data-parallel ring crosses every host's links alike: no single pair can be told
        assert all(len(w.indistinguishable_links(link)) == w.n_hosts for link in w.inter_host_links())
    if pp >= 3:  # rank 0's pipeline ring wraps from the last stage to the first: no send, never a candidate
        first, last = w.host_of(0), w.host_of(w.rank_of(pp - 1, 0, 0))
        assert first != last and f"{first}<->{last}" not in w.inter_host_links()


def test_a_link_set_localizes_only_when_it_is_exactly_what_the_data_cannot_tell_apart() -> None:
    label = {"subject_kind": "link", "subject": "h1<->h2", "indistinguishable": ["h0<->h1", "h1<->h2", "h0<->h2"]}
    inc = {"subject_kind": "link"}
    assert _localized(label, {**inc, "subject": "h1<->h2"})
    assert _localized(label, {**inc, "subject": "h0<->h1 | h0<->h2 | h1<->h2"})
    assert not _localized(label, {**inc, "subject": "h0<->h1 | h1<->h2"})
    assert not _localized(label, {**inc, "subject": "h0<->h1 | h0<->h2 | h1<->h2 | h2<->h3"})
    assert not _localized(label, {**inc, "subject": "h0<->h1"})
    alone = {**label, "indistinguishable": ["h1<->h2"]}
    assert not _localized(alone, {**inc, "subject": "h1<->h2 | h2<->h3"})
    assert not _localized({**label, "indistinguishable": None}, {**inc, "subject": "h0<->h1 | h0<->h2 | h1<->h2"})


def test_a_replica_of_one_rank_is_that_rank() -> None:
    label = {"subject_kind": "replica", "subject": "dp=93", "ranks": [93]}
    assert _localized(label, {"subject_kind": "rank", "subject": "93", "ranks": [93]})
    assert not _localized(label, {"subject_kind": "rank", "subject": "94", "ranks": [94]})
    assert not _localized({**label, "ranks": [93, 94]}, {"subject_kind": "rank", "subject": "93", "ranks": [93]})
    assert _localized({"subject_kind": "rank", "subject": "7", "ranks": [7]},
                      {"subject_kind": "replica", "subject": "dp=7", "ranks": [7]})


def _slow_run(tmp_path: Path, timing: str) -> tuple[Path, int]:
    """A run with rank 5 50 % slower from step 10 (device work), built below the phenomena layer."""
    world = World(4, 2, 2, 99)
    rng = np.random.default_rng(5)
    draw = healthy(world, 40, timing, rng)
    draw.plan.work[10:, 5] *= 1.5
    sim = simulate(draw.plan, np.random.default_rng(6))
    from independent.tables import write_tables

    run = tmp_path / timing
    write_tables(str(run), Builder(draw, sim, 99, np.random.default_rng(7)).build())
    return run, 5


@pytest.mark.timeout(60)
def test_late_rank_spends_least_time_inside_blocking_collectives(tmp_path: Path) -> None:
    run, x = _slow_run(tmp_path, "cpu")
    c = _read(run, Table.COLLECTIVES)
    mine = (c["rank"] == x) & (c["step"] >= 12) & (c["op"] == "all_reduce") & (c["status"] == "ok")
    checked = 0
    for g, s in set(zip(c["group"][mine].tolist(), c["group_seq"][mine].tolist())):
        same = (c["group"] == g) & (c["group_seq"] == s) & (c["status"] == "ok")
        d = dict(zip(c["rank"][same].tolist(), c["duration_ns"][same].tolist()))
        if not g.startswith("mp"):  # (its own optimizer comes after the model-parallel norm)
            assert d[x] == min(d.values()), (g, s, d)
            checked += 1
    assert checked > 20


@pytest.mark.timeout(60)
def test_gpu_step_times_agree_while_device_compute_shows_the_slow_device(tmp_path: Path) -> None:
    run, x = _slow_run(tmp_path, "gpu")
    st = _read(run, Table.STEPS)
    late = st["step"] >= 12
    for s in range(12, 40):  # every host waits for the same step end; only the optimizer's tail after it differs
        dur = st["duration_ns"][st["step"] == s]
        assert dur.max() - dur.min() < 0.05 * np.median(dur)
    dev = st["device_compute_ns"]
    mine = np.median(dev[late & (st["rank"] == x)])
    others = np.median(dev[late & (st["rank"] != x)])
    assert mine > 1.3 * others
    cpu = st["compute_ns"]
    assert abs(np.median(cpu[late & (st["rank"] == x)]) / np.median(cpu[late & (st["rank"] != x)]) - 1) < 0.03
    c = _read(run, Table.COLLECTIVES)
    assert np.nanmax(c["duration_ns"].astype(float)) < 1e6  # CPU side of a CUDA collective: launch latency


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["tp_fwd", "tp_bwd"])
@pytest.mark.parametrize("timing", ["cpu", "gpu"])
def test_a_death_inside_a_tensor_parallel_op_of_any_stage_is_placed_in_that_stage(where: str, timing: str) -> None:
    """The forward / backward waves visit every stage; a death inside a tensor-parallel op belongs to the pass of
    the dying rank's own stage (a later stage's pass once moved it to 'never', and the run could not be built)."""
    from independent.timeline import Death

    world = World(4, 2, 3, 7)  # dp=4, tp=2, pp=3: a first, a middle and a last stage
    for rank in range(world.n):
        draw = healthy(world, 12, timing, np.random.default_rng(rank))
        draw.plan.death = Death(rank=rank, step=8, where=where, frac=0.5)
        sim = simulate(draw.plan, np.random.default_rng(11))
        assert sim.death_time is not None and np.isfinite(sim.death_time), (rank, world.pp_of[rank])
        op = next(o for o in sim.ops if o.key == where)
        # it dies once inside the op it entered, not at a later stage's pass (where it was long gone)
        assert op.enter[8, rank] <= sim.death_time - sim.origin[8] <= op.enter[8, rank] + 1e-3, rank
