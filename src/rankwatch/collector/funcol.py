"""Functional collectives (DTensor's redistributions, tensor parallelism) recorded without the job doing anything.

DTensor moves data with torch.distributed._functional_collectives (torch/distributed/tensor/placement_types.py and
_collective_utils.py call ``funcol.all_gather_single``, ``funcol.reduce_scatter_single``, ``funcol.all_reduce``
through the module's attributes). Those functions issue a C++ op (``torch.ops._c10d_functional.*``) that returns at
once, and wrap its output in an AsyncCollectiveTensor that waits (``funcol.wait_tensor``, looked up as a module
global) when the output is first used. So the collective's wait is neither in the call nor visible to
torch.distributed's Python functions: without this it is counted as compute, and the rank waited for looks fast
while its peers look slow.

While attached, each of those functions is wrapped: the operation is entered at the call (as an async operation of
its process group) and left when its output is waited on — `wait_tensor` of a tensor sharing the output's storage
(a view of it, as AsyncCollectiveTensor's view handling makes) — or, when the output is never waited on through the
module (a traced graph's own wait), when the output is freed. The wait's start is noted too: the time between the
call and the wait is the rank's own work, the wait is waiting (`StepRecord.waits`). A call made inside another
wrapped call (``all_gather_tensor`` calls ``all_gather_single``) is recorded once, as the outer one.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.collector.collectives import CollectiveTracker
from rankwatch.collector.instrument import tracing

__all__ = ["WRAPPED", "instrument_funcol"]

WRAPPED: dict[str, str] = {
    "broadcast": "broadcast",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_single_autograd": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_autograd": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
    "permute_tensor": "all_to_all",
}
"""torch.distributed._functional_collectives function -> recorded op (torch 2.13's names; absent ones skipped)."""

_GROUP_ARG = {"broadcast": 2, "all_reduce": 2, "all_reduce_coalesced": 2, "all_to_all_single": 3,
              "all_to_all_single_autograd": 3, "permute_tensor": 2}
"""Position of the `group` argument where it is not the third after `self` (default: index 2 of (self, x, group)
for gather, 3 for reduce_scatter: (self, reduceOp, scatter_dim, group))."""


def _group_index(name: str) -> int:
    if name in _GROUP_ARG:
        return _GROUP_ARG[name]
    return 3 if name.startswith("reduce_scatter") else 2


class _Pending:
    """Operations entered and not yet left, by the data pointer of their output's storage."""

    def __init__(self, tracker: CollectiveTracker) -> None:
        self.tracker = tracker
        self.lock = threading.Lock()
        self.open: dict[int, Any] = {}

    def add(self, key: int, o: Any, output: torch.Tensor) -> None:
        with self.lock:
            previous = self.open.pop(key, None)
            self.open[key] = o
        if previous is not None:  # the storage was reused: the earlier output is gone
            self.tracker.exit(previous)
        weakref.finalize(output, self.leave, key, o)

    def waiting(self, key: int) -> None:
        """The training thread begins to wait for the operation whose output has storage `key` (if one is open):
        its wait is counted from here (`StepRecord.waits`)."""
        o = self.open.get(key)
        if o is not None and o.wait_mono is None:
            o.wait_mono = time.monotonic_ns()

    def leave(self, key: int, o: Any | None = None) -> None:
        with self.lock:
            found = self.open.get(key)
            if found is None or (o is not None and found is not o):
                return
            del self.open[key]
        self.tracker.exit(found)


def _storage_key(t: Any) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return None


def _output(result: Any) -> torch.Tensor | None:
    """The plain tensor a functional collective's result waits for (the first output's AsyncCollectiveTensor
    `elem`); None when the result is already waited on (a plain tensor: traced, or waited eagerly)."""
    if isinstance(result, (list, tuple)):
        result = result[0] if result else None
    elem = getattr(result, "elem", None)
    return elem if isinstance(elem, torch.Tensor) else None


def instrument_funcol(collector: Any) -> Callable[[], None]:
    """Record every functional collective through `collector` (see the module docstring); returns the undo."""
    try:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.distributed_c10d import _resolve_process_group
    except Exception:  # a torch without them: nothing to record
        return lambda: None
    tracker: CollectiveTracker = collector.tracker
    pending = _Pending(tracker)
    inside = threading.local()
    groups: dict[str, Any] = {}
    originals: dict[str, Callable[..., Any]] = {}

    def process_group(group: Any, tag: str) -> Any:
        name = funcol._resolve_group_name(group, tag)
        pg = groups.get(name)
        if pg is None:
            pg = groups[name] = _resolve_process_group(name)
        return pg

    def wrap(name: str, fn: Callable[..., Any], op: str) -> Callable[..., Any]:
        at = _group_index(name)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if tracing() or bool(getattr(inside, "depth", 0)) or not dist.is_initialized():
                return fn(*args, **kwargs)  # traced by torch.compile: torch's own call in the graph (`tracing`)
            o = None
            try:
                group = kwargs["group"] if "group" in kwargs else args[at] if len(args) > at else None
                tag = kwargs.get("tag", args[at + 1] if len(args) > at + 1 else "")
                pg = process_group(group, tag)
                o = tracker.enter(op, pg, args[0] if args else kwargs.get("self"), async_op=True)
            except Exception as exc:
                tracker._on_internal(f"funcol.{name}", exc)
            inside.depth = 1
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                if o is not None:
                    tracker.exit(o, exc)
                raise
            finally:
                inside.depth = 0
            if o is not None:
                out = _output(result)
                key = _storage_key(out) if out is not None else None
                if out is None or key is None:  # already waited (traced, eager wait)
                    tracker.exit(o)
                else:
                    try:
                        pending.add(key, o, out)
                    except Exception as exc:
                        tracker._on_internal(f"funcol.{name}", exc)
                        tracker.exit(o)
            return result

        wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
        return wrapper

    for name, op in WRAPPED.items():
        fn = getattr(funcol, name, None)
        if fn is None or hasattr(fn, "__rankwatch_wrapped__"):
            continue
        originals[name] = fn
        setattr(funcol, name, wrap(name, fn, op))

    wait = getattr(funcol, "wait_tensor", None)
    if wait is not None and not hasattr(wait, "__rankwatch_wrapped__"):
        originals["wait_tensor"] = wait

        @functools.wraps(wait)
        def wait_tensor(tensor: Any) -> Any:
            if tracing():
                return wait(tensor)
            key = _storage_key(tensor) if pending.open else None
            if key is not None:
                pending.waiting(key)
            out = wait(tensor)
            if key is not None:
                pending.leave(key)
            return out

        wait_tensor.__rankwatch_wrapped__ = wait  # type: ignore[attr-defined]
        funcol.wait_tensor = wait_tensor

    def undo() -> None:
        for name, fn in originals.items():
            setattr(funcol, name, fn)

    return undo
