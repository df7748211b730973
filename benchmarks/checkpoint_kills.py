"""SIGKILL one rank of the canary at a random instant of a checkpoint save, many times: no loader may ever accept a
partial checkpoint.

    .venv/bin/python benchmarks/checkpoint_kills.py [--layout dp=2,tp=2] [--trials 40] [--seed 0] [--jobs 1]
                                                    [--every 1,2] [--uniform-only] [--keep DIR]

Each trial runs the real canary (4 gloo ranks, dp=2,tp=2 or the ``--layout`` given, e.g. ``dp=4``; the tests' small
model, a checkpoint every 1 or 2 steps)
and kills one randomly chosen rank from outside, with SIGKILL, during its fourth save (three committed checkpoints
precede it, so a commit of it also prunes the oldest). The killer is a thread of this process: it reads the ranks'
pids from the topology table, watches ``checkpoints/`` every millisecond and times the saves before the target one
(when each ``.step-*.tmp`` appears and when it is renamed). The kill instant is drawn uniformly over a window from
15 % of a save before the target's temporary directory appears (the snapshot and serialize phases, which write
nothing, lie there) to 8 % of a save after its commit (outcome gather, prune); instants after the directory appears
are measured from the moment the killer sees it. The save duration comes from the previous save of the same run,
so the window follows the machine's load. The DCP write is three quarters of a save and the publish a few
milliseconds, so a uniform instant seldom hits the end of the protocol. Trials therefore come in three zones, in a
fixed pattern of ten: five draw over the whole window (`Zone.SAVE`), three over its part from 75 % of the save on
(`Zone.LATE`: rank shards, fsync, report gather, manifest, rename, prune), two over 1.5 times the previous save's
publish time from the moment the killer sees the manifest appear (`Zone.PUBLISH`: manifest, rename, outcome
gather, prune). ``--uniform-only`` draws every trial over the whole window.

Where the kill landed, for the killed rank: its own files in the temporary directory at the moment it was dead
(no file of its own yet: snapshot, serialize or the start of write, told apart by the survivors' phase rows, all
ranks having left the save's barrier together; DCP data or a half-written shard: write; its shard complete: fsync
and waiting for the report gather; a manifest in the directory: publish), and whether ``step-*`` existed when the
signal was sent (after commit: the parent fsync, the outcome gather, the prune). Kills outside the save (before
its barrier, after its step ended) are reported as misses.

After each trial the catalog must hold: every finished name COMMITTED and SHA-256-verified, every temporary
PARTIAL, the chosen checkpoint the newest committed one and never a temporary, the checkpoints older than the
target intact (only the oldest may be gone, and only when the target committed, by retention). Each committed
directory is also checked without the catalog's code: its manifest parsed as plain JSON, every listed file's size
and SHA-256 recomputed, no file on disk that the manifest does not list. Then one fresh gloo job (the layout's
ranks) loads every trial's chosen checkpoint with `load_checkpoint` (verify on) into a new model and optimizer, and
each rank's state (parameters, optimizer, RNG hashes, data position) must equal what an uninterrupted run of the
same config fingerprinted after that step.

Last, every killed run is resumed: launched again in its own directory with ``resume=True`` (it loads the newest
usable checkpoint, the one the catalog check chose, and trains to the configured last step, one more save included),
`jobs` at a time. Each rank's state after the last step, as its latest attempt fingerprinted it, must be bitwise the
uninterrupted run's (the canary fingerprints the last step even with ``fingerprint_every`` off). The launch's replay
verification is recorded per trial: where the killed attempt had fingerprinted a step the resume trains again (the
first step after the chosen checkpoint, fingerprinted by the ranks that had flushed it), one check that held or
broke; none where it had not (the target committed and no rank finished the next step before the kill). The summary
counts the resumed runs, the bitwise-equal final states and the replay checks held / broken / none. At dp >= 4 this
is bitwise only because the canary pins DDP's gradient buckets (``CanaryConfig.pin_ddp_buckets``): each fresh
process would otherwise reduce its first step in another bucket order. Exit status 1 on any violation (a resume that
fails or ends elsewhere included), 2 when a trial could not be run as planned.

Measured 2026-12-01 (docs/benchmarks.md has the tables): ``--layout dp=4 --trials 10`` (573 s) loaded 10/10
chosen checkpoints into the uninterrupted state, resumed 10/10 killed runs to a bitwise-equal final state on every
rank, replay checks held 5, broken 0, none 5, no partial accepted, 0 violations; ``--layout dp=4 --trials 6``
(534 s) 6/6 and 6/6, replay held 4, broken 0, none 2; the default dp=2,tp=2 with ``--trials 4`` (322 s) 4/4 and
4/4, replay held 3, broken 0, none 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.base.schema import CheckpointPhase, CheckpointPhases, Fingerprints, Steps, Table, Topology
from rankwatch.base.topology import Layout
from rankwatch.recovery.catalog import (
    DCP_DIR, MANIFEST, Candidate, Verdict, checkpoint_id, choose, list_checkpoints, rank_shard_name,
)

if TYPE_CHECKING:
    from rankwatch.analytics.replay import ReplayCheck

DEFAULT_LAYOUT = Layout(dp=2, tp=2)
"""The campaign's layout unless ``--layout`` says otherwise."""
TARGET_SAVE = 3
"""0-based index of the save that is killed: three committed checkpoints precede it, so its commit prunes one."""
KEEP_LAST = 3
"""The canary's retention (`CheckpointConfig.keep_last` default)."""
LEAD = 0.15
"""Kill window starts this many save durations before the target's temporary directory appears."""
TAIL = 0.08
"""Kill window ends this many save durations after the target's commit."""
LATE = 0.75
"""`Zone.LATE` trials draw from the window's part from this many save durations after the directory appears: the
rank shards, fsync, report gather, manifest, rename and prune (a quarter of the time, most of the protocol)."""
FAST_POLL_S = 0.00025
"""Polling period while waiting for a manifest (it exists for a few milliseconds before the rename)."""
POLL_S = 0.001
"""Killer's polling period of the checkpoint directory."""
MIN_SAVE_S = 0.05
"""Save duration assumed when the killer saw the previous save's directory only once it was renamed."""


