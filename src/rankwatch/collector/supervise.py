"""The host agent beside one rank: runs the training script as its child and records how it ended, at once.

    python -m rankwatch.collector.supervise [--module | --exec] TARGET [ARGS ...]

`rankwatch torchrun` makes this each worker's command (torchrun ``--no-python``), so every local rank has a parent
that sees its end the moment it happens and writes ``<run>/live/exit-<rank>.json`` (`liveness.write_exit_record`):
the exit code or the signal that ended it, and the first signal that came from outside before the end. That is what
tells the rank that died from the ranks the launcher then stopped:

- torchrun stops the surviving workers of a failed group by signalling each worker's process group
  (``os.killpg(pid, SIGTERM)``, then SIGKILL after the grace period: torch/distributed/elastic/multiprocessing/
  subprocess_handler/subprocess_handler.py `SubprocessHandler.close`; the worker is started with
  ``start_new_session=True``), so this agent and its rank receive the signal together: it is recorded as the outside
  signal, and not forwarded (the rank has it already);
- a SIGKILL sent to the rank's process alone (the OOM killer, an operator, a fault drill) reaches the rank only: its
  exit record says signal 9 and no outside signal;
- a signal sent to this agent alone by anyone but the launcher is forwarded to the rank.

The agent exits as its rank did (the same code, or the same signal raised on itself), so the launcher's own failure
handling and messages are unchanged. Without a run directory (``RANKWATCH_RUN_DIR``) it just runs the target in its
place (`os.execv`). Torch-free and small: one per rank.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rankwatch.collector.launcher_env import RUN_DIR_ENV, launch_env, numbered
from rankwatch.collector.liveness import write_exit_record

__all__ = ["FORWARDED", "child_command", "main"]

FORWARDED: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
"""Signals recorded as coming from outside (and forwarded to the rank when sent to this agent alone)."""

_USAGE = "usage: python -m rankwatch.collector.supervise [--module | --exec] TARGET [ARGS ...]"


def child_command(argv: Sequence[str]) -> list[str]:
    """The rank's command line: a script run by this Python as torchrun runs one (``python -u SCRIPT``), a module
    (``--module``: ``python -u -m MODULE``) or an executable (``--exec``). ValueError naming the problem when there is
    no target."""
    args = list(argv)
    mode = "script"
    if args and args[0] in ("--module", "--exec"):
        mode = args.pop(0).removeprefix("--")
    if not args:
        raise ValueError(f"rankwatch supervise: no training script given; {_USAGE}")
    if mode == "module":
        return [sys.executable, "-u", "-m", *args]
    if mode == "exec":
        return args
    return [sys.executable, "-u", *args]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cmd = child_command(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        os.execv(cmd[0] if os.path.isabs(cmd[0]) else _which(cmd[0]), cmd)
    try:
        me = launch_env()
    except ValueError as exc:
        print(f"rankwatch supervise: {exc}", file=sys.stderr)
        return 2
    try:
        me = numbered(me, run_dir)  # the attempt its rank's collector records (`collector.attach`)
    except (ValueError, OSError) as exc:  # the rank's own attach says it too, and fails its set-up
        print(f"rankwatch supervise: attempt not numbered: {exc}", file=sys.stderr)
    watched = set(FORWARDED) | {signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)  # delivered to sigtimedwait below, never lost in between

    def unblock() -> None:  # in the child, before exec: the rank starts with the signal mask it would have had
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)

    child = subprocess.Popen(cmd, preexec_fn=unblock)  # noqa: PLW1509 - single-threaded here; needed for the mask
    launcher = os.getppid()
    outside: tuple[int, int] | None = None
    code = child.poll()
    while code is None:
        info = signal.sigtimedwait(watched, 1.0)  # SIGCHLD wakes it the moment the rank ends
        if info is not None and info.si_signo != signal.SIGCHLD:
            if outside is None:
                outside = (info.si_signo, time.time_ns())
            if info.si_pid not in (launcher, 0):  # sent to this agent alone: pass it on
                try:
                    os.kill(child.pid, info.si_signo)
                except ProcessLookupError:
                    pass
        code = child.poll()
    ended_ns = time.time_ns()
    try:
        write_exit_record(Path(run_dir), rank=me.rank, world_size=me.world_size, attempt=me.attempt, pid=child.pid,
                          host=socket.gethostname(), returncode=code, wall_ns=ended_ns,
                          outside_signal=None if outside is None else outside[0],
                          outside_signal_ns=None if outside is None else outside[1])
    except OSError as exc:
        print(f"rankwatch supervise: rank {me.rank}: exit record not written: {exc}", file=sys.stderr)
    if code < 0:  # end as the rank did: the launcher reads the same signal
        try:
            signal.signal(-code, signal.SIG_DFL)  # SIGKILL and SIGSTOP take no handler: default already
        except (OSError, ValueError):
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _which(name: str) -> str:
    import shutil

    found = shutil.which(name)
    if found is None:
        print(f"rankwatch supervise: {name}: command not found", file=sys.stderr)
        raise SystemExit(127)
    return found


if __name__ == "__main__":
    raise SystemExit(main())
