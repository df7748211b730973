"""Localization of recurring faults across the runs and restarts of a job: does a fault follow the device, the rank
number, the host or an inter-host link?

The caller gives one `RunObservation` per run or attempt: the incidents found in it and the topology at the time
(rank -> device UUID and host; process groups with the inter-host links they cross). For each fault family (the
incidents of one class) `localize` counts, per device, rank number, host and link, in how many observations it was
implicated and in how many it was present, and reads the verdict off the mapping changes:

- DEVICE: one GPU UUID implicated in >= 2 observations under >= 2 different rank numbers (ranks were reshuffled,
  the fault stayed with the hardware).
- RANK: one rank number implicated in >= 2 observations on >= 2 different devices: the fault follows the rank's data
  shard or code path; quarantining hardware will not help.
- HOST: one host implicated in >= 2 observations through different devices and rank numbers, or host-subject
  incidents (a host's input pipeline) repeating.
- LINK: link-subject incidents repeating, or ranks implicated in different observations on different devices and
  hosts whose (non-world) process groups all cross one inter-host link, and only that one.
- INCONCLUSIVE: seen in one observation only; or the implicated device and rank kept the same mapping every time,
  so device and rank cannot be told apart (reshuffle ranks to tell); or nothing recurs.

Which incidents implicate what: a RANK, DEVICE or REPLICA subject implicates its ranks (and through the topology
their devices and hosts); a HOST subject its host; a LINK subject its link. STAGE, DOMAIN and JOB subjects blame
no one and are not localized. When several verdicts fit, the more specific wins (device over host, host over link
when both recur as often); a device and a rank that both qualify are told apart by the share of observations they
were present in that implicated them, and a tie is INCONCLUSIVE.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import polars as pl

from rankwatch.analytics.incidents import Incident, IncidentClass, SubjectKind
from rankwatch.base.schema import GroupField, GroupKind, Topology


class FollowsKind(StrEnum):
    DEVICE = "device"
    RANK = "rank"
    HOST = "host"
    LINK = "link"
    INCONCLUSIVE = "inconclusive"


class QuarantineKind(StrEnum):
    DEVICE = "device"
    HOST = "host"
    LINK = "link"
    NONE = "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunObservation:
    """One run or attempt: its incidents and its topology and groups frames (as in analytics/frames.py)."""

    run: str
    attempt: int
    incidents: tuple[Incident, ...]
    topology: pl.DataFrame
    groups: pl.DataFrame


@dataclass(frozen=True, kw_only=True, slots=True)
class Occurrences:
    """`implicated` of the `present` observations that had this device, rank, host or link implicated it."""

    id: str
    implicated: int
    present: int


@dataclass(frozen=True, kw_only=True, slots=True)
class QuarantineCandidate:
    """What to take out of service. `confidence` = implicated / present, discounted for few occurrences by
    (1 - 2^-implicated): 2 of 2 -> 0.75, 3 of 3 -> 0.875, 2 of 4 -> 0.375; 0 for kind NONE."""

    kind: QuarantineKind
    id: str
    occurrences: int
    runs_observed: int
    confidence: float
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Localization:
    """The verdict for one fault family (one incident class). `subject` is the device UUID, rank number, host or
    link the fault follows ('' when inconclusive); `occurrences` the observations with any incident of the family
    that blames someone, of `observations` in all. The by_* tuples count, for everything implicated at least once,
    how many observations implicated it out of how many it was present in, most implicated first."""

    klass: IncidentClass
    follows: FollowsKind
    subject: str
    observations: int
    occurrences: int
    by_device: tuple[Occurrences, ...]
    by_rank: tuple[Occurrences, ...]
    by_host: tuple[Occurrences, ...]
    by_link: tuple[Occurrences, ...]
    quarantine: tuple[QuarantineCandidate, ...]
    summary: str
    incident_ids: tuple[str, ...] = ()
    reshuffle: bool = False
    """Inconclusive because a device implicated again and again only ever held one rank number: moving ranks to
    other devices (a relaunch placed otherwise) is what tells device from rank at the next occurrence."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Seen:
    """What one observation's incidents of one family implicate, and what the observation had at all."""

    ranks: frozenset[int]
    rank_device: dict[int, str]
    rank_host: dict[int, str]
    hosts: frozenset[str]
    links: frozenset[str]
    rank_links: frozenset[str] | None
    """Links every implicated rank's groups cross, in the intersection over ranks (None: no rank implicated)."""
    all_devices: frozenset[str]
    all_ranks: frozenset[int]
    all_hosts: frozenset[str]
    all_links: frozenset[str]

    @property
    def devices(self) -> frozenset[str]:
        return frozenset(d for r in self.ranks if (d := self.rank_device.get(r)) is not None)

    @property
    def any(self) -> bool:
        return bool(self.ranks or self.hosts or self.links)


_Pick = Callable[[_Seen], frozenset[str]]
_BLAMING = frozenset({SubjectKind.RANK, SubjectKind.DEVICE, SubjectKind.REPLICA})


