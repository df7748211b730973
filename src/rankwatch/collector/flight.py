"""How many collectives each process group issued, by torch's own count: the Flight Recorder's process-group status.

With the Flight Recorder on (``TORCH_FR_BUFFER_SIZE`` > 0; `rankwatch torchrun` sets it), torch keeps per process
group the sequence number of the last collective enqueued (``pg_status[<group name>].last_enqueued_collective`` in
the JSON dump, format 2.10: ``torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives, onlyActive)``; the
same counter the group's collectives carry as ``collective_seq_id``; point-to-point operations are counted apart and
not here). The dump is read as JSON (never pickle), twice a run: at start and before the groups are destroyed.

The collector takes the counts when it starts and when it closes, and records the difference per group, under the
group names its own rows use, in one `EventKind.COLLECTIVE_COUNTS` event: what `analytics` compares the collectives
table against, to say when the table is partial (collectives issued that nothing recorded: a C++ caller such as DDP's
construction-time broadcasts, a framework path not instrumented). Without the Flight Recorder there is no count and
no event.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["FR_BUFFER_ENV", "Dump", "Entry", "dump", "enabled", "encode_counts", "ring_size", "entries", "issued", "issued_by_group", "named", "outstanding", "status",
           "table_groups"]

FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""torch's switch for the Flight Recorder (torch/csrc/distributed/c10d/FlightRecorder.hpp): entries kept per rank."""


def ring_size() -> int:
    """Entries the Flight Recorder keeps, all groups together (``TORCH_FR_BUFFER_SIZE``; 0: off or not a number)."""
    try:
        return max(0, int(os.environ.get(FR_BUFFER_ENV, "0") or 0))
    except ValueError:
        return 0


def enabled() -> bool:
    """The Flight Recorder is on in this process (``TORCH_FR_BUFFER_SIZE`` > 0, read by torch when a group is made)."""
    return ring_size() > 0


def issued() -> dict[str, int]:
    """Collectives enqueued so far per process group, by c10d group name; empty when the Flight Recorder is off or
    this torch has none. Never raises.

    ``pg_status`` is keyed by the group's id in this process (its ``pg_id``, the order this rank's groups were
    created in), not by its name; the entries carry both (``pg_id`` and ``process_group`` = [name, description]),
    so the ids are named from the entries still in the ring buffer. A group none of whose entries is left there
    gets no count (nothing is compared for it, rather than a wrong number)."""
    found = dump()
    return {} if found is None else named(found)


def named(found: Dump) -> dict[str, int]:
    """`found`'s last enqueued collective per group, by c10d group name (the groups with an entry in it)."""
    names = {e.pg_id: e.group for e in found.entries}
    return {names[pg_id]: n for pg_id, n in found.last.items() if pg_id in names}


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One collective as the Flight Recorder holds it."""

    seq: int
    """Its ``collective_seq_id`` in its group."""
    op: str
    """Its ``profiling_name`` without the backend ("gloo:broadcast" -> "broadcast")."""
    created_ns: int
    """``time_created_ns``: when it was enqueued (wall clock; c10d's getTime)."""
    nbytes: int
    """Input bytes (element count of ``input_sizes`` times the size of each ``input_dtypes`` entry)."""
    group: str = ""
    """Its process group's c10d name (``process_group[0]``)."""
    pg_id: str = ""
    """Its process group's id in this process (``pg_id``: the key of ``pg_status``)."""
    dtype: str = ""
    """The first ``input_dtypes`` entry (c10's ScalarType name: "Float", "BFloat16", ...)."""
    device_ns: int | None = None
    """``duration_ms`` as nanoseconds: the device time NCCL's CUDA events measured (``TORCH_NCCL_ENABLE_TIMING``);
    None where none was measured (gloo; NCCL without timing; not completed yet)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Dump:
    """The Flight Recorder's collectives (point-to-point left out) and, per group id, the last collective enqueued."""

    entries: tuple[Entry, ...]
    last: dict[str, int]


_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
                "Byte": 1, "Bool": 1, "ComplexFloat": 8, "ComplexDouble": 16}
"""Sizes of the dtype names in ``input_dtypes`` (c10's ScalarType names); others count as 1 byte an element."""


def _read(include_entries: bool) -> dict[str, Any]:
    import torch

    return dict(json.loads(getattr(torch._C._distributed_c10d, "_dump_fr_trace_json")(include_entries, False)))


