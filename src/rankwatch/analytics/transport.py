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

What the survivors print when a peer goes is a reaction, never a cause (`is_reaction`, the texts in
`REACTION_TEXTS`): NCCL's and c10d's texts for a remote failure, a communicator aborted, a watchdog timeout, and the
transport's remote side above. None of them names the peer: where NCCL prints a rank it is the reporter's own, in its
process group's numbering ("[PG ID 1 PG GUID 3(dp) Rank 2]", "aborted on rank 2"), which is another global rank in a
subgroup. `peers_named` reads the ranks a message names as peers with those left out (gloo's "(rank 11)", c10d's
"Rank 3 failed to pass monitoredBarrier").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from enum import StrEnum

__all__ = [
    "NAMED_RANK", "REACTION_TEXTS", "REPORTER_RANK", "TransportSide", "is_reaction", "partitioned", "peers_named",
    "transport_side",
]


class TransportSide(StrEnum):
    LOCAL = "local"
    """The reporter's own end failed (aborted by its own stack, no network)."""
    REMOTE = "remote"
    """The peer's end went away (reset, closed, refused)."""


_LOCAL = re.compile(r"(?i)software caused connection abort|network is (?:down|unreachable)|\bE(?:CONNABORTED|NETDOWN|NETUNREACH)\b")
_REMOTE = re.compile(r"(?i)connection (?:reset|closed) by peer|broken pipe|connection refused|\bE(?:CONNRESET|PIPE|CONNREFUSED)\b")


_NCCL_RESULT = ("NCCL's result name, printed by C10D_NCCL_CHECK and its kin "
                "(torch/csrc/distributed/c10d/NCCLUtils.hpp: \"NCCL error in: <file>:<line>, \" + "
                "ncclGetErrorWithVersion(result)) for a failure NCCL met in the network or in a peer "
                "(ncclUnhandledCudaError, the rank's own device, is not one)")

REACTION_TEXTS: tuple[tuple[str, str], ...] = (
    (r"remote process exited or there was a network error",
     "torch/csrc/distributed/c10d/NCCLUtils.cpp, getNcclErrorDetailStr for ncclRemoteError"),
    (r"\bncclRemoteError\b", _NCCL_RESULT),
    (r"\bncclSystemError\b",
     _NCCL_RESULT + "; its \"Last error\" is NCCL's socket error, e.g. \"socketProgress: Connection reset by peer\""),
    (r"\bncclInternalError\b", _NCCL_RESULT),
    (r"NCCL communicator was aborted",
     "torch/csrc/distributed/c10d/NCCLUtils.cpp (NCCLComm::checkForNcclError): the reporter's own communicator, "
     "aborted by its watchdog after an error or a timeout"),
    (r"Watchdog caught collective operation timeout",
     "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (WorkNCCL::checkTimeout): a collective this rank waited in "
     "for longer than the process group's timeout"),
    (r"watchdog thread terminated with exception",
     "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (the watchdog loop rethrowing a failed or timed-out work)"),
    (r"watchdog got stuck for \d+ seconds",
     "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (HeartbeatMonitor: the watchdog itself blocked, e.g. in a "
     "CUDA call behind a collective that never ends)"),
    (r"Some NCCL operations have failed or timed out",
     "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp (WorkNCCL::handleException)"),
    (r"Timed out waiting \d+ms for (?:recv|send) operation",
     "third_party/gloo/gloo/transport/tcp/unbound_buffer.cc: a gloo wait on a peer that never sent or received"),
)
"""(regular expression, where the text is printed) for each text a survivor prints when another rank failed: the
error is the peer's (or the network's), the reporter only waited for it. Cited by file: the torch wheel ships no C++
sources, so there are no line numbers to give."""

_REACTION = re.compile("|".join(f"(?:{p})" for p, _ in REACTION_TEXTS), re.IGNORECASE)

NAMED_RANK = r"(?i)\brank\s*[=:#]?\s*(\d+)"
"""A rank named in an error message: gloo's "(rank 11)", c10d's "Rank 3 failed to pass monitoredBarrier"."""

REPORTER_RANK = (r"(?i)\[(?:PG ID [^\]]*?)?\brank\s*\d+\]|aborted on rank\s*\d+"
                 r"|collective timeout from\s+rank\s*\d+")
"""Ranks NCCL's and c10d's texts print that are not the failed peer: the reporter's own rank in its process group's
numbering, in ProcessGroupNCCL.cpp's log prefix ("[PG ID 1 PG GUID 3(dp) Rank 2] ", torch before 2.4: "[Rank 2] ")
and in NCCLUtils.cpp's "NCCL communicator was aborted on rank 2."; and, in ProcessGroupNCCL.cpp's heartbeat monitor
("Received a dump signal due to a collective timeout from rank 5"), the rank that timed out first: a waiter too."""

_NAMED = re.compile(NAMED_RANK)
_REPORTER = re.compile(REPORTER_RANK)


def is_reaction(message: str | None) -> bool:
    """The message is a survivor's for another rank's failure (`REACTION_TEXTS`, or the transport's remote side)."""
    if not message:
        return False
    return bool(_REACTION.search(message)) or transport_side(message) is TransportSide.REMOTE


def peers_named(message: str | None, *, reporter: int, world: int) -> set[int]:
    """The ranks `message` (written by `reporter`) names as peers: below `world`, not the reporter, and not a rank
    NCCL prints of the reporter itself (`REPORTER_RANK`)."""
    if not message:
        return set()
    named = {int(m) for m in _NAMED.findall(_REPORTER.sub("", message))}
    return {r for r in named if r != reporter and r < world}


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
