"""The checkpoint catalog on hand-made checkpoint directories: every way a candidate is rejected, and the choice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankwatch.base.topology import Layout
from rankwatch.recovery.catalog import MANIFEST, ShardFile, Verdict, choose, list_checkpoints, rank_shard_name
from rankwatch.recovery.checkpoint import CheckpointConfig, CheckpointFault, FaultAction, SavePoint
from support import LAYOUT as SUPPORT_LAYOUT
from support import make_checkpoint

pytestmark = pytest.mark.timeout(30)

LAYOUT = SUPPORT_LAYOUT


def verdicts(run_dir: Path, **kw: object) -> dict[str, tuple[Verdict, str]]:
    return {c.path.name: (c.verdict, c.reason) for c in list_checkpoints(run_dir, verify=True, **kw)}  # type: ignore[arg-type]


def test_committed_round_trip_and_newest_first(tmp_path: Path) -> None:
    for step in (4, 9, 14):
        make_checkpoint(tmp_path, step)
    cands = list_checkpoints(tmp_path, verify=True)
    assert [c.step for c in cands] == [14, 9, 4]
    assert all(c.verdict is Verdict.COMMITTED and c.reason == "ok" and c.verified for c in cands)
    assert cands[0].manifest is not None and cands[0].manifest.layout == LAYOUT
    assert choose(tmp_path, layout=LAYOUT, world_size=4).step == 14


def test_flipped_byte_is_corrupt_and_the_older_one_is_chosen(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 4)
    newer = make_checkpoint(tmp_path, 9)
    shard = newer / "model_optim" / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    assert verdicts(tmp_path)["step-00000009"] == (Verdict.CORRUPT, "sha256 mismatch for model_optim/__2_0.distcp (rank 2)")
    # sizes alone cannot see a flipped byte: only verify=True does
    assert list_checkpoints(tmp_path, verify=False)[0].verdict is Verdict.COMMITTED
    chosen = choose(tmp_path, layout=LAYOUT, world_size=4)
    assert chosen.step == 4
    assert shard.exists()  # the rejected candidate stays on disk as evidence


@pytest.mark.parametrize("keep", [0, 17, -40])
def test_truncated_manifest_is_corrupt(tmp_path: Path, keep: int) -> None:
    make_checkpoint(tmp_path, 4)
    path = make_checkpoint(tmp_path, 9)
    text = (path / MANIFEST).read_bytes()
    (path / MANIFEST).write_bytes(text[:keep])
    verdict, reason = verdicts(tmp_path)["step-00000009"]
    assert verdict is Verdict.CORRUPT
    assert reason.startswith(f"invalid {MANIFEST}: ")
    assert choose(tmp_path, layout=LAYOUT, world_size=4).step == 4


def test_missing_manifest_is_partial(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 9)
    (path / MANIFEST).unlink()
    assert verdicts(tmp_path)["step-00000009"] == (Verdict.PARTIAL, f"missing {MANIFEST}")


def test_deleted_shard_is_partial(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 4)
    path = make_checkpoint(tmp_path, 9)
    (path / rank_shard_name(3)).unlink()
    assert verdicts(tmp_path)["step-00000009"] == (Verdict.PARTIAL, "missing shard rank-00003.pt (rank 3)")
    assert choose(tmp_path, layout=LAYOUT, world_size=4).step == 4


def test_truncated_shard_is_a_size_mismatch_even_without_verify(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 9)
    shard = path / rank_shard_name(1)
    size = shard.stat().st_size
    os.truncate(shard, size - 3)
    (c,) = list_checkpoints(tmp_path, verify=False)
    assert (c.verdict, c.reason) == (
        Verdict.CORRUPT, f"size mismatch for rank-00001.pt: manifest {size} bytes, file {size - 3}")


def test_manifest_without_a_rank_shard_is_corrupt(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 9)
    text = (path / MANIFEST).read_text().replace(rank_shard_name(2), "rank-other.pt")
    (path / MANIFEST).write_text(text)
    assert verdicts(tmp_path)["step-00000009"] == (
        Verdict.CORRUPT, f"invalid {MANIFEST}: manifest lists no shard for rank 2 ({rank_shard_name(2)})")


def test_manifest_of_another_step_is_corrupt(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, 9)
    other = make_checkpoint(tmp_path, 4)
    (path / MANIFEST).write_text((other / MANIFEST).read_text())
    assert verdicts(tmp_path)["step-00000009"][1] == f"{MANIFEST} is for step-00000004, not step-00000009"


def test_temporary_directory_is_partial_and_never_chosen(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 9, tmp=True)  # complete inside, but never renamed: not committed
    assert verdicts(tmp_path)[".step-00000009.tmp"] == (
        Verdict.PARTIAL, "uncommitted temporary directory (the save never published)")
    assert choose(tmp_path, layout=LAYOUT, world_size=4).step == 4


def test_layout_mismatch_is_rejected_with_reason(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 9, layout=Layout(dp=4))
    assert verdicts(tmp_path, layout=LAYOUT, world_size=4)["step-00000009"] == (
        Verdict.INCOMPATIBLE,
        "layout incompatible: saved by dp=4,tp=1,pp=1 (world 4), job is dp=2,tp=2,pp=1 (world 4)",
    )
    assert choose(tmp_path, layout=LAYOUT, world_size=4).step == 4
    assert choose(tmp_path, layout=Layout(dp=4), world_size=4).step == 9


def test_no_committed_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no checkpoint to resume from"):
        choose(tmp_path, layout=LAYOUT, world_size=4)
    path = make_checkpoint(tmp_path, 9)
    (path / rank_shard_name(0)).unlink()
    make_checkpoint(tmp_path, 12, tmp=True)
    with pytest.raises(ValueError, match=r"no usable checkpoint: \.step-00000012\.tmp: partial .*; "
                                         r"step-00000009: partial \(missing shard rank-00000\.pt \(rank 0\)\)$"):
        choose(tmp_path, layout=LAYOUT, world_size=4)
    with pytest.raises(ValueError, match="world size 8 does not match layout"):
        choose(tmp_path, layout=LAYOUT, world_size=8)


def test_configs_validate() -> None:
    assert CheckpointFault.parse("kill:rank=1,step=9,at=write,after_s=0.01") == CheckpointFault(
        action=FaultAction.KILL, rank=1, step=9, at=SavePoint.WRITE, after_s=0.01)
    with pytest.raises(ValueError, match="enospc needs at="):
        CheckpointFault.parse("enospc:rank=1,step=9,at=write")
    with pytest.raises(ValueError, match="bad checkpoint fault"):
        CheckpointFault.parse("kill:rank=1")
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        CheckpointConfig(keep_last=0)
    with pytest.raises(ValueError, match="must be relative"):
        ShardFile(path="../x", size=1, sha256="0" * 64, rank=0)
