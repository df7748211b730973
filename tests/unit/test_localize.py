"""Localization across runs: a recurring fault follows the device, the rank number, the host or a link, or the
evidence cannot tell (one occurrence, or a mapping that never changed)."""

from __future__ import annotations

import polars as pl

from rankwatch.analytics.incidents import Cause, Incident, IncidentClass, Subject, SubjectKind
from rankwatch.analytics.localize import (
    FollowsKind, Localization, Occurrences, QuarantineKind, RunObservation, localize,
)
from rankwatch.base.topology import link_name

PER_HOST, HOSTS = 4, 3
WORLD = PER_HOST * HOSTS
L01, L12 = link_name("host0", "host1"), link_name("host1", "host2")


def _topology(devices: list[str]) -> pl.DataFrame:
    """Rank r runs on devices[r]; device 'GPU-h<k>-<i>' sits on host k, and a rank sits on its device's host."""
    return pl.DataFrame({
        "rank": list(range(len(devices))), "device_uuid": devices,
        "host": [f"host{d.split('-')[1][1:]}" for d in devices],
    })


def _identity() -> list[str]:
    return [f"GPU-h{r // PER_HOST}-{r % PER_HOST}" for r in range(WORLD)]


def _groups() -> pl.DataFrame:
    """Tensor-parallel groups inside each host; data-parallel pairs (r, r + 4) crossing host k <-> host k+1."""
    rows = [{"group": f"tp{h}", "kind": "tp", "ranks": list(range(h * PER_HOST, (h + 1) * PER_HOST)),
             "links": []} for h in range(HOSTS)]
    rows += [{"group": f"dp{r}", "kind": "dp", "ranks": [r, r + PER_HOST],
              "links": [link_name(f"host{r // PER_HOST}", f"host{r // PER_HOST + 1}")]} for r in range(WORLD - PER_HOST)]
    rows.append({"group": "world", "kind": "world", "ranks": list(range(WORLD)), "links": [L01, L12]})
    return pl.DataFrame(rows, schema={"group": pl.String, "kind": pl.String, "ranks": pl.List(pl.Int32),
                                      "links": pl.List(pl.String)})


def _incident(kind: SubjectKind, sid: str, ranks: tuple[int, ...] = (),
              klass: IncidentClass = IncidentClass.STRAGGLER) -> Incident:
    return Incident(klass=klass, subject=Subject(kind=kind, id=sid), ranks=ranks, onset_step=10, detection_step=15,
                    confidence=0.9, cause=Cause.UNKNOWN, summary="test")


def _rank(r: int, klass: IncidentClass = IncidentClass.STRAGGLER) -> Incident:
    return _incident(SubjectKind.RANK, str(r), (r,), klass)


def _obs(i: int, incidents: list[Incident], devices: list[str] | None = None) -> RunObservation:
    return RunObservation(run=f"run{i}", attempt=0, incidents=tuple(incidents),
                          topology=_topology(devices or _identity()), groups=_groups())


def _swap(a: int, b: int) -> list[str]:
    devices = _identity()
    devices[a], devices[b] = devices[b], devices[a]
    return devices


def _one(observations: list[RunObservation]) -> Localization:
    (loc,) = localize(observations)
    return loc


def test_fault_follows_the_device_when_ranks_are_reshuffled() -> None:
    # run 0: rank 5 on GPU-h1-1; run 1 swaps ranks 5 and 6 (same host), and the fault shows under rank 6
    loc = _one([_obs(0, [_rank(5)]), _obs(1, [_rank(6)], _swap(5, 6)), _obs(2, [])])
    assert loc.follows is FollowsKind.DEVICE and loc.subject == "GPU-h1-1"
    assert loc.occurrences == 2 and loc.observations == 3
    assert loc.by_device[0] == Occurrences(id="GPU-h1-1", implicated=2, present=3)
    assert {o.id: o.implicated for o in loc.by_rank} == {"5": 1, "6": 1}
    (q,) = loc.quarantine
    assert (q.kind, q.id, q.occurrences, q.runs_observed) == (QuarantineKind.DEVICE, "GPU-h1-1", 2, 3)
    assert 0 < q.confidence < 0.75  # 2 of 3 observations