class Landing(StrEnum):
    """Where in the target save the killed rank was when it died."""

    BEFORE = "before-save"
    """Not yet past the save's opening barrier (a miss)."""
    SNAPSHOT = "snapshot"
    SERIALIZE = "serialize"
    WRITE = "write"
    """DCP planning or data, or the per-rank shard."""
    FSYNC = "fsync"
    """Own files complete: fsync + SHA-256, or waiting at the gather of the reports."""
    PUBLISH = "publish"
    """Rank 0 writing the manifest or renaming, the others waiting for the outcome."""
    AFTER_COMMIT = "after-commit"
    """The checkpoint was visible: parent fsync, outcome gather, prune."""
    AFTER = "after-save"
    """The step that saved had ended on every survivor (a miss)."""
    NO_KILL = "no-kill"
    """The job ended, or failed, before the kill instant."""


class Zone(StrEnum):
    """Which part of the target save a trial's kill instant is drawn over (uniformly)."""

    SAVE = "save"
    """The whole window: snapshot to prune."""
    LATE = "late"
    """The window from 75 % of the save on."""
    PUBLISH = "publish"
    """1.5 times the previous save's publish time, from the manifest's first sight."""


ZONE_PATTERN = (Zone.SAVE, Zone.LATE, Zone.SAVE, Zone.PUBLISH, Zone.SAVE, Zone.LATE, Zone.SAVE, Zone.LATE, Zone.SAVE,
                Zone.PUBLISH)
"""Zones of trials 0, 1, 2, ... (repeating)."""

