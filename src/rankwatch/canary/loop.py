"""The canary job: one rank's training loop on real torch.distributed, with the collector embedded.

Data parallelism goes through DDP (gradient buckets timed by the collector's comm hook, which also measures
the pre-all-reduce gradient norm); tensor parallelism is explicit all-reduces on the tp group; pipeline
parallelism is explicit send/recv between neighbouring stages, microbatch by microbatch. Faults come from
`Faults` and are applied where a real fault would show.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rankwatch.base.rundir import RunDir
from rankwatch.base.schema import EventKind
from rankwatch.base.topology import GroupInfo, Hosts
from rankwatch.canary.config import CanaryConfig, slot_of
from rankwatch.canary.faults import DEVICE_ERROR_TEXT, FlipTarget
from rankwatch.canary.model import ShardedLoader, Stage, SyntheticRegression
from rankwatch.canary.parallel import build_groups
from rankwatch.collector.collector import Collector, CollectorConfig
from rankwatch.collector.gpu import ReplaySampler, open_sampler
from rankwatch.collector.null import NullCollector
from rankwatch.recovery.checkpointer import Checkpointer, RngScope

log = logging.getLogger("rankwatch.canary")

GPU_SLOW_CPU_WARNING = "gpu_slow on CPU: extra CPU work instead of device work"
"""How the warning event (and log line) of a rank that applies `gpu_slow` without a CUDA device begins, once per
process; the calibration follows in parentheses."""


class ExtraCompute:
    """The extra work of the `gpu_slow` fault: square matrix products that make the rank's step compute `factor`
    times as long.

    `calibrate` measures, once at setup and on the rank's own device, the rank's own step compute (`own_s`: a step
    of a throwaway copy of its model) and one product of a size picked so that about `SLICES` of them make `own_s`
    (`matmul_s`). `run(factor)` then issues (factor - 1) * own_s / matmul_s products, carrying the fraction to the
    next call so the mean is exact. On CUDA they are enqueued on the current (compute) stream and `run` returns at
    once — no host sleep, no synchronization: the device, not the host thread, is slow. On CPU they run on the
    calling thread (the fallback the canary announces with `GPU_SLOW_CPU_WARNING`)."""

    SLICES = 16
    """Products per `own_s` the size is picked for: the grain of a factor is 1 / SLICES of the own compute."""
    MIN_MATMUL_S = {"cuda": 50e-6, "cpu": 0.0}
    """Shortest product per device type: on CUDA a kernel must outlast its launch (a few µs), or the host, not the
    device, would pay for the extra work."""
    SIZES = (16, 8192)
    """Bounds of the matrix size (fp32; 8192 holds 768 MiB in the three matrices)."""

    def __init__(self, device: torch.device, *, own_s: float, size: int, matmul_s: float) -> None:
        if own_s <= 0 or matmul_s <= 0:
            raise ValueError(f"ExtraCompute: own_s and matmul_s must be > 0, got {own_s}, {matmul_s}")
        self.device = device
        self.own_s = own_s
        """Seconds of the rank's own step compute, as measured."""
        self.size = size
        """Rows (and columns) of the square matrices multiplied."""
        self.matmul_s = matmul_s
        """Seconds of one product, as measured."""
        gen = torch.Generator(device=device).manual_seed(0)  # a generator of its own: the job's RNG stays untouched
        self._a = torch.randn((size, size), generator=gen, device=device) / size**0.5
        self._b = torch.randn((size, size), generator=gen, device=device) / size**0.5
        self._out = torch.empty((size, size), device=device)
        self._carry = 0.0

    @classmethod
    def calibrate(cls, device: torch.device, own_step: Callable[[], object], *, repeats: int = 7) -> ExtraCompute:
        """Time `own_step` (one step of the rank's own compute) and size the products after it."""
        own_s = _fastest_s(own_step, device, repeats)
        target = max(own_s / cls.SLICES, cls.MIN_MATMUL_S.get(device.type, 0.0))
        size = 256 if device.type == "cpu" else 2048
        for attempt in range(4):
            probe = cls(device, own_s=own_s, size=size, matmul_s=1.0)
            matmul_s = _fastest_s(lambda: probe._products(8), device, repeats) / 8
            scaled = size * (target / matmul_s) ** (1 / 3)  # a product's work grows with the cube of its size
            nxt = min(max(cls.SIZES[0], 16 * round(scaled / 16)), cls.SIZES[1])
            if nxt == size or 0.7 < target / matmul_s < 1.4 or attempt == 3:
                break
            size = nxt
        return cls(device, own_s=own_s, size=size, matmul_s=matmul_s)

    def products_for(self, factor: float) -> float:
        """Products that add (factor - 1) times the own compute."""
        return max(0.0, factor - 1.0) * self.own_s / self.matmul_s

    def run(self, factor: float) -> int:
        """Issue the products of one step at `factor`; returns how many."""
        if factor <= 1.0:
            return 0
        wanted = self.products_for(factor) + self._carry
        n = int(wanted)
        self._carry = wanted - n
        self._products(n)
        return n

    def _products(self, n: int) -> None:
        a, b, out = self._a, self._b, self._out
        for _ in range(n):
            torch.mm(a, b, out=out)


