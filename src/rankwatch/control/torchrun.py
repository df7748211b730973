"""`rankwatch torchrun [--run-dir DIR] [torchrun args] SCRIPT [args]`: torchrun with rankwatch beside every rank.

The command line is torchrun's own, read by torchrun's own parser (torch/distributed/run.py `get_args_parser`), and
changed in one place: each worker runs under the host agent (`collector.supervise`, through torchrun's
``--no-python``), which records the worker's exit status and signal the moment it ends, so liveness and fail-stop
need no rankwatch launcher. The environment gets ``RANKWATCH_RUN_DIR`` (what `collector.attach()` writes to) and,
unless set, ``TORCH_FR_BUFFER_SIZE`` (`FR_BUFFER_DEFAULT`). Then
torchrun replaces this process (`os.execve`): its signals, output and exit status are torchrun's.

Plain ``torchrun`` (and ``srun``) still work with `collector.attach()`: without the host agent a rank's end is known
only from its own records (its exit event, or its liveness record going stale: a heartbeat interval or more later,
and a SIGKILLed rank's last part-file interval lost), and a rank the launcher stopped is told from the one that died
by the timing of their records alone.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rankwatch.collector.flight import FR_BUFFER_ENV
from rankwatch.collector.launcher_env import RUN_DIR_ENV

__all__ = ["FR_BUFFER_DEFAULT", "split_run_dir", "torchrun_argv"]

FR_BUFFER_DEFAULT = "2000"
"""``TORCH_FR_BUFFER_SIZE`` when the environment has none: torch's Flight Recorder on, its last 2,000 collectives
kept per rank, so each rank can say how many collectives its groups issued (collector/flight.py) and `analyze` can
say when the collectives table is short."""

_DROPPED_FLAGS = ("-m", "--module", "--no-python", "--no_python")
"""torchrun's flags for how the worker is run, replaced by the host agent's own (`--module`, `--exec`)."""


def split_run_dir(argv: Sequence[str], env: Mapping[str, str]) -> tuple[Path, list[str]]:
    """(run directory, torchrun's arguments): ``--run-dir DIR`` or ``--run-dir=DIR`` first, else
    ``$RANKWATCH_RUN_DIR``, else runs/<script>-<UTC time>."""
    args = list(argv)
    run_dir: str | None = None
    if args and args[0] == "--run-dir":
        if len(args) < 2:
            raise ValueError("--run-dir needs a directory")
        run_dir, args = args[1], args[2:]
    elif args and args[0].startswith("--run-dir="):
        run_dir, args = args[0].split("=", 1)[1], args[1:]
    if not run_dir:
        run_dir = env.get(RUN_DIR_ENV) or ""
    if not run_dir:
        stem = next((Path(a).stem for a in reversed(args) if a.endswith(".py")), "job")
        run_dir = f"runs/{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    return Path(run_dir), args


def torchrun_argv(args: Sequence[str]) -> list[str]:
    """torchrun's arguments with each worker run under the host agent. ValueError naming the problem when torchrun's
    parser finds no training script (its own usage errors exit as torchrun's do)."""
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(list(args))
    script, script_args = str(ns.training_script), [str(a) for a in ns.training_script_args]
    at = len(args) - len(script_args) - 1
    if at < 0 or args[at] != script:
        raise ValueError(f"could not find the training script {script!r} in the torchrun arguments")
    head = [a for a in args[:at] if a not in _DROPPED_FLAGS]
    mode = ["--module"] if ns.module else ["--exec"] if ns.no_python else []
    return [*head, "--no-python", sys.executable, "-m", "rankwatch.collector.supervise", *mode, script, *script_args]


def exec_torchrun(argv: Sequence[str], *, say: object = print) -> None:
    """Replace this process with torchrun (never returns; OSError if it cannot start)."""
    run_dir, args = split_run_dir(argv, os.environ)
    full = torchrun_argv(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, RUN_DIR_ENV: str(run_dir.resolve())}
    env.setdefault(FR_BUFFER_ENV, FR_BUFFER_DEFAULT)  # torch's Flight Recorder: the collectives table is checked
    if callable(say):
        say(f"rankwatch: run directory {run_dir}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "torch.distributed.run", *full], env)
