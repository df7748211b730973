"""Attach rankwatch to a training script in a few lines, from what the launcher gives.

    from rankwatch import collector
    rw = collector.attach(mesh=mesh)          # after init_process_group / init_device_mesh
    for i, batch in enumerate(loader):
        with rw.step(i):
            ...                               # forward, backward, optimizer step

`attach` reads the rank, world size, local rank and restart count from the launcher's environment (torchrun:
RANK, WORLD_SIZE, LOCAL_RANK, TORCHELASTIC_RESTART_COUNT, set by torch/distributed/elastic/agent/server/api.py;
Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_RESTART_COUNT), the run directory from its argument or
``RANKWATCH_RUN_DIR``, and then, without further calls:

- records the topology: every rank's host gathered once over the default group, the process groups named and
  kinded — a DeviceMesh's dimensions by their names (``attach(mesh=...)``; dp/fsdp/shard/replicate are data
  parallel, tp tensor parallel, pp pipeline parallel), every other group torch knows by the description it was
  created with — and the rank's coordinates in the mesh;
- records every explicit torch.distributed collective (`instrument.instrument_distributed`) and every DDP model's
  gradient all-reduces (`ddp.hook_ddp`) and every functional collective, DTensor's (`funcol.instrument_funcol`);
- records an uncaught exception (``sys.excepthook``, ``threading.excepthook``) with its text, a SIGTERM and the
  exit, each chained to what the script had installed before.

With ``RANKWATCH_DISABLE=1`` in the environment it returns a `NullCollector` and touches nothing: the same script
runs without rankwatch (benchmarks/attach_cost.py's OFF arm).

The returned object is the `Collector`: phases, loaders and fingerprints stay optional. Attaching twice returns the
first collector. Bad configuration (no run directory, a launcher environment that is not numbers) raises ValueError
here, at set-up; once attached, nothing the collector does raises into training.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import torch.distributed as dist

from rankwatch.base.schema import GroupKind
from rankwatch.base.topology import GroupInfo, group_kind, group_name
from rankwatch.collector.collector import Collector, CollectorConfig
from rankwatch.collector.ddp import hook_ddp
from rankwatch.collector.funcol import instrument_funcol
from rankwatch.collector.instrument import instrument_distributed
from rankwatch.collector.launcher_env import RUN_DIR_ENV, disabled, launch_env, numbered
from rankwatch.collector.null import NullCollector

__all__ = ["attach", "detach"]

@dataclass(frozen=True, kw_only=True, slots=True)
class _Coords:
    dp: int = 0
    tp: int = 0
    pp: int = 0
    dp_size: int = 1
    tp_size: int = 1
    pp_size: int = 1


def _count_before_destroy(collector: Collector) -> Callable[[], None]:
    """Take torch's collective counts before `destroy_process_group` takes them away (`record_collective_counts`);
    returns the undo."""
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is dist.GroupMember.WORLD:
            collector.record_collective_counts()
        original(group)

    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group
    c10d.destroy_process_group = destroy_process_group

    def undo() -> None:
        dist.destroy_process_group = original
        c10d.destroy_process_group = original

    return undo


def _register_world(collector: Collector, world: GroupInfo) -> None:
    collector.register_group(None, world)
    if dist.is_initialized():
        collector.register_group(dist.GroupMember.WORLD, world)


def _hosts(world_size: int, host: str, collector: Collector) -> list[str]:
    """Every rank's host, gathered once over the default group (only this one when there is none)."""
    if world_size == 1 or not dist.is_initialized():
        return [host] * world_size
    hosts: list[Any] = [None] * world_size
    try:
        dist.all_gather_object(hosts, host)
    except Exception as exc:  # a broken group now fails the first collective of training just the same
        collector.warning(f"rankwatch.attach: hosts not gathered ({type(exc).__name__}: {exc}); peers' hosts unknown")
        return [host if r == collector.rank else "?" for r in range(world_size)]
    return [str(h) for h in hosts]