def test_fault_follows_the_rank_number_when_it_moves_to_another_device() -> None:
    loc = _one([_obs(0, [_rank(5)]), _obs(1, [_rank(5)], _swap(5, 9))])
    assert loc.follows is FollowsKind.RANK and loc.subject == "5"
    assert loc.by_rank == (Occurrences(id="5", implicated=2, present=2),)
    assert {o.id for o in loc.by_device} == {"GPU-h1-1", "GPU-h2-1"}
    (q,) = loc.quarantine
    assert q.kind is QuarantineKind.NONE and "data or code" in q.reason


def test_fault_follows_the_host_through_different_devices_and_ranks() -> None:
    loc = _one([_obs(0, [_rank(4)]), _obs(1, [_rank(6)]), _obs(2, [_rank(7)])])
    assert loc.follows is FollowsKind.HOST and loc.subject == "host1"
    assert loc.by_host[0] == Occurrences(id="host1", implicated=3, present=3)
    assert loc.quarantine[0].kind is QuarantineKind.HOST and loc.quarantine[0].confidence == 0.875
    # host-subject incidents (a host's input pipeline) count for the host directly
    host = _incident(SubjectKind.HOST, "host2", (8, 9, 10, 11))
    loc = _one([_obs(0, [host]), _obs(1, [host])])
    assert (loc.follows, loc.subject) == (FollowsKind.HOST, "host2")


def test_fault_follows_the_link_its_ranks_collectives_cross() -> None:
    # rank 3 (host0) only crosses host0<->host1; rank 5 (host1) crosses both links: the common one is host0<->host1
    loc = _one([_obs(0, [_rank(3)]), _obs(1, [_rank(5)])])
    assert loc.follows is FollowsKind.LINK and loc.subject == L01
    assert loc.quarantine[0].kind is QuarantineKind.LINK and loc.quarantine[0].id == L01
    # rank 5 (host1) and rank 9 (host2) have only host1<->host2 in common
    assert _one([_obs(0, [_rank(5)]), _obs(1, [_rank(9)])]).subject == L12
    # link-subject incidents repeating
    link = _incident(SubjectKind.LINK, L12, (4, 5, 6, 7, 8, 9, 10, 11))
    loc = _one([_obs(0, [link]), _obs(1, []), _obs(2, [link])])
    assert (loc.follows, loc.subject) == (FollowsKind.LINK, L12)
    assert loc.by_link == (Occurrences(id=L12, implicated=2, present=3),)
    assert not loc.by_rank  # the link incident's member ranks are not blamed


def test_single_occurrence_is_inconclusive() -> None:
    loc = _one([_obs(0, [_rank(5)]), _obs(1, []), _obs(2, [])])
    assert loc.follows is FollowsKind.INCONCLUSIVE and loc.subject == ""
    assert "one occurrence" in loc.summary
    assert loc.quarantine[0].kind is QuarantineKind.NONE
    assert loc.by_device == (Occurrences(id="GPU-h1-1", implicated=1, present=3),)


def test_unchanged_mapping_is_inconclusive_and_says_so() -> None:
    loc = _one([_obs(0, [_rank(5)]), _obs(1, [_rank(5)]), _obs(2, [_rank(5)], _swap(0, 1))])
    assert loc.follows is FollowsKind.INCONCLUSIVE
    assert "cannot be told apart" in loc.summary and "GPU-h1-1" in loc.summary
    assert loc.quarantine[0].kind is QuarantineKind.NONE


