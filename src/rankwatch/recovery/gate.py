"""The consistency gate: before training (re)starts, the ranks prove that they hold what they must agree on.

Each rank states its `RankState` (committed step, data position, and the collector's XXH3 fingerprints of
model, optimizer and RNG states); one `all_gather_object` carries every state to every rank, and every rank
judges every `Domain` the same way, so all ranks reach the same decision and stop (or go on) together.

What is compared, per domain (the same fields the collector fingerprints per domain and analytics compares):

- the data-parallel group of a (pp, tp) coordinate (``dp.pp0.tp1``): all `Field`\\s. DP replicas of one shard
  hold the same model and optimizer; in the canary every rank seeds its RNGs identically and draws from them
  identically, and the loader's position counts samples consumed by the *job* (each replica reads its own slice
  of the same global batch), so RNG and data position agree too. A job whose replicas draw different random
  numbers by design (per-replica dropout seeds) would compare `ORIGIN_FIELDS` minus RNG for such a domain.
- ``world``: step and data position only; model and optimizer differ across pipeline stages and tensor
  shards by construction.

Failure semantics: a gather that raises (a missing member, a dead peer, the group's timeout) makes every domain
UNKNOWN on the ranks where it raised; the gate never raises a communication error itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from rankwatch.collector.fingerprint import hash_optimizer, hash_tensors, rng_hashes
from rankwatch.recovery.decision import GateVerdict

__all__ = ["ALL_FIELDS", "Domain", "Field", "GateOutcome", "GateVerdict", "RankState", "Split", "WORLD_FIELDS",
           "judge", "rank_state", "run_gate"]


class Field(StrEnum):
    STEP = "step"
    DATA_POSITION = "data_position"
    PARAM = "param"
    OPTIM = "optim"
    RNG_PYTHON = "rng_python"
    RNG_NUMPY = "rng_numpy"
    RNG_TORCH = "rng_torch"
    RNG_CUDA = "rng_cuda"


ALL_FIELDS: tuple[Field, ...] = tuple(Field)
"""Compared within a data-parallel domain (replicas of one shard)."""
WORLD_FIELDS: tuple[Field, ...] = (Field.STEP, Field.DATA_POSITION)
"""Compared across the whole job."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankState:
    """What one rank says it holds; the hashes are `collector.fingerprint`'s."""

    rank: int
    step: int
    """Last committed (loaded) step; -1 for a fresh start."""
    data_position: int
    """Samples the job has consumed (the loader's `position`)."""
    param: str
    optim: str
    rng_python: str
    rng_numpy: str
    rng_torch: str
    rng_cuda: str | None
    """None without CUDA (equal to None on every rank)."""

    def value(self, f: Field) -> str:
        return str(getattr(self, str(f)))


@dataclass(frozen=True, kw_only=True, slots=True)
class Domain:
    name: str
    """As the collector names the group (``world``, ``dp.pp0.tp1``)."""
    ranks: tuple[int, ...]
    """Members, in group order."""
    fields: tuple[Field, ...]
    """Fields its members must agree on."""

    def __post_init__(self) -> None:
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"gate domain {self.name}: ranks must be non-empty and distinct, got {list(self.ranks)}")
        if not self.fields:
            raise ValueError(f"gate domain {self.name}: no fields to compare")


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    """How one field divides a domain."""

    field: Field
    groups: tuple[tuple[str, tuple[int, ...]], ...]
    """(value, ranks) for each distinct value, largest group first (ties by lowest rank)."""
    majority: str | None
    """The value a strict majority holds; None when no value has more than half of the members."""

    @property
    def minority_ranks(self) -> tuple[int, ...]:
        """Ranks outside the strict majority (every rank when there is none)."""
        return tuple(sorted(r for v, rs in self.groups if v != self.majority for r in rs))

    def describe(self) -> str:
        if self.majority is not None:
            others = ", ".join(f"rank {list(rs)}={v[:12]}" for v, rs in self.groups if v != self.majority)
            return f"{self.field}: majority {self.majority[:12]}, minority {others}"
        return f"{self.field}: no majority, " + " | ".join(f"{list(rs)}={v[:12]}" for v, rs in self.groups)