def _last(raw: dict[str, Any]) -> dict[str, int]:
    out = {}
    for pg_id, s in (raw.get("pg_status") or {}).items():
        n = int(s.get("last_enqueued_collective", -1))
        if n >= 0:
            out[str(pg_id)] = n
    return out


def _entry(e: dict[str, Any]) -> Entry:
    nbytes = 0
    for size, dtype in zip(e.get("input_sizes") or (), e.get("input_dtypes") or ()):
        n = 1
        for d in size:
            n *= int(d)
        nbytes += n * _DTYPE_BYTES.get(str(dtype), 1)
    pg = e.get("process_group") or ["", ""]
    dtypes = e.get("input_dtypes") or ()
    ms = e.get("duration_ms")
    return Entry(seq=int(e.get("collective_seq_id", -1)), op=str(e.get("profiling_name", "?")).split(":", 1)[-1],
                 created_ns=int(e.get("time_created_ns", 0)), nbytes=nbytes, group=str(pg[0]),
                 pg_id=str(e.get("pg_id", "")), dtype=str(dtypes[0]) if dtypes else "",
                 device_ns=None if ms is None else int(float(ms) * 1e6))


def status() -> dict[str, int]:
    """Per group id (``pg_id``), the last collective enqueued (``pg_status``), read without the entries (~0.1 ms);
    empty when the Flight Recorder is off or this torch has none. Never raises."""
    try:
        return _last(_read(False))
    except Exception:
        return {}


def outstanding() -> dict[str, tuple[int, int]]:
    """Per group id (``pg_id``), (the first collective not completed, the last enqueued) where the group has
    collectives enqueued and not completed (``pg_status``'s ``last_completed_collective`` and
    ``last_enqueued_collective``); read without the entries. Empty when none, or the Flight Recorder is off. Never
    raises."""
    try:
        out = {}
        for pg_id, s in (_read(False).get("pg_status") or {}).items():
            enqueued = int(s.get("last_enqueued_collective", -1))
            completed = int(s.get("last_completed_collective", -1))
            if enqueued > completed >= -1 and enqueued > 0:
                out[str(pg_id)] = (max(completed, 0) + 1, enqueued)
        return out
    except Exception:
        return {}


def dump() -> Dump | None:
    """The whole ring buffer's collectives, in sequence order per group, and the groups' last enqueued; None when the
    Flight Recorder is off or unreadable. Milliseconds at thousands of entries: for the writer thread or rare calls.
    Never raises."""
    try:
        raw = _read(True)
        found = [_entry(e) for e in raw.get("entries") or () if not e.get("is_p2p")]
        return Dump(entries=tuple(sorted(found, key=lambda x: (x.pg_id, x.seq))), last=_last(raw))
    except Exception:
        return None


def entries(group_name: str, first_seq: int, last_seq: int) -> list[Entry]:
    """The collectives of group `group_name` with sequence numbers first_seq..last_seq still in the Flight Recorder,
    in order; empty when it is off. Reads the whole ring buffer: for rare calls (DDP's set-up broadcasts), never per
    collective. Never raises."""
    if last_seq < first_seq:
        return []
    found = dump()
    if found is None:
        return []
    return [e for e in found.entries if e.group == group_name and first_seq <= e.seq <= last_seq]


def table_groups(tracker: Any, only: set[str] | None = None) -> dict[str, Any]:
    """c10d group name -> the tracker's `GroupInfo` (`CollectiveTracker.info`: the names its rows use) of the groups
    this rank belongs to; with `only`, of those c10d names alone."""
    try:
        from torch.distributed.distributed_c10d import _world

        names = dict(_world.pg_names)
    except Exception:
        return {}
    out: dict[str, Any] = {}
    for pg, c10d_name in names.items():
        if only is not None and str(c10d_name) not in only:
            continue
        try:
            out[str(c10d_name)] = tracker.info(pg)
        except Exception:  # a group this rank is not in
            continue
    return out


def issued_by_group(counts: dict[str, int], tracker: Any) -> dict[str, int]:
    """`counts` (by c10d group name) under the names the tracker's rows use (`CollectiveTracker.info`), for the groups
    this rank belongs to."""
    out: dict[str, int] = {}
    for c10d_name, info in table_groups(tracker, set(counts)).items():
        out[info.name] = out.get(info.name, 0) + counts[c10d_name]
    return out


def encode_counts(counts: dict[str, int]) -> str:
    """The event message: a JSON object group -> collectives issued while recording, sorted by group."""
    return json.dumps(dict(sorted(counts.items())), separators=(",", ":"))
