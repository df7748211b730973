"""Two runs with the same seed, layout and steps end bitwise identical; another seed does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import canary, rows, run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 25


def _final(run_dir: Path, seed: int) -> list[tuple[object, ...]]:
    result = run(canary(run_dir, layout="dp=2,pp=2", hosts=2, steps=STEPS, seed=seed, fingerprint_every=0))
    assert result.ok, result
    return rows(
        run_dir,
        f"SELECT rank, param_hash, optim_hash, rng_torch_hash, data_position FROM fingerprints "
        f"WHERE step = {STEPS - 1} ORDER BY rank",
    )


def test_same_seed_bitwise_identical(tmp_path: Path) -> None:
    a = _final(tmp_path / "a", seed=7)
    b = _final(tmp_path / "b", seed=7)
    c = _final(tmp_path / "c", seed=8)
    assert len(a) == 4
    assert a == b
    assert [r[1] for r in a] != [r[1] for r in c]
