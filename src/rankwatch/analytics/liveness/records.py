"""The liveness records as read: a rank's `rank-<r>.live` (a header, a CRC, JSON; a write caught half done reads as
torn and is read again) and the launcher's `exit-<r>.json`. A record of the wrong shape is an error naming it."""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankwatch.analytics.errors import RunDirError, SchemaVersionError
from rankwatch.base.schema import LIVE_HEADER_BYTES, LIVE_VERSION, ExitField, LiveField, LiveState


@dataclass(frozen=True, kw_only=True, slots=True)
class OpenCollective:
    """The collective a rank is in (or, in an exiting record, the one its exception came from)."""

    op: str
    group: str
    seq: int | None
    peer: int | None = None
    wall_ns: int | None = None
    ranks: tuple[int, ...] | None = None
    """Its group's ranks (written once it has been open a while; None before)."""

    def __str__(self) -> str:
        peer = f" with rank {self.peer}" if self.peer is not None else ""
        return f"{self.op} on {self.group} (#{self.seq}){peer}"


@dataclass(frozen=True, kw_only=True, slots=True)
class RankRecord:
    """One rank record as the collector wrote it (`schema.LiveField`)."""

    rank: int
    world_size: int
    attempt: int
    pid: int | None
    host: str
    state: LiveState
    seq: int
    wall_ns: int
    heartbeat_ns: int
    started_wall_ns: int
    last_step: int | None = None
    last_step_wall_ns: int | None = None
    step_ns: int | None = None
    step: int | None = None
    phase: str | None = None
    phase_start_wall_ns: int | None = None
    collective: OpenCollective | None = None
    exit_code: int | None = None
    signal: int | None = None
    exc_type: str | None = None
    message: str | None = None

    @property
    def progress_wall_ns(self) -> int:
        """The rank's last progress: its last completed step's end, or its collector's start before any."""
        return self.last_step_wall_ns if self.last_step_wall_ns is not None else self.started_wall_ns

    @property
    def closed(self) -> bool:
        return self.state is not LiveState.RUNNING


@dataclass(frozen=True, kw_only=True, slots=True)
class ExitRecord:
    """A rank process's end as its launcher saw it (`schema.ExitField`)."""

    rank: int
    world_size: int
    attempt: int
    pid: int | None
    host: str
    wall_ns: int
    exit_code: int | None
    signal: int | None
    outside_signal: int | None = None
    """The first signal that reached the rank from outside before it ended (the launcher's SIGTERM, then SIGKILL, to
    its process group), as `rankwatch torchrun`'s host agent saw it; None when none did, or the launcher's side does
    not tell (`schema.ExitField.OUTSIDE_SIGNAL`)."""
    outside_signal_wall_ns: int | None = None
    """When that signal arrived (wall clock)."""


class TornRecord(Exception):
    """A rank record read while being written (or otherwise not a whole frame)."""


def _field(d: Mapping[str, Any], key: str, kind: type, where: str, *, required: bool = False) -> Any:
    value = d.get(key)
    if type(value) is kind:  # the common case first: this runs ~20 times per record read
        return value
    if value is None:
        if required:
            raise RunDirError(f"{where}: liveness record without `{key}`")
        return None
    raise RunDirError(f"{where}: liveness record field `{key}` is {value!r}, not {kind.__name__}")


def _version(d: Mapping[str, Any], where: str) -> None:
    version = d.get(LiveField.VERSION)
    if version != LIVE_VERSION:
        raise SchemaVersionError(f"{where}: liveness record version {version!r}; this rankwatch reads {LIVE_VERSION}")


