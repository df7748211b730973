"""instrument_distributed records plain torch.distributed calls (a one-rank gloo group in this process)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rankwatch.base.schema import Collectives, Table, column_names
from rankwatch.collector import Collector, CollectorConfig, MemorySink
from rankwatch.collector.instrument import instrument_distributed


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_plain_calls_are_recorded_and_undo_restores(one_rank_world: None, tmp_path: Path) -> None:
    sink = MemorySink()
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False), rank=0, world_size=1, sink=sink)
    original = dist.all_reduce
    undo = instrument_distributed(c)
    try:
        t = torch.ones(8)
        with c.step(0):
            dist.all_reduce(t)
            work = dist.all_reduce(t, async_op=True)
            assert work is not None
            work.wait()
            dist.broadcast(t, src=0)
            dist.barrier()
        assert torch.equal(t, torch.ones(8))  # transparent: same results
    finally:
        undo()
    assert dist.all_reduce is original
    rows = [dict(zip(column_names(Table.COLLECTIVES), r)) for r in sink.rows(Table.COLLECTIVES)]
    # the async row lands when its future completes, so compare without order
    assert sorted((r[Collectives.OP], r[Collectives.ASYNC_OP]) for r in rows) == [
        ("all_reduce", False), ("all_reduce", True), ("barrier", False), ("broadcast", False),
    ]
    assert {r[Collectives.BYTES] for r in rows if r[Collectives.OP] != "barrier"} == {32}
    assert all(r[Collectives.STATUS] == "ok" and r[Collectives.EXIT_MONO_NS] is not None for r in rows)
    dist.all_reduce(torch.ones(1))
    assert len(sink.rows(Table.COLLECTIVES)) == 4  # nothing recorded after undo


@pytest.mark.timeout(120)
def test_a_compiled_graph_is_the_one_torch_would_build(one_rank_world: None, tmp_path: Path) -> None:
    """torch.compile traces through the wrappers to torch's own functions: `fullgraph=True` compiles (a wrapper that
    recorded while traced broke the graph there, and a fullgraph job failed), the result is the same, and the
    compiled collectives run as ops no wrapper sees (the Flight Recorder's count tells the table they are missing);
    calls outside the compiled function are still recorded."""
    import torch.distributed._functional_collectives as funcol

    from rankwatch.collector.funcol import instrument_funcol

    def f(x: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(x * 2, "sum", dist.group.WORLD)
        z = y.sin() + 1
        dist.all_reduce(z)
        return z.cos()

    want = f(torch.ones(8))
    sink = MemorySink()
    c = Collector(CollectorConfig(run_dir=tmp_path, handle_sigterm=False), rank=0, world_size=1, sink=sink)
    undo = [instrument_distributed(c), instrument_funcol(c)]
    torch._dynamo.reset()
    try:
        g = torch.compile(f, backend="aot_eager", fullgraph=True)
        with c.step(0):
            got = g(torch.ones(8))
            dist.all_reduce(torch.ones(4))
        assert torch.equal(got, want)
    finally:
        for u in undo:
            u()
        torch._dynamo.reset()
    rows = [dict(zip(column_names(Table.COLLECTIVES), r)) for r in sink.rows(Table.COLLECTIVES)]
    assert [(r[Collectives.OP], r[Collectives.BYTES]) for r in rows] == [("all_reduce", 16)]
