"""The checkpoint catalog: what is on disk under ``<run>/checkpoints``, which candidates are usable, and why not.

A checkpoint directory ``step-XXXXXXXX`` is committed when its ``manifest.json`` parses and every file it lists is
present with the listed size (and, with ``verify=True``, the listed SHA-256). The saver makes that name appear by
renaming a finished temporary directory (``.step-XXXXXXXX.tmp``) that already holds the manifest, so a
``step-*`` directory without a valid manifest was damaged after the fact, and a ``.tmp`` directory is a save that
never published. The catalog only reads: rejected candidates stay on disk as evidence.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.base.topology import Layout

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
DCP_DIR = "model_optim"
"""Subdirectory of a checkpoint holding the torch.distributed.checkpoint files (model and optimizer)."""
DCP_METADATA = f"{DCP_DIR}/.metadata"

PIECE_SAVED = "saved"
PIECE_NONE = "none"
PIECE_MISSING = "missing:"
AGREED = "agreed"
"""`Manifest.agreement` of a save every rank's vote agreed on."""
DISAGREED = "disagreed:"
"""`Manifest.agreement` prefix of a save the ranks disagreed on, then how."""

_FINAL_RE = re.compile(r"^step-(\d{8})$")
_TMP_RE = re.compile(r"^\.step-(\d{8})\.tmp$")
_CHUNK = 1 << 20


def checkpoint_id(step: int) -> str:
    return f"step-{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint id ``step-XXXXXXXX``; None for anything else."""
    m = _FINAL_RE.match(name)
    return int(m.group(1)) if m else None


