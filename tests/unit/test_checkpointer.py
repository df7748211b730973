"""`recovery.Checkpointer` in one process (a world of one gloo rank): what a save records, what a resume restores and
checks, and the checkpoints it refuses (a save without a data position is never a recovery point). The multi-rank,
killed-from-outside behaviour is tests/integration/test_resume_examples.py."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rankwatch.base.schema import GroupKind
from rankwatch.base.topology import Layout
from rankwatch.collector import Collector, CollectorConfig, MemorySink
from rankwatch.recovery.catalog import AGREED, DISAGREED, MANIFEST, Manifest, Verdict, list_checkpoints
from rankwatch.recovery.checkpointer import (
    Checkpointer, RngScope, agreement_of, job_layout, rng_fields,
)
from rankwatch.recovery.gate import Field, RankState
from rankwatch.recovery.lineage import lineage_path
from rankwatch.recovery.resume import GateRefused

from support import world_of_one  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)


class Stream:
    """A loader position as a user's job keeps one."""

    def __init__(self) -> None:
        self.position = 0
        self.g = torch.Generator().manual_seed(7)

    def __next__(self) -> torch.Tensor:
        self.position += 1
        return torch.randn(4, 8, generator=self.g)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "generator": self.g.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.g.set_state(state["generator"])


class Job:
    """A tiny training job with a scheduler, dropout and a data stream."""

    def __init__(self, run_dir: Path, *, data: bool = True, attempt: int = 0, every: int = 3) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)
        self.data = Stream()
        self.collector = Collector(CollectorConfig(run_dir=run_dir, handle_sigterm=False), rank=0, world_size=1,
                                   attempt=attempt, sink=MemorySink())
        self.ckpt = Checkpointer(self.collector, self.model, self.optimizer, lr_scheduler=self.scheduler,
                                 grad_scaler=None, data=self.data if data else None, rng="replicated", every=every,
                                 config={"lr": 0.01})

    def train(self, first: int, last: int) -> None:
        for step in range(first, last):
            loss = self.model(next(self.data)).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.ckpt.after_step(step)

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def test_resume_continues_bitwise_and_records_the_lineage(tmp_path: Path, world_of_one: Any) -> None:
    straight = Job(tmp_path / "straight")
    straight.train(0, 10)

    first = Job(tmp_path / "run")
    first.train(0, 7)  # saves after steps 2 and 5; steps 6 trained, then the process "dies"
    manifest = list_checkpoints(tmp_path / "run", verify=True)[0].manifest
    assert manifest is not None and manifest.step == 5
    assert dict(manifest.pieces) == {"lr_scheduler": "saved", "grad_scaler": "none", "rng": "saved",
                                     "data_position": "saved"}

    random.random()  # a fresh process's RNG states are not the saved ones
    torch.rand(3)
    again = Job(tmp_path / "run", attempt=1)
    start = again.ckpt.resume()
    assert start == 6
    assert again.data.position == first.data.position - 1  # step 6's batch is drawn again
    assert again.scheduler.last_epoch == 6
    again.train(start, 10)
    assert all(torch.equal(a, b) for a, b in zip(again.params(), straight.params()))


def _vote(rank: int, members: tuple[int, ...], nonfinite: tuple[int, int] = (0, 0), **hashes: str) -> Any:
    values = {"param": "p", "optim": "o", "rng_python": "py", "rng_numpy": "np", "rng_torch": "t"} | hashes
    return RankState(rank=rank, step=9, data_position=-1, rng_cuda=None, **values), members, nonfinite