def _fastest_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of `fn` after one warm-up call (the fastest: preemption only ever
    adds time). On CUDA wall time, synchronized around each call (setup only); on CPU with one intra-op thread the
    calling thread's CPU time, which is the work itself and leaves out other processes' share of a loaded host."""
    cuda = device.type == "cuda"
    clock = time.thread_time if not cuda and torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times: list[float] = []
    for _ in range(max(1, repeats)):
        if cuda:
            torch.cuda.synchronize(device)
        start = clock()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(clock() - start)
    return max(min(times), 1e-9)


def _freeze(seconds: float) -> None:
    """Stop this whole process for `seconds` (SIGSTOP), continued by a helper process started first (SIGCONT): what
    an operator's `kill -STOP`/`-CONT`, or a host that froze the process, does."""
    pid = os.getpid()
    subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep({seconds!r}); "
                      f"os.kill({pid}, signal.SIGCONT)"], start_new_session=True)
    os.kill(pid, signal.SIGSTOP)


def _flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    flat = t.data.view(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    view = flat.view(ints)
    i = index % view.numel()
    b = bit % (8 * flat.element_size())
    mask = torch.iinfo(ints).min if b == 8 * flat.element_size() - 1 else 1 << b  # the sign bit is iinfo.min
    view[i] ^= mask


class _Rank:
    """Everything one rank holds while it trains."""

    def __init__(self, cfg: CanaryConfig, rank: int, store_port: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.layout = cfg.layout
        self.hosts = Hosts(count=cfg.hosts, world_size=cfg.world_size)
        self.host = self.hosts.host_of(rank)
        self.local_rank = self.hosts.local_rank(rank)
        self.slot = slot_of(cfg, rank)
        """This rank's device slot on its host (its GPU index)."""
        self.dp, self.tp, self.pp = self.layout.coords(rank)
        self.cuda = torch.cuda.is_available() and cfg.backend != "gloo"
        self.backend = cfg.backend or ("nccl" if self.cuda else "gloo")
        self.device = torch.device(f"cuda:{self.slot % max(1, torch.cuda.device_count())}") if self.cuda else torch.device("cpu")
        self.store_port = store_port
        self.faults = cfg.faults.placed(rank=rank, host=rank // self.hosts.per_host, slot=self.slot)

    # -- setup ----------------------------------------------------------------------------------------
    def setup(self) -> None:
        torch.set_num_threads(self.cfg.threads)
        torch.use_deterministic_algorithms(self.cfg.deterministic_algorithms)
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        torch.manual_seed(self.cfg.seed)
        if self.cuda:
            torch.cuda.set_device(self.device)
        sampler = None
        if self.cfg.collector:
            sampler = open_sampler(self.cfg.gpu, host=self.host, indices=[self.slot], seed=self.cfg.seed)
            self.c: Any = Collector(
                CollectorConfig(
                    run_dir=self.cfg.run_dir,
                    flush_interval_s=self.cfg.flush_interval_s,
                    heartbeat_interval_s=self.cfg.heartbeat_interval_s,
                    gpu_interval_s=self.cfg.gpu_interval_s,
                    fingerprint_every=self.cfg.fingerprint_every,
                    grad_norm=self.cfg.grad_norm,
                ),
                rank=self.rank,
                world_size=self.cfg.world_size,
                host=self.host,
                local_rank=self.local_rank,
                attempt=self.cfg.attempt,
                gpu_sampler=sampler,
            ).start()
        else:
            self.c = NullCollector(rank=self.rank, world_size=self.cfg.world_size)
        self.replay = sampler if isinstance(sampler, ReplaySampler) else None
        store = dist.TCPStore("127.0.0.1", self.store_port, self.cfg.world_size, is_master=False,
                              timeout=timedelta(seconds=max(30.0, self.cfg.pg_timeout_s)))
        dist.init_process_group(
            self.backend, store=store, rank=self.rank, world_size=self.cfg.world_size,
            timeout=timedelta(seconds=self.cfg.pg_timeout_s),
        )
        self.groups, mine = build_groups(
            self.layout, self.hosts, self.rank, timeout=timedelta(seconds=self.cfg.pg_timeout_s)
        )
        for group, info in mine:
            self.c.register_group(group, info)
        self.c.record_topology(
            backend=self.backend, dp=self.dp, tp=self.tp, pp=self.pp,
            dp_size=self.layout.dp, tp_size=self.layout.tp, pp_size=self.layout.pp,
            device_index=self.device.index if self.cuda else None,
        )
        self.c.flush()  # the topology row (with this rank's pid) is on disk before training starts

        self.stage = Stage(self.cfg.model, seed=self.cfg.seed, pp=self.pp, pp_size=self.layout.pp,
                           tp=self.tp, tp_size=self.layout.tp).to(self.device)
        self.extra = self._calibrate_extra() if self.faults.slows_device(self.rank) else None
        self.stage.set_all_reduce(self._tp_all_reduce)
        self.ddp = DDP(self.stage, process_group=self.groups.dp)
        # the link-fault delay runs inside the timed bucket all-reduce; without faults there is nothing to call
        link_delay = self._link_delay if self.faults else None
        self.ddp.register_comm_hook(None, self.c.ddp_comm_hook(self.groups.dp, before=link_delay))
        self.optimizer = torch.optim.AdamW(self.stage.parameters(), lr=self.cfg.lr)
        self.loader = ShardedLoader(SyntheticRegression(self.cfg.model, seed=self.cfg.seed),
                                    global_batch=self.cfg.global_batch, dp=self.dp, dp_size=self.layout.dp)
        self.batches = self.c.wrap_loader(self.loader, position=lambda: self.loader.position)
        self.step = -1
        self.start_step = 0
        if self.cfg.replay_basis is not None and self.rank == 0:
            self.c.event(EventKind.REPLAY_BASIS, step=self.cfg.replay_basis,
                         message=f"earlier attempts are a replay reference before step {self.cfg.replay_basis} only")
        self.ckpt = self._checkpointer()
        if self.cfg.resume:
            self.start_step = self.ckpt.resume(self.cfg.resume_from)
            if self.faults and (nudge := self.faults.nudge_after_load()) is not None:
                self._nudge(nudge.param, nudge.index)

    def _calibrate_extra(self) -> ExtraCompute:
        """The `gpu_slow` work, sized after one step of a throwaway copy of this rank's stage (its tensor-parallel
        all-reduces still no-ops, no DDP, inputs from a generator of its own): the job's state and RNG stay as
        they are, so a gpu_slow run trains bitwise like a clean one."""
        cfg = self.cfg
        stage = copy.deepcopy(self.stage)
        optimizer = torch.optim.AdamW(stage.parameters(), lr=cfg.lr)
        mb = cfg.global_batch // self.layout.dp // cfg.microbatches
        width = cfg.model.d_in if stage.first else cfg.model.d_model
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed)
        inputs = [torch.randn((mb, width), generator=gen, device=self.device) for _ in range(cfg.microbatches)]

        def own_step() -> None:
            for x in inputs:
                out = stage(x)
                out.backward(torch.ones_like(out) / out.numel())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        extra = ExtraCompute.calibrate(self.device, own_step)
        calibration = (f"calibrated: own step {extra.own_s * 1e3:.2f} ms, {extra.products_for(2.0):.1f} products of "
                       f"{extra.size}x{extra.size} per unit of factor")
        if self.cuda:
            log.info("rank %d: gpu_slow %s", self.rank, calibration)
        else:
            log.warning("rank %d: %s (%s)", self.rank, GPU_SLOW_CPU_WARNING, calibration)
            self.c.warning(f"{GPU_SLOW_CPU_WARNING} ({calibration})")
        return extra

    # -- communication (timed, with link faults inside the timed region) ------------------------------
    def _link_delay(self, info: GroupInfo) -> None:
        if self.faults:
            delay = self.faults.link_delay_s(info.links, self.step, self.hosts.names)
            if delay > 0:
                time.sleep(delay)

    def _timed(self, op: str, group: Any, info: GroupInfo, tensor: torch.Tensor, call: Callable[[], Any],
               peer: int | None = None) -> None:
        with self.c.collective(op, group, tensor, peer=peer):
            self._link_delay(info)
            call()

    def _tp_all_reduce(self, t: torch.Tensor) -> None:
        g = self.groups.tp
        self._timed("all_reduce", g, self.groups.tp_info, t, lambda: dist.all_reduce(t, group=g))

    def _send(self, t: torch.Tensor, peer: int) -> None:
        g = self.groups.pp
        self._timed("send", g, self.groups.pp_info, t, lambda: dist.send(t, dst=peer, group=g), peer=peer)

    def _recv(self, t: torch.Tensor, peer: int) -> None:
        g = self.groups.pp
        self._timed("recv", g, self.groups.pp_info, t, lambda: dist.recv(t, src=peer, group=g), peer=peer)

    # -- faults at step boundaries --------------------------------------------------------------------
    def _step_start_faults(self, step: int) -> None:
        f = self.faults
        if not f:
            return
        if (ex := f.exit_at(self.rank, step)) is not None:
            os._exit(ex.code)
        if (kill := f.kill_at(self.rank, step)) is not None:
            os.kill(os.getpid(), kill.signal)
            time.sleep(60)
        if f.hang_at(self.rank, step):
            threading.Event().wait()  # the training thread never returns; heartbeats go on
        if f.device_error_at(self.rank, step):  # recorded as the rank's exception (run_rank), then the process exits
            raise RuntimeError(f"{DEVICE_ERROR_TEXT} (device slot {self.slot} of {self.host})")
        if f.skews_rng(self.rank, step):
            torch.rand(1)
        if (offset := f.data_offset(self.rank, step)):
            self.loader.skip(offset)
        if self.replay is not None:
            reason = f.throttle_reason(self.rank, step)
            if reason is not None:
                self.replay.throttle(self.slot, reason=reason)
            else:
                self.replay.clear_throttle(self.slot)

    # -- one step -------------------------------------------------------------------------------------
    def train_step(self, step: int) -> float | None:
        self.step = step
        cfg, layout = self.cfg, self.layout
        first, last = self.pp == 0, self.pp == layout.pp - 1
        prev_peer = layout.rank_of(dp=self.dp, tp=self.tp, pp=self.pp - 1) if not first else None
        next_peer = layout.rank_of(dp=self.dp, tp=self.tp, pp=self.pp + 1) if not last else None
        mb = self.loader.local_batch // cfg.microbatches
        d_model = cfg.model.d_model
        flips = self.faults.bitflips(self.rank, step, FlipTarget.GRAD) if self.faults else []
        handles = [self._grad_flip_hook(f.param, f.index, f.bit) for f in flips]
        with self.c.step(step) as rec:
            with self.c.phase("data"):
                x, y = next(self.batches)
                x, y = x.to(self.device), y.to(self.device)
            delay = (self.faults.compute_delay_s(self.rank, step) if self.faults else 0.0) + cfg.pace_s
            factor = self.faults.device_factor(self.rank, step) if self.extra is not None else 1.0
            frozen = self.faults.freeze_s(self.rank, step) if self.faults else 0.0
            losses: list[torch.Tensor] = []
            for m in range(cfg.microbatches):
                xm, ym = x[m * mb : (m + 1) * mb], y[m * mb : (m + 1) * mb]
                sync = m == cfg.microbatches - 1
                with (nullcontext() if sync else self.ddp.no_sync()):
                    with self.c.phase("forward"):
                        if delay and m == 0:
                            time.sleep(delay)  # a slow device: more time in the rank's own compute
                        if frozen and m == 0:
                            _freeze(frozen)
                        if factor > 1.0 and m == 0:
                            self.extra.run(factor)  # type: ignore[union-attr]  # on CUDA: enqueued, no wait
                        if first:
                            inp = xm
                        else:
                            inp = torch.empty(mb, d_model, device=self.device)
                            self._recv(inp, prev_peer)  # type: ignore[arg-type]
                            inp.requires_grad_(True)
                        out = self.ddp(inp)
                        if not last:
                            self._send(out.detach().contiguous(), next_peer)  # type: ignore[arg-type]
                    with self.c.phase("backward"):
                        if last:
                            loss = torch.nn.functional.mse_loss(out, ym) / cfg.microbatches
                            loss.backward()
                            losses.append(loss.detach())
                        else:
                            grad = torch.empty_like(out)
                            self._recv(grad, next_peer)  # type: ignore[arg-type]
                            out.backward(grad)
                        if not first:
                            self._send(inp.grad.contiguous(), prev_peer)  # type: ignore[arg-type]
            with self.c.phase("optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if self.faults:
                for f in self.faults.bitflips(self.rank, step, FlipTarget.PARAM):
                    with torch.no_grad():
                        _flip_bit(list(self.stage.parameters())[f.param % len(list(self.stage.parameters()))], f.index, f.bit)
            loss_value = float(sum(losses)) if losses else None
            rec.loss = loss_value
            rec.data_position = self.loader.position
            # a save inside the step: its stall shows as a slow step, attributed; a save that fails (ENOSPC, ...)
            # commits nothing on any rank, is recorded, and training goes on
            self.ckpt.after_step(step)
        for h in handles:
            h.remove()
        return loss_value

    def _nudge(self, param_index: int, index: int) -> None:
        params = list(self.stage.parameters())
        with torch.no_grad():
            flat = params[param_index % len(params)].data.view(-1)
            i = index % flat.numel()
            flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf"), dtype=flat.dtype))

    def _grad_flip_hook(self, param_index: int, index: int, bit: int) -> Any:
        params = list(self.stage.parameters())
        p = params[param_index % len(params)]
        fired = [False]

        def flip(grad: torch.Tensor) -> torch.Tensor:
            if fired[0]:
                return grad
            fired[0] = True
            grad = grad.clone()
            _flip_bit(grad, index, bit)
            return grad

        return p.register_hook(flip)

    def _fingerprint_due(self, step: int) -> bool:
        """Beyond every `fingerprint_every` steps: the last step, and the first step after every checkpoint (the
        first step a resume from it trains), so every replay can be compared with the attempt it replays."""
        every = self.cfg.checkpoint_every
        return (step == self.cfg.steps - 1 or (self.cfg.resume and step == self.start_step)
                or (every > 0 and step > 0 and step % every == 0))

    def fingerprint(self, step: int, *, force: bool = False) -> None:
        self.c.maybe_fingerprint(
            step, self.stage, self.optimizer, domain=self.groups.dp_info.name,
            domain_ranks=self.groups.dp_info.ranks, data_position=self.loader.position, force=force,
        )

    def _checkpointer(self) -> Checkpointer:
        """The recovery contract as any job uses it (`recovery.Checkpointer`): the canary splits its model by hand,
        so its layout is given and each (tp, pp) shard is its own DCP key; every rank seeds every RNG stream alike,
        and Python's and numpy's stay alike, but building a stage draws torch numbers by its layers (`nn.Linear`'s
        own init, overwritten), so torch's streams are alike within each shard's replicas; the data position is the job's global sample count (`ShardedLoader.state_dict`), which every rank
        must agree on and any dp degree re-slices. The config hashed into each manifest is what changes the
        numerics, without the layout (a dp change is recorded as one, not as another config)."""
        cfg = self.cfg
        numerics = {"model": cfg.model, "seed": cfg.seed, "global_batch": cfg.global_batch,
                    "microbatches": cfg.microbatches, "lr": cfg.lr, "threads": cfg.threads}
        return Checkpointer(self.c, self.ddp, self.optimizer, lr_scheduler=None, grad_scaler=None, data=self.loader,
                            rng={"python": RngScope.REPLICATED, "numpy": RngScope.REPLICATED,
                                 "torch": RngScope.REPLICAS, "cuda": RngScope.REPLICAS},
                            every=cfg.checkpoint_every, layout=self.layout,
                            config=numerics, seed=cfg.seed, run_dir=cfg.run_dir, group=self.groups.world,
                            global_batch=cfg.global_batch, position=lambda: self.loader.position,
                            attempt=cfg.attempt, pin_buckets=cfg.pin_ddp_buckets)

    def run(self) -> None:
        ends: list[int] = []
        thread_cpu: list[int] = []
        process_cpu: list[int] = []
        for step in range(self.start_step, self.cfg.steps):
            self._step_start_faults(step)
            self.train_step(step)
            self.fingerprint(step, force=self._fingerprint_due(step))
            if self.cfg.record_step_times:  # three clock reads a step, only for benchmarks that ask
                ends.append(time.perf_counter_ns())
                thread_cpu.append(time.thread_time_ns())
                process_cpu.append(time.process_time_ns())
        if self.cfg.record_step_times:
            out = RunDir(Path(self.cfg.run_dir)).step_times
            out.mkdir(parents=True, exist_ok=True)
            doc = {"rank": self.rank, "step_end_ns": ends, "thread_cpu_ns": thread_cpu, "process_cpu_ns": process_cpu}
            (out / f"rank-{self.rank}.json").write_text(json.dumps(doc))


def run_rank(index: int, cfg: CanaryConfig, store_port: int) -> None:
    """Entry point of one spawned rank (`torch.multiprocessing.start_processes`)."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {index}] %(levelname)s %(name)s: %(message)s")
    r = _Rank(cfg, index, store_port)
    try:
        r.setup()
        r.run()
    except BaseException as exc:  # record, then die without tearing down a broken process group
        c = getattr(r, "c", None)
        if c is not None:
            c.exception(exc)
            c.close(exit_code=1)
        print(f"rank {index}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
        os._exit(1)
    r.c.close(exit_code=0)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # gloo keeps background threads; leave without waiting on them
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os._exit(0)
