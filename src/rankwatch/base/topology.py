"""Topology nouns: a dp × tp × pp layout over N ranks, (virtual) hosts, process groups and the links between hosts.

Torch-free, so the collector, the simulator, analytics and the canary all import down to it. Rank order follows the
usual mesh ["pp", "dp", "tp"] (tp fastest): rank = (pp * dp_size + dp) * tp_size + tp, and ranks fill hosts
contiguously, so tensor-parallel groups stay inside a host and pipeline groups cross hosts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rankwatch.base.schema import GroupKind

_LAYOUT_RE = re.compile(r"^(dp|tp|pp)=(\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout {name}={getattr(self, name)}: every degree must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, text: str, *, nproc: int | None = None, flag: str = "--nproc") -> Layout:
        """Parse ``dp=2,tp=2,pp=2``; missing degrees are 1, and with `nproc` a missing dp takes the rest. `flag`: how
        the caller's user gave the world size, for the error (``--nproc``, ``--ranks``, the world size)."""
        values: dict[str, int] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            m = _LAYOUT_RE.match(item)
            if not m or m.group(1) in values:
                raise ValueError(f"bad layout {text!r}: expected comma-separated dp=N,tp=N,pp=N (each at most once)")
            values[m.group(1)] = int(m.group(2))
            if values[m.group(1)] < 1:
                raise ValueError(f"bad layout {text!r}: {item}: every degree must be >= 1")
        if nproc is not None and "dp" not in values:
            rest = values.get("tp", 1) * values.get("pp", 1)
            if nproc % rest:
                raise ValueError(f"bad layout {text!r}: tp*pp={rest} does not divide {flag} {nproc}")
            values["dp"] = nproc // rest
        layout = cls(**values)
        if nproc is not None and layout.world_size != nproc:
            raise ValueError(
                f"bad layout {text!r}: dp*tp*pp={layout.world_size} but {flag} is {nproc}; the product must equal it"
            )
        return layout

    def __str__(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp}"

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, tp, pp) coordinates of a rank."""
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return dp, tp, pp

    def rank_of(self, *, dp: int, tp: int, pp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp


@dataclass(frozen=True, kw_only=True, slots=True)
class Hosts:
    """Virtual hosts: `count` labels over the world, ranks filling them contiguously."""

    count: int
    world_size: int

    def __post_init__(self) -> None:
        if self.count < 1 or self.world_size % self.count:
            raise ValueError(f"--hosts {self.count} must be >= 1 and divide the world size {self.world_size}")

    @property
    def per_host(self) -> int:
        return self.world_size // self.count

    @property
    def names(self) -> list[str]:
        return [f"host{i}" for i in range(self.count)]

    def host_of(self, rank: int) -> str:
        return f"host{rank // self.per_host}"

    def local_rank(self, rank: int) -> int:
        return rank % self.per_host


def group_specs(layout: Layout) -> list[tuple[GroupKind, str, list[int]]]:
    """Every dp, tp and pp group of the layout as (kind, name, ranks), in the order all ranks create them.

    A group varies one coordinate and is named after the fixed others: ``dp.pp0.tp1`` holds the data-parallel
    replicas of stage 0, tensor shard 1."""
    specs: list[tuple[GroupKind, str, list[int]]] = []
    sizes = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}
    for kind, varying, fixed in ((GroupKind.DP, "dp", ("pp", "tp")), (GroupKind.TP, "tp", ("pp", "dp")),
                                 (GroupKind.PP, "pp", ("dp", "tp"))):
        for a in range(sizes[fixed[0]]):
            for b in range(sizes[fixed[1]]):
                at = {fixed[0]: a, fixed[1]: b}
                ranks = [layout.rank_of(**{**at, varying: v}) for v in range(sizes[varying])]
                specs.append((kind, f"{varying}.{fixed[0]}{a}.{fixed[1]}{b}", ranks))
    return specs


_DP_NAMES = ("dp", "ddp", "fsdp", "hsdp", "data", "shard", "replicate", "dp_shard", "dp_replicate", "dp_cp")
_TP_NAMES = ("tp", "tensor", "sp", "ep")
_PP_NAMES = ("pp", "pipe", "pipeline")


def group_kind(dim_name: str) -> GroupKind:
    """The kind of a mesh dimension (or group description) from its name: "dp_shard" is data parallel, "tp" tensor
    parallel, "pp" pipeline parallel; anything else (a context-parallel "cp", a name of the job's own) is OTHER."""
    name = dim_name.lower().removeprefix("mesh_")
    if name in _PP_NAMES:
        return GroupKind.PP
    if name in _TP_NAMES:
        return GroupKind.TP
    if name in _DP_NAMES or name.startswith("dp"):
        return GroupKind.DP
    return GroupKind.OTHER


def group_name(desc: str, c10d_name: str, ranks: tuple[int, ...]) -> str:
    """A process group's name in telemetry when the job did not name it: the description it was created with and
    its first member (DeviceMesh names every tensor-parallel group "mesh_tp": "mesh_tp.r2" is the one starting at
    rank 2), else its c10d group name ("pg3"). The same on every member, since groups are created collectively in one
    order (torch/distributed/distributed_c10d.py `_process_group_name`)."""
    if desc and desc not in ("undefined", "default_pg"):
        return f"{desc}.r{min(ranks)}" if ranks else desc
    return f"pg{c10d_name}"


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupInfo:
    """A process group as telemetry names it."""

    name: str
    kind: GroupKind
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    """Host of each member, in `ranks` order."""

    @property
    def links(self) -> tuple[str, ...]:
        """Inter-host links a ring over the members crosses, sorted and unique."""
        n = len(self.hosts)
        if n < 2:
            return ()
        pairs = {link_name(self.hosts[i], self.hosts[(i + 1) % n]) for i in range(n)}
        return tuple(sorted(p for p in pairs if p.split("<->")[0] != p.split("<->")[1]))


def link_name(host_a: str, host_b: str) -> str:
    """Canonical name of the inter-host link between two hosts (order-independent)."""
    a, b = sorted((host_a, host_b))
    return f"{a}<->{b}"
