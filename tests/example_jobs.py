"""The examples under examples/ launched as a user launches them, for the integration tests:
`rankwatch torchrun --run-dir <tmp>/run --standalone --nproc-per-node 4 examples/<name>.py --steps N ...`, 4 gloo ranks
on CPU, one thread each, torch's Flight Recorder on, the examples' fault variables cleared unless a test sets them."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rankwatch.analytics.liveness.records import RankRecord, TornRecord, decode_rank_record
from rankwatch.collector.liveness import rank_record_path

__all__ = ["EXAMPLES_DIR", "FAULT_VARS", "WORLD", "Job", "live_record", "run_ok", "running", "start"]

_LAUNCHES = itertools.count()

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
WORLD = 4
FAULT_VARS = ("FAULT_SLEEP_RANK", "FAULT_SLEEP_MS", "FAULT_SLEEP_STEP", "FAULT_RAISE_RANK", "FAULT_RAISE_STEP", "FAULT_RNG_SKEW_RANK",
              "FAULT_RNG_SKEW_STEP", "FAULT_BITFLIP_RANK", "FAULT_BITFLIP_STEP", "FAULT_DEVICE", "FAULT_DEVICE_STEP",
              "FAULT_HANG_RANK", "FAULT_HANG_STEP", "FAULT_DATA_SKEW_RANK", "FAULT_DATA_SKEW_STEP")


@dataclass
class Job:
    run_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def wait(self, timeout_s: float = 150.0) -> int:
        """The job's exit status (torchrun's); the whole job killed, and the test failed, past `timeout_s`."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.run_dir}: job still running after {timeout_s} s\n{self.tail()}") from None

    def kill(self) -> None:
        """End torchrun and its workers (the session this test started), if still running."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def start(tmp: Path, example: str, *args: str, steps: int, env: Mapping[str, str] | None = None) -> Job:
    """`rankwatch torchrun --standalone` of `example` with `WORLD` ranks into `tmp`/run (the same run for every
    launch into `tmp`), its output in a log of its own."""
    run_dir = tmp / "run"
    tmp.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in FAULT_VARS}
    full_env = {**base, "TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1", **(env or {})}
    log = tmp / f"job-{next(_LAUNCHES)}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rankwatch.cli", "torchrun", "--run-dir", str(run_dir), "--standalone",
             "--nproc-per-node", str(WORLD), str(EXAMPLES_DIR / f"{example}.py"), "--steps", str(steps), *args],
            env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return Job(run_dir=run_dir, proc=proc, log=log)


@contextmanager
def running(tmp: Path, example: str, *args: str, steps: int, env: Mapping[str, str] | None = None) -> Iterator[Job]:
    """A started job, killed if the block fails before it ends."""
    job = start(tmp, example, *args, steps=steps, env=env)
    try:
        yield job
    except BaseException:
        job.kill()
        raise


def run_ok(tmp: Path, example: str, *args: str, steps: int, env: Mapping[str, str] | None = None) -> Path:
    job = start(tmp, example, *args, steps=steps, env=env)
    assert job.wait() == 0, job.tail()
    return job.run_dir


def live_record(run_dir: Path, rank: int, *, min_step: int = -1, timeout_s: float = 90.0) -> RankRecord:
    """`rank`'s liveness record once it says a step >= `min_step` completed (a torn read is read again)."""
    path = rank_record_path(run_dir, rank)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            record = decode_rank_record(path.read_bytes(), str(path))
        except (FileNotFoundError, TornRecord):
            pass
        else:
            if record.pid is not None and (record.last_step if record.last_step is not None else -1) >= min_step:
                return record
        time.sleep(0.05)
    raise AssertionError(f"{path}: no record of step >= {min_step} within {timeout_s} s")