def test_a_save_is_judged_by_the_gates_own_domains() -> None:
    world = (0, 1, 2, 3)
    same = [_vote(r, world) for r in world]
    assert agreement_of(same, rng=(Field.RNG_TORCH,)) == AGREED
    # rank 1 drew one more random number: replicated torch stream declared, so the save is not a recovery point
    skewed = [_vote(r, world, rng_torch="t" if r != 1 else "t'") for r in world]
    text = agreement_of(skewed, rng=(Field.RNG_TORCH,))
    assert text.startswith(DISAGREED) and "world [0, 1, 2, 3]: disagree: ranks [1] differ in rng_torch" in text
    assert agreement_of(skewed, rng=()) == AGREED  # a stream seeded per rank is not compared across ranks
    # DDP replicas must hold equal parameters; sharded ranks (each its own domain) need not
    flipped = [_vote(r, world, param="p" if r != 2 else "p'") for r in world]
    assert "replicas:0-3 [0, 1, 2, 3]: disagree: ranks [2] differ in param" in agreement_of(flipped, rng=())
    sharded = [_vote(r, (r,), param=f"p{r}") for r in world]
    assert agreement_of(sharded, rng=(Field.RNG_TORCH,)) == AGREED
    # a shard holding an inf (Adam's second moment overflowed): nobody holds a copy to disagree, yet never a
    # recovery point
    sharded[1] = _vote(1, (1,), nonfinite=(0, 1), param="p1")
    assert agreement_of(sharded, rng=()) == (f"{DISAGREED} rank 1 holds non-finite values (0 in its parameters, 1 in "
                                              "its optimizer state)")
    assert agreement_of([same[0], None, same[2], same[3]], rng=()) == f"{DISAGREED} no vote from ranks [1]"
    # a data position the job gives must agree across the world (one rank's stream skipped a batch)
    ahead = [(replace(v[0], data_position=64 if v[0].rank == 3 else 32), *v[1:]) for v in same]
    assert agreement_of(ahead, rng=()) == AGREED  # none given: not compared
    assert "ranks [3] differ in data_position" in agreement_of(ahead, rng=(), position=True)