def _mesh_groups(mesh: Any, rank: int, hosts: list[str]) -> tuple[list[tuple[Any, GroupInfo]], _Coords]:
    """This rank's group along each named mesh dimension, named as the canary names its own (``tp.dp1``: the tensor-
    parallel group at data-parallel coordinate 1), and the rank's dp/tp/pp coordinates (several data-parallel
    dimensions, HSDP's replicate × shard, flatten to one)."""
    names = tuple(mesh.mesh_dim_names or (f"dim{d}" for d in range(mesh.ndim)))
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return [], _Coords()
    out: list[tuple[Any, GroupInfo]] = []
    sizes = {k: 1 for k in (GroupKind.DP, GroupKind.TP, GroupKind.PP)}
    index = {k: 0 for k in (GroupKind.DP, GroupKind.TP, GroupKind.PP)}
    for d, dim in enumerate(names):
        kind = group_kind(dim)
        group = mesh.get_group(d)
        if group is dist.GroupMember.WORLD:  # a 1-D mesh over every rank is the default group: keep it "world"
            sizes[kind], index[kind] = mesh.size(d), coord[d]
            continue
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
        fixed = ".".join(f"{names[o]}{coord[o]}" for o in range(len(names)) if o != d)
        name = f"{dim}.{fixed}" if fixed else dim
        out.append((group, GroupInfo(name=name, kind=kind, ranks=ranks,
                                     hosts=tuple(hosts[r] if r < len(hosts) else "?" for r in ranks))))
        if kind in sizes:
            index[kind] = index[kind] * mesh.size(d) + coord[d]
            sizes[kind] *= mesh.size(d)
    return out, _Coords(dp=index[GroupKind.DP], tp=index[GroupKind.TP], pp=index[GroupKind.PP],
                        dp_size=sizes[GroupKind.DP], tp_size=sizes[GroupKind.TP], pp_size=sizes[GroupKind.PP])


def _known_groups(rank: int, hosts: list[str], taken: set[int]) -> list[tuple[Any, GroupInfo]]:
    """The other process groups torch knows (torch.distributed.distributed_c10d's `_world` registry) that hold this
    rank: named by the description they were created with, else by their c10d group name — both the same on every
    member, since groups are created collectively in one order."""
    try:
        from torch.distributed.distributed_c10d import _world

        registry = dict(_world.pg_group_ranks)
        names = dict(_world.pg_names)
    except Exception:
        return []
    out = []
    for pg, members in registry.items():
        if id(pg) in taken or pg is dist.GroupMember.WORLD or rank not in members:
            continue
        ranks = tuple(sorted(int(r) for r in members))
        name = group_name(str(getattr(pg, "group_desc", "") or ""), str(names.get(pg, "?")), ranks)
        out.append((pg, GroupInfo(name=name, kind=group_kind(name), ranks=ranks,
                                  hosts=tuple(hosts[r] if r < len(hosts) else "?" for r in ranks))))
    return out


