"""The consistency gate: pure judging, and the real collective on a small gloo group."""

from __future__ import annotations

import multiprocessing as mp
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from rankwatch.recovery.decision import GateVerdict
from rankwatch.recovery.gate import ALL_FIELDS, WORLD_FIELDS, Domain, Field, RankState, judge


def _state(rank: int, **kw: Any) -> RankState:
    base: dict[str, Any] = dict(rank=rank, step=9, data_position=320, param="p", optim="o", rng_python="a",
                                rng_numpy="b", rng_torch="c", rng_cuda=None)
    return RankState(**{**base, **kw})


def test_agree() -> None:
    d = Domain(name="dp.pp0.tp0", ranks=(0, 1, 2), fields=ALL_FIELDS)
    out = judge(d, [_state(r) for r in range(3)])
    assert out.verdict is GateVerdict.AGREE and out.splits == () and out.ranks == (0, 1, 2)


def test_minority_named_with_field_and_majority_value() -> None:
    d = Domain(name="dp.pp0.tp0", ranks=(0, 1, 2, 3), fields=ALL_FIELDS)
    out = judge(d, [_state(0), _state(1), _state(2, rng_torch="skewed"), _state(3)])
    assert out.verdict is GateVerdict.DISAGREE
    assert out.fields == (Field.RNG_TORCH,)
    assert out.disagreeing_ranks == (2,)
    (split,) = out.splits
    assert split.majority == "c" and split.groups == (("c", (0, 1, 3)), ("skewed", (2,)))
    assert "rank [2]=skewed" in out.message() and "rng_torch" in out.message()


def test_no_majority_lists_the_split() -> None:
    d = Domain(name="dp.pp0.tp0", ranks=(0, 1), fields=ALL_FIELDS)
    out = judge(d, [_state(0), _state(1, param="q", data_position=352)])
    assert out.verdict is GateVerdict.DISAGREE
    assert out.fields == (Field.DATA_POSITION, Field.PARAM)
    assert all(s.majority is None for s in out.splits) and out.disagreeing_ranks == (0, 1)
    assert "no majority" in out.message()


def test_world_domain_ignores_state_that_differs_across_stages() -> None:
    d = Domain(name="world", ranks=(0, 1), fields=WORLD_FIELDS)
    assert judge(d, [_state(0), _state(1, param="stage1", optim="stage1")]).verdict is GateVerdict.AGREE


def test_missing_member_is_unknown() -> None:
    d = Domain(name="world", ranks=(0, 1, 2), fields=WORLD_FIELDS)
    out = judge(d, [_state(0), None, _state(2)])
    assert out.verdict is GateVerdict.UNKNOWN and "[1]" in out.reason


def test_domain_validation() -> None:
    with pytest.raises(ValueError, match="distinct"):
        Domain(name="x", ranks=(0, 0), fields=ALL_FIELDS)


# -- the real collective ------------------------------------------------------------------------------------
def _member(rank: int, world: int, store_path: str, skew: int, absent: int, out: Any) -> None:
    try:
        _gate_member(rank, world, store_path, skew, absent, out)
    except BaseException as exc:
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def _gate_member(rank: int, world: int, store_path: str, skew: int, absent: int, out: Any) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from rankwatch.recovery.gate import rank_state as state_of, run_gate

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=3))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    if rank == skew:
        torch.rand(1)  # one draw: this rank's torch RNG is now elsewhere in the stream
    if rank == absent:
        out.put((rank, None))
        return
    domain = Domain(name="dp.pp0.tp0", ranks=tuple(range(world)), fields=ALL_FIELDS)
    (outcome,) = run_gate(state_of(rank=rank, step=4, data_position=160, model=model, optimizer=None),
                          domains=[domain], group=dist.group.WORLD, world_size=world)
    out.put((rank, outcome))


def _spawn(tmp_path: Path, world: int, *, skew: int = -1, absent: int = -1) -> dict[int, Any]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, world, str(tmp_path / "store"), skew, absent, out))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=40) for _ in range(world))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return results


@pytest.mark.slow  # four gloo ranks
@pytest.mark.timeout(90)
def test_gate_on_gloo_names_the_skewed_rank_and_unknown_when_a_member_is_absent(tmp_path: Path) -> None:
    results = _spawn(tmp_path / "a", 3, skew=2)
    for rank in range(3):
        o = results[rank]
        assert o.verdict is GateVerdict.DISAGREE, o
        assert o.fields == (Field.RNG_TORCH,) and o.disagreeing_ranks == (2,)
        assert o.splits[0].majority is not None
    results = _spawn(tmp_path / "b", 2, absent=1)
    assert results[1] is None
    assert results[0].verdict is GateVerdict.UNKNOWN and "gather failed" in results[0].reason
