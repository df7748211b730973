"""What a monitor sends each tick (`AlertTracker.update`): each new incident once (firing), its resolution once, each
decision once. Pure: no I/O; a restarted monitor takes its state back from the outbox (`AlertTracker.resume`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING


from rankwatch.analytics.incidents import FaultKey, Cause, Incident, sort_incidents
from rankwatch.control.wire import (
    STOPPING_CLASSES, AlertStatus, DecisionFields, Message, MessageType, RankPlacement, alert_start, decision_message,
    incident_message,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("rankwatch.alerts")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackerConfig:
    resolve_after: int = 3
    """An incident absent from this many consecutive updates is resolved (a straggler that caught up, a divergence
    the window moved past)."""
    stop_resolve_after: int | None = None
    """Fail-stop and hang (not a transient stall): resolved after this many absent updates; None = only when the
    job was relaunched (`attempt=` newer than the incident's), a recovery dealt with it (`recovered=`), or the run
    ended (`finish`). A rank that stopped does not come back by itself, and its incident leaving a monitor's window
    says only that the window moved on."""

    def __post_init__(self) -> None:
        if self.resolve_after < 1 or (self.stop_resolve_after is not None and self.stop_resolve_after < 1):
            raise ValueError(f"TrackerConfig: resolve_after {self.resolve_after} and stop_resolve_after "
                             f"{self.stop_resolve_after} must be >= 1")


def _key(incident: Incident) -> FaultKey:
    """What stays the same while one fault goes on (`Incident.fault`): two sources (the part-file detectors, the
    liveness channel) may raise one fail-stop under two ids, and a window moves an incident's onset and its ranks."""
    return incident.fault


def _stops(incident: Incident) -> bool:
    return incident.klass in STOPPING_CLASSES and incident.cause is not Cause.TRANSIENT_STALL


@dataclass(slots=True)
class _Open:
    incident: Incident
    starts_at: float
    absent: int = 0
    decision: str = ""


class AlertTracker:
    """Which messages a monitor sends, one call per tick. Pure: it builds messages and holds what it has said; the
    caller enqueues them (an `AlertSender`).

    One alert per fault, not per incident id: an incident with the fault key (class, subject, attempt:
    `Incident.fault`) of an open alert is that episode still going on — its id moved with the window's onset, its
    ranks with a spreading fault — and sends nothing. The alert's
    messages keep the id of the incident that raised it. A resolved incident id is not raised again, nor a
    fail-stop or hang of a resolved alert, or of an attempt older than the newest one seen. Built afresh after a
    monitor restart, it rebuilds the same messages (same ids) for what is still in the window, which the outbox
    stores once."""

    def __init__(self, run_dir: Path | str, config: TrackerConfig = TrackerConfig(), *,
                 evidence_path: Callable[[Incident], Path | str | None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self._evidence = evidence_path or (lambda _: None)
        self._open: dict[str, _Open] = {}
        self._keys: dict[FaultKey, str] = {}
        """Open alerts by key."""
        self._resolved: set[str] = set()
        self._resolved_stops: set[FaultKey] = set()
        self._decided: set[str] = set()
        self._decided_keys: set[FaultKey] = set()
        self._attempt: int | None = None

    @property
    def open(self) -> tuple[Incident, ...]:
        """The incidents whose alerts fire (each as first raised)."""
        return sort_incidents(o.incident for o in self._open.values())

    def _open_for(self, incident: Incident) -> str | None:
        if incident.id in self._open:
            return incident.id
        return self._keys.get(_key(incident))

    def undecided(self, incidents: Iterable[Incident]) -> tuple[Incident, ...]:
        """Those of `incidents` whose fault no decision sent so far covers, and that would fire (not resolved): what
        the caller plans for."""
        return sort_incidents(i for i in incidents
                              if _key(i) not in self._decided_keys and not self._silenced(i))

    def _silenced(self, incident: Incident) -> bool:
        if incident.id in self._resolved:
            return True
        if not _stops(incident):
            return False
        old = incident.attempt is not None and self._attempt is not None and incident.attempt < self._attempt
        return old or _key(incident) in self._resolved_stops

    def update(self, incidents: Iterable[Incident], decisions: Iterable[DecisionFields] = (), *,
               recovered: Iterable[str | Incident] = (), attempt: int | None = None,
               placement: Mapping[int, RankPlacement] | None = None, now: float | None = None,
               analyzed: bool = True) -> list[Message]:
        """The messages for this tick, in the order to send them: the new alerts firing (most consequential first),
        then each decision not sent before, then the resolutions.

        `incidents`: the latest analysis (and liveness view). `decisions`: what the caller decided this tick (for
        `undecided(incidents)`); each names incident ids of this tick or of open alerts. `recovered`: incidents (or
        ids) a recovery dealt with, e.g. those of the manager's recovery records; their alerts resolve now, present
        or not. `attempt`: the run's newest attempt (the topology's max attempt); a fail-stop or hang of an older
        attempt resolves (the job was relaunched past it). `analyzed`: False when the
        incidents are those of an analysis given before (a monitor's liveness polls between part-file refreshes):
        absence is counted in analyses, not in calls, so one window that misses a fault does not resolve it."""
        now = time.time() if now is None else now
        place = placement or {}
        if attempt is not None:
            self._attempt = attempt if self._attempt is None else max(self._attempt, attempt)
        current = {i.id: i for i in incidents}
        seen: set[str] = set()
        out: list[Message] = []
        for inc in sort_incidents(current.values()):
            if self._silenced(inc):
                continue
            held = self._open_for(inc)
            if held is not None:
                seen.add(held)
                continue
            o = _Open(incident=inc, starts_at=alert_start(inc, now, None))
            self._open[inc.id] = o
            self._keys[_key(inc)] = inc.id
            seen.add(inc.id)
            out.append(incident_message(self.run_dir, inc, AlertStatus.FIRING, evidence_path=self._evidence(inc),
                                        placement=place, now=now, starts_at=o.starts_at))
        for d in decisions:
            if d.id in self._decided:
                continue
            known = {**{k: o.incident for k, o in self._open.items()}, **current}
            missing = [i for i in d.incidents if i not in known]
            if missing:
                raise ValueError(f"decision {d.id}: incidents {missing} were never reported to the tracker")
            chosen = [known[i] for i in d.incidents]
            starts = {i.id: self._open[h].starts_at for i in chosen if (h := self._open_for(i)) is not None}
            out.append(decision_message(self.run_dir, d, chosen, evidence_path=self._evidence(chosen[0]),
                                        placement=place, now=now, starts_at=starts))
            self._decided.add(d.id)
            for i in chosen:
                self._decided_keys.add(_key(i))
                if (h := self._open_for(i)) is not None:
                    self._open[h].decision = d.line()
        done_ids, done_keys = set(), set()
        for r in recovered:
            if isinstance(r, str):
                done_ids.add(r)
            else:
                done_ids.add(r.id)
                done_keys.add(_key(r))
        for iid, o in list(self._open.items()):
            inc = o.incident
            if iid in done_ids or _key(inc) in done_keys:
                out.append(self._resolve(iid, place, now, "a recovery dealt with it"))
                continue
            if _stops(inc) and inc.attempt is not None and self._attempt is not None and inc.attempt < self._attempt:
                out.append(self._resolve(iid, place, now, f"the job was relaunched (attempt {self._attempt})"))
                continue
            if iid in seen:
                o.absent = 0
                continue
            if not analyzed:  # the same analysis again (a liveness poll between refreshes): nothing went away
                continue
            o.absent += 1
            after = self.config.stop_resolve_after if _stops(inc) else self.config.resolve_after
            if after is not None and o.absent >= after:
                out.append(self._resolve(iid, place, now, f"absent from {o.absent} consecutive analyses"))
        return out

    def resume(self, messages: Iterable[Message]) -> int:
        """Take back what an earlier monitor of this run said, from its messages in the order they were made (an
        outbox's `entries()`, whatever their delivery state): its open alerts, decisions and resolutions, so a
        restarted monitor neither raises a fault again under the newer id the window gave it nor decides it again.
        Returns how many messages of this run were read."""
        run, n = self.run_dir.name, 0
        for m in messages:
            if m.run != run:
                continue
            n += 1
            doc = m.doc()
            rw = doc["rankwatch"]
            inc = Incident.from_dict(rw["incident_doc"])
            if m.type is MessageType.FIRING and not self._silenced(inc) and self._open_for(inc) is None:
                starts = datetime.strptime(doc["alerts"][0]["startsAt"], "%Y-%m-%dT%H:%M:%S.%fZ")
                self._open[inc.id] = _Open(incident=inc, starts_at=starts.replace(tzinfo=timezone.utc).timestamp())
                self._keys[_key(inc)] = inc.id
            elif m.type is MessageType.DECISION and m.decision is not None:
                self._decided.add(m.decision)
                line = doc["alerts"][0]["annotations"]["decision"]
                self._decided_keys.add(_key(inc))
                for iid in rw["evidence"].get("incidents", [inc.id]):
                    if iid in self._open:
                        self._open[iid].decision = line
                        self._decided_keys.add(_key(self._open[iid].incident))
                if (h := self._open_for(inc)) is not None:
                    self._open[h].decision = line
            elif m.type is MessageType.RESOLVED:
                if (h := self._open_for(inc)) is not None:
                    self._resolve(h, {}, 0.0, "")
                else:
                    self._resolved.add(inc.id)
                    if _stops(inc):
                        self._resolved_stops.add(_key(inc))
        return n

    def finish(self, *, now: float | None = None, why: str = "the run ended",
               placement: Mapping[int, RankPlacement] | None = None) -> list[Message]:
        """Resolve every open alert (the run is over, or the monitor stops watching it for good)."""
        now = time.time() if now is None else now
        return [self._resolve(iid, placement or {}, now, why) for iid in
                [i.id for i in sort_incidents(o.incident for o in self._open.values())]]

    def _resolve(self, iid: str, placement: Mapping[int, RankPlacement], now: float, why: str) -> Message:
        o = self._open.pop(iid)
        key = _key(o.incident)
        self._keys.pop(key, None)
        self._resolved.add(iid)
        if _stops(o.incident):
            self._resolved_stops.add(key)
        return incident_message(self.run_dir, o.incident, AlertStatus.RESOLVED, decision=o.decision or None,
                                evidence_path=self._evidence(o.incident), placement=placement, now=now,
                                starts_at=o.starts_at, resolution=why)