IN_SAVE = (Landing.SNAPSHOT, Landing.SERIALIZE, Landing.WRITE, Landing.FSYNC, Landing.PUBLISH, Landing.AFTER_COMMIT)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialPlan:
    index: int
    """Trial number."""
    rank: int
    """Rank to kill."""
    every: int
    """``checkpoint_every`` of the run."""
    fraction: float
    """Where in the zone the instant falls, in [0, 1)."""
    zone: Zone = Zone.SAVE
    layout: Layout = DEFAULT_LAYOUT
    """The canary's layout (every trial of a campaign has the same)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.layout.world_size:
            raise ValueError(f"trial {self.index}: rank {self.rank} outside world of {self.layout.world_size}")
        if self.every < 1:
            raise ValueError(f"trial {self.index}: checkpoint_every must be >= 1, got {self.every}")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"trial {self.index}: fraction must be in [0, 1), got {self.fraction}")

    def save_step(self, k: int) -> int:
        """Step of the k-th save (0-based)."""
        return self.every * (k + 1) - 1

    @property
    def target_step(self) -> int:
        return self.save_step(TARGET_SAVE)

    @property
    def steps(self) -> int:
        """Steps the run would train: one more save after the target, so a late kill still lands in a save."""
        return self.save_step(TARGET_SAVE + 1) + 1


def plan_trials(n: int, seed: int, everies: Sequence[int] = (1, 2), *, uniform_only: bool = False,
                layout: Layout = DEFAULT_LAYOUT) -> list[TrialPlan]:
    rng = random.Random(seed)
    return [TrialPlan(index=i, rank=rng.randrange(layout.world_size), every=rng.choice(list(everies)),
                      fraction=rng.random(), zone=Zone.SAVE if uniform_only else ZONE_PATTERN[i % len(ZONE_PATTERN)],
                      layout=layout)
            for i in range(n)]


# -- the killer -------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class DirState:
    """The target checkpoint's directories at one instant."""

    tmp_exists: bool
    tmp_files: frozenset[str]
    """Files under ``.step-S.tmp``, relative (``/``-separated)."""
    committed: bool
    """``step-S`` exists."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Kill:
    rank: int
    pid: int
    wall_ns: int
    """time.time_ns() just before the signal."""
    anchor: str
    """What `offset_ms` is relative to: the target's temporary directory appearing ("tmp"; predicted from the
    previous save when the offset is negative), or its manifest appearing ("manifest")."""
    offset_ms: float
    """Kill instant relative to the anchor."""
    window_ms: tuple[float, float]
    """The range the instant was drawn from, relative to the anchor."""
    before: DirState
    """Just before the signal."""
    at_death: DirState
    """Once the process was dead."""
    dead: bool
    """The process was seen dead within 5 s."""


def _tmp_dir(root: Path, step: int) -> Path:
    return root / f".{checkpoint_id(step)}.tmp"


def _dir_state(root: Path, step: int) -> DirState:
    tmp = _tmp_dir(root, step)
    files = frozenset(
        (Path(d) / n).relative_to(tmp).as_posix() for d, _, names in os.walk(tmp) for n in names
    )
    return DirState(tmp_exists=tmp.is_dir(), tmp_files=files, committed=(root / checkpoint_id(step)).is_dir())


def _dead(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")


class _Killer(threading.Thread):
    """Times the saves before the target, then SIGKILLs the planned rank at the planned point of the target."""

    def __init__(self, run_dir: Path, plan: TrialPlan, done: threading.Event) -> None:
        super().__init__(name=f"killer-{plan.index}", daemon=True)
        self.run_dir, self.plan, self.done = run_dir, plan, done
        self.root = run_dir / CHECKPOINT_DIR
        self.kill: Kill | None = None
        self.note = ""

    def run(self) -> None:
        try:
            self.kill = self._run()
        except Exception as exc:  # reported with the trial; the launcher still ends the job
            self.note = f"killer failed: {type(exc).__name__}: {exc}"

    def _wait_for(self, *paths: Path, deadline: float | None = None, poll_s: float = POLL_S) -> int | None:
        """time.time_ns() when one of `paths` is first seen, or None when the job ended (or the deadline passed)."""
        while not self.done.is_set():
            if any(p.exists() for p in paths):
                return time.time_ns()
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(poll_s)
        return None

    def _pids(self) -> dict[int, int] | None:
        import duckdb

        from rankwatch.analytics.errors import RunDirError
        from rankwatch.analytics.store import connect, part_files

        sql = f"SELECT {Topology.RANK}, {Topology.PID} FROM {Table.TOPOLOGY}"
        world = self.plan.layout.world_size
        while not self.done.is_set():
            time.sleep(0.05)
            try:  # a glob is cheap; a DuckDB connection only once every rank has a topology part
                if len(part_files(self.run_dir, Table.TOPOLOGY)) < world:
                    continue
                pids = dict(connect(self.run_dir, check=False).execute(sql).fetchall())
            except (RunDirError, duckdb.Error):  # nothing recorded yet
                continue
            if len(pids) == world:
                return {int(r): int(p) for r, p in pids.items()}
        return None

    def _run(self) -> Kill | None:
        plan, root = self.plan, self.root
        pids = self._pids()
        if pids is None:
            self.note = "job ended before every rank recorded its pid"
            return None
        prev2, prev, target = plan.save_step(TARGET_SAVE - 2), plan.save_step(TARGET_SAVE - 1), plan.target_step
        # coarse polling while the ranks start; every millisecond from the save before the timed ones
        if self._wait_for(_tmp_dir(root, prev2), root / checkpoint_id(prev2), poll_s=0.01) is None:
            self.note = "job ended before the saves preceding the target began"
            return None
        # each wait also ends on a later sign, so a killer that was not scheduled for a while still goes on
        c2 = self._wait_for(root / checkpoint_id(prev2))
        w1 = self._wait_for(_tmp_dir(root, prev), root / checkpoint_id(prev)) if c2 is not None else None
        m1 = self._wait_for(*self._publish_paths(prev), poll_s=FAST_POLL_S) if w1 is not None else None
        c1 = self._wait_for(root / checkpoint_id(prev)) if m1 is not None else None
        if c2 is None or w1 is None or m1 is None or c1 is None:
            self.note = "job ended before the saves preceding the target committed"
            return None
        visible = max(MIN_SAVE_S, (c1 - w1) / 1e9)  # write start -> commit, as the killer sees it
        gap = (w1 - c2) / 1e9  # previous commit -> next write start (training, barrier, snapshot, serialize)
        deadline = time.monotonic() + 10 * (gap + visible)
        if plan.zone is Zone.PUBLISH:
            span = 1.5 * max(0.002, (c1 - m1) / 1e9)  # manifest first seen -> commit, and half again
            anchor, offset, window = "manifest", plan.fraction * span, (0.0, span * 1e3)
            seen = self._wait_for(*self._publish_paths(target), deadline=deadline, poll_s=FAST_POLL_S)
        else:
            lead, span = LEAD * visible, visible * (1 + TAIL)
            start = visible * LATE if plan.zone is Zone.LATE else -lead
            anchor, offset, window = "tmp", start + plan.fraction * (span - start), (start * 1e3, span * 1e3)
            if offset < 0:  # before the directory appears: predicted from the previous cycle
                seen = c1 + int(gap * 1e9)
            else:
                seen = self._wait_for(_tmp_dir(root, target), root / checkpoint_id(target), deadline=deadline)
        if seen is None:
            self.note = f"the target save's {anchor} was never seen"
            return None
        at = seen / 1e9 + offset
        while not self.done.is_set() and (left := at - time.time()) > 0:
            time.sleep(min(left, 0.05))
        if self.done.is_set():
            self.note = "job ended before the kill instant"
            return None
        pid = pids[plan.rank]
        before = _dir_state(root, target)
        wall = time.time_ns()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while not (dead := _dead(pid)) and time.monotonic() < deadline:
            time.sleep(0.0005)
        return Kill(rank=plan.rank, pid=pid, wall_ns=wall, anchor=anchor, offset_ms=offset * 1e3, window_ms=window,
                    before=before, at_death=_dir_state(root, target), dead=dead)

    def _publish_paths(self, step: int) -> tuple[Path, ...]:
        """Seen when rank 0 begins to publish `step` (or, if the killer missed that, once it has)."""
        tmp = _tmp_dir(self.root, step)
        return tmp / (MANIFEST + ".tmp"), tmp / MANIFEST, self.root / checkpoint_id(step)


# -- where the kill landed --------------------------------------------------------------------------------
def _own_files(files: frozenset[str], rank: int) -> frozenset[str]:
    mine = {rank_shard_name(rank), rank_shard_name(rank) + ".tmp"}
    return frozenset(f for f in files if f in mine or f.startswith(f"{DCP_DIR}/__{rank}_"))


def classify(plan: TrialPlan, kill: Kill | None, run_dir: Path, *, committed: bool) -> tuple[Landing, str]:
    """The killed rank's position in the target save, from its files at death, whether the target ended up
    `committed`, and the survivors' rows."""
    if kill is None:
        return Landing.NO_KILL, ""
    r, st = kill.rank, kill.at_death
    phases, ends = _survivor_rows(run_dir, plan.target_step, r)
    if kill.before.committed or (r == 0 and st.committed):
        root = run_dir / CHECKPOINT_DIR
        oldest = plan.save_step(TARGET_SAVE - KEEP_LAST)
        pruning = r == 0 and ((root / checkpoint_id(oldest)).exists() or
                              (root / f".{checkpoint_id(oldest)}.deleting").exists())
        if len(ends) == plan.layout.world_size - 1 and kill.wall_ns > max(ends) and not pruning:
            return Landing.AFTER, "the saving step had ended on every survivor"
        return Landing.AFTER_COMMIT, "prune not finished" if pruning else "checkpoint visible"
    late = " (rank 0 committed it after the kill)" if committed else ""
    files = st.tmp_files
    if MANIFEST in files:
        return Landing.PUBLISH, "manifest complete" + late
    if MANIFEST + ".tmp" in files:
        return Landing.PUBLISH, "manifest being written" + late
    if committed:  # rank 0 published without it: its report had been gathered, it waited for the outcome
        return Landing.PUBLISH, "report gathered" + late
    mine = _own_files(files, r)
    if rank_shard_name(r) in mine:
        return Landing.FSYNC, "own files complete"
    if rank_shard_name(r) + ".tmp" in mine:
        return Landing.WRITE, "rank shard half-written"
    if mine:
        return Landing.WRITE, ("DCP finished, rank shard not begun" if f"{DCP_DIR}/.metadata" in files
                               else "DCP data, before its metadata")
    snap = [s for (p, s) in phases if p == CheckpointPhase.SNAPSHOT]
    if not snap or kill.wall_ns < min(snap):
        return Landing.BEFORE, "no survivor had begun the snapshot"
    ser = [s for (p, s) in phases if p == CheckpointPhase.SERIALIZE]
    wri = [s for (p, s) in phases if p == CheckpointPhase.WRITE]
    if not ser or kill.wall_ns < statistics.median(ser):
        return Landing.SNAPSHOT, "no file of its own (survivors' rows)"
    if not wri or kill.wall_ns < statistics.median(wri):
        return Landing.SERIALIZE, "no file of its own (survivors' rows)"
    return Landing.WRITE, "DCP planning, no file of its own yet"


