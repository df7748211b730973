"""Who this process is, as its launcher said it: torchrun's and Slurm's environment variables, read once.

Torch-free: the host agent beside each rank (`collector.supervise`) reads it too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["ATTEMPT_ENV", "DISABLE_ENV", "LAUNCH_ENV", "RUN_DIR_ENV", "LaunchEnv", "disabled", "launch_env", "numbered"]

RUN_DIR_ENV = "RANKWATCH_RUN_DIR"
"""The run directory when `attach` is given none (`rankwatch torchrun --run-dir` sets it)."""

DISABLE_ENV = "RANKWATCH_DISABLE"
"""Set to 1 (true, yes, on): `attach` records nothing and patches nothing (a job run without rankwatch, unedited)."""


ATTEMPT_ENV = "RANKWATCH_ATTEMPT"
"""The attempt number, when the launcher numbers attempts itself (the canary's launcher); otherwise `numbered` finds
it in the run file from the launch's own identity."""

LAUNCH_ENV = "RANKWATCH_LAUNCH"
"""The launch's name, when the process that started the launcher names it (the recovery manager's command launcher,
`control.command`, which records the launch under it first): it replaces torchrun's run id in the launch key, with the
restart count after it, so torchrun's own restarts of that launch are the next attempts."""


def disabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether `DISABLE_ENV` turns rankwatch off; any other value than the four words and 0/false/no/off/empty is
    an error naming it."""
    env = os.environ if env is None else env
    text = env.get(DISABLE_ENV, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"rankwatch.attach: environment variable {DISABLE_ENV}={text[:40]!r} is not 1/0, true/false, "
                     "yes/no or on/off")


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEnv:
    """Who this process is, as the launcher said it."""

    rank: int
    world_size: int
    local_rank: int
    attempt: int
    """The attempt this process belongs to: `ATTEMPT_ENV` when set; else, until `numbered` finds the launch's number
    in the run file, the launcher's restart count (torchrun's TORCHELASTIC_RESTART_COUNT, Slurm's
    SLURM_RESTART_COUNT)."""
    launcher: str
    """"torchrun", "slurm" or "none" (a single process)."""
    key: str | None = None
    """What names this launch, the same in every process of it and different in every other launch: torchrun's
    rendezvous run id (TORCHELASTIC_RUN_ID, a fresh UUID per ``--standalone`` launch) with its restart count, or
    Slurm's job and step ids with its restart count; None where the launcher gives no such name (`ATTEMPT_ENV` set,
    or ranks started by hand)."""


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None or text == "":
        if default is None:
            raise ValueError(f"rankwatch.attach: environment variable {name} is not set")
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"rankwatch.attach: environment variable {name}={text[:40]!r} is not an integer") from None


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launcher's description of this process: torchrun's variables first, then Slurm's, else a world of one."""
    env = os.environ if env is None else env
    key: str | None = None
    if "RANK" in env and "WORLD_SIZE" in env:
        restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", _int(env, "SLURM_RESTART_COUNT", 0))
        out = LaunchEnv(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
                        local_rank=_int(env, "LOCAL_RANK", 0), attempt=restarts,
                        launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env else "env")
        if env.get(LAUNCH_ENV):
            key = f"{env[LAUNCH_ENV]}:{restarts}"
        elif env.get("TORCHELASTIC_RUN_ID"):
            key = f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{restarts}"
    elif "SLURM_PROCID" in env:
        restarts = _int(env, "SLURM_RESTART_COUNT", 0)
        out = LaunchEnv(rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
                        local_rank=_int(env, "SLURM_LOCALID", 0), attempt=restarts, launcher="slurm")
        if env.get(LAUNCH_ENV):
            key = f"{env[LAUNCH_ENV]}:{restarts}"
        elif env.get("SLURM_JOB_ID"):
            key = f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}:{restarts}"
    else:
        out = LaunchEnv(rank=0, world_size=1, local_rank=0, attempt=0, launcher="none")
    if not 0 <= out.rank < out.world_size:
        raise ValueError(f"rankwatch.attach: rank {out.rank} is outside the world of {out.world_size}")
    if env.get(ATTEMPT_ENV, "") != "":
        attempt = _int(env, ATTEMPT_ENV)
        if attempt < 0:
            raise ValueError(f"rankwatch.attach: environment variable {ATTEMPT_ENV}={attempt} is negative")
        return replace(out, attempt=attempt)
    return replace(out, key=key)


def numbered(me: LaunchEnv, run_dir: Path | str) -> LaunchEnv:
    """`me` with the attempt number its launch has in `<run>/run.json` (`base.rundir.claim_launch`: the first process
    of a launch to get there records it), so a relaunch of the same command — by a person, by the recovery manager,
    or torchrun's own restart — is the next attempt, not attempt 0 again. `me` unchanged when it has no launch key."""
    if me.key is None:
        return me
    from rankwatch.base.rundir import claim_launch

    record = {"launcher": me.launcher, "world_size": me.world_size, "started_wall_ns": time.time_ns()}
    return replace(me, attempt=claim_launch(run_dir, me.key, record))
