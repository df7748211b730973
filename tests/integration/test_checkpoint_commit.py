"""The checkpoint commit protocol on real gloo ranks: commits that round-trip bitwise, kills mid-save that never
publish a partial checkpoint, and a full disk on one rank that publishes nothing while training goes on."""

from __future__ import annotations

import json
import random
import signal
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.base.topology import Layout
from rankwatch.canary.model import Stage
from rankwatch.collector.collector import Collector, CollectorConfig
from rankwatch.collector.fingerprint import fingerprint
from rankwatch.recovery.catalog import Verdict, choose, list_checkpoints
from rankwatch.recovery.checkpoint import CHECKPOINT_FAULT_ENV, load_checkpoint

from support import SMALL, canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LAYOUT = Layout(dp=2, tp=2)


def _committed(run_dir: Path) -> list[int]:
    return sorted(c.step for c in list_checkpoints(run_dir, verify=True) if c.verdict is Verdict.COMMITTED)


def _load_rank(rank: int, run_dir: Path, port: int, out: Path) -> None:
    """One rank of a fresh job: build the model, scramble the RNGs, load the chosen checkpoint, report state."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, LAYOUT.world_size, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=LAYOUT.world_size, timeout=timedelta(seconds=20))
    _, tp, pp = LAYOUT.coords(rank)
    model = Stage(SMALL, seed=0, pp=pp, pp_size=LAYOUT.pp, tp=tp, tp_size=LAYOUT.tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    random.seed(1234 + rank)
    np.random.seed(1234 + rank)
    torch.manual_seed(1234 + rank)
    c = Collector(CollectorConfig(run_dir=out, handle_sigterm=False), rank=rank, world_size=LAYOUT.world_size).start()
    candidate = choose(run_dir, layout=LAYOUT, world_size=LAYOUT.world_size)
    result = load_checkpoint(c, candidate, rank=rank, layout=LAYOUT, group=dist.group.WORLD, model=model,
                             optimizer=optimizer)
    fp = fingerprint(model, optimizer)
    c.close(exit_code=0)
    (out / f"rank-{rank}.json").write_text(json.dumps({
        "step": result.step, "data_position": result.data_position, "param_hash": fp.param_hash,
        "optim_hash": fp.optim_hash, "rng": [fp.rng_python_hash, fp.rng_numpy_hash, fp.rng_torch_hash],
        "lr_scheduler": result.lr_scheduler, "grad_scaler": result.grad_scaler,
    }))
    dist.destroy_process_group()


def test_commits_verify_prune_and_round_trip_bitwise(run_dir: Path, tmp_path: Path) -> None:
    result = run(canary(run_dir, layout=str(LAYOUT), steps=4, checkpoint_every=1))
    assert result.ok, result.exit_codes
    # checkpoints after steps 0..3; retention (keep_last=3) pruned step 0; no temporaries left
    assert _committed(run_dir) == [1, 2, 3]
    assert sorted(p.name for p in (run_dir / CHECKPOINT_DIR).iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]
    assert rows(run_dir, "SELECT DISTINCT phase FROM checkpoint_phases ORDER BY phase") == [
        ("fsync",), ("publish",), ("serialize",), ("snapshot",), ("write",)]
    assert rows(run_dir, "SELECT bool_and(ok), count(DISTINCT rank) FROM checkpoint_phases") == [(True, 4)]

    # a fresh 4-rank job loads the newest and lands exactly on the state the run fingerprinted after step 3
    out = tmp_path / "load"
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, LAYOUT.world_size, is_master=True, wait_for_workers=False)
    mp.start_processes(_load_rank, args=(run_dir, store.port, out), nprocs=LAYOUT.world_size, start_method="spawn")
    expected = {
        r: (pos, ph, oh, [py, npy, th])
        for r, pos, ph, oh, py, npy, th in rows(
            run_dir, "SELECT rank, data_position, param_hash, optim_hash, rng_python_hash, rng_numpy_hash, "
                     "rng_torch_hash FROM fingerprints WHERE step = 3")
    }
    assert sorted(expected) == [0, 1, 2, 3]
    for r in range(LAYOUT.world_size):
        got = json.loads((out / f"rank-{r}.json").read_text())
        assert got["step"] == 3 and got["lr_scheduler"] is None and got["grad_scaler"] is None
        assert (got["data_position"], got["param_hash"], got["optim_hash"], got["rng"]) == expected[r], r
    assert rows(out, "SELECT phase, count(DISTINCT rank), bool_and(ok) FROM checkpoint_phases GROUP BY phase ORDER BY phase") == [
        ("load", 4, True), ("verify", 4, True)]


# (rank, point, after_s range): a kill before the directory rename must leave step 3 uncommitted; a kill after it
# (rank 0, "published") finds step 3 already committed. Kills on a timer land at a random instant.
KILLS = [
    (1, "write", (0.0, 0.03)),
    (2, "shard", None),
    (0, "manifest", None),
    (0, "rename", None),
    (0, "published", None),
]


@pytest.mark.parametrize(("rank", "point", "delay"), KILLS, ids=[f"rank{r}-{p}" for r, p, _ in KILLS])
def test_sigkill_during_save_never_publishes_a_partial(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, rank: int, point: str, delay: tuple[float, float] | None
) -> None:
    after_s = random.Random(f"{rank}{point}").uniform(*delay) if delay else 0.0
    monkeypatch.setenv(CHECKPOINT_FAULT_ENV, f"kill:rank={rank},step=3,at={point},after_s={after_s:.4f}")
    result = run(canary(run_dir, layout=str(LAYOUT), steps=6, checkpoint_every=2), failure_grace_s=3.0,
                 term_grace_s=1.0)
    assert result.exit_codes[rank] == -signal.SIGKILL, result.exit_codes
    cands = list_checkpoints(run_dir, verify=True, layout=LAYOUT, world_size=4)
    # a finished name is only ever a committed checkpoint; anything else is a temporary, PARTIAL, never chosen
    for c in cands:
        if not c.path.name.startswith("."):
            assert c.verdict is Verdict.COMMITTED, (c.path.name, c.reason)
        else:
            assert c.verdict is Verdict.PARTIAL
    chosen = choose(run_dir, layout=LAYOUT, world_size=4)
    assert chosen.manifest is not None and len(chosen.manifest.files) == 4 + 4 + 1  # 4 DCP files, 4 rank files, metadata
    if point == "published":
        assert chosen.step == 3
    elif point != "write":
        assert chosen.step == 1 and not (run_dir / CHECKPOINT_DIR / "step-00000003").exists()
    else:  # a timer kill may land after the commit: either is right, as long as what is chosen verified
        assert chosen.step in (1, 3)
    assert 1 in _committed(run_dir)  # the older checkpoint is intact


@pytest.mark.parametrize(("rank", "point"), [(2, "shard"), (0, "manifest")])
def test_full_disk_on_one_rank_publishes_nothing_and_training_goes_on(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, rank: int, point: str
) -> None:
    monkeypatch.setenv(CHECKPOINT_FAULT_ENV, f"enospc:rank={rank},step=3,at={point}")
    result = run(canary(run_dir, layout=str(LAYOUT), steps=6, checkpoint_every=2))
    assert result.ok, result.exit_codes  # the failed save did not stop training
    assert _committed(run_dir) == [1, 5]
    assert sorted(p.name for p in (run_dir / CHECKPOINT_DIR).iterdir()) == ["step-00000001", "step-00000005"]
    assert rows(run_dir, "SELECT max(step) FROM steps") == [(5,)]
    # every rank recorded the same outcome; the failing rank also recorded its own error
    who = {"shard": "rank 2", "manifest": "rank 0 publish"}[point]
    warned = rows(run_dir, "SELECT DISTINCT rank FROM events WHERE kind = 'checkpoint_failed' AND message LIKE "
                           f"'checkpoint step-00000003 not committed: {who}: OSError: [Errno 28] No space left on device%'")
    assert sorted(r for (r,) in warned) == [0, 1, 2, 3]
    failed = rows(run_dir, "SELECT rank, phase, error FROM checkpoint_phases WHERE NOT ok")
    assert [(r, ph) for r, ph, _ in failed] == [(rank, "write" if point == "shard" else "publish")]
    assert "No space left on device" in failed[0][2]
