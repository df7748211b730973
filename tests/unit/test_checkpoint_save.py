"""A failed save in one process (a world of one gloo rank): DCP's CheckpointException is caught, the partial files
are removed and described in a checkpoint_failed event with the bytes freed, the committed checkpoint stays."""

from __future__ import annotations

import re
import shutil
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from rankwatch.base.rundir import CHECKPOINT_DIR
from rankwatch.base.schema import CheckpointPhases, EventKind, Events, Table, column_names
from rankwatch.base.topology import Layout
from rankwatch.collector import Collector, CollectorConfig, MemorySink
from rankwatch.recovery import checkpoint as ckpt_mod
from rankwatch.recovery.catalog import Verdict, list_checkpoints
from rankwatch.recovery.checkpoint import (
    CheckpointConfig, DcpSaveError, SaveResult, commit_checkpoint, current_versions, stage_checkpoint,
)

from support import world_of_one  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(60)

LAYOUT = Layout(dp=1, tp=1, pp=1)


def _save(run_dir: Path, group: Any, sink: MemorySink, step: int) -> SaveResult:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    c = Collector(CollectorConfig(run_dir=run_dir, handle_sigterm=False), rank=0, world_size=1, sink=sink)
    staged = stage_checkpoint(c, step=step, rank=0, layout=LAYOUT, model=model,
                              optimizer=torch.optim.AdamW(model.parameters()), data_position=0,
                              versions=current_versions(object()))
    return commit_checkpoint(c, CheckpointConfig(), staged, run_dir=run_dir, group=group)


def _full_disk_dcp(written: int) -> SimpleNamespace:
    """A stand-in for torch.distributed.checkpoint whose save writes `written` bytes, then fails as DCP does on a
    full disk: a CheckpointException (a BaseException) carrying each rank's OSError."""

    def save(state: object, *, storage_writer: Path, process_group: object) -> None:
        storage_writer.mkdir(parents=True)
        (storage_writer / "__0_0.distcp").write_bytes(b"\0" * written)
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise CheckpointException("save failed", {0: (exc, traceback.extract_tb(exc.__traceback__))}) from None

    return SimpleNamespace(save=save, FileSystemWriter=lambda path, **kw: Path(path))


def test_a_checkpoint_exception_is_a_failed_save_that_frees_its_partial(
    tmp_path: Path, world_of_one: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = MemorySink()
    assert _save(tmp_path, world_of_one, sink, 4).ok
    monkeypatch.setattr(ckpt_mod, "dcp", _full_disk_dcp(written=300_000))
    result = _save(tmp_path, world_of_one, sink, 9)

    assert not result.ok and result.path is None
    assert result.reason == "rank 0: DcpSaveError: rank 0: OSError: [Errno 28] No space left on device"
    assert result.freed_bytes >= 300_000  # the DCP file, and the rank file written beside it
    assert sorted(p.name for p in (tmp_path / CHECKPOINT_DIR).iterdir()) == ["step-00000004"]
    assert [(c.step, c.verdict) for c in list_checkpoints(tmp_path, verify=True)] == [(4, Verdict.COMMITTED)]
    events = [dict(zip(column_names(Table.EVENTS), r)) for r in sink.rows(Table.EVENTS)]
    (failed,) = [e for e in events if e[Events.KIND] == EventKind.CHECKPOINT_FAILED]
    message = str(failed[Events.MESSAGE])
    assert message.startswith(f"checkpoint step-00000009 not committed: {result.reason}; partial .step-00000009.tmp "
                              "removed: ")
    m = re.search(r"removed: (\d+) file\(s\), (\d+) bytes freed; (\d+) bytes free", message)
    assert m is not None and int(m.group(2)) == result.freed_bytes, message
    assert int(m.group(1)) >= 1
    phases = [dict(zip(column_names(Table.CHECKPOINT_PHASES), r)) for r in sink.rows(Table.CHECKPOINT_PHASES)]
    (write,) = [p for p in phases if not p[CheckpointPhases.OK]]  # one line, not DCP's traceback per rank
    assert write[CheckpointPhases.ERROR] == result.reason.removeprefix("rank 0: ")


def test_the_first_failing_rank_of_a_checkpoint_exception_is_named(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    failures: dict[int, Any] = {3: (OSError(28, "No space left on device"), traceback.StackSummary()),
                                1: (RuntimeError("unexpected pos 704 vs 598\nmore"), traceback.StackSummary())}
    line = ckpt_mod._first_line(DcpSaveError.of(CheckpointException("x", failures), tmp_path))
    assert line == "DcpSaveError: rank 1: RuntimeError: unexpected pos 704 vs 598"  # room left: torch's words
    # torch's short write on a full disk (caffe2/serialize/inline_container.cc) says so, with the free space
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10 << 30, 10 << 30, 4096))
    line = ckpt_mod._first_line(DcpSaveError.of(CheckpointException("x", failures), tmp_path))
    assert line == ("DcpSaveError: rank 1: No space left on device (4096 bytes free; torch's writer: RuntimeError: "
                    "unexpected pos 704 vs 598)")
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(28, "no room")  # an errno anywhere in the chain names it
    assert ckpt_mod._why(wrapped, tmp_path) == "No space left on device (ENOSPC): RuntimeError: save failed"

