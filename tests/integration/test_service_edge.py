"""The manager service in a process of its own, as `rankwatch manager serve` runs it, against what only a real
process shows: SIGTERM with a hundred clients stalled mid-body ends it within seconds with its state file
consistent, a second SIGTERM ends it at once, and a thousand slowloris connections (headers a byte a second, from
twenty loopback addresses) neither slow /healthz beyond 100 ms nor grow its memory by 50 MB."""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankwatch.base.rundir import RunDir
from service_support import SECRET, TOKEN, contract_body, free_port, incident, signed, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _free_port() -> int:
    return free_port()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    """`serve` in a subprocess, as the cli runs it: its main thread, its signal handling. The header and body
    deadlines are long (the stalled clients stay stalled until the SIGTERM); the per-client cap leaves room for the
    hundred stalled bodies and the fifty slowloris connections of each source address."""
    run_dir = tmp_path / "run-e"
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    port = _free_port()
    code = ("import sys; from pathlib import Path; from rankwatch.control.service import serve; "
            "from rankwatch.control.http import HttpLimits; from rankwatch.recovery.job import FakeLauncher; "
            "from rankwatch.canary import config_from_run; "
            f"sys.exit(serve(Path({str(run_dir)!r}), launcher=FakeLauncher(), load_job=config_from_run, "
            f"listen='127.0.0.1:{port}', secret_file=Path({str(secret)!r}), token_file=Path({str(token)!r}), "
            "limits=HttpLimits(header_timeout_s=60, body_floor_s=60, max_connections_per_client=128, "
            "max_body_readers=200, shutdown_timeout_s=3), log_level='warning'))")
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=log)
    try:
        wait_for(lambda: _healthz_ms(port) is not None, 45)
        yield proc, port, run_dir
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.close()
        text = (tmp_path / "server.log").read_text()
        assert "Traceback" not in text, text[-3000:]


def _healthz_ms(port: int, source: str = "127.0.0.1") -> float | None:
    """None until the service answers. A port from `_free_port` lies in the ephemeral range, so before the service
    listens the kernel may give the probe that same port as its source: a TCP self-connect, whose "response" is the
    probe's own request (CI saw `BadStatusLine: GET /healthz HTTP/1.1`). Such a socket is not the service."""
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2, source_address=(source, 0))
        try:
            conn.connect()
            assert conn.sock is not None
            if conn.sock.getsockname() == conn.sock.getpeername():
                return None
            conn.request("GET", "/healthz")
            ok = conn.getresponse().status == 200
        finally:
            conn.close()
    except (OSError, http.client.HTTPException):
        return None
    return (time.perf_counter() - t0) * 1e3 if ok else None


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _post(port: int, body: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/alerts", body=body, headers={"content-type": "application/json", **signed(body)})
        return conn.getresponse().status
    finally:
        conn.close()


def _stalled(port: int, n: int) -> list[socket.socket]:
    """`n` connections that sent a signed request's headers, Content-Length 1000, and 10 bytes of body."""
    out = []
    for k in range(n):
        body = json.dumps({"k": k}).encode()
        head = (f"POST /alerts HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n"
                + "".join(f"{a}: {b}\r\n" for a, b in signed(body).items()) + "\r\n").encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(head + b"0123456789")
        out.append(s)
    return out


def test_sigterm_with_a_hundred_stalled_bodies_ends_within_seconds_and_the_state_is_consistent(
        server: tuple[subprocess.Popen[bytes], int, Path]) -> None:
    proc, port, run_dir = server
    inc = incident()
    body = contract_body(run_dir, inc, type_="incident.firing", action=None)
    assert _post(port, body) == 200
    held = _stalled(port, 100)
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        for s in held:
            s.close()
    assert code == 0 and took < 10.0, (code, took)
    state = RunDir(run_dir).manager_state
    con = sqlite3.connect(f"file:{state}?mode=ro", uri=True)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        rows = con.execute("SELECT type, state FROM messages").fetchall()
    finally:
        con.close()
    assert rows == [("incident.firing", "recorded")]  # the stalled bodies left nothing behind


def test_a_second_sigterm_ends_a_shutdown_at_once(server: tuple[subprocess.Popen[bytes], int, Path]) -> None:
    proc, port, _ = server
    held = _stalled(port, 10)
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in held:
            s.close()


def test_a_thousand_slowloris_connections_neither_slow_healthz_nor_grow_memory(
        server: tuple[subprocess.Popen[bytes], int, Path]) -> None:
    proc, port, _ = server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    before = _rss_mb(proc.pid)
    base = [ms for ms in (_healthz_ms(port) for _ in range(20)) if ms is not None]
    sources = [f"127.0.0.{10 + k}" for k in range(20)]
    conns: list[socket.socket] = []
    latencies: list[float] = []
    try:
        for n in range(1000):
            s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(sources[n % 20], 0))
            s.sendall(b"G")
            conns.append(s)
        time.sleep(1.0)  # the burst of a thousand new connections settles; what is measured is their holding on
        line = b"ET /healthz HTTP/1.1\r\nhost: slow\r\nx-slow: " + b"z" * 200
        deadline = time.monotonic() + 12.0
        i = 0
        while time.monotonic() < deadline:  # a byte a second on every connection, /healthz in between
            t_round = time.monotonic()
            for s in conns:
                s.send(line[i % len(line):i % len(line) + 1])
            i += 1
            while time.monotonic() - t_round < 1.0:
                ms = _healthz_ms(port)
                assert ms is not None, "/healthz unanswered under slowloris"
                latencies.append(ms)
                time.sleep(0.05)
        during = _rss_mb(proc.pid)
    finally:
        for s in conns:
            s.close()
    assert len(latencies) >= 50
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(f"\n/healthz alone: median {statistics.median(base):.1f} ms; under 1,000 slowloris: median "
          f"{statistics.median(latencies):.1f} ms, p99 {p99:.1f} ms, max {max(latencies):.1f} ms; RSS {before:.0f} -> "
          f"{during:.0f} MB")
    assert max(latencies) < 100.0, sorted(latencies)[-5:]
    assert during - before < 50.0
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


def test_the_cli_logs_the_service_at_the_level_asked(tmp_path: Path) -> None:
    """`rankwatch manager serve --log-level info`: the rankwatch loggers' INFO lines reach stderr, one line each."""
    run_dir, secret, port = tmp_path / "run-l", tmp_path / "secret", _free_port()
    secret.write_text(SECRET + "\n")
    exe = Path(sys.executable).parent / "rankwatch"
    log = tmp_path / "cli.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(exe), "manager", "serve", "--run-dir", str(run_dir), "--secret-file", str(secret),
                                 "--listen", f"127.0.0.1:{port}", "--log-level", "info"], stderr=out)
        try:
            wait_for(lambda: _healthz_ms(port) is not None, 45)
            body = contract_body(run_dir, incident(), type_="incident.firing", action=None)
            assert _post(port, body) == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = log.read_text().splitlines()
    mine = [line for line in lines if " INFO rankwatch.manager: " in line]
    assert any("incident " in line and "firing" in line for line in mine), lines[-20:]
    assert any("manager service for" in line for line in mine)
