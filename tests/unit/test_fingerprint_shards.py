"""Fingerprints of sharded state (FSDP2, DTensor tensor parallel) and the consistency domain they belong to.

The hashing runs on real DTensors in a one-rank gloo world; the domain's coordinate math runs on the 4-rank layouts
through `mesh_peers`, and its reading of DTensor meshes and placements on the one-rank world.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.two_tensor import TwoTensor

from rankwatch.collector.fingerprint import (
    consistency_domain, domain_name, fingerprint, hash_optimizer, hash_tensors, mesh_peers,
)

pytestmark = pytest.mark.timeout(60)
fp_mod = importlib.import_module("rankwatch.collector.fingerprint")  # the package's `fingerprint` is the function


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _local(t: Any) -> Any:
    """The local tensor (with grad enabled, `to_local` would add an autograd node)."""
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


def _plain_optimizer(opt: torch.optim.Optimizer) -> Any:
    """The optimizer's groups and state with every DTensor replaced by its local tensor."""
    # one local object per parameter: `to_local` of a Parameter DTensor is a new view on every call
    local = {p: _local(p) for g in opt.param_groups for p in g["params"]}
    groups = [{**g, "params": [local[p] for p in g["params"]]} for g in opt.param_groups]
    state = {local[p]: {k: _local(v) for k, v in s.items()} for p, s in opt.state.items()}
    return SimpleNamespace(param_groups=groups, state=state)


def _trained_fsdp2(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_fsdp2_parameters_and_adamw_state_hash_from_their_local_shards(mesh: DeviceMesh) -> None:
    model, opt = _trained_fsdp2(mesh)
    first = next(model.parameters())
    assert isinstance(first, DTensor) and isinstance(opt.state[first]["exp_avg"], DTensor)

    fp = fingerprint(model, opt)
    local = [(n, _local(p)) for n, p in model.named_parameters()]
    assert fp.param_hash == hash_tensors(local)[0]
    assert fp.param_count == sum(t.numel() for _, t in local) == 4 * 8 + 8 + 8 * 2 + 2
    assert fp.optim_hash == hash_optimizer(cast(Any, _plain_optimizer(opt)))
    assert fp.unhashed == 0

    with torch.no_grad():
        model[2].weight.to_local()[1, 3] += 1.0
    moved = fingerprint(model, opt)
    assert moved.param_hash != fp.param_hash and moved.optim_hash == fp.optim_hash
    with torch.no_grad():
        opt.state[model[0].bias]["exp_avg_sq"].to_local()[5] += 1.0
    assert fingerprint(model, opt).optim_hash != moved.optim_hash


def test_non_finite_values_a_rank_holds_are_counted_and_told_as_an_event(mesh: DeviceMesh, tmp_path: Path) -> None:
    from rankwatch.base.schema import EventKind, Table
    from rankwatch.collector import Collector, CollectorConfig, MemorySink

    model, opt = _trained_fsdp2(mesh)
    fp = fingerprint(model, opt)
    assert (fp.nonfinite_params, fp.nonfinite_optim) == (0, 0)
    with torch.no_grad():  # a flipped exponent bit: Adam's second moment overflowed in one element of a shard
        opt.state[model[0].bias]["exp_avg_sq"].to_local()[5] = float("inf")
        model[2].weight.to_local()[0, 0] = float("nan")
    fp = fingerprint(model, opt)
    assert (fp.nonfinite_params, fp.nonfinite_optim) == (1, 1)
    sink = MemorySink()
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False, liveness=False), rank=0, world_size=1,
                  sink=sink)
    assert c.maybe_fingerprint(30, model, opt, force=True)
    events = [r for r in sink.rows(Table.EVENTS) if EventKind.NONFINITE in r]
    assert len(events) == 1 and 30 in events[0]
    assert any("1 non-finite value(s) in its parameters, 1 in its optimizer state" in str(v) for v in events[0])
    c.close()


def test_tensor_parallel_and_distributed_parameters_hash_from_their_local_shards(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    model.register_parameter("extra", torch.nn.Parameter(distribute_tensor(torch.randn(6), mesh, [Replicate()])))
    assert {type(p) for p in model.parameters()} == {DTensor}
    assert model[0].weight.placements == (Shard(0),)  # ColwiseParallel shards the weight's rows

    fp = fingerprint(model)
    assert fp.param_hash == hash_tensors((n, _local(p)) for n, p in model.named_parameters())[0]
    assert fp.unhashed == 0
    with torch.no_grad():
        model.extra.to_local()[0] += 1.0
    assert fingerprint(model).param_hash != fp.param_hash


def test_other_subclasses_never_raise() -> None:
    class WithStorage(torch.Tensor):
        pass

    plain = torch.arange(6, dtype=torch.float32)
    assert hash_tensors([("x", plain.as_subclass(WithStorage))]) == hash_tensors([("x", plain)])

    a, b = torch.ones(3), torch.zeros(3)
    two = hash_tensors([("x", TwoTensor(a, b))])[0]  # flattened: both inner tensors
    assert two != hash_tensors([("x", TwoTensor(a, torch.tensor([0.0, 0.0, 1.0])))])[0]

    class Opaque(torch.Tensor):
        """A wrapper subclass whose every op fails: no bytes to read."""

        @staticmethod
        def __new__(cls, *shape: int) -> Opaque:
            return cast(Opaque, torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32))

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            raise NotImplementedError(f"Opaque: {func}")

    model = torch.nn.Linear(2, 2)
    opt = SimpleNamespace(param_groups=[{"params": [model.weight]}], state={model.weight: {"m": Opaque(2, 2)}})
    fp = fingerprint(model, cast(Any, opt))
    assert fp.unhashed == 1
    assert fingerprint(model, cast(Any, opt)).optim_hash == fp.optim_hash  # a marker is deterministic
    opt.state[model.weight]["m"] = Opaque(4)
    assert fingerprint(model, cast(Any, opt)).optim_hash != fp.optim_hash  # it holds the shape