def rank_shard_name(rank: int) -> str:
    """The per-rank state file (RNG states, data position, ...) of `rank`, relative to the checkpoint."""
    return f"rank-{rank:05d}.pt"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Verdict(StrEnum):
    COMMITTED = "committed"
    """Manifest valid, every listed file present and intact (and the layout fits, where one was asked)."""
    PARTIAL = "partial"
    """A save that never finished: no manifest, a temporary directory, or a listed file missing."""
    CORRUPT = "corrupt"
    """Finished once but damaged: unreadable manifest, a size or SHA-256 mismatch."""
    INCOMPATIBLE = "incompatible"
    """Intact, but saved by a different layout or world size than the job asking."""
    INCOMPLETE = "incomplete"
    """Intact, but its manifest says it lacks a piece of state the job declared (no data position, a scheduler whose
    state could not be read), or that the ranks disagreed when it was saved (`Manifest.agreement`): never a recovery
    point, since resuming from it would change the trajectory invisibly (or carry the disagreement on)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardFile:
    path: str
    """Path relative to the checkpoint directory (``/``-separated)."""
    size: int
    """Bytes."""
    sha256: str
    """Hex SHA-256 of the file's bytes."""
    rank: int
    """Rank that wrote it."""

    def __post_init__(self) -> None:
        if not self.path or self.path.startswith("/") or ".." in self.path.split("/"):
            raise ValueError(f"shard path {self.path!r} must be relative and stay inside the checkpoint")
        if self.size < 0:
            raise ValueError(f"shard {self.path}: size must be >= 0, got {self.size}")
        if len(self.sha256) != 64:
            raise ValueError(f"shard {self.path}: sha256 must be 64 hex digits, got {self.sha256!r}")
        if self.rank < 0:
            raise ValueError(f"shard {self.path}: rank must be >= 0, got {self.rank}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Versions:
    """What produced a checkpoint: enough to tell whether a resume would run the same code on the same data."""

    rankwatch: str
    """rankwatch package version."""
    torch: str
    """torch version."""
    python: str
    """Python version (major.minor.micro)."""
    numpy: str
    """numpy version."""
    config_sha256: str
    """SHA-256 of the job-config fields that change the numerics (model, layout, seed, batch, lr, threads)."""
    seed: int
    """The job's seed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    checkpoint_id: str
    """``step-XXXXXXXX``."""
    step: int
    """Last training step included in the checkpoint."""
    world_size: int
    """Ranks that saved it."""
    layout: Layout
    """Parallel layout that saved it."""
    versions: Versions
    """Code, config and environment versions."""
    files: tuple[ShardFile, ...]
    """Every file of the checkpoint except the manifest itself."""
    created_wall_ns: int
    """Wall clock when rank 0 wrote the manifest."""
    pieces: tuple[tuple[str, str], ...] = ()
    """The state beyond model and optimizer the job declared, each as (name, state): `PIECE_SAVED`, `PIECE_NONE` (the
    job said it has none: no scheduler, no scaler) or ``missing: <why>`` (declared but not in this checkpoint).
    Empty in manifests written before pieces were recorded (the canary's saves hold every piece)."""
    global_batch: int | None = None
    """Samples per optimizer step across the job when it was saved, where the job declared it
    (`recovery.Checkpointer(global_batch=...)`); a resume on another world records the change in the lineage."""
    determinism: str = ""
    """The saver's `recovery.determinism.DeterminismInputs` as canonical JSON (`lineage.inputs_json`): what decides
    the numerics beyond config and state, so a resume under other inputs is CHANGED with what changed. "" where the
    saver did not record them (older manifests; the canary records them in its launch records)."""
    agreement: str = ""
    """What the ranks said of one another when it was saved (`recovery.Checkpointer`: the consistency gate's fields,
    judged over every rank's vote in the save's own gather): `AGREED`, ``disagreed: <how>`` (`DISAGREED`), or ""
    where the saver did not check (older manifests, the canary's own saves)."""

    @property
    def disagreed(self) -> str:
        """How the ranks disagreed when it was saved ("" when they did not, or nobody checked)."""
        return self.agreement.removeprefix(DISAGREED).strip() if self.agreement.startswith(DISAGREED) else ""

    @property
    def missing(self) -> tuple[tuple[str, str], ...]:
        """(piece, why) for each piece this checkpoint lacks."""
        return tuple((name, state.removeprefix(PIECE_MISSING).strip()) for name, state in self.pieces
                     if state.startswith(PIECE_MISSING))

    def __post_init__(self) -> None:
        names = [n for n, _ in self.pieces]
        if len(set(names)) != len(names):
            raise ValueError("manifest lists a piece twice")
        for name, state in self.pieces:
            if not name or not (state in (PIECE_SAVED, PIECE_NONE) or state.startswith(PIECE_MISSING)):
                raise ValueError(f"manifest piece {name!r}: state {state!r} is not {PIECE_SAVED!r}, {PIECE_NONE!r} "
                                 f"or {PIECE_MISSING!r} and a reason")
        if self.checkpoint_id != checkpoint_id(self.step):
            raise ValueError(f"manifest checkpoint_id {self.checkpoint_id!r} does not match step {self.step}")
        if self.global_batch is not None and self.global_batch < 1:
            raise ValueError(f"manifest global_batch {self.global_batch} is not a positive number of samples")
        if self.agreement not in ("", AGREED) and not self.agreement.startswith(DISAGREED):
            raise ValueError(f"manifest agreement {self.agreement[:60]!r} is not '', {AGREED!r} or {DISAGREED!r} and "
                             "how")
        if self.world_size != self.layout.world_size:
            raise ValueError(f"manifest world_size {self.world_size} does not match layout {self.layout}")
        paths = [f.path for f in self.files]
        if len(set(paths)) != len(paths):
            raise ValueError("manifest lists a file twice")
        listed = set(paths)
        for rank in range(self.world_size):
            if rank_shard_name(rank) not in listed:
                raise ValueError(f"manifest lists no shard for rank {rank} ({rank_shard_name(rank)})")
        if DCP_METADATA not in listed:
            raise ValueError(f"manifest does not list {DCP_METADATA}")

    def to_json(self) -> str:
        doc = {
            "format": MANIFEST_FORMAT,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "world_size": self.world_size,
            "layout": {"dp": self.layout.dp, "tp": self.layout.tp, "pp": self.layout.pp},
            "versions": {name: getattr(self.versions, name) for name in Versions.__dataclass_fields__},
            "created_wall_ns": self.created_wall_ns,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256, "rank": f.rank} for f in self.files],
        }
        if self.pieces:
            doc["pieces"] = dict(self.pieces)
        if self.agreement:
            doc["agreement"] = self.agreement
        if self.determinism:
            doc["determinism"] = json.loads(self.determinism)
        if self.global_batch is not None:
            doc["global_batch"] = self.global_batch
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse a manifest; ValueError (json.JSONDecodeError included) names what is wrong."""
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("manifest is not a JSON object")
        if doc.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {doc.get('format')!r}, expected {MANIFEST_FORMAT}")
        pieces = _typed(doc, "pieces", dict) if "pieces" in doc else {}
        try:
            return cls(
                checkpoint_id=_typed(doc, "checkpoint_id", str),
                step=_typed(doc, "step", int),
                world_size=_typed(doc, "world_size", int),
                layout=Layout(**{k: _typed(_typed(doc, "layout", dict), k, int) for k in ("dp", "tp", "pp")}),
                versions=Versions(**{k: _typed(_typed(doc, "versions", dict), k, int if k == "seed" else str)
                                     for k in Versions.__dataclass_fields__}),
                files=tuple(
                    ShardFile(path=_typed(f, "path", str), size=_typed(f, "size", int),
                              sha256=_typed(f, "sha256", str), rank=_typed(f, "rank", int))
                    for f in _typed(doc, "files", list)
                ),
                created_wall_ns=_typed(doc, "created_wall_ns", int),
                pieces=tuple((k, _typed(pieces, k, str)) for k in pieces),
                agreement=_typed(doc, "agreement", str) if "agreement" in doc else "",
                global_batch=_typed(doc, "global_batch", int) if "global_batch" in doc else None,
                determinism=(json.dumps(_typed(doc, "determinism", dict), sort_keys=True, separators=(",", ":"),
                                        ensure_ascii=False) if "determinism" in doc else ""),
            )
        except TypeError as exc:
            raise ValueError(str(exc)) from None


def _typed(doc: Any, key: str, kind: type) -> Any:
    if not isinstance(doc, dict) or key not in doc:
        raise ValueError(f"missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    path: Path
    """The candidate's directory."""
    step: int
    """Step from the directory name."""
    verdict: Verdict
    """Whether it may be loaded."""
    reason: str
    """One line: why it has this verdict ("ok" for a committed one)."""
    manifest: Manifest | None
    """The parsed manifest, where it parsed."""
    verified: bool
    """True when SHA-256 was checked (not only sizes)."""

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id(self.step)

    @property
    def usable(self) -> bool:
        return self.verdict is Verdict.COMMITTED