def _survivor_rows(run_dir: Path, step: int, killed: int) -> tuple[list[tuple[str, int]], list[int]]:
    """(phase, start_wall_ns) of the survivors' checkpoint phases of `step`, and the end_wall_ns of their step."""
    import duckdb

    from rankwatch.analytics.errors import RunDirError
    from rankwatch.analytics.store import connect

    try:
        con = connect(run_dir)
        phases = con.execute(
            f"SELECT {CheckpointPhases.PHASE}, {CheckpointPhases.START_WALL_NS} FROM {Table.CHECKPOINT_PHASES} "
            f"WHERE {CheckpointPhases.STEP} = ? AND {CheckpointPhases.RANK} <> ?", [step, killed]).fetchall()
        ends = con.execute(f"SELECT {Steps.END_WALL_NS} FROM {Table.STEPS} WHERE {Steps.STEP} = ? AND {Steps.RANK} <> ?",
                           [step, killed]).fetchall()
    except (RunDirError, duckdb.Error):  # a table nobody wrote: classification then leans on the files only
        return [], []
    return [(str(p), int(s)) for p, s in phases], [int(e) for (e,) in ends]


# -- what the catalog must say ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class CatalogCheck:
    violations: tuple[str, ...]
    partials: int
    """PARTIAL candidates listed."""
    accepted_partial: bool
    """A temporary was judged anything but PARTIAL, or chosen."""
    chosen: Candidate | None
    committed: tuple[int, ...]
    """Steps of the committed candidates."""


