"""The cluster a generated run lives on: layout, hosts, devices, process groups and the links they cross.

Rank order is the usual mesh (pp, dp, tp) with tp fastest: rank = (pp * dp + d) * tp + t. Ranks fill hosts of
`RANKS_PER_HOST` contiguously, so tensor-parallel groups stay inside a host and data-parallel and pipeline groups
cross hosts. Host names are ``gn<index>`` (zero padded so sorting them sorts the index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rankwatch.base.schema import GroupKind
from rankwatch.base.topology import link_name

RANKS_PER_HOST = 8


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    kind: GroupKind
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    """Host of each member, in `ranks` (= ring) order."""

    @property
    def links(self) -> tuple[str, ...]:
        """Inter-host links a ring over the members crosses, sorted and unique."""
        n = len(self.hosts)
        if n < 2:
            return ()
        pairs = {link_name(self.hosts[i], self.hosts[(i + 1) % n]) for i in range(n)}
        return tuple(sorted(p for p in pairs if p.split("<->")[0] != p.split("<->")[1]))


@dataclass(frozen=True, slots=True)
class World:
    """Layout and placement of one run; per-rank arrays are indexed by global rank."""

    dp: int
    tp: int
    pp: int
    seed: int
    n: int = field(init=False)
    hosts: tuple[str, ...] = field(init=False)
    host_index: np.ndarray = field(init=False)
    pp_of: np.ndarray = field(init=False)
    dp_of: np.ndarray = field(init=False)
    tp_of: np.ndarray = field(init=False)
    uuids: tuple[str, ...] = field(init=False)
    pci_ids: tuple[str, ...] = field(init=False)
    groups: tuple[Group, ...] = field(init=False)
    """world first, then every dp, tp, pp and model-parallel group (dp groups are also the consistency domains)."""
    dp_group: np.ndarray = field(init=False)
    tp_group: np.ndarray = field(init=False)
    pp_group: np.ndarray = field(init=False)
    mp_group: np.ndarray = field(init=False)
    """(N,) the rank's model-parallel group (every tp and pp rank of its replica; -1 when tp = pp = 1)."""

    def __post_init__(self) -> None:
        if self.tp > RANKS_PER_HOST or RANKS_PER_HOST % self.tp:
            raise ValueError(f"tp={self.tp} must divide the {RANKS_PER_HOST} ranks of a host")
        n = self.dp * self.tp * self.pp
        if n % RANKS_PER_HOST:
            raise ValueError(f"world size {n} is not a multiple of {RANKS_PER_HOST} ranks per host")
        set_ = object.__setattr__
        set_(self, "n", n)
        ranks = np.arange(n)
        set_(self, "host_index", ranks // RANKS_PER_HOST)
        width = max(3, len(str(n // RANKS_PER_HOST - 1)))
        set_(self, "hosts", tuple(f"gn{i:0{width}d}" for i in range(n // RANKS_PER_HOST)))
        set_(self, "tp_of", ranks % self.tp)
        set_(self, "dp_of", (ranks // self.tp) % self.dp)
        set_(self, "pp_of", ranks // (self.tp * self.dp))
        rng = np.random.default_rng([self.seed, 7411])
        raw = rng.integers(0, 2**62, size=(n, 2))
        set_(self, "uuids", tuple(
            f"GPU-{a & 0xFFFFFFFF:08x}-{(a >> 32) & 0xFFFF:04x}-{(a >> 48) & 0xFFF | 0x4000:04x}-"
            f"{b & 0x3FFF | 0x8000:04x}-{(b >> 14) & 0xFFFFFFFFFFFF:012x}"
            for a, b in raw.tolist()
        ))
        buses = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
        set_(self, "pci_ids", tuple(f"00000000:{buses[r % RANKS_PER_HOST]:02X}:00.0" for r in range(n)))
        self._build_groups()

    def _build_groups(self) -> None:
        host = [self.hosts[h] for h in self.host_index.tolist()]
        groups = [Group("world", GroupKind.WORLD, tuple(range(self.n)), tuple(host))]
        dp_g, tp_g, pp_g = (np.full(self.n, -1, dtype=np.int64) for _ in range(3))
        for p in range(self.pp):
            for t in range(self.tp):
                members = tuple(self.rank_of(p, d, t) for d in range(self.dp))
                dp_g[list(members)] = len(groups)
                groups.append(Group(f"dp.pp{p}.tp{t}", GroupKind.DP, members, tuple(host[m] for m in members)))
        for p in range(self.pp):
            for d in range(self.dp):
                members = tuple(self.rank_of(p, d, t) for t in range(self.tp))
                tp_g[list(members)] = len(groups)
                groups.append(Group(f"tp.pp{p}.dp{d}", GroupKind.TP, members, tuple(host[m] for m in members)))
        for d in range(self.dp):
            for t in range(self.tp):
                members = tuple(self.rank_of(p, d, t) for p in range(self.pp))
                pp_g[list(members)] = len(groups)
                groups.append(Group(f"pp.dp{d}.tp{t}", GroupKind.PP, members, tuple(host[m] for m in members)))
        mp_g = np.full(self.n, -1, dtype=np.int64)
        if self.tp * self.pp > 1:
            for d in range(self.dp):
                members = tuple(self.rank_of(p, d, t) for p in range(self.pp) for t in range(self.tp))
                mp_g[list(members)] = len(groups)
                groups.append(Group(f"mp.dp{d}", GroupKind.OTHER, members, tuple(host[m] for m in members)))
        set_ = object.__setattr__
        set_(self, "mp_group", mp_g)
        set_(self, "groups", tuple(groups))
        set_(self, "dp_group", dp_g)
        set_(self, "tp_group", tp_g)
        set_(self, "pp_group", pp_g)

    @property
    def layout(self) -> str:
        return f"dp={self.dp},tp={self.tp},pp={self.pp}"

    @property
    def n_hosts(self) -> int:
        return len(self.hosts)

    def rank_of(self, p: int, d: int, t: int) -> int:
        return (p * self.dp + d) * self.tp + t

    def host_of(self, rank: int) -> str:
        return self.hosts[rank // RANKS_PER_HOST]

    def ranks_of_host(self, host: int) -> list[int]:
        return list(range(host * RANKS_PER_HOST, (host + 1) * RANKS_PER_HOST))

    def inter_host_links(self) -> list[str]:
        """Links some transfer a link slowdown slows crosses (candidates for a slow link; see `link_traffic`)."""
        return sorted(self.link_traffic())

    def link_traffic(self) -> dict[str, frozenset[str]]:
        """Inter-host link -> the transfers a slowdown of it slows, as timeline.py models them: every data-parallel
        ring that crosses it, and every stage-to-stage send (stage k-1's rank to stage k's of the same replica and
        tp index) across it. A pipeline group's ring wrap (last stage to first) carries no send and so no signal."""
        out: dict[str, set[str]] = {}
        for g in self.groups[1:]:
            if g.kind is GroupKind.DP:
                for link in g.links:
                    out.setdefault(link, set()).add(g.name)
        step = self.dp * self.tp
        for r in range(step, self.n):
            a, b = self.host_of(r - step), self.host_of(r)
            if a != b:
                out.setdefault(link_name(a, b), set()).add(f"send {r - step}->{r}")
        return {k: frozenset(v) for k, v in out.items()}

    def indistinguishable_links(self, link: str) -> list[str]:
        """The links a slowdown of `link` cannot be told apart from by any transfer (those slowing exactly the same
        transfers), `link` among them: the most a link answer can name from this run's data."""
        traffic = self.link_traffic()
        return sorted(other for other, t in traffic.items() if t == traffic[link])

    def grid(self, a: np.ndarray) -> np.ndarray:
        """View a (..., n) array as (..., pp, dp, tp)."""
        return a.reshape(a.shape[:-1] + (self.pp, self.dp, self.tp))