def _exit_status(status: object) -> int:
    """The process exit status of ``sys.exit(status)`` (Python's rule: None is 0, an int itself, anything else is
    printed and gives 1)."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


class _Hooks:
    """The exception hooks of one attached collector, chained to the ones installed before, and ``sys.exit``
    wrapped to note its status (atexit cannot see it)."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.exit_code = 0
        """The status of the last ``sys.exit`` called through the module (0 if none): what `_at_exit` records."""
        self.prev_sys = sys.excepthook
        self.prev_thread = threading.excepthook
        self.prev_exit = sys.exit
        sys.excepthook = self.on_exception
        threading.excepthook = self.on_thread_exception
        sys.exit = self.on_exit

    def on_exit(self, status: object = None) -> Any:
        if threading.current_thread() is threading.main_thread():
            self.exit_code = _exit_status(status)
        return self.prev_exit(status)  # type: ignore[arg-type]

    def on_exception(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            if not isinstance(exc, KeyboardInterrupt):
                self.collector.exception(exc)
            self.collector.close(exit_code=1)
        except Exception:  # the collector's own close never raises; belt and braces for the hook chain
            pass
        self.prev_sys(kind, exc, tb)

    def on_thread_exception(self, args: Any) -> None:
        try:
            if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
                self.collector.warning(f"uncaught in thread {getattr(args.thread, 'name', '?')}: "
                                       f"{type(args.exc_value).__name__}: {str(args.exc_value)[:500]}")
        except Exception:
            pass
        self.prev_thread(args)

    def undo(self) -> None:
        if sys.excepthook == self.on_exception:
            sys.excepthook = self.prev_sys
        if threading.excepthook == self.on_thread_exception:
            threading.excepthook = self.prev_thread
        if sys.exit == self.on_exit:
            sys.exit = self.prev_exit


@dataclass(slots=True)
class _Attached:
    collector: Collector
    hooks: _Hooks
    undo_instrument: Callable[[], None]


_ATTACHED: _Attached | None = None


def attach(run_dir: str | Path | None = None, *, mesh: Any = None, config: CollectorConfig | None = None,
           instrument: bool = True, backend: str | None = None,
           env: Mapping[str, str] | None = None) -> Collector | NullCollector:
    """Start recording this rank into `run_dir` (or ``$RANKWATCH_RUN_DIR``); returns the started `Collector`.

    Call it after the process group (and the DeviceMesh, passed as `mesh`) exist: the topology is recorded then.
    `config` overrides the collector's defaults (its `run_dir` is replaced by the one found here). `instrument`
    False leaves torch.distributed's functions unwrapped (a job that records its collectives itself). With
    ``RANKWATCH_DISABLE=1`` a `NullCollector`: nothing recorded, nothing patched."""
    global _ATTACHED
    if _ATTACHED is not None:
        return _ATTACHED.collector
    env = os.environ if env is None else env
    if disabled(env):
        me = launch_env(env)
        return NullCollector(rank=me.rank, world_size=me.world_size)
    where = run_dir if run_dir is not None else env.get(RUN_DIR_ENV)
    if not where:
        raise ValueError(f"rankwatch.attach: no run directory: pass attach(run_dir) or set {RUN_DIR_ENV}")
    me = numbered(launch_env(env), where)
    if dist.is_initialized() and dist.get_world_size() != me.world_size:
        raise ValueError(f"rankwatch.attach: the launcher says WORLD_SIZE {me.world_size} but the default process "
                         f"group has {dist.get_world_size()} ranks")
    cfg = replace(config if config is not None else CollectorConfig(run_dir=Path(where)), run_dir=Path(where),
                  count_collectives=instrument)
    host = socket.gethostname()
    collector = Collector(cfg, rank=me.rank, world_size=me.world_size, host=host, local_rank=me.local_rank,
                          attempt=me.attempt).start()
    # recording starts before attach's own collective (the hosts' all-gather): every collective issued is recorded
    undo = (_undo_all(instrument_distributed(collector), hook_ddp(collector), instrument_funcol(collector),
                      _count_before_destroy(collector))
            if instrument else (lambda: None))
    world = GroupInfo(name="world", kind=GroupKind.WORLD, ranks=tuple(range(me.world_size)),
                      hosts=("?",) * me.world_size)
    _register_world(collector, world)
    hosts = _hosts(me.world_size, host, collector)
    _register_world(collector, replace(world, hosts=tuple(hosts)))
    coords = _Coords()
    if dist.is_initialized():
        found: list[tuple[Any, GroupInfo]] = []
        if mesh is not None:
            found, coords = _mesh_groups(mesh, me.rank, hosts)
        found += _known_groups(me.rank, hosts, {id(g) for g, _ in found})
        for group, info in found:
            collector.register_group(group, info)
    elif me.world_size > 1:
        collector.warning("rankwatch.attach: called before init_process_group: no groups or peer hosts recorded")
    if backend is None:
        backend = str(dist.get_backend()) if dist.is_initialized() else "none"
    collector.record_topology(backend=backend, dp=coords.dp, tp=coords.tp, pp=coords.pp, dp_size=coords.dp_size,
                              tp_size=coords.tp_size, pp_size=coords.pp_size,
                              device_index=me.local_rank if backend == "nccl" else None)
    collector.flush()  # the topology row (with this rank's pid) is on disk before training starts
    _ATTACHED = _Attached(collector=collector, hooks=_Hooks(collector), undo_instrument=undo)
    atexit.register(_at_exit, collector)  # runs before the collector's own (atexit is last in, first out)
    return collector


def _at_exit(collector: Collector) -> None:
    """The interpreter is ending without an uncaught exception or a signal recorded (those closed the collector
    already): an exit with the status of the main thread's last ``sys.exit`` (0 without one). A ``raise
    SystemExit(n)`` that bypasses ``sys.exit`` reads as 0 here; `rankwatch torchrun`'s host agent records the true
    status in the rank's exit record."""
    attached = _ATTACHED
    code = attached.hooks.exit_code if attached is not None and attached.collector is collector else 0
    collector.close(exit_code=code)


def _undo_all(*undos: Callable[[], None]) -> Callable[[], None]:
    def undo() -> None:
        for u in undos:
            u()

    return undo


def detach(exit_code: int | None = 0) -> None:
    """Stop recording: close the collector with `exit_code`, restore the hooks and torch.distributed's functions.
    Nothing when not attached."""
    global _ATTACHED
    attached, _ATTACHED = _ATTACHED, None
    if attached is None:
        return
    atexit.unregister(_at_exit)
    attached.undo_instrument()
    attached.hooks.undo()
    attached.collector.close(exit_code=exit_code)