def test_only_a_device_that_never_held_another_rank_asks_for_a_reshuffle() -> None:
    stayed = _one([_obs(0, [_rank(5)]), _obs(1, [_rank(5)])])
    assert stayed.follows is FollowsKind.INCONCLUSIVE and stayed.reshuffle and "reshuffle" in stayed.summary
    once = _one([_obs(0, [_rank(5)]), _obs(1, [])])  # one occurrence: nothing recurred, nothing to tell apart
    assert once.follows is FollowsKind.INCONCLUSIVE and not once.reshuffle
    # after the reshuffle the fault shows under the rank now on the device: it follows the device
    moved = _one([_obs(0, [_rank(5)]), _obs(1, [_rank(5)]), _obs(2, [_rank(6)], _swap(5, 6))])
    assert moved.follows is FollowsKind.DEVICE and moved.subject == "GPU-h1-1" and not moved.reshuffle


def test_device_and_rank_recurring_equally_is_inconclusive() -> None:
    # rank 5 on GPU-h1-1, then rank 5 on GPU-h2-1, then rank 9 on GPU-h1-1: either reading fits twice of three
    loc = _one([_obs(0, [_rank(5)]), _obs(1, [_rank(5)], _swap(5, 9)), _obs(2, [_rank(9)])])
    assert loc.follows is FollowsKind.INCONCLUSIVE and "equally" in loc.summary


def test_families_are_localized_separately_and_non_blaming_subjects_ignored() -> None:
    stage = _incident(SubjectKind.STAGE, "pp=1", tuple(range(4, 8)), IncidentClass.IMBALANCE)
    locs = localize([
        _obs(0, [_rank(5), _rank(2, IncidentClass.FAIL_STOP), stage]),
        _obs(1, [_rank(6), _rank(2, IncidentClass.FAIL_STOP), stage], _swap(5, 6)),
    ])
    by_class = {loc.klass: loc for loc in locs}
    assert by_class[IncidentClass.STRAGGLER].follows is FollowsKind.DEVICE
    assert by_class[IncidentClass.FAIL_STOP].follows is FollowsKind.INCONCLUSIVE  # rank 2 never moved
    assert by_class[IncidentClass.FAIL_STOP].reshuffle  # moving ranks is what tells device from rank
    assert not by_class[IncidentClass.STRAGGLER].reshuffle and not by_class[IncidentClass.IMBALANCE].reshuffle
    assert by_class[IncidentClass.IMBALANCE].occurrences == 0
    assert by_class[IncidentClass.IMBALANCE].follows is FollowsKind.INCONCLUSIVE
    assert localize([]) == ()


def test_a_rank_failing_again_without_device_ids_on_one_host_is_not_blamed_on_the_host() -> None:
    # found live (issue 31): CPU ranks have no device UUID, and the same rank of a one-host job failing in two attempts
    # raised IndexError and would have quarantined the only host ("different devices and ranks on the same host")
    one_host = pl.DataFrame({"rank": [0, 1, 2, 3], "device_uuid": [None] * 4, "host": ["vm"] * 4},
                            schema={"rank": pl.Int64, "device_uuid": pl.String, "host": pl.String})
    obs = [RunObservation(run=f"a{i}", attempt=i, incidents=tuple(inc), topology=one_host, groups=_groups().clear())
           for i, inc in enumerate([[_rank(1, IncidentClass.FAIL_STOP)], [_rank(1, IncidentClass.FAIL_STOP)], []])]
    loc = _one(obs)
    assert loc.follows is FollowsKind.INCONCLUSIVE and loc.by_device == ()
    assert "names no device" in loc.summary and loc.quarantine[0].kind is QuarantineKind.NONE
    # different ranks of the one host: still not the host's, as the job ran nowhere else
    obs = [RunObservation(run=f"b{i}", attempt=i, incidents=(_rank(r, IncidentClass.FAIL_STOP),), topology=one_host,
                          groups=_groups().clear()) for i, r in enumerate([1, 2])]
    loc = _one(obs)
    assert loc.follows is FollowsKind.INCONCLUSIVE and "host vm alone" in loc.summary
