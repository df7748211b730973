"""`collector.attach()` in one process (a world of one gloo rank): what the launcher's environment says, the groups
it names, every kind of collective it records (explicit calls, c10d's internal ones, DDP's buckets and set-up
broadcasts, DTensor's functional collectives), each once; and `detach` undoing every patch."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.distributed as dist

from rankwatch.base.schema import EventKind, GroupKind
from rankwatch.base.topology import group_kind, group_name
from rankwatch.base.rundir import read_launches
from rankwatch.collector.launcher_env import launch_env, numbered
from rankwatch.control.torchrun import split_run_dir, torchrun_argv

pytestmark = pytest.mark.timeout(60)


# -- the launcher's environment -------------------------------------------------------------------------------------
def test_torchrun_slurm_and_a_lone_process_are_read_from_their_variables() -> None:
    me = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                     "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "x"})
    assert (me.rank, me.world_size, me.local_rank, me.attempt, me.launcher) == (3, 8, 1, 2, "torchrun")
    me = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_RESTART_COUNT": "1"})
    assert (me.rank, me.world_size, me.local_rank, me.attempt, me.launcher) == (5, 16, 1, 1, "slurm")
    assert launch_env({}).world_size == 1


def test_each_launch_is_numbered_once_in_the_run_file_whoever_gets_there_first(tmp_path: Path) -> None:
    """Every process of a launch (ranks and host agents, in any order, in parallel) gets one attempt number; the
    same command launched again, or torchrun restarting its workers, is the next attempt."""
    def env(run_id: str, rank: int, restarts: int = 0) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": run_id,
                "TORCHELASTIC_RESTART_COUNT": str(restarts)}

    got: list[int] = []
    threads = [threading.Thread(target=lambda r=r: got.append(numbered(launch_env(env("a", r)), tmp_path).attempt))
               for r in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == [0] * 8
    assert numbered(launch_env(env("b", 3)), tmp_path).attempt == 1
    assert numbered(launch_env(env("b", 3, restarts=1)), tmp_path).attempt == 2
    assert numbered(launch_env(env("a", 5)), tmp_path).attempt == 0
    assert [(r["attempt"], r["launch_key"]) for r in read_launches(tmp_path)] == [
        (0, "torchrun:a:0"), (1, "torchrun:b:0"), (2, "torchrun:b:1")]
    assert numbered(launch_env({**env("c", 0), "RANKWATCH_ATTEMPT": "7"}), tmp_path).attempt == 7
    assert numbered(launch_env({"RANK": "0", "WORLD_SIZE": "2"}), tmp_path).attempt == 0  # no launch to name
    assert len(read_launches(tmp_path)) == 3


@pytest.mark.parametrize("env, problem", [
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x' is not an integer"),
    ({"RANK": "4", "WORLD_SIZE": "4"}, "rank 4 is outside the world of 4"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS is not set"),
])
def test_a_launcher_environment_that_is_not_numbers_is_one_line_naming_it(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError, match="rankwatch.attach: .*" + problem.replace("(", r"\(")):
        launch_env(env)


def test_mesh_dimensions_and_group_descriptions_name_their_kind() -> None:
    kinds = {n: group_kind(n) for n in ("dp", "dp_shard", "dp_replicate", "fsdp", "tp", "mesh_tp", "pp", "cp", "x")}
    assert kinds == {"dp": GroupKind.DP, "dp_shard": GroupKind.DP, "dp_replicate": GroupKind.DP,
                     "fsdp": GroupKind.DP, "tp": GroupKind.TP, "mesh_tp": GroupKind.TP, "pp": GroupKind.PP,
                     "cp": GroupKind.OTHER, "x": GroupKind.OTHER}
    # DeviceMesh gives every tensor-parallel group the description "mesh_tp": the first member tells them apart
    assert group_name("mesh_tp", "5", (2, 3)) != group_name("mesh_tp", "4", (0, 1))
    assert group_name("undefined", "7", (0, 1)) == "pg7"


# -- rankwatch torchrun's command line ------------------------------------------------------------------------------
def test_torchrun_arguments_are_kept_and_the_worker_runs_under_the_host_agent() -> None:
    out = torchrun_argv(["--standalone", "--nproc-per-node", "4", "train.py", "--lr", "3", "-m"])
    assert out == ["--standalone", "--nproc-per-node", "4", "--no-python", sys.executable, "-m",
                   "rankwatch.collector.supervise", "train.py", "--lr", "3", "-m"]
    out = torchrun_argv(["--nnodes", "1", "-m", "pkg.train", "--x"])
    assert out[:2] == ["--nnodes", "1"] and "-m" not in out[:out.index("--no-python")]
    assert out[out.index("rankwatch.collector.supervise") + 1:] == ["--module", "pkg.train", "--x"]
    out = torchrun_argv(["--no-python", "./run.sh", "a"])
    assert out[out.index("rankwatch.collector.supervise") + 1:] == ["--exec", "./run.sh", "a"]


def test_the_run_directory_comes_first_then_from_the_environment_then_a_default() -> None:
    assert split_run_dir(["--run-dir", "r1", "--standalone", "t.py"], {}) == (Path("r1"), ["--standalone", "t.py"])
    assert split_run_dir(["--run-dir=r2", "t.py"], {})[0] == Path("r2")
    assert split_run_dir(["t.py"], {"RANKWATCH_RUN_DIR": "r3"})[0] == Path("r3")
    assert split_run_dir(["--standalone", "train.py"], {})[0].name.startswith("train-")
    with pytest.raises(ValueError, match="--run-dir needs a directory"):
        split_run_dir(["--run-dir"], {})


# -- attached in a world of one ------------------------------------------------------------------------------------
@pytest.fixture
def world(tmp_path: Path) -> Iterator[Path]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield tmp_path / "run"
    finally:
        from rankwatch.collector.attach import detach

        detach()
        if dist.is_initialized():
            dist.destroy_process_group()


def _rows(run: Path, table: str) -> pl.DataFrame:
    return pl.read_parquet(sorted((run / "telemetry" / table).glob("*/*.parquet")))


def test_every_kind_of_collective_is_recorded_once_and_detach_restores_torch(world: Path) -> None:
    from torch.distributed import _functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel as DDP

    from rankwatch.collector.attach import attach, detach

    originals = (dist.all_reduce, dist.distributed_c10d.all_gather, DDP.__init__, funcol.all_reduce,
                 dist._broadcast_coalesced, sys.excepthook, threading.excepthook)
    rw = attach(world, env={"RANK": "0", "WORLD_SIZE": "1"})
    assert attach(world) is rw  # attaching twice: the same collector
    assert dist.all_reduce is not originals[0] and DDP.__init__ is not originals[2]
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 8))  # set-up: _verify_params_across_processes, _broadcast_coalesced
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with rw.step(0):
        model(torch.randn(4, 8)).sum().backward()  # one gradient bucket, through the automatic comm hook
        opt.step()
        dist.all_reduce(torch.ones(3))  # explicit
        dist.all_gather_object([None], {"a": 1})  # c10d's own all_gathers, recorded as the collectives they are
        out = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)  # DTensor's kind: left when waited on
        assert float((out + 1).sum()) == 8.0
    detach()
    assert (dist.all_reduce, dist.distributed_c10d.all_gather, DDP.__init__, funcol.all_reduce,
            dist._broadcast_coalesced, sys.excepthook, threading.excepthook) == originals
    rows = _rows(world, "collectives")
    in_step = rows.filter(pl.col("step") == 0)
    ops = sorted(in_step["op"].to_list())
    # the bucket (hook), the explicit one, the functional one: three all-reduces, none twice
    assert ops.count("all_reduce") == 3, ops
    assert ops.count("all_gather") == 2, ops
    assert (in_step["exit_wall_ns"] >= in_step["enter_wall_ns"]).all()
    assert set(rows["group"].to_list()) == {"world"}
    topology = _rows(world, "topology")
    assert topology["world_size"].to_list() == [1] and topology["backend"].to_list() == ["gloo"]
    events = _rows(world, "events")
    assert events.filter(pl.col("kind") == str(EventKind.EXIT))["exit_code"].to_list() == [0]


def test_an_uncaught_exception_is_recorded_then_passed_to_the_hook_before(world: Path) -> None:
    from rankwatch.collector.attach import attach

    seen: list[str] = []
    previous = sys.excepthook
    sys.excepthook = lambda kind, exc, tb: seen.append(str(exc))
    try:
        attach(world, env={"RANK": "0", "WORLD_SIZE": "1"})
        try:
            raise RuntimeError("injected on rank 0")
        except RuntimeError as exc:
            sys.excepthook(type(exc), exc, exc.__traceback__)
    finally:
        from rankwatch.collector.attach import detach

        detach()
        sys.excepthook = previous
    assert seen == ["injected on rank 0"]
    events = _rows(world, "events")
    (exc_row,) = events.filter(pl.col("kind") == str(EventKind.EXCEPTION)).iter_rows(named=True)
    assert exc_row["exc_type"] == "RuntimeError" and exc_row["message"] == "injected on rank 0"
    assert events.filter(pl.col("kind") == str(EventKind.EXIT))["exit_code"].to_list() == [1]


def test_no_run_directory_is_an_error_at_set_up(world: Path) -> None:
    from rankwatch.collector.attach import attach

    with pytest.raises(ValueError, match="no run directory: pass attach\\(run_dir\\) or set RANKWATCH_RUN_DIR"):
        attach(env={"RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(ValueError, match="WORLD_SIZE 4 but the default process group has 1"):
        attach(world, env={"RANK": "0", "WORLD_SIZE": "4"})


def test_a_functional_collective_waits_only_from_its_wait(world: Path) -> None:
    """DTensor's collectives return at once and are waited on when their output is used: the rank's own work between
    the call and the use is compute, not waiting (tensor-parallel peers of a slow rank wait in the wait only)."""
    import time

    from torch.distributed import _functional_collectives as funcol

    from rankwatch.collector.attach import attach, detach

    rw = attach(world, env={"RANK": "0", "WORLD_SIZE": "1"})
    with rw.step(0):
        out = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        time.sleep(0.08)  # the rank's own work before it uses the output
        assert float(out.sum()) == 4.0
    detach()
    steps = _rows(world, "steps")
    wait_ms = steps["collective_wait_ns"].item() / 1e6
    compute_ms = steps["compute_ns"].item() / 1e6
    assert wait_ms < 20 and compute_ms >= 75, (wait_ms, compute_ms)


def test_rankwatch_disable_returns_a_collector_that_records_and_patches_nothing(world: Path) -> None:
    from rankwatch.collector.attach import attach
    from rankwatch.collector.null import NullCollector

    before = (dist.all_reduce, sys.excepthook, sys.exit)
    rw = attach(world, env={"RANK": "0", "WORLD_SIZE": "1", "RANKWATCH_DISABLE": "1"})
    assert isinstance(rw, NullCollector)
    assert (dist.all_reduce, sys.excepthook, sys.exit) == before
    with rw.step(0):
        dist.all_reduce(torch.ones(2))
    assert not world.exists()
    with pytest.raises(ValueError, match="RANKWATCH_DISABLE='maybe' is not 1/0"):
        attach(world, env={"RANK": "0", "WORLD_SIZE": "1", "RANKWATCH_DISABLE": "maybe"})


_EXITING = """
import sys
from datetime import timedelta
import torch.distributed as dist
from rankwatch.collector.attach import attach
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1] + "/store", 1), rank=0, world_size=1,
                        timeout=timedelta(seconds=10))
rw = attach(sys.argv[1] + "/run", env={"RANK": "0", "WORLD_SIZE": "1"})
with rw.step(0):
    pass
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_the_exit_status_of_sys_exit_is_recorded(tmp_path: Path, code: int) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-c", _EXITING, str(tmp_path), str(code)], capture_output=True, timeout=60)
    assert done.returncode == code, done.stderr.decode()[-2000:]
    events = _rows(tmp_path / "run", "events")
    assert events.filter(pl.col("kind") == str(EventKind.EXIT))["exit_code"].to_list() == [code]
