"""A collector that records nothing: the "collector off" arm of benchmarks, and jobs that disable telemetry.

It mirrors `Collector`'s public surface (a test pins that), so the training loop has one code path."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rankwatch.base.schema import CheckpointPhase, EventKind
from rankwatch.base.topology import GroupInfo
from rankwatch.collector.collectives import StepRecord
from rankwatch.collector.collector import CheckpointPhaseRecord

R = TypeVar("R")


class NullCollector:
    errors = 0

    def __init__(self, *, rank: int = 0, world_size: int = 1, **_: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.gpu_sampler = None

    def start(self) -> NullCollector:
        return self

    def __enter__(self) -> NullCollector:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def close(self, exit_code: int | None = None) -> None:
        return None

    def flush(self, timeout_s: float | None = 5.0) -> bool:
        return True

    def register_group(self, group: Any, info: GroupInfo) -> None:
        return None

    def record_topology(self, **_: Any) -> None:
        return None

    @contextmanager
    def step(self, step: int) -> Iterator[StepRecord]:
        yield StepRecord(step)

    def phase(self, name: str) -> Any:
        return nullcontext()

    def wrap_loader(self, iterable: Iterable[R], *, position: Callable[[], int] | None = None) -> Iterator[R]:
        return iter(iterable)

    def set_data_position(self, position: int) -> None:
        return None

    def collective(self, op: str, group: Any, tensor: Any = None, *, peer: int | None = None) -> Any:
        return nullcontext()

    def ddp_comm_hook(self, group: Any = None, *, before: Callable[[GroupInfo], None] | None = None) -> Any:
        size = dist.get_world_size(group)

        def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
            buf = bucket.buffer().div_(size)
            work = dist.all_reduce(buf, group=group, async_op=True)
            assert work is not None
            fut = work.get_future()
            return fut.then(lambda f: f.value()[0])

        # DDP checks these annotations at registration; under postponed evaluation they would be strings
        hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        return hook

    @contextmanager
    def checkpoint_phase(
        self, step: int, checkpoint_id: str, phase: CheckpointPhase, nbytes: int | None = None, *,
        background: bool = False,
    ) -> Iterator[CheckpointPhaseRecord]:
        yield CheckpointPhaseRecord(bytes=nbytes)

    def maybe_fingerprint(self, step: int, model: Any, optimizer: Any = None, **_: Any) -> bool:
        return False

    def event(self, kind: EventKind, **_: Any) -> None:
        return None

    def record_collective_counts(self) -> None:
        return None

    def exception(self, exc: BaseException) -> None:
        return None

    def warning(self, message: str) -> None:
        return None
