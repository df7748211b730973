"""Which end of a broken connection failed: a rank's own network, or the peer it was talking to.

When one rank's network goes (its NIC or link down, its connections torn down: a partition of that rank), every
collective it is in fails on every member at about the same time, and every member raises. The error messages
differ by side. The rank whose own end failed reads a *local* transport error — its own stack aborted the connection
or has no network ("Software caused connection abort": ECONNABORTED; "Network is down" / "Network is unreachable":
ENETDOWN / ENETUNREACH). Its peers read a *remote* one — the other end went away ("Connection reset by peer",
"Connection closed by peer", "Broken pipe", "Connection refused"). gloo prints exactly these strerror texts (pair.cc
"Read error [addr]:port: <strerror>"); NCCL's socket transport and the rendezvous store use the same errno names.

`partitioned` is the rule both fail-stop readers (analytics.liveness on the live records, analytics.failstop on the
part files) apply before blaming the whole job: the ranks whose own errors are local while another rank's are remote,
fewer than half of those reporting (a network lost by most of the job is the job's, not a rank's). Errors that name
neither side ("timed out", NCCL's "remote process exited or there was a network error") count for no one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import StrEnum

__all__ = ["TransportSide", "partitioned", "transport_side"]


class TransportSide(StrEnum):
    LOCAL = "local"
    """The reporter's own end failed (aborted by its own stack, no network)."""
    REMOTE = "remote"
    """The peer's end went away (reset, closed, refused)."""


_LOCAL = re.compile(r"(?i)software caused connection abort|network is (?:down|unreachable)|\bE(?:CONNABORTED|NETDOWN|NETUNREACH)\b")
_REMOTE = re.compile(r"(?i)connection (?:reset|closed) by peer|broken pipe|connection refused|\bE(?:CONNRESET|PIPE|CONNREFUSED)\b")


def transport_side(message: str | None) -> TransportSide | None:
    """LOCAL, REMOTE, or None when the message says neither (or both: no side can be taken)."""
    if not message:
        return None
    local, remote = bool(_LOCAL.search(message)), bool(_REMOTE.search(message))
    if local == remote:
        return None
    return TransportSide.LOCAL if local else TransportSide.REMOTE


def partitioned(messages: Mapping[int, Iterable[str | None]]) -> set[int]:
    """The ranks whose own connections failed: every side their messages take is LOCAL, while some other rank's
    messages take REMOTE, and they are fewer than half of the ranks whose messages take a side. `messages`: each
    reporting rank's error and exception texts."""
    sides: dict[int, set[TransportSide]] = {}
    for rank, texts in messages.items():
        taken = {s for s in (transport_side(t) for t in texts) if s is not None}
        if taken:
            sides[int(rank)] = taken
    local = {r for r, s in sides.items() if s == {TransportSide.LOCAL}}
    remote = {r for r, s in sides.items() if TransportSide.REMOTE in s}
    if not local or not remote or 2 * len(local) >= len(sides):
        return set()
    return local