def localize(observations: Sequence[RunObservation]) -> tuple[Localization, ...]:
    """One `Localization` per incident class seen in any observation, in `IncidentClass` order."""
    classes = {inc.klass for obs in observations for inc in obs.incidents}
    return tuple(_family(k, observations) for k in IncidentClass if k in classes)


def _family(klass: IncidentClass, observations: Sequence[RunObservation]) -> Localization:
    seen = [_seen(obs, [i for i in obs.incidents if i.klass is klass]) for obs in observations]
    ids = tuple(i.id for obs in observations for i in obs.incidents if i.klass is klass)
    occurrences = sum(s.any for s in seen)
    by_device = _count(seen, lambda s: s.devices, lambda s: s.all_devices)
    by_rank = _count(seen, lambda s: frozenset(map(str, s.ranks)), lambda s: frozenset(map(str, s.all_ranks)))
    by_host = _count(seen, lambda s: s.hosts, lambda s: s.all_hosts)
    by_link = _count(seen, lambda s: s.links, lambda s: s.all_links)
    follows, subject, quarantine, why = _verdict(seen, occurrences, by_device, by_rank, by_host, by_link)
    return Localization(
        klass=klass, follows=follows, subject=subject, observations=len(observations), occurrences=occurrences,
        by_device=by_device, by_rank=by_rank, by_host=by_host, by_link=by_link, quarantine=(quarantine,),
        summary=f"{klass}: {why}", incident_ids=ids,
        reshuffle=follows is FollowsKind.INCONCLUSIVE and _never_moved(seen, by_device),
    )


def _never_moved(seen: Sequence[_Seen], by_device: tuple[Occurrences, ...]) -> bool:
    """A device implicated at least twice, only ever under one rank number."""
    return any(o.implicated >= 2 and len({r for s in seen for r in s.ranks if s.rank_device.get(r) == o.id}) < 2
               for o in by_device)


def _seen(obs: RunObservation, incidents: Sequence[Incident]) -> _Seen:
    topo = obs.topology
    rank_device = dict(zip(topo[Topology.RANK].to_list(), topo[Topology.DEVICE_UUID].to_list(), strict=True))
    rank_host = dict(zip(topo[Topology.RANK].to_list(), topo[Topology.HOST].to_list(), strict=True))
    device_rank = {d: r for r, d in rank_device.items() if d is not None}
    ranks: set[int] = set()
    hosts: set[str] = set()
    links: set[str] = set()
    for inc in incidents:
        kind = inc.subject.kind
        if kind is SubjectKind.DEVICE and inc.subject.id in device_rank:
            ranks.add(device_rank[inc.subject.id])
        if kind in _BLAMING:
            ranks.update(inc.ranks)
        elif kind is SubjectKind.HOST:
            hosts.add(inc.subject.id)
        elif kind is SubjectKind.LINK:
            links.add(inc.subject.id)
    hosts.update(rank_host[r] for r in ranks if r in rank_host)
    groups = obs.groups.filter(pl.col(GroupField.KIND) != GroupKind.WORLD) if obs.groups.height else obs.groups
    all_links: set[str] = set()
    rank_links: frozenset[str] | None = None
    if groups.height:
        pairs = list(zip(groups[GroupField.RANKS].to_list(), groups[GroupField.LINKS].to_list(), strict=True))
        for _, crossed in pairs:
            all_links.update(crossed or ())
        for r in sorted(ranks):
            crossed_by_r = {lk for members, crossed in pairs if r in (members or ()) for lk in (crossed or ())}
            rank_links = frozenset(crossed_by_r) if rank_links is None else rank_links & crossed_by_r
    return _Seen(
        ranks=frozenset(ranks), rank_device=rank_device, rank_host=rank_host, hosts=frozenset(hosts),
        links=frozenset(links), rank_links=rank_links if ranks else None,
        all_devices=frozenset(d for d in rank_device.values() if d is not None), all_ranks=frozenset(rank_device),
        all_hosts=frozenset(h for h in rank_host.values() if h is not None), all_links=frozenset(all_links),
    )


def _count(seen: Sequence[_Seen], implicated: _Pick, present: _Pick) -> tuple[Occurrences, ...]:
    hits: dict[str, int] = defaultdict(int)
    there: dict[str, int] = defaultdict(int)
    for s in seen:
        for key in implicated(s):
            hits[str(key)] += 1
        for key in present(s):
            there[str(key)] += 1
    out = [Occurrences(id=k, implicated=n, present=max(there[k], n)) for k, n in hits.items()]
    return tuple(sorted(out, key=lambda o: (-o.implicated, -o.implicated / o.present, o.id)))