def verify_directory(path: Path) -> str | None:
    """Check a committed checkpoint without the catalog's code: the manifest as plain JSON, every listed file's
    size and SHA-256, and no unlisted file. None when intact, else the first problem."""
    try:
        doc = json.loads((path / MANIFEST).read_text())
        listed = {f["path"]: (int(f["size"]), str(f["sha256"])) for f in doc["files"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path.name}: manifest unreadable without the catalog ({type(exc).__name__}: {exc})"
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {MANIFEST}
    if on_disk != set(listed):
        return f"{path.name}: files on disk {sorted(on_disk ^ set(listed))} differ from the manifest's list"
    for rel, (size, digest) in listed.items():
        data = (path / rel).read_bytes()
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            return f"{path.name}: {rel} does not match its manifest entry"
    for rank in range(int(doc["world_size"])):
        if rank_shard_name(rank) not in listed:
            return f"{path.name}: no shard for rank {rank}"
    return None


def check_catalog(run_dir: Path, plan: TrialPlan, *, history: bool = True) -> CatalogCheck:
    """The catalog's view of a trial's run. With `history` (the saves before the target were seen to commit),
    those must be intact and one must be chosen; without, only what is on disk is judged."""
    bad: list[str] = []
    accepted = False
    cands = list_checkpoints(run_dir, verify=True)
    for c in cands:
        if c.path.name.startswith("."):
            if c.verdict is not Verdict.PARTIAL:
                bad.append(f"temporary {c.path.name} judged {c.verdict} ({c.reason})")
                accepted = True
        elif c.verdict is not Verdict.COMMITTED or not c.verified:
            bad.append(f"finished name {c.path.name} is {c.verdict} ({c.reason})")
        elif (problem := verify_directory(c.path)) is not None:
            bad.append(f"catalog committed a damaged checkpoint: {problem}")
    committed = tuple(sorted(c.step for c in cands if c.verdict is Verdict.COMMITTED and not c.path.name.startswith(".")))
    on_disk_tmps = {p.name for p in (run_dir / CHECKPOINT_DIR).glob(".step-*.tmp")}
    listed_tmps = {c.path.name for c in cands if c.path.name.startswith(".")}
    if on_disk_tmps != listed_tmps:
        bad.append(f"temporaries on disk {sorted(on_disk_tmps)} but listed {sorted(listed_tmps)}")
    chosen: Candidate | None = None
    try:
        chosen = choose(run_dir, layout=plan.layout, world_size=plan.layout.world_size)
    except ValueError as exc:
        if history or committed:
            bad.append(f"nothing chosen: {exc}")
    if chosen is not None:
        if chosen.path.name.startswith(".") or chosen.path.name != checkpoint_id(chosen.step):
            bad.append(f"chose a temporary: {chosen.path.name}")
            accepted = True
        if chosen.verdict is not Verdict.COMMITTED or not chosen.verified or chosen.manifest is None:
            bad.append(f"chose {chosen.path.name}: {chosen.verdict}, verified={chosen.verified}")
        elif (problem := verify_directory(chosen.path)) is not None:
            bad.append(f"chosen checkpoint damaged: {problem}")
        if committed and chosen.step != committed[-1]:
            bad.append(f"chose {chosen.path.name}, newest committed is {checkpoint_id(committed[-1])}")
    # retention deletes only beyond the newest KEEP_LAST, and the saves before the target were never interrupted
    newest = max([k for k in range(TARGET_SAVE + 2) if plan.save_step(k) in committed], default=-1)
    top = max(newest, TARGET_SAVE - 1)
    for k in range(max(0, top - KEEP_LAST + 1), top + 1) if history else ():
        if plan.save_step(k) not in committed:
            bad.append(f"older checkpoint {checkpoint_id(plan.save_step(k))} not intact")
    partials = sum(1 for c in cands if c.verdict is Verdict.PARTIAL)
    return CatalogCheck(violations=tuple(bad), partials=partials, accepted_partial=accepted, chosen=chosen,
                        committed=committed)


# -- one trial --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeResult:
    """The killed run launched again with ``resume=True`` and trained to its last step."""

    exit_codes: tuple[int | None, ...]
    """Of the resumed job; empty when the launcher refused the run directory."""
    replay: tuple[ReplayCheck, ...]
    """The launch's replay verification: the replayed steps against the killed attempt's fingerprints."""
    warnings: tuple[str, ...]
    """The launcher's (e.g. replay verification not recorded)."""
    violations: tuple[str, ...]
    """Resume failed, or a rank's state after the last step differs from the uninterrupted run's."""
    duration_s: float

    @property
    def final_equal(self) -> bool:
        """Every rank ended bitwise where the uninterrupted run ended."""
        return not self.violations


@dataclass(frozen=True, kw_only=True, slots=True)
class TrialResult:
    plan: TrialPlan
    run_dir: Path
    kill: Kill | None
    landing: Landing
    detail: str
    exit_codes: tuple[int | None, ...]
    check: CatalogCheck
    note: str
    """Why the trial did not go as planned ("" when it did)."""
    duration_s: float
    attempts: int = 1
    """Jobs run: more than one when a job failed before the kill."""
    load_violations: tuple[str, ...] = ()
    """Filled in after the load job."""
    loaded: bool = False
    """Every rank loaded the catalog's choice into the uninterrupted run's state."""
    resume: ResumeResult | None = None
    """The killed run resumed to its last step (after the load job); None when not resumed."""

    @property
    def violations(self) -> tuple[str, ...]:
        return self.check.violations + self.load_violations + (self.resume.violations if self.resume else ())

    @property
    def target_committed(self) -> bool:
        return self.plan.target_step in self.check.committed

    @property
    def committed_at_kill(self) -> bool:
        k = self.kill
        return k is not None and (k.before.committed or (k.rank == 0 and k.at_death.committed))


def canary_config(run_dir: Path, *, layout: Layout, every: int, steps: int, fingerprint_every: int = 50) -> Any:
    """The trials' canary: the tests' small model and short timeouts (`tests/support.py canary`)."""
    from rankwatch.canary import CanaryConfig
    from rankwatch.canary.model import ModelConfig

    return CanaryConfig(run_dir=run_dir, steps=steps, layout=layout, gpu="off", pg_timeout_s=8.0,
                        flush_interval_s=0.5, heartbeat_interval_s=0.25, checkpoint_every=every,
                        fingerprint_every=fingerprint_every, model=ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2))


def run_trial(plan: TrialPlan, root: Path, *, attempts: int = 2) -> TrialResult:
    """Run one trial; a job that failed before the kill (no kill was sent: e.g. a rendezvous timing out on an
    overloaded machine) is run again, up to `attempts` times in all, each in its own directory."""
    from rankwatch.canary import launch

    start = time.monotonic()
    for attempt in range(attempts):
        run_dir = root / (f"trial-{plan.index:03d}" + (f"-again{attempt}" if attempt else ""))
        done = threading.Event()
        killer = _Killer(run_dir, plan, done)
        killer.start()
        try:
            cfg = canary_config(run_dir, layout=plan.layout, every=plan.every, steps=plan.steps)
            result = launch(cfg, timeout_s=150, failure_grace_s=3.0, term_grace_s=1.0)
        finally:
            done.set()
            killer.join(10.0)
        if killer.kill is not None:
            break
    kill = killer.kill
    note = killer.note
    if kill is not None and result.exit_codes[plan.rank] != -signal.SIGKILL:
        note = f"rank {plan.rank} exit code {result.exit_codes[plan.rank]}, not SIGKILL"
    if kill is not None and not kill.dead:
        note = f"rank {plan.rank} (pid {kill.pid}) not seen dead 5 s after SIGKILL"
    check = check_catalog(run_dir, plan, history=kill is not None)
    landing, detail = classify(plan, kill, run_dir, committed=plan.target_step in check.committed)
    return TrialResult(plan=plan, run_dir=run_dir, kill=kill, landing=landing, detail=detail,
                       exit_codes=result.exit_codes, check=check, note=note, duration_s=time.monotonic() - start,
                       attempts=attempt + 1)


# -- loading every chosen checkpoint on fresh ranks ------------------------------------------------------
_STATE_COLUMNS = (Fingerprints.DATA_POSITION, Fingerprints.PARAM_HASH, Fingerprints.OPTIM_HASH,
                  Fingerprints.RNG_PYTHON_HASH, Fingerprints.RNG_NUMPY_HASH, Fingerprints.RNG_TORCH_HASH)


