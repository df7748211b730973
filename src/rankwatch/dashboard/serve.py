"""Start the dashboard: `streamlit run dashboard/app.py -- RUN_DIR ...` as a child process, bound to 127.0.0.1
unless told otherwise, headless, without usage statistics; `wait_ready` polls Streamlit's health endpoint.

The child (`python -m rankwatch.dashboard.serve run ...`) imports the analysis stack before Streamlit starts
serving, so the first visitor does not wait for the imports (several seconds here: DuckDB, polars, scikit-learn)."""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

APP = Path(__file__).with_name("app.py")
RUNS_ENV = "RANKWATCH_DASHBOARD_RUNS"
"""The run directories, os.pathsep-separated, where the app is not given them on its command line (tests)."""


def command(run_dirs: Sequence[Path], *, port: int, address: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "rankwatch.dashboard.serve", "run", str(APP), "--server.address", address,
            "--server.port", str(port), "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--server.fileWatcherType", "none", "--global.developmentMode", "false", "--client.toolbarMode", "viewer",
            "--", *[str(Path(r).resolve()) for r in run_dirs]]


def check_runs(run_dirs: Sequence[Path]) -> None:
    """ValueError naming the first argument that is not a directory (the app itself explains damaged runs)."""
    if not run_dirs:
        raise ValueError("dashboard: give at least one run directory")
    for r in run_dirs:
        if not Path(r).is_dir():
            raise ValueError(f"{r}: no such run directory")


def start(run_dirs: Sequence[Path], *, port: int, address: str = "127.0.0.1", quiet: bool = True) -> subprocess.Popen[bytes]:
    """The dashboard as a child process (its own session, so it can be stopped with its children)."""
    check_runs(run_dirs)
    env = {**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    out = subprocess.DEVNULL if quiet else None
    return subprocess.Popen(command(run_dirs, port=port, address=address), env=env, stdout=out, stderr=out,
                            start_new_session=True)


def wait_ready(port: int, *, address: str = "127.0.0.1", timeout_s: float = 60.0,
               proc: subprocess.Popen[bytes] | None = None) -> float:
    """Seconds until Streamlit answers its health check; TimeoutError (or RuntimeError if `proc` exited) else."""
    t0 = time.monotonic()
    url = f"http://{address}:{port}/_stcore/health"
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"dashboard exited with code {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            # HTTPException: before Streamlit listens, a probe to an ephemeral-range port can be given that same
            # port as its source (a TCP self-connect) and read its own request back as a malformed status line
            pass
        time.sleep(0.2)
    raise TimeoutError(f"dashboard on {address}:{port}: no answer within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes], *, grace_s: float = 5.0) -> None:
    import signal

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def serve(run_dirs: Sequence[Path], *, port: int, address: str = "127.0.0.1") -> int:
    """Run the dashboard in the foreground until Ctrl-C, SIGTERM (a supervisor) or SIGHUP (a closed terminal), each
    of which stops the server too (it runs in a session of its own, so no signal reaches it otherwise); the exit
    code (128 + the signal's number after a signal)."""
    import signal

    check_runs(run_dirs)
    print(f"rankwatch dashboard: http://{address}:{port}/  ({len(run_dirs)} run(s); Ctrl-C stops it)", flush=True)
    proc = start(run_dirs, port=port, address=address, quiet=False)

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stopped(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return proc.wait()
    except KeyboardInterrupt:
        stop(proc)
        return 130
    except _Stopped as stopped:
        stop(proc)
        return 128 + stopped.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":  # the server process: preload what every page imports, then Streamlit's own command line
    import logging

    from streamlit import logger as _st_logger

    # cached functions defined before Streamlit's runtime exists each warn "No runtime found" (13 lines at start)
    _st_logger.get_logger("streamlit.runtime.caching.cache_data_api").setLevel(logging.ERROR)
    import rankwatch.dashboard.data  # noqa: F401  (rankwatch.analytics and its libraries)
    import altair  # noqa: F401
    from streamlit.web import cli

    sys.argv = ["streamlit", *sys.argv[1:]]
    sys.exit(cli.main())
