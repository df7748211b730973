"""Who this process is, as its launcher said it: torchrun's and Slurm's environment variables, read once.

Torch-free: the host agent beside each rank (`collector.supervise`) reads it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DISABLE_ENV", "RUN_DIR_ENV", "LaunchEnv", "disabled", "launch_env"]

RUN_DIR_ENV = "RANKWATCH_RUN_DIR"
"""The run directory when `attach` is given none (`rankwatch torchrun --run-dir` sets it)."""

DISABLE_ENV = "RANKWATCH_DISABLE"
"""Set to 1 (true, yes, on): `attach` records nothing and patches nothing (a job run without rankwatch, unedited)."""


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
    """Restarts of the job so far (torchrun's TORCHELASTIC_RESTART_COUNT, Slurm's SLURM_RESTART_COUNT)."""
    launcher: str
    """"torchrun", "slurm" or "none" (a single process)."""


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
    if "RANK" in env and "WORLD_SIZE" in env:
        out = LaunchEnv(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
                        local_rank=_int(env, "LOCAL_RANK", 0),
                        attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", _int(env, "SLURM_RESTART_COUNT", 0)),
                        launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env else "env")
    elif "SLURM_PROCID" in env:
        out = LaunchEnv(rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
                        local_rank=_int(env, "SLURM_LOCALID", 0), attempt=_int(env, "SLURM_RESTART_COUNT", 0),
                        launcher="slurm")
    else:
        out = LaunchEnv(rank=0, world_size=1, local_rank=0, attempt=0, launcher="none")
    if not 0 <= out.rank < out.world_size:
        raise ValueError(f"rankwatch.attach: rank {out.rank} is outside the world of {out.world_size}")
    return out
