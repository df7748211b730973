"""`control.command`: a job the recovery manager owns by its command line — what it reads from a torchrun command,
how it is placed off quarantined devices, what a relaunch is told, how the run file keeps it, and the launcher's
start, stop and exit codes on small real commands. The manager recovering a real example job is
tests/integration/test_manager_owns_examples.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from rankwatch.base.rundir import claim_launch, read_launches
from rankwatch.base.topology import Layout
from rankwatch.collector.launcher_env import LAUNCH_ENV, launch_env
from rankwatch.control.command import CommandJob, CommandLauncher, command_world_size
from rankwatch.recovery.decision import MembershipSupport
from rankwatch.recovery.job import FROM_START, LAYOUT_ENV, REPLAY_BASIS_ENV, RESUME_FROM_ENV

pytestmark = pytest.mark.timeout(60)

TORCHRUN = ["rankwatch", "torchrun", "--run-dir", "runs/x", "--standalone", "--nproc-per-node", "4", "train.py",
            "--resume"]


def test_the_world_size_is_read_from_torchrun_arguments() -> None:
    assert command_world_size(TORCHRUN) == 4
    assert command_world_size(["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "t.py"]) == 16
    assert command_world_size([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "t.py"]) == 2
    assert command_world_size(["torchrun", "--nnodes", "1:4", "--nproc-per-node", "8", "t.py"]) is None  # elastic
    assert command_world_size(["torchrun", "--nproc-per-node", "gpu", "t.py"]) is None
    assert command_world_size(["python", "train.py"]) is None


def test_the_layout_given_must_hold_the_world_the_command_starts(tmp_path: Path) -> None:
    job = CommandJob.from_args(tmp_path, TORCHRUN)
    assert job.layout == Layout(dp=4) and job.world_size == 4
    assert CommandJob.from_args(tmp_path, TORCHRUN, layout=Layout(dp=2, tp=2)).layout == Layout(dp=2, tp=2)
    with pytest.raises(ValueError, match="layout dp=2,tp=1,pp=1 holds 2 ranks, the command starts 4"):
        CommandJob.from_args(tmp_path, TORCHRUN, layout=Layout(dp=2))
    with pytest.raises(ValueError, match="cannot tell the world size of 'python train.py': give --layout"):
        CommandJob.from_args(tmp_path, ["python", "train.py"])
    with pytest.raises(ValueError, match="command is empty"):
        CommandJob.from_args(tmp_path, [], layout=Layout(dp=1))


def test_placement_off_a_quarantined_device_uses_a_spare_and_refuses_when_none_is_left(tmp_path: Path) -> None:
    job = CommandJob.from_args(tmp_path, TORCHRUN, devices=["GPU-a", "GPU-b", "GPU-c", "GPU-d", "GPU-e"])
    assert job.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b,GPU-c,GPU-d"
    assert job.placement()[1][1:] == (1, "GPU-b")
    moved, lines = job.placed_off(devices={"GPU-b"})
    assert moved.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-c,GPU-d,GPU-e"
    assert lines and "rank 1: device GPU-b" in lines[0]
    same, none = moved.placed_off(devices={"GPU-b"})
    assert same == moved and none == ()
    with pytest.raises(ValueError, match=r"needs 4 devices .*usable: \['GPU-a', 'GPU-d', 'GPU-e'\]"):
        moved.placed_off(devices={"GPU-c"})
    with pytest.raises(ValueError, match=f"host {job.host} is quarantined"):
        job.placed_off(hosts={job.host})
    rotated = moved.rotations()[0]
    assert rotated.environment()["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d,GPU-e,GPU-a"


def test_a_job_without_devices_is_placed_by_local_rank(tmp_path: Path) -> None:
    job = CommandJob.from_args(tmp_path, TORCHRUN)
    assert job.placement() == {r: (job.host, r, "") for r in range(4)}
    assert "CUDA_VISIBLE_DEVICES" not in job.environment()
    assert job.placed_off(devices={"GPU-a"}) == (job, ())


def test_a_relaunch_is_told_its_checkpoint_layout_and_replay_basis(tmp_path: Path) -> None:
    job = CommandJob.from_args(tmp_path, TORCHRUN, layout=Layout(dp=2, tp=2))
    assert RESUME_FROM_ENV not in job.environment()
    env = job.relaunched(checkpoint="step-00000011", keep_faults=False, replay_basis=9).environment()
    assert env[RESUME_FROM_ENV] == "step-00000011" and env[REPLAY_BASIS_ENV] == "9"
    assert env[LAYOUT_ENV] == "dp=2,tp=2,pp=1"
    assert job.relaunched(checkpoint=None, keep_faults=False, replay_basis=None).environment()[RESUME_FROM_ENV] \
        == FROM_START
    assert job.declaration().membership is MembershipSupport.FIXED_SHAPES


def test_the_run_file_gives_the_job_back(tmp_path: Path) -> None:
    job = CommandJob.from_args(tmp_path, TORCHRUN, membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH,
                               devices=["GPU-a", "GPU-b", "GPU-c", "GPU-d"], env={"OMP_NUM_THREADS": "1"})
    claim_launch(tmp_path, "manager:x:0", job.relaunched(checkpoint="step-00000003", keep_faults=False,
                                                         replay_basis=None).launch_record())
    claim_launch(tmp_path, "torchrun:y:1", {"launcher": "torchrun", "world_size": 4})  # torchrun's own restart
    back = CommandJob.from_run(tmp_path)
    assert back == job  # as first given: a relaunch's checkpoint is not carried over
    with pytest.raises(ValueError, match="records no launch of a command"):
        (tmp_path / "other").mkdir()
        claim_launch(tmp_path / "other", "torchrun:z:0", {"world_size": 1})
        CommandJob.from_run(tmp_path / "other")


def test_the_launch_named_by_the_manager_numbers_the_ranks_and_torchruns_restarts(tmp_path: Path) -> None:
    claim_launch(tmp_path, "torchrun:old:0", {"world_size": 4})
    n = claim_launch(tmp_path, "manager:abc:0", {"world_size": 4})
    env = {"RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0",
           LAUNCH_ENV: "manager:abc"}
    assert launch_env(env).key == "manager:abc:0"
    from rankwatch.collector.launcher_env import numbered

    assert numbered(launch_env(env), tmp_path).attempt == n == 1
    restarted = numbered(launch_env({**env, "TORCHELASTIC_RESTART_COUNT": "1"}), tmp_path)
    assert restarted.attempt == 2 and len(read_launches(tmp_path)) == 3


def _job(tmp_path: Path, code: str) -> CommandJob:
    return CommandJob.from_args(tmp_path / "run", [sys.executable, "-c", code], layout=Layout(dp=2), cwd=tmp_path)


def test_the_launcher_runs_the_command_in_its_environment_and_records_the_launch(tmp_path: Path) -> None:
    code = ("import json, os; json.dump({k: v for k, v in os.environ.items() if k.startswith('RANKWATCH')}, "
            "open('env.json', 'w'))")
    job = _job(tmp_path, code).relaunched(checkpoint="step-00000003", keep_faults=False, replay_basis=None)
    seen: list[tuple[int, ...]] = []
    result = CommandLauncher(poll_s=0.02)(job, stop=threading.Event(), on_start=seen.append)
    assert result.ok and result.exit_codes == (0, 0) and not result.stopped
    env = json.loads((tmp_path / "env.json").read_text())
    launches = read_launches(tmp_path / "run")
    assert env[RESUME_FROM_ENV] == "step-00000003" and env["RANKWATCH_RUN_DIR"] == str(tmp_path / "run")
    assert launches[0]["launch_key"] == env[LAUNCH_ENV] + ":0" and launches[0]["resume_from"] == "step-00000003"
    assert len(seen) == 1 and (tmp_path / "run" / "manager" / "attempt-0.log").is_file()


def test_stop_ends_the_command_at_once_and_sigkill_follows_a_command_that_ignores_sigterm(tmp_path: Path) -> None:
    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    for code, grace in (("import time; time.sleep(60)", 5.0), (ignores, 0.5)):
        job = _job(tmp_path, code)
        stop = threading.Event()
        timer = threading.Timer(0.5, stop.set)
        timer.start()
        t0 = time.monotonic()
        result = CommandLauncher(term_grace_s=grace, poll_s=0.02)(job, stop=stop, on_start=lambda pids: None)
        assert result.stopped and not result.ok and result.terminated == (0, 1)
        assert result.exit_codes == (None, None)  # no host agent: each rank's end unobserved
        assert time.monotonic() - t0 < 5.0


def test_a_failing_command_without_exit_records_is_not_ok(tmp_path: Path) -> None:
    result = CommandLauncher(poll_s=0.02)(_job(tmp_path, "raise SystemExit(3)"))
    assert not result.ok and result.exit_codes == (None, None) and not result.stopped


def test_only_a_declared_data_parallel_job_is_resized_and_the_answer_says_on_what_conditions(tmp_path: Path) -> None:
    from rankwatch.control.manager import continue_on

    dp = CommandJob.from_args(tmp_path, TORCHRUN, membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH)
    smaller = dp.resized(3)
    assert smaller.world_size == 3 and smaller.command[smaller.command.index("--nproc-per-node") + 1] == "3"
    ok, lines = continue_on(dp, 3)
    assert ok and "yes, on 3 of 4 ranks" in lines[0] and any("CHANGED" in line for line in lines)
    assert not continue_on(dp, 5)[0]

    fixed = CommandJob.from_args(tmp_path, TORCHRUN, layout=Layout(dp=2, tp=2))
    ok, lines = continue_on(fixed, 3)
    assert not ok and "fixed_shapes" in lines[0] and "full restart" in lines[1]
    with pytest.raises(ValueError, match="tensor and pipeline shapes are fixed"):
        fixed.resized(2)
    elastic = CommandJob.from_args(tmp_path, ["torchrun", "--nproc-per-node=4", "t.py"],
                                   membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH)
    assert elastic.resized(2).command == ("torchrun", "--nproc-per-node=2", "t.py")
    spare = CommandJob.from_args(tmp_path, TORCHRUN, membership=MembershipSupport.SPARE_REPLACEMENT)
    assert not continue_on(spare, 3)[0]


def test_recover_answers_whether_the_run_can_go_on_with_fewer_ranks(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from rankwatch.cli import main

    job = CommandJob.from_args(tmp_path, TORCHRUN, membership=MembershipSupport.PURE_DP_RECONFIGURABLE_BATCH)
    claim_launch(tmp_path, "manager:a:0", job.launch_record())
    assert main(["recover", str(tmp_path), "--continue-on", "3"]) == 0
    out = capsys.readouterr().out
    assert "go on with 3 of its 4 ranks? yes" in out and "re-plans its data over 3 replicas" in out
    assert main(["recover", str(tmp_path), "--continue-on", "8"]) == 1


SRUN = ["srun", "--nodelist={hosts}", "--nodes={nnodes}", "--ntasks-per-node=1", "rankwatch", "torchrun",
        "--nnodes={nnodes}", "--nproc-per-node", "2", "--rdzv-endpoint={first_host}:29500", "train.py", "--resume"]


def test_a_job_on_a_host_list_is_placed_off_a_quarantined_host_onto_a_spare_and_refused_when_none_is_left(
        tmp_path: Path) -> None:
    job = CommandJob.from_args(tmp_path, SRUN, layout=Layout(dp=4), hosts=["n1", "n2", "n3"], nodes=2)
    assert job.argv()[1:3] == ("--nodelist=n1,n2", "--nodes=2") and "--rdzv-endpoint=n1:29500" in job.argv()
    assert job.placement() == {0: ("n1", 0, ""), 1: ("n1", 1, ""), 2: ("n2", 0, ""), 3: ("n2", 1, "")}
    moved, lines = job.placed_off(hosts={"n1"})
    # node 0 moves to the spare; node 1 keeps its host, so the rendezvous host is the spare now
    assert moved.argv()[1] == "--nodelist=n3,n2" and "--rdzv-endpoint=n3:29500" in moved.argv()
    assert lines == ("node 0 (ranks 0..1): host n1 -> n3 (quarantined)",)
    assert moved.placed_off(hosts={"n1"}) == (moved, ())
    with pytest.raises(ValueError, match=r"needs 2 hosts; usable: \['n2'\] .*quarantined: \['n1', 'n3'\]"):
        moved.placed_off(hosts={"n3"})
    claim_launch(tmp_path, "manager:x:0", moved.launch_record())
    back = CommandJob.from_run(tmp_path)
    assert back.argv() == moved.argv() and back.excluded_hosts == ("n1",)


def test_a_host_list_must_have_where_to_go_and_enough_hosts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must take it where the command says \{hosts\}"):
        CommandJob.from_args(tmp_path, TORCHRUN, hosts=["n1", "n2"], nodes=2)
    with pytest.raises(ValueError, match="the job needs 2 hosts; usable: \\['n1'\\]"):
        CommandJob.from_args(tmp_path, SRUN, layout=Layout(dp=4), hosts=["n1"], nodes=2)
    with pytest.raises(ValueError, match="3 nodes for a world of 4 ranks"):
        CommandJob.from_args(tmp_path, SRUN, layout=Layout(dp=4), hosts=["n1", "n2", "n3"], nodes=3)
    with pytest.raises(ValueError, match="not both"):
        CommandJob.from_args(tmp_path, SRUN, layout=Layout(dp=4), hosts=["n1", "n2"], nodes=2, devices=["0", "1"])
    with pytest.raises(ValueError, match="not resized"):
        CommandJob.from_args(tmp_path, SRUN, layout=Layout(dp=4), hosts=["n1", "n2"], nodes=2).resized(2)


def test_the_launcher_runs_the_command_with_the_hosts_written_in(tmp_path: Path) -> None:
    code = "import sys; open('hosts.txt', 'w').write(sys.argv[1])"
    job = CommandJob.from_args(tmp_path / "run", [sys.executable, "-c", code, "{hosts}"], layout=Layout(dp=2),
                               cwd=tmp_path, hosts=["a", "b", "c"], nodes=2)
    job, _ = job.placed_off(hosts={"b"})
    assert CommandLauncher(poll_s=0.02)(job, stop=threading.Event()).ok
    assert (tmp_path / "hosts.txt").read_text() == "a,c"
    assert read_launches(tmp_path / "run")[0]["placement"] == {"0": ["a", 0, ""], "1": ["c", 0, ""]}


def test_the_manager_places_a_host_list_job_off_a_quarantined_host_and_records_each_rank_moved(tmp_path: Path) -> None:
    from rankwatch.base.rundir import QuarantineEntry, write_quarantine
    from rankwatch.control.manager import place_off_quarantine
    from rankwatch.recovery.lineage import lineage_path, read

    job = CommandJob.from_args(tmp_path, SRUN, layout=Layout(dp=4), hosts=["n1", "n2", "n3"], nodes=2)
    write_quarantine(tmp_path, [QuarantineEntry(kind="host", id="n2", incident="operator")])
    said: list[str] = []
    placed = place_off_quarantine(tmp_path, job, say=said.append)
    assert placed.chosen_hosts == ("n1", "n3") and said == [
        "placement off the quarantine list: node 1 (ranks 2..3): host n2 -> n3 (quarantined)"]
    moved = [(e.details.old_device, e.details.new_device, str(e.verdict.comparability))
             for e in read(lineage_path(tmp_path))]
    assert [m[:2] for m in moved] == [("n2:0", "n3:0"), ("n2:1", "n3:1")] and all("changed" in m[2] for m in moved)
    assert place_off_quarantine(tmp_path, placed) == placed  # placed already: nothing recorded again
    write_quarantine(tmp_path, [QuarantineEntry(kind="host", id="n2"), QuarantineEntry(kind="host", id="n3")])
    with pytest.raises(ValueError, match="the job needs 2 hosts; usable: \\['n1'\\]"):
        place_off_quarantine(tmp_path, placed)
