"""benchmarks/gpu_check.py, the prepared check a lent GPU machine runs: here its CPU part, end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CPU_CHECKS = ("replay sampler", "fake device timer -> collector", "gpu_slow CPU fallback (work)",
              "gpu_slow CPU fallback (canary)")
GPU_CHECKS = ("nvml sampler", "gpu_slow 1 rank (device)", "gpu_slow 2 ranks (analyze)",
              "collector overhead (GPU step)", "CUDA device timer (in-process)")


@pytest.mark.slow  # a 1-rank canary and the replay checks, in a subprocess
@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU part is for a lent GPU machine, not CI")
def test_cpu_part_passes_and_prints_one_table(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[:2] == ["| check | result | figures |", "|---|---|---|"]
    results = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in table[2:]}
    assert results["cuda"] == "SKIP" and "no CUDA device" in done.stdout
    assert {name: results.get(name) for name in CPU_CHECKS} == dict.fromkeys(CPU_CHECKS, "PASS"), done.stdout
    assert not set(GPU_CHECKS) & set(results)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["check"] for r in saved] == list(results)
    assert (tmp_path / "gpu_check.md").read_text().splitlines() == table


def test_t_interval_and_table_rendering() -> None:
    import gpu_check  # benchmarks/ is on the tests' path (pyproject: pythonpath)

    mean, low, high = gpu_check.t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and low == pytest.approx(2.0 - 4.303 / 3**0.5) and high == pytest.approx(2.0 + 4.303 / 3**0.5)
    assert gpu_check.t_interval([5.0])[1:] == (float("-inf"), float("inf"))
    rendered = gpu_check.render([gpu_check.Result(check="a", result="PASS", figures="x | y")])
    assert rendered.splitlines()[-1] == "| a | PASS | x / y |"