@dataclass(frozen=True, kw_only=True, slots=True)
class GateOutcome:
    verdict: GateVerdict
    domain: str
    ranks: tuple[int, ...]
    """Members of the domain."""
    splits: tuple[Split, ...] = ()
    """DISAGREE: one per differing field, in `Field` order."""
    reason: str = ""
    """UNKNOWN: why (the gather's error, the members that sent nothing)."""

    @property
    def disagreeing_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for s in self.splits for r in s.minority_ranks}))

    @property
    def fields(self) -> tuple[Field, ...]:
        return tuple(s.field for s in self.splits)

    def message(self) -> str:
        """One line for an event or a log."""
        head = f"consistency gate {self.domain} {list(self.ranks)}: {self.verdict}"
        if self.verdict is GateVerdict.DISAGREE:
            return f"{head}: ranks {list(self.disagreeing_ranks)} differ in " + "; ".join(s.describe() for s in self.splits)
        if self.verdict is GateVerdict.UNKNOWN:
            return f"{head}: {self.reason}"
        return head


def rank_state(*, rank: int, step: int, data_position: int, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer | None) -> RankState:
    """This rank's state, hashed exactly as the collector's fingerprints are."""
    param, _ = hash_tensors(model.named_parameters())
    py, npy, cpu, cuda = rng_hashes()
    return RankState(rank=rank, step=step, data_position=data_position, param=param, optim=hash_optimizer(optimizer),
                     rng_python=py, rng_numpy=npy, rng_torch=cpu, rng_cuda=cuda)


def _split(f: Field, members: Sequence[RankState]) -> Split:
    by: dict[str, list[int]] = {}
    for s in members:
        by.setdefault(s.value(f), []).append(s.rank)
    groups = tuple(sorted(((v, tuple(sorted(rs))) for v, rs in by.items()), key=lambda g: (-len(g[1]), g[1][0])))
    counts = Counter({v: len(rs) for v, rs in groups})
    top, n = counts.most_common(1)[0]
    return Split(field=f, groups=groups, majority=top if 2 * n > len(members) else None)


def judge(domain: Domain, states: Sequence[RankState | None]) -> GateOutcome:
    """Judge one domain from the gathered states (indexed by rank; None = that rank sent nothing). Pure."""
    by_rank = {s.rank: s for s in states if s is not None}
    missing = [r for r in domain.ranks if r not in by_rank]
    if missing:
        return GateOutcome(verdict=GateVerdict.UNKNOWN, domain=domain.name, ranks=domain.ranks,
                           reason=f"no state from ranks {missing}")
    members = [by_rank[r] for r in domain.ranks]
    splits = tuple(sp for f in domain.fields if len((sp := _split(f, members)).groups) > 1)
    verdict = GateVerdict.DISAGREE if splits else GateVerdict.AGREE
    return GateOutcome(verdict=verdict, domain=domain.name, ranks=domain.ranks, splits=splits)


def run_gate(state: RankState, *, domains: Sequence[Domain], group: Any, world_size: int) -> tuple[GateOutcome, ...]:
    """Collective over `group` (every member calls it, with the same `domains`): gather every rank's state and
    judge each domain. Blocks at most the group's timeout; a failed gather makes every domain UNKNOWN."""
    gathered: list[Any] = [None] * world_size
    try:
        dist.all_gather_object(gathered, state, group=group)
    except Exception as exc:  # gloo raises RuntimeError / DistBackendError on a timeout or a dead peer
        text = str(exc).strip().splitlines()
        why = f"gather failed: {type(exc).__name__}: {text[0][:200] if text else ''}"
        return tuple(GateOutcome(verdict=GateVerdict.UNKNOWN, domain=d.name, ranks=d.ranks, reason=why)
                     for d in domains)
    return tuple(judge(d, gathered) for d in domains)
