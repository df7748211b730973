"""DDP's gradient all-reduces recorded without the job registering anything.

DDP reduces gradient buckets from its C++ reducer, not through torch.distributed's Python functions, so
`instrument_distributed` never sees them. While attached, every `DistributedDataParallel` built gets the collector's
comm hook (`CollectiveTracker.ddp_comm_hook`: DDP's own averaging all-reduce, timed per bucket) right after its
constructor. A job's own hook still works: DDP accepts one registration per model (the reducer raises
"register_comm_hook or register_builtin_comm_hook can only be called once": torch/csrc/distributed/c10d/reducer.cpp),
so `register_comm_hook` on a hooked model stores the job's hook and the collector's hook calls it in place of its own
all-reduce; the collectives the job's hook issues through torch.distributed are recorded by the instrumentation,
once. `_register_builtin_comm_hook` is mapped to the equivalent Python hook of
torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py (ALLREDUCE: the collector's own; FP16_COMPRESS:
`fp16_compress_hook`).

DDP also issues collectives from C++ inside calls its Python code makes: at construction
``dist._verify_params_across_processes`` (an all-gather and a broadcast) and ``dist._broadcast_coalesced`` (the
parameters from rank 0), each forward with buffers ``dist._broadcast_coalesced`` again, and at the first backward
``Reducer._rebuild_buckets`` (broadcasts of the bucket order): torch/nn/parallel/distributed.py and
torch/distributed/utils.py. Each of these calls is wrapped: the group's collective sequence number before and after
says how many collectives it issued. One (each forward's buffer broadcast) is the call itself, timed as a whole with
the bytes it was given. Several are each recorded under the name and with the enqueue time torch's Flight Recorder
gives it (`flight.entries`; from its enqueue to the next one's, the last to the call's end): a dump of the Flight
Recorder's whole buffer costs milliseconds (4.7 ms a call at 2,000 entries on this machine), so it is read only
for these set-up calls. Without the Flight Recorder the call is one operation of its nominal kind.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from rankwatch.collector import flight

__all__ = ["hook_ddp", "wrap_internal"]

_HOOKED = "_rankwatch_hooked"
_USER = "_rankwatch_user_hook"


def _hook(collector: Any, ddp: Any, register: Callable[..., None]) -> None:
    """Register the collector's hook on `ddp`, dispatching to the job's hook once it registers one."""
    ours = collector.ddp_comm_hook(ddp.process_group)

    def hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        user = getattr(ddp, _USER, None)
        if user is not None:
            return user[1](user[0], bucket)
        return ours(state, bucket)

    hook.__annotations__ = dict(ours.__annotations__)
    register(ddp, None, hook)
    setattr(ddp, _HOOKED, True)


def _seq(pg: Any) -> int:
    return int(pg._get_sequence_number_for_group())


def _tensor_bytes(args: tuple[Any, ...]) -> int:
    """Bytes of the tensors the call was given (its first list of tensors): a lone collective's payload."""
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            return sum(t.nbytes for t in a)
    return 0


def _record(collector: Any, pg: Any, op: str, t0: int, t1: int, seq0: int, seq1: int, nbytes: int = 0) -> None:
    """The collectives `pg` issued (sequence numbers seq0+1..seq1) between monotonic instants t0 and t1. One
    collective is the call itself (DDP's per-forward buffer broadcast: the common case, read without the Flight
    Recorder, whose JSON dump of its whole buffer costs milliseconds); several are named and split by the Flight
    Recorder's entries."""
    tracker = collector.tracker
    if seq1 <= seq0:
        return
    if seq1 == seq0 + 1:
        tracker.past(op, pg, nbytes, t0, t1)
        return
    found = flight.entries(str(pg.group_name), seq0 + 1, seq1)
    if len(found) != seq1 - seq0:  # the Flight Recorder is off (or overflowed): the call as one operation
        tracker.past(op, pg, 0, t0, t1)
        return
    offset = time.time_ns() - time.monotonic_ns()
    for i, e in enumerate(found):
        start = min(max(e.created_ns - offset, t0), t1)
        end = t1 if i + 1 == len(found) else min(max(found[i + 1].created_ns - offset, start), t1)
        tracker.past(e.op, pg, e.nbytes, start, end)