def decode_rank_record(data: bytes, where: str = "rank record") -> RankRecord:
    """Parse one rank-record frame (`schema.LIVE_HEADER_BYTES`). Raises `TornRecord` for a frame whose length or CRC does
    not hold (a write in progress); `SchemaVersionError` / `RunDirError` for a whole record this rankwatch cannot
    read."""
    try:
        crc, n = int(data[:8], 16), int(data[9:15])
    except ValueError:
        raise TornRecord(where) from None
    body = data[LIVE_HEADER_BYTES:LIVE_HEADER_BYTES + n]
    if len(body) != n or zlib.crc32(body) != crc:
        raise TornRecord(where)
    try:
        d = json.loads(body)
    except ValueError:
        raise RunDirError(f"{where}: liveness record with a good CRC but not JSON") from None
    if not isinstance(d, dict):
        raise RunDirError(f"{where}: liveness record is not a JSON object")
    return _rank_record(d, where)


def _rank_record(d: Mapping[str, Any], where: str) -> RankRecord:
    _version(d, where)
    state = _field(d, LiveField.STATE, str, where, required=True)
    try:
        live_state = LiveState(state)
    except ValueError:
        raise RunDirError(f"{where}: liveness record state {state!r} is none of {[str(s) for s in LiveState]}") from None
    collective = None
    op = _field(d, LiveField.COLLECTIVE_OP, str, where)
    if op is not None:
        ranks = d.get(LiveField.COLLECTIVE_RANKS)
        collective = OpenCollective(
            op=op, group=str(_field(d, LiveField.COLLECTIVE_GROUP, str, where) or "?"),
            seq=_field(d, LiveField.COLLECTIVE_SEQ, int, where), peer=_field(d, LiveField.COLLECTIVE_PEER, int, where),
            wall_ns=_field(d, LiveField.COLLECTIVE_WALL_NS, int, where),
            ranks=tuple(int(r) for r in ranks) if isinstance(ranks, list) else None,
        )
    return RankRecord(
        rank=_field(d, LiveField.RANK, int, where, required=True),
        world_size=_field(d, LiveField.WORLD_SIZE, int, where, required=True),
        attempt=_field(d, LiveField.ATTEMPT, int, where, required=True),
        pid=_field(d, LiveField.PID, int, where),
        host=str(_field(d, LiveField.HOST, str, where) or ""),
        state=live_state,
        seq=_field(d, LiveField.SEQ, int, where, required=True),
        wall_ns=_field(d, LiveField.WALL_NS, int, where, required=True),
        heartbeat_ns=_field(d, LiveField.HEARTBEAT_NS, int, where, required=True),
        started_wall_ns=_field(d, LiveField.STARTED_WALL_NS, int, where, required=True),
        last_step=_field(d, LiveField.LAST_STEP, int, where),
        last_step_wall_ns=_field(d, LiveField.LAST_STEP_WALL_NS, int, where),
        step_ns=_field(d, LiveField.STEP_NS, int, where),
        step=_field(d, LiveField.STEP, int, where),
        phase=_field(d, LiveField.PHASE, str, where),
        phase_start_wall_ns=_field(d, LiveField.PHASE_START_WALL_NS, int, where),
        collective=collective,
        exit_code=_field(d, LiveField.EXIT_CODE, int, where),
        signal=_field(d, LiveField.SIGNAL, int, where),
        exc_type=_field(d, LiveField.EXC_TYPE, str, where),
        message=_field(d, LiveField.MESSAGE, str, where),
    )


def parse_exit_record(d: Mapping[str, Any], where: str = "exit record") -> ExitRecord:
    _version(d, where)
    return ExitRecord(
        rank=_field(d, ExitField.RANK, int, where, required=True),
        world_size=_field(d, ExitField.WORLD_SIZE, int, where, required=True),
        attempt=_field(d, ExitField.ATTEMPT, int, where, required=True),
        pid=_field(d, ExitField.PID, int, where),
        host=str(_field(d, ExitField.HOST, str, where) or ""),
        wall_ns=_field(d, ExitField.WALL_NS, int, where, required=True),
        exit_code=_field(d, ExitField.EXIT_CODE, int, where),
        signal=_field(d, ExitField.SIGNAL, int, where),
        outside_signal=_field(d, ExitField.OUTSIDE_SIGNAL, int, where),
        outside_signal_wall_ns=_field(d, ExitField.OUTSIDE_SIGNAL_NS, int, where),
    )
