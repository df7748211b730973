"""Time every explicit torch.distributed call without touching the training code.

    undo = instrument_distributed(collector)
    ...                       # dist.all_reduce(t, group=g) etc. are now recorded, on every group
    undo()

Wraps the module-level functions of torch.distributed (the names training code calls). Blocking calls are timed
around the call; ``async_op=True`` calls are entered at the call and left when the work's future completes.
The wrapper is transparent: same arguments, same return value, same exceptions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.collector.collectives import CollectiveTracker

#: torch.distributed function -> (recorded op name, name of its tensor argument, name of its peer argument)
INSTRUMENTED: dict[str, tuple[str, str | None, str | None]] = {
    "all_reduce": ("all_reduce", "tensor", None),
    "broadcast": ("broadcast", "tensor", None),
    "reduce": ("reduce", "tensor", None),
    "all_gather": ("all_gather", "tensor", None),
    "all_gather_into_tensor": ("all_gather", "input_tensor", None),
    "reduce_scatter_tensor": ("reduce_scatter", "input", None),
    "all_to_all_single": ("all_to_all", "input", None),
    "barrier": ("barrier", None, None),
    "send": ("send", "tensor", "dst"),
    "recv": ("recv", "tensor", "src"),
}


def _wrap(tracker: CollectiveTracker, fn: Callable[..., Any], op: str, tensor_arg: str | None, peer_arg: str | None) -> Callable[..., Any]:
    import inspect

    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
            tensor = bound.get(tensor_arg) if tensor_arg else None
            group = bound.get("group")
            peer = bound.get(peer_arg) if peer_arg else None
            async_op = bool(bound.get("async_op", False))
            o = tracker.enter(op, group, tensor, peer=peer, async_op=async_op)
        except Exception as exc:
            tracker._on_internal(f"instrument.{op}", exc)
            return fn(*args, **kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            tracker.exit(o, exc)
            raise
        if not async_op or result is None:
            tracker.exit(o)
            return result
        try:
            future = result.get_future()
        except Exception:  # a work object without a future (some backends): leave at the call
            tracker.exit(o)
            return result

        def done(f: torch.futures.Future[Any]) -> None:
            try:
                f.value()
            except BaseException as exc:
                tracker.exit(o, exc)
                return
            tracker.exit(o)

        future.add_done_callback(done)
        return result

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def instrument_distributed(collector: Any) -> Callable[[], None]:
    """Record every call of the functions in `INSTRUMENTED` through `collector`; returns a function that undoes it."""
    tracker: CollectiveTracker = collector.tracker
    originals: dict[str, Callable[..., Any]] = {}
    for name, (op, tensor_arg, peer_arg) in INSTRUMENTED.items():
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "__rankwatch_wrapped__"):
            continue
        originals[name] = fn
        setattr(dist, name, _wrap(tracker, fn, op, tensor_arg, peer_arg))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)

    return undo