def wrap_internal(collector: Any, fn: Callable[..., Any], op: str,
                  group_of: Callable[[tuple[Any, ...]], Any]) -> Callable[..., Any]:
    """`fn` (a call that issues collectives from C++) recording each collective it issued on the group
    `group_of(args)` names (see the module docstring). Transparent: same arguments, result and exceptions."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            pg = group_of(args)
            if pg is None:
                pg = dist.distributed_c10d._get_default_group()
            seq0 = _seq(pg)
        except Exception:
            return fn(*args, **kwargs)
        t0 = time.monotonic_ns()
        collector.tracker.enter_call(op, pg)  # while blocked inside, the rank waits in `op` (liveness)
        try:
            result = fn(*args, **kwargs)
        finally:
            collector.tracker.exit_call()
        t1 = time.monotonic_ns()
        try:
            _record(collector, pg, op, t0, t1, seq0, _seq(pg), _tensor_bytes(args))
        except Exception as exc:
            collector.tracker._on_internal(f"ddp.{op}", exc)
        return result

    wrapper.__rankwatch_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def hook_ddp(collector: Any) -> Callable[[], None]:
    """Hook every DDP model constructed from now on (see the module docstring); returns the undo. An error while
    hooking is the collector's own (a warning): the model trains unhooked, its all-reduces unrecorded."""
    cls: Any = DistributedDataParallel
    if hasattr(cls.__init__, "__rankwatch_wrapped__") or not hasattr(cls, "_register_builtin_comm_hook"):
        return lambda: None
    original_init = cls.__init__
    original_register = cls.register_comm_hook
    original_builtin = cls._register_builtin_comm_hook

    reducers: dict[int, Any] = {}  # id(reducer) -> its DDP's process group

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            reducers[id(self.reducer)] = self.process_group
            _hook(collector, self, original_register)
        except Exception as exc:
            collector.warning(f"rankwatch: DDP gradient all-reduces not recorded: {type(exc).__name__}: {exc}")

    @functools.wraps(original_register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        if not getattr(self, _HOOKED, False):
            original_register(self, state, hook)
            return
        if getattr(self, _USER, None) is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        setattr(self, _USER, (state, hook))

    @functools.wraps(original_builtin)
    def register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        if not getattr(self, _HOOKED, False):
            original_builtin(self, comm_hook_type)
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        if name == "ALLREDUCE":
            return
        if name == "FP16_COMPRESS":
            register_comm_hook(self, self.process_group, default_hooks.fp16_compress_hook)
            return
        raise RuntimeError(f"rankwatch: builtin comm hook {name} has no Python equivalent here")

    init.__rankwatch_wrapped__ = original_init  # type: ignore[attr-defined]
    cls.__init__ = init
    cls.register_comm_hook = register_comm_hook
    cls._register_builtin_comm_hook = register_builtin_comm_hook
    internals: list[tuple[Any, str, Any]] = []
    for owner, name, op, group_of in (
        (dist, "_verify_params_across_processes", "all_gather", lambda a: a[0] if a else None),
        (dist, "_broadcast_coalesced", "broadcast", lambda a: a[0] if a else None),
        (torch._C._distributed_c10d.Reducer, "_rebuild_buckets", "broadcast",
         lambda a: reducers.get(id(a[0])) if a else None),
    ):
        fn = getattr(owner, name, None)
        if fn is None or hasattr(fn, "__rankwatch_wrapped__"):
            continue
        internals.append((owner, name, fn))
        setattr(owner, name, wrap_internal(collector, fn, op, group_of))

    def undo() -> None:
        cls.__init__ = original_init
        cls.register_comm_hook = original_register
        cls._register_builtin_comm_hook = original_builtin
        for owner, name, fn in internals:
            setattr(owner, name, fn)

    return undo