def _load_rank(rank: int, layout: Layout, run_dirs: list[str], port: int, out: str) -> None:
    """One rank of a fresh job: for each run, choose as a resume would, load with verification into a new model
    and optimizer (RNGs scrambled first), and report the loaded state's fingerprint."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from rankwatch.canary.model import ModelConfig, Stage
    from rankwatch.collector.fingerprint import fingerprint
    from rankwatch.collector.null import NullCollector
    from rankwatch.recovery.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    world = layout.world_size
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    _, tp, pp = layout.coords(rank)
    collector = NullCollector(rank=rank, world_size=world)
    report: list[dict[str, Any]] = []
    for run_dir in run_dirs:
        entry: dict[str, Any] = {"run_dir": run_dir}
        try:
            model = Stage(ModelConfig(d_model=64, d_hidden=256, blocks_per_stage=2), seed=99, pp=pp, pp_size=layout.pp,
                          tp=tp, tp_size=layout.tp)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            random.seed(1234 + rank)
            np.random.seed(1234 + rank)
            torch.manual_seed(1234 + rank)
            candidate = choose(Path(run_dir), layout=layout, world_size=world)
            loaded = load_checkpoint(collector, candidate, rank=rank, layout=layout, group=dist.group.WORLD,
                                     model=model, optimizer=optimizer, verify=True)
            fp = fingerprint(model, optimizer)
            entry.update(chosen=candidate.path.name, step=loaded.step, state=[
                loaded.data_position, fp.param_hash, fp.optim_hash, fp.rng_python_hash, fp.rng_numpy_hash,
                fp.rng_torch_hash])
        except Exception as exc:  # recorded per run; a failed load on one rank fails it on all (gathered verify)
            entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        report.append(entry)
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def load_all(run_dirs: Sequence[Path], out: Path, layout: Layout) -> dict[str, list[dict[str, Any]]]:
    """Run the load job (`layout`'s ranks) over `run_dirs`; per run directory, each rank's report."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, layout.world_size, is_master=True, wait_for_workers=False)
    mp.start_processes(_load_rank, args=(layout, [str(d) for d in run_dirs], store.port, str(out)),
                       nprocs=layout.world_size, start_method="spawn")
    by_run: dict[str, list[dict[str, Any]]] = {str(d): [] for d in run_dirs}
    for rank in range(layout.world_size):
        for entry in json.loads((out / f"rank-{rank}.json").read_text()):
            by_run[entry["run_dir"]].append(entry)
    return by_run


def reference_states(root: Path, layout: Layout, every: int, steps: int, *,
                     attempts: int = 2) -> dict[tuple[int, int], list[Any]]:
    """(step, rank) -> fingerprinted state after that step, every step up to the last (``steps - 1``, where a resumed
    trial ends), from an uninterrupted run of the trials' config; a failed run (e.g. a rendezvous timing out on an
    overloaded machine) is run again in its own directory, up to `attempts` runs in all."""
    from rankwatch.canary import launch

    for attempt in range(attempts):
        run_dir = root / (f"reference-every{every}" + (f"-again{attempt}" if attempt else ""))
        result = launch(canary_config(run_dir, layout=layout, every=every, steps=steps, fingerprint_every=1),
                        timeout_s=150)
        if result.ok:
            return _fingerprinted_states(run_dir)
    raise RuntimeError(f"reference run {run_dir} failed {attempts} times: last exit codes {result.exit_codes}")


def _fingerprinted_states(run_dir: Path, step: int | None = None) -> dict[tuple[int, int], list[Any]]:
    """(step, rank) -> state fingerprinted after that step (only `step`, if given) by the latest attempt that
    trained it."""
    from rankwatch.analytics.store import connect

    cols = ", ".join(_STATE_COLUMNS)
    where = "" if step is None else f"WHERE {Fingerprints.STEP} = {int(step)} "
    rows = connect(run_dir).execute(
        f"SELECT {Fingerprints.STEP}, {Fingerprints.RANK}, {cols} FROM {Table.FINGERPRINTS} {where}"
        f"QUALIFY row_number() OVER (PARTITION BY {Fingerprints.STEP}, {Fingerprints.RANK} "
        f"ORDER BY {Fingerprints.ATTEMPT} DESC, {Fingerprints.WALL_NS} DESC) = 1").fetchall()
    return {(int(s), int(r)): list(rest) for s, r, *rest in rows}


def check_loads(results: Sequence[TrialResult], loads: dict[str, list[dict[str, Any]]],
                reference: dict[int, dict[tuple[int, int], list[Any]]]) -> list[TrialResult]:
    """Add load violations: every rank loaded the catalog's choice, into the uninterrupted run's state."""
    out: list[TrialResult] = []
    for t in results:
        if t.check.chosen is None:  # nothing to load: a violation already where something should have been
            out.append(t)
            continue
        bad: list[str] = []
        entries = loads.get(str(t.run_dir), [])  # in rank order
        chosen = t.check.chosen
        world = t.plan.layout.world_size
        if len(entries) != world:
            bad.append(f"load job reported {len(entries)} of {world} ranks")
        for rank, e in enumerate(entries):
            if "error" in e:
                bad.append(f"load failed on a rank: {e['error']}")
                continue
            if chosen is None or e["chosen"] != chosen.path.name:
                bad.append(f"loader chose {e['chosen']}, the catalog check chose {chosen.path.name if chosen else None}")
                continue
            want = reference[t.plan.every].get((int(e["step"]), rank))
            if want is None or e["state"] != want:
                bad.append(f"rank {rank}: state loaded from {e['chosen']} differs from the uninterrupted run's")
        out.append(replace(t, load_violations=tuple(bad), loaded=not bad))
    return out


# -- resuming every killed run ---------------------------------------------------------------------------
def resume_trial(t: TrialResult, reference: dict[tuple[int, int], list[Any]]) -> TrialResult:
    """Launch a killed trial's run again with ``resume=True`` (it loads the newest usable checkpoint, the one the
    catalog check chose) and train to the last step: each rank's state there, as its latest attempt fingerprinted
    it, must equal `reference`'s (the uninterrupted run of the same config). Trials without a kill or a chosen
    checkpoint are returned as they are."""
    import duckdb

    from rankwatch.canary import launch

    if t.kill is None or t.check.chosen is None:
        return t
    plan = t.plan
    cfg = canary_config(t.run_dir, layout=plan.layout, every=plan.every, steps=plan.steps)
    start = time.monotonic()
    codes: tuple[int | None, ...] = ()
    replay: tuple[ReplayCheck, ...] = ()
    warnings: tuple[str, ...] = ()
    bad: list[str] = []
    try:
        result = launch(replace(cfg, resume=True), timeout_s=150, term_grace_s=1.0)
        codes, replay, warnings = result.exit_codes, result.replay, result.warnings
        if not result.ok:
            bad.append(f"resume failed: exit codes {codes}")
    except ValueError as exc:  # the preflight refused the run directory
        bad.append(f"resume refused: {exc}")
    last = plan.steps - 1
    if not bad:
        try:
            final = _fingerprinted_states(t.run_dir, last)
        except (ValueError, duckdb.Error) as exc:  # the analytics error tree is ValueError's
            bad.append(f"fingerprints after the resume unreadable: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            final = {}
        for rank in range(plan.layout.world_size) if not bad else ():
            got = final.get((last, rank))
            if got is None:
                bad.append(f"rank {rank}: no fingerprint of step {last} after the resume")
            elif got != reference.get((last, rank)):
                bad.append(f"rank {rank}: state after step {last} of the resumed run differs from the uninterrupted "
                           "run's")
    return replace(t, resume=ResumeResult(exit_codes=codes, replay=replay, warnings=warnings, violations=tuple(bad),
                                          duration_s=time.monotonic() - start))


# -- a campaign ------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    trials: int
    landings: dict[Landing, int]
    landings_uniform: dict[Landing, int]
    """Trials of `Zone.SAVE` only."""
    in_save: int
    partials_seen: int
    partials_accepted: int
    """Trials where a temporary was judged other than PARTIAL, or chosen."""
    committed_at_kill: int
    """Target already visible when the signal was sent."""
    committed_after_kill: int
    """Target committed by rank 0 although a peer died before the commit."""
    loaded: int
    """Trials whose chosen checkpoint loaded, on every rank, into the uninterrupted run's state."""
    resumed: int
    """Killed runs launched again with ``resume=True``."""
    resumed_ok: int
    """Of those, the resumed job exited 0 on every rank."""
    final_equal: int
    """Resumed runs whose every rank ended bitwise in the uninterrupted run's state."""
    replay_held: int
    """Replay checks of the resumes that held (every replayed fingerprint bitwise equal to the killed attempt's)."""
    replay_broken: int
    replay_none: int
    """Resumed runs without a replay check (the killed attempt had fingerprinted no step the resume trained)."""
    violations: int
    not_as_planned: int
    rerun: int
    """Trials whose first job failed before the kill (run again)."""


def run_campaign(plans: Sequence[TrialPlan], root: Path, *, jobs: int = 1,
                 on_trial: Callable[[TrialResult], None] | None = None,
                 on_resume: Callable[[TrialResult], None] | None = None) -> list[TrialResult]:
    """Reference runs, the trials (`jobs` at a time), one load job over every trial, then every killed run resumed
    to its last step (`jobs` at a time; after the load job, which must see the checkpoints as the kill left them);
    results in plan order."""
    layouts = {p.layout for p in plans}
    if len(layouts) != 1:
        raise ValueError(f"a campaign runs one layout, the plans have {sorted(map(str, layouts))}")
    [layout] = layouts
    reference = {e: reference_states(root, layout, e, max(p.steps for p in plans if p.every == e))
                 for e in sorted({p.every for p in plans})}
    results: list[TrialResult] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(lambda p: run_trial(p, root), plans):
            results.append(r)
            if on_trial is not None:
                on_trial(r)
    loads = load_all([r.run_dir for r in results if r.check.chosen is not None], root / "loads", layout)
    loaded = check_loads(results, loads, reference)
    resumed: list[TrialResult] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(lambda t: resume_trial(t, reference[t.plan.every]), loaded):
            resumed.append(r)
            if on_resume is not None and r.resume is not None:
                on_resume(r)
    return resumed


def summarize(results: Sequence[TrialResult]) -> Summary:
    landings = Counter(r.landing for r in results)
    uniform = Counter(r.landing for r in results if r.plan.zone is Zone.SAVE)
    accepted = sum(1 for r in results if r.check.accepted_partial)
    resumes = [r.resume for r in results if r.resume is not None]
    return Summary(
        trials=len(results), landings={k: landings.get(k, 0) for k in Landing},
        landings_uniform={k: uniform.get(k, 0) for k in Landing},
        in_save=sum(landings.get(k, 0) for k in IN_SAVE), partials_seen=sum(r.check.partials for r in results),
        partials_accepted=accepted, committed_at_kill=sum(1 for r in results if r.committed_at_kill),
        committed_after_kill=sum(1 for r in results if r.target_committed and r.kill is not None
                                 and not r.committed_at_kill),
        loaded=sum(1 for r in results if r.loaded),
        resumed=len(resumes), resumed_ok=sum(1 for u in resumes if u.exit_codes and all(c == 0 for c in u.exit_codes)),
        final_equal=sum(1 for u in resumes if u.final_equal),
        replay_held=sum(1 for u in resumes for c in u.replay if c.held),
        replay_broken=sum(1 for u in resumes for c in u.replay if not c.held),
        replay_none=sum(1 for u in resumes if not u.replay),
        violations=sum(len(r.violations) for r in results), not_as_planned=sum(1 for r in results if r.note),
        rerun=sum(1 for r in results if r.attempts > 1),
    )


def describe(r: TrialResult) -> str:
    p, k = r.plan, r.kill
    when = (f"{k.anchor:>8} {k.offset_ms:+6.1f} ms of [{k.window_ms[0]:+.0f}, {k.window_ms[1]:+.0f}]" if k
            else " " * 31)
    chosen = r.check.chosen.path.name if r.check.chosen else "-"
    codes = ",".join("?" if c is None else str(c) for c in r.exit_codes)
    status = "OK" if not r.violations else "VIOLATION: " + "; ".join(r.violations)
    note = f"  [{r.note}]" if r.note else ""
    return (f"trial {p.index:3d} {p.zone:<7} every={p.every} target={checkpoint_id(p.target_step)} "
            f"kill rank {p.rank} at {when}  "
            f"{r.landing:<12} {r.detail:<40} committed={'yes' if r.target_committed else 'no ':<3} "
            f"partials={r.check.partials} chosen={chosen} exits=({codes}) {r.duration_s:4.1f}s  {status}{note}")


def describe_resume(r: TrialResult) -> str:
    u = r.resume
    if u is None:
        return f"trial {r.plan.index:3d} not resumed"
    codes = ",".join("?" if c is None else str(c) for c in u.exit_codes)
    chosen = r.check.chosen.path.name if r.check.chosen else "-"
    final = "final state = uninterrupted" if u.final_equal else "VIOLATION: " + "; ".join(u.violations)
    replay = "; ".join(c.describe() for c in u.replay) or "no replay check"
    warn = f"  [{'; '.join(u.warnings)}]" if u.warnings else ""
    return (f"trial {r.plan.index:3d} resumed from {chosen} to step {r.plan.steps - 1}: exits=({codes}) "
            f"{u.duration_s:4.1f}s  {final}  replay: {replay}{warn}")


def record(r: TrialResult) -> dict[str, Any]:
    """One trial as a JSON-able dict (``trials.jsonl`` in the run root)."""
    k = r.kill
    return {
        "trial": r.plan.index, "zone": str(r.plan.zone), "every": r.plan.every, "rank": r.plan.rank,
        "fraction": r.plan.fraction, "target": checkpoint_id(r.plan.target_step),
        "anchor": k.anchor if k else None, "offset_ms": k.offset_ms if k else None,
        "window_ms": list(k.window_ms) if k else None, "landing": str(r.landing), "detail": r.detail,
        "committed_at_kill": r.committed_at_kill, "target_committed": r.target_committed,
        "partials": r.check.partials, "chosen": r.check.chosen.path.name if r.check.chosen else None,
        "loaded": r.loaded, "exit_codes": list(r.exit_codes), "note": r.note, "violations": list(r.violations),
        "duration_s": r.duration_s, "attempts": r.attempts,
        "resume": None if (u := r.resume) is None else {
            "exit_codes": list(u.exit_codes), "final_equal": u.final_equal, "violations": list(u.violations),
            "replay": [{"held": c.held, "broken_step": c.broken_step, "describe": c.describe()} for c in u.replay],
            "warnings": list(u.warnings), "duration_s": u.duration_s,
        },
    }


def print_summary(s: Summary, wall_s: float) -> None:
    print(f"\ntrials                               {s.trials}")
    print(f"kills landed during the target save  {s.in_save} ({100 * s.in_save / max(1, s.trials):.0f} %)")
    print("kills per phase                      " + ", ".join(f"{k} {n}" for k, n in s.landings.items()))
    print("  of which zone 'save' (uniform)     " + ", ".join(f"{k} {n}" for k, n in s.landings_uniform.items()))
    print(f"partial candidates seen              {s.partials_seen}")
    print(f"partial candidates accepted          {s.partials_accepted} (must be 0)")
    print(f"target visible when killed           {s.committed_at_kill}")
    print(f"target committed after the kill      {s.committed_after_kill} (rank 0 finished publishing after a peer died)")
    print(f"chosen loaded = uninterrupted state  {s.loaded}/{s.trials}")
    print(f"killed runs resumed to the last step {s.resumed} ({s.resumed_ok} exited 0 on every rank)")
    print(f"resumed final state = uninterrupted  {s.final_equal}/{s.resumed} (every rank bitwise)")
    print(f"replay checks                        held {s.replay_held}, broken {s.replay_broken}, "
          f"none {s.replay_none} (resumes without one)")
    print(f"violations                           {s.violations}")
    print(f"trials not run as planned            {s.not_as_planned}")
    print(f"trials re-run (failed before kill)   {s.rerun}")
    print(f"wall time                            {wall_s:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--layout", default=str(DEFAULT_LAYOUT), help="canary layout, e.g. dp=4 (4 ranks: dp*tp*pp = 4 "
                   "keeps the timing the docstring describes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="trials at a time (more skews the timing on few cores)")
    p.add_argument("--every", default="1,2", help="checkpoint_every values to draw from")
    p.add_argument("--uniform-only", action="store_true", help="every trial's instant over the whole save")
    p.add_argument("--keep", type=Path, help="keep the run directories here (kept anyway on a violation)")
    args = p.parse_args()
    if args.trials < 1 or args.jobs < 1:
        raise SystemExit("--trials and --jobs must be >= 1")
    try:
        layout = Layout.parse(args.layout)
    except ValueError as exc:
        raise SystemExit(f"--layout: {exc}") from None
    plans = plan_trials(args.trials, args.seed, tuple(int(e) for e in args.every.split(",")),
                        uniform_only=args.uniform_only, layout=layout)
    root = args.keep or Path(tempfile.mkdtemp(prefix="checkpoint-kills-"))
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log = root / "trials.jsonl"
    log.write_text("")

    def on_trial(r: TrialResult) -> None:
        print(describe(r), flush=True)
        with open(log, "a") as f:  # as it goes (before loading), so an interrupted campaign leaves its trials
            f.write(json.dumps(record(r)) + "\n")

    print(f"layout {layout}, {layout.world_size} ranks", flush=True)
    results = run_campaign(plans, root, jobs=args.jobs, on_trial=on_trial,
                           on_resume=lambda r: print(describe_resume(r), flush=True))
    log.write_text("".join(json.dumps(record(r)) + "\n" for r in results))
    bad = [r for r in results if r.violations]
    if bad:
        print("\nafter loading and resuming:")
        for r in bad:
            print(describe(r))
    summary = summarize(results)
    print_summary(summary, time.monotonic() - start)
    if bad or args.keep:
        print(f"run directories kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    raise SystemExit(1 if bad else 2 if summary.not_as_planned else 0)


if __name__ == "__main__":
    main()