def _verdict(seen: Sequence[_Seen], occurrences: int, by_device: tuple[Occurrences, ...],
             by_rank: tuple[Occurrences, ...], by_host: tuple[Occurrences, ...],
             by_link: tuple[Occurrences, ...]) -> tuple[FollowsKind, str, QuarantineCandidate, str]:
    if occurrences < 2:
        return _inconclusive(f"seen in {occurrences} of {len(seen)} observation(s): one occurrence cannot be localized")
    # a link-subject incident repeating is the link's own fault
    if by_link and by_link[0].implicated >= 2:
        return _follows(FollowsKind.LINK, by_link[0], "link incidents repeat on it")

    def ranks_under(device: str) -> set[int]:
        return {r for s in seen for r in s.ranks if s.rank_device.get(r) == device}

    def devices_under(rank: int) -> set[str]:
        return {d for s in seen if rank in s.ranks and (d := s.rank_device.get(rank)) is not None}

    device = next((o for o in by_device if o.implicated >= 2 and len(ranks_under(o.id)) >= 2), None)
    rank = next((o for o in by_rank if o.implicated >= 2 and len(devices_under(int(o.id))) >= 2), None)
    if device and rank:
        share_d, share_r = device.implicated / device.present, rank.implicated / rank.present
        if share_d == share_r:
            return _inconclusive(f"device {device.id} (under ranks {sorted(ranks_under(device.id))}) and rank "
                                 f"{rank.id} (on devices {sorted(devices_under(int(rank.id)))}) recur equally often")
        if share_d < share_r:
            device = None
        else:
            rank = None
    if device:
        return _follows(FollowsKind.DEVICE, device,
                        f"it stayed with the device under ranks {sorted(ranks_under(device.id))}")
    if rank:
        return _follows(FollowsKind.RANK, rank,
                        f"it stayed with the rank number on devices {sorted(devices_under(int(rank.id)))}: data "
                        f"shard or code path, not hardware")
    stuck = next((o for o in by_device if o.implicated >= 2), None)
    if stuck:
        return _inconclusive(f"device {stuck.id} and rank {sorted(ranks_under(stuck.id))[0]} were implicated "
                             f"{stuck.implicated} times but the rank never moved off the device, so device and rank "
                             f"cannot be told apart; reshuffle ranks to tell")
    unplaced = next((o for o in by_rank if o.implicated >= 2 and not devices_under(int(o.id))), None)
    if unplaced:
        return _inconclusive(f"rank {unplaced.id} was implicated {unplaced.implicated} times but the telemetry names "
                             "no device under it, so device and rank cannot be told apart")
    host = by_host[0] if by_host and by_host[0].implicated >= 2 else None
    if host:
        under = {r for s in seen for r in s.ranks if s.rank_host.get(r) == host.id}
        named = any(host.id in s.hosts and not any(s.rank_host.get(r) == host.id for r in s.ranks) for s in seen)
        if len(under) < 2 and not named:
            host = None  # one rank number each time, no incident of the host's own: the rank's as much as the host's
    if host and all(s.all_hosts <= {host.id} for s in seen):
        return _inconclusive(f"every observation ran on host {host.id} alone: a fault of the host cannot be told "
                             "from one of the job")
    link, tied = _common_link(seen)
    if link and (host is None or link.implicated > host.implicated):
        return _follows(FollowsKind.LINK, link, "the implicated ranks differ in device and host, but their process "
                                                "groups all cross this link")
    if host:
        return _follows(FollowsKind.HOST, host, "different devices and ranks on the same host")
    if tied:
        return _inconclusive(f"the implicated ranks' groups share several links equally: {', '.join(tied)}")
    return _inconclusive(f"seen in {occurrences} observations but no device, rank, host or link recurs")


def _common_link(seen: Sequence[_Seen]) -> tuple[Occurrences | None, list[str]]:
    """The one link crossed by every implicated rank's groups in the most observations (>= 2), if unique."""
    hits: dict[str, int] = defaultdict(int)
    for s in seen:
        for lk in s.rank_links or ():
            hits[lk] += 1
    if not hits:
        return None, []
    best = max(hits.values())
    top = sorted(k for k, n in hits.items() if n == best)
    if best < 2:
        return None, []
    if len(top) > 1:
        return None, top
    present = sum(top[0] in s.all_links for s in seen)
    return Occurrences(id=top[0], implicated=best, present=max(present, best)), []


def _follows(kind: FollowsKind, o: Occurrences, why: str) -> tuple[FollowsKind, str, QuarantineCandidate, str]:
    confidence = round(o.implicated / o.present * (1.0 - 0.5 ** o.implicated), 4)
    where = f"{kind} {o.id}: implicated in {o.implicated} of the {o.present} observations it was in; {why}"
    if kind is FollowsKind.RANK:
        q = QuarantineCandidate(kind=QuarantineKind.NONE, id="", occurrences=o.implicated, runs_observed=o.present,
                                confidence=0.0, reason=f"follows rank {o.id}, not hardware: look at its data or code")
    else:
        q = QuarantineCandidate(kind=QuarantineKind(kind.value), id=o.id, occurrences=o.implicated,
                                runs_observed=o.present, confidence=confidence, reason=where)
    return kind, o.id, q, f"follows {where}"


def _inconclusive(why: str) -> tuple[FollowsKind, str, QuarantineCandidate, str]:
    q = QuarantineCandidate(kind=QuarantineKind.NONE, id="", occurrences=0, runs_observed=0, confidence=0.0,
                            reason=why)
    return FollowsKind.INCONCLUSIVE, "", q, f"inconclusive: {why}"