def _judge(path: Path, step: int, *, verify: bool, layout: Layout | None, world_size: int | None) -> Candidate:
    def verdict(v: Verdict, reason: str, manifest: Manifest | None = None) -> Candidate:
        return Candidate(path=path, step=step, verdict=v, reason=reason, manifest=manifest, verified=verify)

    if _TMP_RE.match(path.name):
        return verdict(Verdict.PARTIAL, "uncommitted temporary directory (the save never published)")
    manifest_path = path / MANIFEST
    try:
        text = manifest_path.read_text()
    except FileNotFoundError:
        return verdict(Verdict.PARTIAL, f"missing {MANIFEST}")
    except (OSError, UnicodeDecodeError) as exc:
        return verdict(Verdict.CORRUPT, f"unreadable {MANIFEST}: {exc}")
    try:
        manifest = Manifest.from_json(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError: a truncated manifest lands here
        return verdict(Verdict.CORRUPT, f"invalid {MANIFEST}: {exc}")
    if manifest.step != step:
        return verdict(Verdict.CORRUPT, f"{MANIFEST} is for {manifest.checkpoint_id}, not {path.name}", manifest)
    for f in manifest.files:
        file = path / f.path
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            return verdict(Verdict.PARTIAL, f"missing shard {f.path} (rank {f.rank})", manifest)
        if size != f.size:
            return verdict(Verdict.CORRUPT, f"size mismatch for {f.path}: manifest {f.size} bytes, file {size}", manifest)
    if verify:
        for f in manifest.files:
            if sha256_file(path / f.path) != f.sha256:
                return verdict(Verdict.CORRUPT, f"sha256 mismatch for {f.path} (rank {f.rank})", manifest)
    if layout is not None and manifest.layout != layout or world_size is not None and manifest.world_size != world_size:
        want = f"{layout or '?'} (world {world_size if world_size is not None else '?'})"
        return verdict(
            Verdict.INCOMPATIBLE,
            f"layout incompatible: saved by {manifest.layout} (world {manifest.world_size}), job is {want}",
            manifest,
        )
    if manifest.missing:
        lacks = "; ".join(f"{name} ({why})" for name, why in manifest.missing)
        return verdict(Verdict.INCOMPLETE, f"saved without {lacks}: not a recovery point", manifest)
    if manifest.disagreed:
        return verdict(Verdict.INCOMPLETE, f"the ranks disagreed when it was saved ({manifest.disagreed}): not a "
                                           "recovery point", manifest)
    return verdict(Verdict.COMMITTED, "ok", manifest)


def list_checkpoints(
    run_dir: Path, *, verify: bool, layout: Layout | None = None, world_size: int | None = None
) -> tuple[Candidate, ...]:
    """Every checkpoint candidate of the run, newest step first (a finished directory before a temporary one of
    the same step). `verify` reads every byte to check SHA-256; otherwise sizes only. With `layout` /
    `world_size`, intact checkpoints saved by another layout are INCOMPATIBLE."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return ()
    found: list[tuple[int, bool, Path]] = []
    for entry in root.iterdir():
        m = _FINAL_RE.match(entry.name) or _TMP_RE.match(entry.name)
        if m and entry.is_dir():
            found.append((int(m.group(1)), entry.name.startswith("."), entry))
    found.sort(key=lambda t: (-t[0], t[1]))
    return tuple(_judge(p, step, verify=verify, layout=layout, world_size=world_size) for step, _, p in found)


def choose(run_dir: Path, *, layout: Layout, world_size: int) -> Candidate:
    """The newest committed, SHA-256-verified checkpoint this layout can load; ValueError listing why each
    candidate was rejected when there is none."""
    if world_size != layout.world_size:
        raise ValueError(f"world size {world_size} does not match layout {layout} ({layout.world_size} ranks)")
    candidates = list_checkpoints(run_dir, verify=True, layout=layout, world_size=world_size)
    for c in candidates:
        if c.usable:
            return c
    root = Path(run_dir) / CHECKPOINT_DIR
    if not candidates:
        raise ValueError(f"{root}: no checkpoint to resume from (no step-* directories)")
    rejected = "; ".join(f"{c.path.name}: {c.verdict} ({c.reason})" for c in candidates)
    raise ValueError(f"{root}: no usable checkpoint: {rejected}")
