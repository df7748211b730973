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
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.collector.collectives import CollectiveTracker

#: torch.distributed function -> (recorded op name, name of its tensor argument, name of its peer argument). The
#: names are those of torch/distributed/distributed_c10d.py (torch 2.13); FSDP2 calls all_gather_single and
#: reduce_scatter_single (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). Functions the c10d module calls
#: internally (all_gather_object's all_gather) go through its own globals, not these attributes, so a call is
#: recorded once, under the name the job called.
INSTRUMENTED: dict[str, tuple[str, str | None, str | None]] = {
    "all_reduce": ("all_reduce", "tensor", None),
    "all_reduce_coalesced": ("all_reduce", "tensors", None),
    "broadcast": ("broadcast", "tensor", None),
    "reduce": ("reduce", "tensor", None),
    "all_gather": ("all_gather", "tensor", None),
    "all_gather_into_tensor": ("all_gather", "input_tensor", None),
    "all_gather_single": ("all_gather", "input_tensor", None),
    "all_gather_coalesced": ("all_gather", "input_tensor_list", None),
    "reduce_scatter": ("reduce_scatter", "input_list", None),
    "reduce_scatter_tensor": ("reduce_scatter", "input", None),
    "reduce_scatter_single": ("reduce_scatter", "input", None),
    "all_to_all_single": ("all_to_all", "input", None),
    "all_to_all": ("all_to_all", "input_tensor_list", None),
    "gather": ("gather", "tensor", None),
    "scatter": ("scatter", "tensor", None),
    "barrier": ("barrier", None, None),
    "monitored_barrier": ("barrier", None, None),
    "send": ("send", "tensor", "dst"),
    "recv": ("recv", "tensor", "src"),
    "isend": ("send", "tensor", "dst"),
    "irecv": ("recv", "tensor", "src"),
}
ALWAYS_ASYNC = frozenset({"isend", "irecv"})
_INSIDE = threading.local()
"""`depth` 1 while a recorded call runs on this thread: a recorded function it calls is part of it."""
"""Functions that return a work object whatever their arguments (they take no `async_op`)."""


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


def tracing() -> bool:
    """Whether torch.compile's Dynamo is tracing the caller (`torch.compiler.is_compiling`, which Dynamo folds to
    True while tracing). A wrapper then calls torch's function and records nothing: recording would break the graph
    (Dynamo cannot trace the tracker's locks and clocks) and change the job's compiled program, and Dynamo maps
    ``dist.all_reduce`` and its kin to their functional forms only when it reaches torch's own functions
    (torch/_dynamo/variables/functions.py, ``traceable_collective_remaps``). The compiled graph's collectives run
    as ``torch.ops._c10d_functional`` ops no Python wrapper sees: the Flight Recorder's per-group count
    (`collector.flight`) is what tells the table they are missing."""
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def _wrap(tracker: CollectiveTracker, fn: Callable[..., Any], op: str, tensor_arg: str | None, peer_arg: str | None,
          *, always_async: bool = False) -> Callable[..., Any]:
    bind = _binder(fn, (tensor_arg or "", "group", peer_arg or "", "" if always_async else "async_op"))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # traced by torch.compile: the graph gets torch's own call, as without rankwatch (`tracing`)
        if tracing() or bool(getattr(_INSIDE, "depth", 0)):  # or called by another recorded call
            return fn(*args, **kwargs)
        try:
            tensor, group, peer, async_op = bind(args, kwargs)
            if not tensor_arg:
                tensor = None
            if not peer_arg:
                peer = None
            async_op = always_async or bool(async_op)
            o = tracker.enter(op, group, tensor, peer=peer, async_op=async_op)
        except Exception as exc:
            tracker._on_internal(f"instrument.{op}", exc)
            return fn(*args, **kwargs)
        _INSIDE.depth = 1
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            tracker.exit(o, exc)
            raise
        finally:
            _INSIDE.depth = 0
        if not async_op or result is None:
            tracker.exit(o)
            return result
        _leave_when_done(tracker, o, result)
        return result

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _leave_when_done(tracker: CollectiveTracker, o: Any, work: Any) -> None:
    """Leave `o` when `work` (an async call's work object) completes: its future's callback."""
    try:
        future = work.get_future()
    except Exception:  # a work object without a future (some backends): leave at the call
        tracker.exit(o)
        return

    def done(f: torch.futures.Future[Any]) -> None:
        try:
            f.value()
        except BaseException as exc:
            tracker.exit(o, exc)
            return
        tracker.exit(o)

    future.add_done_callback(done)