def test_a_model_split_by_hand_is_judged_by_its_data_parallel_groups() -> None:
    """The canary's case: no DTensor, a (dp, tp, pp) layout given. Each rank's replicas are its dp group, so two
    pipeline stages holding different parameters, and drawing torch numbers apart (declared ``replicas``), is no
    disagreement; a replica that differs in either is; a stream declared replicated is compared across the world."""
    layout = Layout.parse("dp=2,pp=2")
    dp_groups = [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [layout.rank_of(dp=d, tp=0, pp=p) for p in range(2) for d in range(2)] == [0, 1, 2, 3]
    kw: dict[str, Any] = {"rng": (Field.RNG_PYTHON,), "position": True, "replica_rng": (Field.RNG_TORCH,)}

    def votes(**at3: str) -> list[Any]:
        out = [_vote(r, dp_groups[r], param=f"stage{r // 2}", rng_torch=f"t{r // 2}") for r in range(4)]
        out[3] = _vote(3, (2, 3), **({"param": "stage1", "rng_torch": "t1"} | at3))
        return out

    assert agreement_of(votes(), **kw) == AGREED
    text = agreement_of(votes(param="stage1'"), **kw)
    assert text.startswith(DISAGREED) and "replicas:2,3 [2, 3]: disagree: ranks" in text and "param" in text
    text = agreement_of(votes(rng_torch="t1'"), **kw)
    assert text.startswith(DISAGREED) and "replicas:2,3" in text and "rng_torch" in text and "world" not in text
    text = agreement_of(votes(rng_python="py'"), **kw)
    assert text.startswith(DISAGREED) and "world" in text and "rng_python" in text


def test_a_save_the_ranks_disagreed_on_is_never_chosen_nor_pushes_out_the_last_one_they_agreed_on(
        tmp_path: Path, world_of_one: Any) -> None:
    job = Job(tmp_path / "run")
    job.train(0, 3)  # step 2: agreed
    assert list_checkpoints(tmp_path / "run", verify=True)[0].manifest.agreement == AGREED  # type: ignore[union-attr]
    job.ckpt._judge = lambda votes: f"{DISAGREED} world [0]: disagree: ranks [0] differ in rng_torch"  # type: ignore[method-assign]
    job.train(3, 15)  # steps 5, 8, 11, 14: disagreed; keep_last=3 keeps 14, 11, 8, and the agreed step 2
    found = {c.path.name: c for c in list_checkpoints(tmp_path / "run", verify=True)}
    assert sorted(found) == ["step-00000002", "step-00000008", "step-00000011", "step-00000014"]
    assert found["step-00000014"].verdict is Verdict.INCOMPLETE
    assert found["step-00000014"].reason == ("the ranks disagreed when it was saved (world [0]: disagree: ranks [0] "
                                             "differ in rng_torch): not a recovery point")
    assert found["step-00000002"].verdict is Verdict.COMMITTED
    assert Job(tmp_path / "run", attempt=1).ckpt.resume() == 3
    manifest = found["step-00000014"].manifest
    assert manifest is not None and Manifest.from_json(manifest.to_json()) == manifest
    with pytest.raises(ValueError, match="manifest agreement 'maybe'"):
        replace(manifest, agreement="maybe")


def test_a_resume_under_other_determinism_inputs_is_changed_with_what_changed(tmp_path: Path,
                                                                              world_of_one: Any) -> None:
    threads = torch.get_num_threads()
    Job(tmp_path / "run").train(0, 4)  # saves step 2 under this process's inputs
    manifest = list_checkpoints(tmp_path / "run", verify=True)[0].manifest
    assert manifest is not None and json.loads(manifest.determinism)["torch_threads"] == threads
    assert Job(tmp_path / "run", attempt=1).ckpt.resume() == 3  # the same inputs: bitwise identical expected
    torch.set_num_threads(threads + 1)  # the thread count is part of the numerics
    try:
        assert Job(tmp_path / "run", attempt=2).ckpt.resume() == 3
    finally:
        torch.set_num_threads(threads)
    entries = [json.loads(line) for line in lineage_path(tmp_path / "run").read_text().splitlines()]
    verdicts = [e["verdict"] for e in entries if e["kind"] in ("rollback", "restart")]
    assert verdicts[0]["comparability"] == "bitwise_identical_expected", verdicts
    assert verdicts[-1]["comparability"] == "changed" and "determinism_inputs" in verdicts[-1]["reasons"]
    assert f"torch_threads {threads}->{threads + 1}" in verdicts[-1]["note"]


def test_a_fresh_run_starts_at_step_zero(tmp_path: Path, world_of_one: Any) -> None:
    assert Job(tmp_path / "run").ckpt.resume() == 0
    assert not lineage_path(tmp_path / "run").exists()


def test_a_save_without_a_data_position_is_never_a_recovery_point(tmp_path: Path, world_of_one: Any) -> None:
    job = Job(tmp_path / "run", data=False)
    job.train(0, 4)
    [candidate] = list_checkpoints(tmp_path / "run", verify=True)
    assert candidate.verdict is Verdict.INCOMPLETE
    assert candidate.reason == ("saved without data_position (the job gave no data position (Checkpointer "
                                "data=None)): not a recovery point")
    with pytest.raises(ValueError, match=r"^.*step-00000002: incomplete \(saved without data_position"):
        Job(tmp_path / "run", data=False, attempt=1).ckpt.resume()


def test_a_data_position_that_cannot_be_read_makes_the_save_incomplete(tmp_path: Path, world_of_one: Any) -> None:
    job = Job(tmp_path / "run")

    def broken() -> dict[str, Any]:
        raise OSError("loader state unavailable")

    job.data.state_dict = broken  # type: ignore[method-assign]
    job.train(0, 3)
    [candidate] = list_checkpoints(tmp_path / "run", verify=True)
    assert candidate.verdict is Verdict.INCOMPLETE
    assert "data.state_dict() failed: OSError: loader state unavailable" in candidate.reason


def test_the_newest_incomplete_save_is_passed_over_for_an_older_complete_one(tmp_path: Path,
                                                                             world_of_one: Any) -> None:
    job = Job(tmp_path / "run")
    job.train(0, 3)  # step 2: complete
    job.ckpt._data = None  # the job stops giving its data position
    job.train(3, 6)  # step 5: incomplete
    again = Job(tmp_path / "run", attempt=1)
    assert again.ckpt.resume() == 3


def test_a_restore_that_differs_from_what_was_saved_is_refused(tmp_path: Path, world_of_one: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    Job(tmp_path / "run").train(0, 3)
    again = Job(tmp_path / "run", attempt=1)
    real = again.data.load_state_dict

    def skips_one(state: dict[str, Any]) -> None:  # a loader that restores one batch further on
        real(state)
        next(again.data)

    monkeypatch.setattr(again.data, "load_state_dict", skips_one)
    with pytest.raises(GateRefused, match="restore check failed: rank 0: data after loading differs"):
        again.ckpt.resume()


def test_a_manifest_missing_piece_round_trips_and_bad_states_are_refused(tmp_path: Path, world_of_one: Any) -> None:
    Job(tmp_path / "run").train(0, 3)
    path = tmp_path / "run" / "checkpoints" / "step-00000002" / MANIFEST
    m = Manifest.from_json(path.read_text())
    assert Manifest.from_json(m.to_json()) == m
    doc = json.loads(path.read_text())
    doc["pieces"]["data_position"] = "lost"
    with pytest.raises(ValueError, match="manifest piece 'data_position': state 'lost' is not"):
        Manifest.from_json(json.dumps(doc))
    doc["pieces"] = ["data_position"]
    with pytest.raises(ValueError, match="field 'pieces' is list, expected dict"):
        Manifest.from_json(json.dumps(doc))


def test_rng_declarations() -> None:
    assert rng_fields("replicated") == (Field.RNG_PYTHON, Field.RNG_NUMPY, Field.RNG_TORCH, Field.RNG_CUDA)
    assert rng_fields("per_rank") == ()
    assert rng_fields({"torch": "replicated", "python": "per_rank"}) == (Field.RNG_TORCH,)
    with pytest.raises(ValueError, match=r"rng names unknown stream\(s\) \['jax'\]"):
        rng_fields({"jax": "replicated"})
    with pytest.raises(ValueError, match="rng scope 'same' is none of 'replicated', 'replicas', 'per_rank'"):
        rng_fields("same")
    # alike within each shard's replicas: compared in the consistency domains, not across the world
    mixed = {"python": "replicated", "torch": "replicas", "cuda": RngScope.REPLICAS}
    assert rng_fields(mixed) == (Field.RNG_PYTHON,)
    assert rng_fields(mixed, RngScope.REPLICAS) == (Field.RNG_TORCH, Field.RNG_CUDA)


def test_job_layout_from_mesh_dimension_names() -> None:
    def mesh(names: tuple[str, ...] | None, shape: tuple[int, ...]) -> Any:
        return SimpleNamespace(mesh_dim_names=names, ndim=len(shape), shape=shape, size=lambda i: shape[i])

    assert job_layout(None, 8) == Layout(dp=8)
    assert job_layout(mesh(("dp", "tp"), (2, 4)), 8) == Layout(dp=2, tp=4)
    assert job_layout(mesh(("replicate", "shard", "tp"), (2, 2, 2)), 8) == Layout(dp=4, tp=2)
    assert job_layout(mesh(("pp", "dp_shard"), (2, 4)), 8) == Layout(dp=4, pp=2)
    assert job_layout(mesh(None, (4,)), 4) == Layout(dp=4)
    with pytest.raises(ValueError, match="holds 4 ranks, the world 8"):
        job_layout(mesh(("dp", "tp"), (2, 2)), 8)
    assert GroupKind.DP  # the kinds the layout is read by


def test_without_a_collector_the_attempt_is_the_launch_number(tmp_path: Path, world_of_one: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """RANKWATCH_DISABLE=1 gives a NullCollector (no attempt of its own): the launch's number in run.json is used."""
    from rankwatch.collector.null import NullCollector

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters())

    def attempt(run_id: str) -> int:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        return Checkpointer(NullCollector(), model, optimizer, lr_scheduler=None, grad_scaler=None, data=None,
                            rng="per_rank", every=0, run_dir=tmp_path).attempt

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert [attempt("first"), attempt("second"), attempt("first")] == [0, 1, 0]


def test_a_relaunch_resumes_only_from_the_checkpoint_the_manager_ordered(tmp_path: Path, world_of_one: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.recovery.job import RESUME_FROM_ENV

    Job(tmp_path / "run").train(0, 7)  # saves step-00000002 and step-00000005
    monkeypatch.setenv(RESUME_FROM_ENV, "step-00000002")  # e.g. a checkpoint that appeared after the decision
    with pytest.raises(ValueError, match="ordered a resume from step-00000002; the newest usable checkpoint is "
                                         "step-00000005"):
        Job(tmp_path / "run", attempt=1).ckpt.resume()
    monkeypatch.setenv(RESUME_FROM_ENV, "step-00000005")
    assert Job(tmp_path / "run", attempt=2).ckpt.resume() == 6


def test_a_restart_from_step_zero_ordered_by_the_manager(tmp_path: Path, world_of_one: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.recovery.job import FROM_START, RESUME_FROM_ENV

    Job(tmp_path / "run").train(0, 7)
    monkeypatch.setenv(RESUME_FROM_ENV, FROM_START)
    assert Job(tmp_path / "run", attempt=1).ckpt.resume() == 0
    assert not lineage_path(tmp_path / "run").exists()  # the manager writes the restart's lineage, not the job


def test_a_relaunch_that_never_resumes_is_stopped_at_its_first_step(tmp_path: Path, world_of_one: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.recovery.job import RESUME_FROM_ENV

    monkeypatch.setenv(RESUME_FROM_ENV, "step-00000005")
    job = Job(tmp_path / "run")
    with pytest.raises(RuntimeError, match=r"without calling Checkpointer.resume\(\)"):
        job.train(0, 1)


def test_a_layout_declared_to_the_manager_must_be_the_mesh(tmp_path: Path, world_of_one: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.recovery.job import LAYOUT_ENV

    monkeypatch.setenv(LAYOUT_ENV, "dp=1,tp=1,pp=1")
    Job(tmp_path / "ok")
    monkeypatch.setenv(LAYOUT_ENV, "dp=2,tp=2,pp=1")
    with pytest.raises(ValueError, match="layout is dp=2,tp=2,pp=1 .*its mesh says dp=1,tp=1,pp=1"):
        Job(tmp_path / "bad")


class AsyncJob(Job):
    def __init__(self, run_dir: Path, *, attempt: int = 0) -> None:
        super().__init__(run_dir, attempt=attempt)
        self.ckpt = Checkpointer(self.collector, self.model, self.optimizer, lr_scheduler=self.scheduler,
                                 grad_scaler=None, data=self.data, rng="replicated", every=3, config={"lr": 0.01},
                                 async_save=True)


def test_an_asynchronous_save_commits_the_state_of_its_step_while_training_goes_on(tmp_path: Path,
                                                                                   world_of_one: Any) -> None:
    straight = Job(tmp_path / "straight")
    straight.train(0, 10)

    first = AsyncJob(tmp_path / "run")
    first.train(0, 7)  # saves after steps 2 and 5, each written while the next steps train
    result = first.ckpt.close()
    assert result is not None and result.ok and result.step == 5
    assert [c.verdict for c in list_checkpoints(tmp_path / "run", verify=True)] == [Verdict.COMMITTED] * 2

    again = AsyncJob(tmp_path / "run", attempt=1)
    assert again.ckpt.resume() == 6
    again.train(6, 10)
    again.ckpt.close()
    assert all(torch.equal(a, b) for a, b in zip(again.params(), straight.params()))  # the step's state, not later


def test_a_half_written_asynchronous_save_is_never_chosen(tmp_path: Path, world_of_one: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import rankwatch.recovery.checkpoint as protocol

    held, release = threading.Event(), threading.Event()
    write = protocol._write_durably

    def slow(path: Path, data: bytes, *, mid: Any = None) -> None:
        if ".step-00000005.tmp" in str(path):  # the second save stops halfway, as a killed process leaves it
            held.set()
            release.wait(30)
            raise OSError("the process was killed")
        write(path, data, mid=mid)

    monkeypatch.setattr(protocol, "_write_durably", slow)
    first = AsyncJob(tmp_path / "run")
    first.train(0, 7)
    assert held.wait(30)
    found = {c.path.name: c.verdict for c in list_checkpoints(tmp_path / "run", verify=True)}
    assert found == {"step-00000002": Verdict.COMMITTED, ".step-00000005.tmp": Verdict.PARTIAL}, found

    again = Job(tmp_path / "run", attempt=1)  # another process resumes while the save is half written
    assert again.ckpt.resume() == 3
    release.set()
    result = first.ckpt.wait()
    assert result is not None and not result.ok and "killed" in result.reason


def test_a_layout_given_by_hand_must_hold_the_world_and_not_come_with_a_mesh(tmp_path: Path, world_of_one: Any) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    kw: dict[str, Any] = {"lr_scheduler": None, "grad_scaler": None, "data": None, "rng": "replicated", "every": 0,
                          "run_dir": tmp_path, "attempt": 0}
    c = Checkpointer(_null(), model, optimizer, layout=Layout(dp=1), **kw)
    assert c.layout == Layout(dp=1) and c.members() == (0,) and c.attempt == 0
    with pytest.raises(ValueError, match=r"the layout dp=2,tp=1,pp=1 holds 2 ranks, the world 1"):
        Checkpointer(_null(), model, optimizer, layout=Layout(dp=2), **kw)
    mesh = SimpleNamespace(mesh_dim_names=("dp",), ndim=1, shape=(1,), size=lambda i: 1)
    with pytest.raises(ValueError, match="pass a mesh .* or a layout .*, not both"):
        Checkpointer(_null(), model, optimizer, layout=Layout(dp=1), mesh=mesh, **kw)


def _null() -> Any:
    from rankwatch.collector.null import NullCollector

    return NullCollector(rank=0, world_size=1)