# -- the consistency domain ----------------------------------------------------------------------------------------
LINE = [0, 1, 2, 3]
GRID = [[0, 1], [2, 3]]


@pytest.mark.parametrize(("layout", "mesh_ranks", "fixed", "expected"), [
    ("DDP over 4", LINE, (False,), {r: (0, 1, 2, 3) for r in range(4)}),
    ("FSDP2 over 4", LINE, (True,), {r: (r,) for r in range(4)}),
    ("HSDP replicate 2 x shard 2", GRID, (False, True), {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}),
    ("FSDP 2 x TP 2", GRID, (True, True), {r: (r,) for r in range(4)}),
    ("DDP 2 x TP 2", GRID, (False, True), {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}),
])
def test_mesh_peers_of_the_four_rank_layouts(layout: str, mesh_ranks: Any, fixed: tuple[bool, ...],
                                             expected: dict[int, tuple[int, ...]]) -> None:
    assert {r: mesh_peers(mesh_ranks, r, fixed) for r in range(4)} == expected, layout


def test_mesh_peers_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="rank 7 appears 0 times"):
        mesh_peers(GRID, 7, (True, True))
    with pytest.raises(ValueError, match="2-d mesh, 1 'fixed' flags"):
        mesh_peers(GRID, 0, (True,))


def test_domain_names_are_the_members() -> None:
    assert domain_name([3, 1]) == "replicas:1,3"
    assert domain_name([2]) == "replicas:2"
    assert domain_name(range(8)) == "replicas:0-7"
    assert domain_name(range(1, 64, 8)) == "replicas:1-57/8"
    assert domain_name([0, 1, 3]) == "replicas:0,1,3"


def test_plain_parameters_belong_to_their_replicas() -> None:
    model = torch.nn.Linear(2, 2)
    assert consistency_domain(model, 2, 4) == ("replicas:0-3", (0, 1, 2, 3))
    assert consistency_domain(model, 2, 4, replicas=[2, 0]) == ("replicas:0,2", (0, 2))
    with pytest.raises(ValueError, match="rank 1 is not among its replicas"):
        consistency_domain(model, 1, 4, replicas=[0, 2])


def _on(mesh2d: DeviceMesh, *placements: Any) -> torch.nn.Parameter:
    return torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh2d, list(placements)))


def test_dtensor_meshes_and_placements_are_read(mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    fsdp, _ = _trained_fsdp2(mesh)
    assert consistency_domain(fsdp, 0, 1) == ("replicas:0", (0,))

    # a (replicate/dp, shard/tp) mesh of one rank; its ranks read as rank 2's row of the 4-rank GRID
    mesh2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    seen: list[tuple[tuple[int, ...], tuple[bool, ...]]] = []

    def on_grid(m: Any, rank: int, world_size: int, fixed: tuple[bool, ...]) -> frozenset[int]:
        seen.append((tuple(m.shape), fixed))
        return frozenset(mesh_peers(GRID, rank, fixed))

    monkeypatch.setattr(fp_mod, "_dtensor_peers", on_grid)
    hsdp = torch.nn.Module()
    hsdp.w = _on(mesh2d, Replicate(), Shard(0))
    hsdp.v = _on(mesh2d, Replicate(), Shard(1))
    assert consistency_domain(hsdp, 2, 4) == ("replicas:0,2", (0, 2))
    assert seen == [((1, 1), (False, True))]  # one look per (mesh, layout), not per parameter
    hsdp.norm = _on(mesh2d, Replicate(), Replicate())  # replicated everywhere: constrains nothing more
    assert consistency_domain(hsdp, 2, 4) == ("replicas:0,2", (0, 2))
    hsdp.row = _on(mesh2d, Shard(0), Replicate())  # sharded on the other dimension: no peer left
    assert consistency_domain(hsdp, 2, 4) == ("replicas:2", (2,))
    fsdp_tp = torch.nn.Module()
    fsdp_tp.w = _on(mesh2d, Shard(0), Shard(1))
    assert consistency_domain(fsdp_tp, 3, 4) == ("replicas:3", (3,))
