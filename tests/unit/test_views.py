"""The views people look at (analytics/views/): built by the analysis, stored, read back, kept honest about
stale or damaged input, and arranged (heatmap, collective progress, timeline, topology status) from real runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rankwatch.analytics import views

from rankwatch.analytics.analyze import ensure_views
from rankwatch.analytics.errors import AnalyticsError, RunDirError
from views_support import STRAGGLER, analyzed_run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return analyzed_run(tmp_path_factory.mktemp("views") / "run")


def test_the_analysis_stores_views_that_read_back_without_analysing_again(run: Path) -> None:
    folder = views.views_dir(run)
    manifest = (folder / views.MANIFEST).stat().st_mtime_ns
    store = ensure_views(run)
    assert store.folder == folder and (folder / views.MANIFEST).stat().st_mtime_ns == manifest
    s = store.summary
    assert (s.ranks, s.first_step, s.last_step, s.layout, s.hosts) == (16, 0, 299, {"dp": 4, "tp": 2, "pp": 2}, 4)
    assert 0 < s.effective_s <= s.wall_s and 0 < s.goodput <= 1
    assert not store.stale()
    assert set(store.names) == set(views.FRAME_NAMES)
    assert store.frame("rank_steps").height == 16 * 300
    assert store.rank(STRAGGLER)["step"].to_list() == list(range(300))
    progress = store.frame("progress")
    assert progress.height == 16 and progress["last_step"].to_list() == [299] * 16
    assert [str(i.subject) for i in store.incidents] == [f"rank:{STRAGGLER}"]


def test_the_leaderboard_puts_the_straggler_first_with_its_incident(run: Path) -> None:
    lb = ensure_views(run).frame("leaderboard")
    top = lb.row(0, named=True)
    assert top["rank"] == STRAGGLER and top["score"] > 1.2 and "straggler" in top["incidents"]
    assert 0.5 < top["persistence"] <= 1 and lb["persistence"][1:].max() < 0.1  # type: ignore[operator]
    assert top["arrived_last"] == lb["arrived_last"].max()


def test_incidents_carry_the_decision_and_its_status(run: Path) -> None:
    store = ensure_views(run)
    decided = views.decisions(run)
    assert decided["status"].to_list() == ["proposed"] and decided["path"][0].len() > 0
    table = views.incident_table(store.incidents, decided, store.summary.start_wall_ns)
    row = table.row(0, named=True)
    assert row["subject"] == f"rank:{STRAGGLER}" and row["decision"] == "observe" and row["status"] == "proposed"
    assert row["since_s"] is not None and 0 < row["since_s"] < store.summary.wall_s
    undecided = views.incident_table(store.incidents, decided.clear(), 0)
    assert undecided["decision"].to_list() == ["none"] and undecided["status"].to_list() == ["undecided"]


def test_the_detail_shows_the_subject_against_its_peers_around_the_onset(run: Path) -> None:
    store = ensure_views(run)
    inc = store.incidents[0]
    d = views.incident_detail(store, inc)
    subject = d.series.filter(pl.col("who") == "subject")
    peers = d.series.filter(pl.col("who") == "peers median")
    # a straggler's series covers its whole episode: from 50 steps before the onset to the run's last step
    assert subject["step"].min() == inc.onset_step - 50 and subject["step"].max() == store.summary.last_step  # type: ignore[operator]
    after = pl.col("step") > inc.onset_step  # type: ignore[operator]
    assert subject.filter(after)["compute_ms"].median() > 1.2 * peers.filter(after)["compute_ms"].median()  # type: ignore[operator]
    assert subject.filter(after)["late_ms"].median() > 5 * peers.filter(after)["late_ms"].median()  # type: ignore[operator]
    before = subject.filter(~after)["compute_ms"].median() / peers.filter(~after)["compute_ms"].median()  # type: ignore[operator]
    assert 0.9 < before < 1.1
    assert d.gpu["who"].to_list() == ["subject", "median GPU"]
    assert d.arrivals.row(0, named=True)["rank"] == STRAGGLER
    assert d.decisions.height == 1 and d.decisions["action"].to_list() == ["observe"]


def test_the_heatmap_bins_keep_the_largest_value(run: Path) -> None:
    store = ensure_views(run)
    full = store.frame("rank_steps")
    hm = views.heatmap(store, "step_ms", max_ranks=4, max_steps=30)
    assert hm.height == 4 * 30
    assert hm["rank_lo"].unique().sort().to_list() == [0, 4, 8, 12]
    cell = hm.filter((pl.col("rank_lo") <= STRAGGLER) & (pl.col("rank_hi") >= STRAGGLER) & (pl.col("step_lo") == 200))
    expect = full.filter(pl.col("rank").is_between(4, 7) & pl.col("step").is_between(200, 209))["step_ms"].max()
    assert cell["value"].to_list() == [expect]
    assert views.heatmap(store, "late_ms").height == 16 * 150  # 300 steps into at most 200 bins: 150 bins of 2
    grid = views.grid(store)
    assert grid.height == 8 and grid.sort("value").row(-1, named=True)["rank"] == STRAGGLER


def test_the_timeline_holds_starts_checkpoints_the_incident_the_decision_and_the_lineage(run: Path) -> None:
    store = ensure_views(run)
    tl = views.timeline(store, store.incidents, views.decisions(run), views.lineage(run))
    kinds = tl["kind"].to_list()
    assert kinds[0] == "start" and kinds.count("checkpoint saved") == 3 and kinds.count("incident") == 1
    assert "decision (proposed)" in kinds and "lineage" in kinds and "exit" in kinds
    assert tl["wall_ns"].is_sorted()
    assert views.comparability(run, store.incidents).bitwise


def test_comparability_names_what_changed(tmp_path: Path) -> None:
    entry = {"seq": 3, "time_ns": 1, "kind": "world_size_change", "details": {"attempt": 2},
             "verdict": {"comparability": "changed", "reasons": ["batch_composition"], "note": "dp 4 -> 2"},
             "prev_hash": "0", "hash": "1"}
    (tmp_path / "lineage.jsonl").write_text(json.dumps(entry) + "\n")
    c = views.comparability(tmp_path)
    assert not c.bitwise and c.line() == "CHANGED: #3 world_size_change: batch_composition"
    (tmp_path / "lineage.jsonl").write_text('{"seq": 0}\n')
    with pytest.raises(RunDirError, match=r"lineage.jsonl: line 1 is not a lineage entry"):
        views.lineage(tmp_path)


def test_topology_marks_incidents_and_quarantine(run: Path, tmp_path: Path) -> None:
    store = ensure_views(run)
    device = store.frame("topology").filter(pl.col("rank") == 3)["device_uuid"].item()
    (tmp_path / "quarantine.json").write_text(json.dumps({"entries": [{"kind": "device", "id": device,
                                                                        "incident": "x"}]}))
    devices, links = views.topology_status(store, store.incidents, views.quarantine(tmp_path))
    status = dict(zip(devices["rank"].to_list(), devices["status"].to_list()))
    assert status[STRAGGLER] == "straggler" and status[3] == "quarantined" and status[0] == "ok"
    assert links.height == 6 and set(links["status"]) == {"ok"}
    (tmp_path / "quarantine.json").write_text(json.dumps({"entries": [{"id": "x"}]}))
    with pytest.raises(RunDirError, match="quarantine.json: not a quarantine list"):
        views.quarantine(tmp_path)


def test_collective_progress_names_the_hung_rank(tmp_path: Path) -> None:
    run = analyzed_run(tmp_path / "hang", steps=200, faults=("hang:rank=6,step=120",))
    col = ensure_views(run).frame("collectives")
    behind = col.filter(pl.col("behind") > 0)
    # its tensor- and pipeline-parallel peers wait for it, so they never reach their data-parallel all-reduce either
    assert set(behind["rank"]) == {6, 7, 14, 15}
    assert set(col.filter(pl.col("missing"))["rank"]) == {6}
    assert set(col.filter(pl.col("waiting"))["rank"]) == set(range(16)) - {6}  # every other rank waits somewhere
    assert not ensure_views(run).summary.ended  # the hung rank never exited


def test_views_of_a_copied_run_belong_to_the_copy_and_say_it_ended(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "moved"
    shutil.copytree(run, copy)
    store = ensure_views(copy)
    assert store.run_dir == copy and store.summary.run_dir == str(run)  # views built elsewhere, read for the copy
    assert store.summary.ended and not store.stale()
    part = next((copy / "telemetry" / "steps").glob("rank=*"))
    shutil.copy(next(part.glob("*.parquet")), part / "part-new.parquet")
    assert store.stale() and not views.stored_views(run).stale()  # the copy changed, not the original


def test_stale_views_are_told_and_rebuilt(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(views.views_dir(copy))
    store = ensure_views(copy)  # none stored: the analysis builds them
    assert not store.stale()
    part = next((copy / "telemetry").rglob("*.parquet"))
    shutil.copy(part, part.with_name("part-99999.parquet"))
    assert store.stale()
    assert ensure_views(copy).summary == store.summary  # without refresh: what is stored
    with pytest.raises(AnalyticsError):  # a copied part is damaged input, never a fresh answer
        ensure_views(copy, refresh=True)


def test_damaged_or_missing_input_is_one_line_never_an_empty_answer(run: Path, tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no such run directory"):
        ensure_views(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AnalyticsError, match="no telemetry"):
        ensure_views(tmp_path / "empty")
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    (views.views_dir(copy) / views.MANIFEST).write_text("{not json")
    with pytest.raises(RunDirError, match=r"manifest.json: unreadable views manifest") as err:
        ensure_views(copy)
    assert "\n" not in str(err.value)
    (views.views_dir(copy) / views.MANIFEST).write_text(json.dumps({"version": 99}))
    with pytest.raises(RunDirError, match="views version 99"):
        ensure_views(copy)
    (copy / "recovery" / "recovery-0001.json").write_text(json.dumps({"id": "r1", "decisions": [{"class": "x"}]}))
    with pytest.raises(RunDirError, match=r"recovery-0001.json: not a recovery record"):
        views.decisions(copy)


def test_views_of_a_run_whose_folder_cannot_be_written_go_to_the_cache(run: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    copy = tmp_path / "ro"
    shutil.copytree(run / "telemetry", copy / "telemetry")
    (copy / "analysis").write_text("a file where the analysis folder would be")
    store = ensure_views(copy)
    assert str(store.folder).startswith(str(tmp_path / "cache")) and store.summary.ranks == 16
    assert views.stored_views(copy) is not None and views.stored_views(copy).folder == store.folder  # type: ignore[union-attr]


def test_live_progress_reads_what_was_written_since_the_views_and_merges_it(run: Path, tmp_path: Path) -> None:
    copy = tmp_path / "live"
    shutil.copytree(run, copy)
    store = ensure_views(copy)
    # every part the views read was written before their newest record (as in a run being written)
    old = (store.summary.end_wall_ns - 2 * views.LIVE_SKEW_NS) / 1e9
    for part in (copy / "telemetry").rglob("*.parquet"):
        os.utime(part, (old, old))
    stored = store.frame("progress").select(views.live_progress(copy).columns)
    assert views.live_progress(copy, since=store).equals(stored.sort("rank"))  # nothing new: the stored progress
    # rank 3 then published a part with ten more steps
    folder = copy / "telemetry" / "steps" / "rank=3"
    t = pq.read_table(next(folder.glob("*.parquet")))
    late = t.slice(t.num_rows - 10)
    for col, add in (("step", 10), ("start_wall_ns", 10**10), ("end_wall_ns", 10**10)):
        late = late.set_column(late.schema.get_field_index(col), col, pc.add(late[col], add))
    pq.write_table(late, folder / "part-999999.parquet")
    events = copy / "telemetry" / "events" / "rank=3"
    shutil.copy(next(events.glob("*.parquet")), events / "part-999999.parquet")  # its events part, written anew
    # and an old part of rank 0 (from before the views) no longer reads: only a whole read would see that
    gone = next((copy / "telemetry" / "steps" / "rank=0").glob("*.parquet"))
    gone.write_bytes(b"not parquet")
    os.utime(gone, (old, old))
    merged = views.live_progress(copy, since=store)
    whole = views.live_progress(copy)
    assert whole.filter(pl.col("rank") == 0)["last_step"][0] == -1
    r3 = merged.filter(pl.col("rank") == 3).row(0, named=True)
    assert r3["last_step"] == stored.filter(pl.col("rank") == 3)["last_step"][0] + 10
    assert r3["last_step"] == whole.filter(pl.col("rank") == 3)["last_step"][0]
    assert merged.filter(pl.col("rank") != 3).equals(stored.filter(pl.col("rank") != 3).sort("rank"))


def test_goodput_counts_every_attempt_and_never_passes_100_percent() -> None:
    """Attempt 0 trains steps 0..22 (1 s each) and is killed; attempt 1 starts 8 s later and replays 20..29. The wall
    runs from the first launch (not the relaunch) to the end; each step counts once, as its newest attempt trained it."""
    from rankwatch.analytics.frames import Frames
    from rankwatch.analytics.views.build import run_span

    s, t0 = 1_000_000_000, 1_800_000_000_000_000_000
    rows = [{"rank": r, "attempt": 0, "step": i, "start_wall_ns": t0 + i * s, "end_wall_ns": t0 + (i + 1) * s,
             "duration_ns": s} for r in range(2) for i in range(20)]  # 20..22 of attempt 0 are replayed: dropped
    rows += [{"rank": r, "attempt": 1, "step": i, "start_wall_ns": t0 + (31 + i - 20) * s,
              "end_wall_ns": t0 + (32 + i - 20) * s, "duration_ns": s} for r in range(2) for i in range(20, 30)]
    frames = Frames.build(
        steps=pl.DataFrame(rows),
        topology=pl.DataFrame({"rank": [0, 1], "attempt": [1, 1], "start_wall_ns": [t0 + 30 * s] * 2}),  # the latest
        events=pl.DataFrame({"rank": [0, 1, 0, 1], "attempt": [0, 0, 1, 1], "kind": ["start"] * 4,
                             "wall_ns": [t0, t0, t0 + 30 * s, t0 + 30 * s]}),
        end_wall_ns=t0 + 41 * s)
    start, end, wall, effective = run_span(frames)
    assert (start, end) == (t0, t0 + 41 * s)
    assert (wall, effective) == (41.0, 30.0)  # goodput 73 %, not 30 / 11 = 273 %


def test_a_long_episode_is_binned_not_cut(run: Path) -> None:
    store = ensure_views(run)
    d = views.incident_detail(store, store.incidents[0], max_points=40)
    subject = d.series.filter(pl.col("who") == "subject")
    assert subject.height <= 41 and subject["step"].max() >= store.summary.last_step - 10  # type: ignore[operator]


def test_times_durations_and_masks_read_as_people_read_them() -> None:
    assert [views.duration(x) for x in (4e-5, 0.0015, 0.85, 12.44, 185, 8040)] == [
        "40 µs", "1.5 ms", "850 ms", "12.4 s", "3 min 05 s", "2 h 14 min"]
    assert views.throttle_names(0x40) == "HW_THERMAL_SLOWDOWN" and views.throttle_names(0) == "none"
    assert views.throttle_names(0x44 | 0x1000) == "SW_POWER_CAP|HW_THERMAL_SLOWDOWN|0x1000"
    assert views.readable_text("clock 41% of max, throttle_reasons=64") == \
        "clock 41% of max, throttle_reasons=HW_THERMAL_SLOWDOWN"
    frame = views.readable(pl.DataFrame({"rank": [1, 2], "wall_ns": [1_796_473_477_619_475_955, None],
                                         "median_transfer_ns": [1_500_000, 2_000], "throttle_reasons": [64, 0],
                                         "note": ["a", None]}))
    assert frame.columns == ["rank", "wall", "median_transfer", "throttle_reasons", "note"]
    row = frame.row(0, named=True)
    assert row["wall"].count(":") == 2 and row["wall"].endswith(".619") and row["median_transfer"] == "1.5 ms"
    assert frame["throttle_reasons"].to_list() == ["HW_THERMAL_SLOWDOWN", "none"]
    assert frame.row(1, named=True)["wall"] == "" and frame.row(1, named=True)["note"] == ""  # not "None"


def test_a_decision_reads_in_words() -> None:
    assert views.action_text("restart_job", "checkpoint:step-00000015@15") == \
        "restart the job from step-00000015 (step 15)"
    assert views.action_text("restart_job", None) == "restart the job from step 0 (no clean committed checkpoint)"
    assert views.action_text("quarantine", "device:GPU-1") == "quarantine device GPU-1"
    assert views.action_text("observe", None) == "observe (leave the job as it is)"
    assert views.action_text("new_action", "x:y") == "new_action x:y"  # unknown to this version: as recorded


def test_each_incident_has_a_state_and_a_next_step(run: Path, tmp_path: Path) -> None:
    store = ensure_views(run)
    observed = views.incident_states(store.incidents, views.decisions(run), str(run))
    assert observed.row(0, named=True)["state"] == "observed"
    assert observed.row(0, named=True)["next_step"].startswith("nothing to do")
    stopped = analyzed_run(tmp_path / "stopped", steps=200, faults=("exit:rank=3,step=150",))
    s = ensure_views(stopped)
    row = views.incident_states(s.incidents, views.decisions(stopped), str(stopped)).row(0, named=True)
    assert row["state"] == "proposed" and row["decision"] == "restart the job from step 0 (no clean committed " \
        "checkpoint)" and f"`rankwatch recover {stopped} --apply`" in row["next_step"]
    row = views.incident_states(s.incidents, views.decisions(stopped).clear(), str(stopped)).row(0, named=True)
    assert row["state"] == "open" and row["next_step"].startswith(f"decide: `rankwatch recover {stopped}`")
    story = views.fail_stop_story(s, s.incidents[0], views.decisions(stopped), views.lineage(stopped))
    first = story.stops.row(0, named=True)
    assert (first["rank"], first["role"], first["how"], first["in_step"]) == (3, "stopped first", "exit code 1", 150)
    assert set(story.stops["rank"]) == set(range(16)) and set(story.stops["role"][1:]) == {"reacted"}
    assert story.waits.height and set(story.waits["state"]) == {"error"}
    assert story.replayed == () and story.lines()[-1] == "Replayed: no step was trained twice"
    assert story.recovery.startswith("not carried out (proposed")


def test_a_hang_is_told_with_the_collectives_left_open(tmp_path: Path) -> None:
    run = analyzed_run(tmp_path / "hang", steps=200, faults=("hang:rank=6,step=120",))
    s = ensure_views(run)
    [hang] = [i for i in s.incidents if i.klass == "hang"]
    story = views.fail_stop_story(s, hang, views.decisions(run), views.lineage(run))
    assert story.stops.row(0, named=True)["rank"] == 6
    assert story.waits.height >= 15 and 6 not in set(story.waits["rank"])  # every peer waited for it, rank 6 in none


def test_a_decision_path_reads_in_words() -> None:
    words = views.path_words(["class=fail_stop", "gate=none", "membership=pure_dp_reconfigurable_batch",
                              "checkpoint=step-00000015", "recurrence=none", "-> restart job from step-00000015",
                              "novel=step"])
    assert words[0] == "a fail_stop incident" and words[1].startswith("no consistency gate ran: nothing proves")
    assert "replica can be dropped" in words[2] and words[3].endswith("checkpoint is step-00000015")
    assert words[5] == "so: restart job from step-00000015" and words[6] == "novel=step"  # unknown: as recorded
    assert not any("=" in w for w in words[:6])


@pytest.mark.parametrize(("outcome", "state"), [("recovered", "recovered"), ("quarantined", "quarantined"),
                                                ("observed", "observed"), ("relaunch_failed", "failed"),
                                                ("relaunch_refused", "failed")])
def test_an_applied_decision_reads_as_its_outcome(run: Path, outcome: str, state: str) -> None:
    store = ensure_views(run)
    applied = views.decisions(run).with_columns(pl.lit("applied").alias("status"), pl.lit("recovery-0001").alias(
        "record"), pl.lit(outcome).alias("outcome"), pl.lit("quarantine").alias("action"),
        pl.lit("device:GPU-1").alias("target"))
    row = views.incident_states(store.incidents, applied, str(run)).row(0, named=True)
    assert row["state"] == state and row["decision"] == "quarantine device GPU-1"
    assert row["next_step"].startswith("look:" if state == "failed" else "nothing to do: recovery-0001")
