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


def _binder(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[[tuple[Any, ...], dict[str, Any]], list[Any]]:
    """The values of `names` in a call of `fn` (None where not passed), as `inspect.Signature.bind_partial` finds them,
    raising TypeError where it would. Without *args/**kwargs in the signature (the torch.distributed functions), by
    position or keyword from precomputed indexes: `bind_partial` costs more than the whole collector per call."""
    import inspect

    sig = inspect.signature(fn)
    kinds = [p.kind for p in sig.parameters.values()]
    positional = tuple(n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(k not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY) for k in kinds):

        def slow(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
            bound = sig.bind_partial(*args, **kwargs).arguments
            return [bound.get(n) for n in names]

        return slow
    known = frozenset(sig.parameters)
    where = [(n, positional.index(n) if n in positional else len(positional)) for n in names]
    most = len(positional)

    def fast(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        count = len(args)
        if count > most or (
            kwargs and (not known.issuperset(kwargs) or not kwargs.keys().isdisjoint(positional[:count]))
        ):
            sig.bind_partial(*args, **kwargs)  # raises the TypeError `fn` would
        return [args[i] if i < count else kwargs.get(n) for n, i in where]

    return fast


def _wrap(tracker: CollectiveTracker, fn: Callable[..., Any], op: str, tensor_arg: str | None, peer_arg: str | None) -> Callable[..., Any]:
    bind = _binder(fn, (tensor_arg or "", "group", peer_arg or "", "async_op"))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            tensor, group, peer, async_op = bind(args, kwargs)
            if not tensor_arg:
                tensor = None
            if not peer_arg:
                peer = None
            async_op = bool(async_op)
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