def _wrap_batch(tracker: CollectiveTracker, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`batch_isend_irecv(p2p_op_list)`: each P2POp recorded as the send or recv it is, with its peer, left when
    its own work completes (the batch returns one work per op, in order; NCCL may return one for the whole
    coalesced batch: then every op is left when it completes)."""

    @functools.wraps(fn)
    def wrapper(p2p_op_list: Any) -> Any:
        if tracing():
            return fn(p2p_op_list)
        opened: list[Any] = []
        try:
            for p in p2p_op_list:
                name = getattr(p.op, "__name__", "")
                op = "send" if name in ("isend", "send") else "recv"
                opened.append(tracker.enter(op, p.group, p.tensor, peer=p.peer, async_op=True))
        except Exception as exc:
            tracker._on_internal("instrument.batch_isend_irecv", exc)
            for o in opened:
                tracker.exit(o)
            return fn(p2p_op_list)
        try:
            works = fn(p2p_op_list)
        except BaseException as exc:
            for o in opened:
                tracker.exit(o, exc)
            raise
        works_list = list(works or [])
        for i, o in enumerate(opened):
            if not works_list:
                tracker.exit(o)
            else:
                _leave_when_done(tracker, o, works_list[min(i, len(works_list) - 1)])
        return works

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The torch.distributed function behind `fn` (itself when not instrumented): what rankwatch's own recorded
    calls (the DDP comm hook's all_reduce) use, so that no collective is recorded twice."""
    return getattr(fn, "__rankwatch_wrapped__", fn)


def instrument_distributed(collector: Any) -> Callable[[], None]:
    """Record every call of the functions in `INSTRUMENTED` (and `batch_isend_irecv`) through `collector`; returns a
    function that undoes it.

    Each function is replaced wherever torch.distributed's modules hold it: the ``torch.distributed`` namespace the
    job calls, distributed_c10d's own globals (so ``all_gather_object``'s two all-gathers are recorded as the two
    collectives they are), and the modules that imported it by name (DTensor's ``mesh_scatter`` and
    ``mesh_broadcast`` in torch/distributed/tensor/_collective_utils.py, which place a tensor when a module is
    parallelized). A module imported later that imports the name from distributed_c10d gets the wrapper."""
    tracker: CollectiveTracker = collector.tracker
    wrappers: dict[int, Callable[..., Any]] = {}
    for name, (op, tensor_arg, peer_arg) in INSTRUMENTED.items():
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "__rankwatch_wrapped__"):
            continue
        wrappers[id(fn)] = _wrap(tracker, fn, op, tensor_arg, peer_arg, always_async=name in ALWAYS_ASYNC)
    batch = getattr(dist, "batch_isend_irecv", None)
    if batch is not None and not hasattr(batch, "__rankwatch_wrapped__"):
        wrappers[id(batch)] = _wrap_batch(tracker, batch)
    patched: list[tuple[Any, str, Any]] = []
    modules = [m for n, m in list(sys.modules.items())
               if m is not None and (n == "torch.distributed" or n.startswith("torch.distributed."))]
    for module in modules:
        try:
            names = list(vars(module).items())
        except TypeError:
            continue
        for attr, value in names:
            wrapper = wrappers.get(id(value))
            if wrapper is not None and getattr(wrapper, "__rankwatch_wrapped__", None) is value:
                setattr(module, attr, wrapper)
                patched.append((module, attr, value))

    def undo() -> None:
        for module, attr, value in patched:
            setattr(module, attr, value)

    return undo
