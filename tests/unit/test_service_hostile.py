"""The manager service against hostile and broken clients, on its real HTTP server (uvicorn on 127.0.0.1, a free
port), with the documented contract (docs/manager.md) as the oracle: every malformed input is a 4xx with its reason
counted in /status and one log line, never a 5xx; stalled headers and bodies are cut at their deadlines; a client's
connections are capped. What needs a process of its own (SIGTERM with stalled clients, a thousand slowloris
connections) is in tests/integration/test_service_edge.py."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankwatch.control.http import HttpLimits
from rankwatch.control.service import ManagerService, _is_loopback, shown
from rankwatch.recovery.job import FakeLauncher
from service_support import SECRET, TOKEN, contract_body, incident, msg_id, signed, wait_for
from test_service import job

pytestmark = pytest.mark.timeout(120)

LIMITS = HttpLimits(header_timeout_s=1.0, body_floor_s=1.0, body_min_rate=64 * 1024, max_connections_per_client=8,
                    max_body_readers=4, shutdown_timeout_s=1.0)
MAX_BODY = 1 << 20


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[ManagerService]:
    run_dir = tmp_path / "run-h"
    fake = FakeLauncher(("run",))
    service = ManagerService(run_dir, secret=SECRET, token=TOKEN, job=job(run_dir), launcher=fake,
                             max_body=MAX_BODY, limits=LIMITS).start()
    assert fake.started.acquire(timeout=10)
    try:
        yield service
    finally:
        fake.finish()
        service.stop()


def raw(svc: ManagerService, request: bytes, *, timeout_s: float = 10.0,
        source: str = "127.0.0.1") -> tuple[int | None, bytes]:
    """Send `request` as bytes on a fresh connection; (status, whole answer) or (None, b"") when the server closed
    without one."""
    with socket.create_connection(("127.0.0.1", svc.port), timeout=timeout_s, source_address=(source, 0)) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):  # refused before the whole request was read
            pass
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
    if not data:
        return None, b""
    return int(data.split(b" ", 2)[1]), data


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None, *,
            raw_headers: list[tuple[bytes, bytes]] = ()) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"host: 127.0.0.1", b"content-type: application/json",
             f"content-length: {len(body)}".encode(), b"connection: close"]
    lines += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    lines += [k + b": " + v for k, v in raw_headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def answer(data: bytes) -> Any:
    return json.loads(data.split(b"\r\n\r\n", 1)[1] or b"null")


def status(svc: ManagerService) -> dict[str, Any]:
    code, data = raw(svc, request("GET", "/status", headers={"authorization": f"Bearer {TOKEN}"}))
    assert code == 200
    doc = answer(data)
    assert isinstance(doc, dict)
    return doc


def _body(svc: ManagerService, **overrides: Any) -> bytes:
    return contract_body(svc.manager.run_dir, incident(), **overrides)


def _incident_doc(**changes: Any) -> dict[str, Any]:
    return {**incident().to_dict(), **changes}


def _with_doc(svc: ManagerService, doc: dict[str, Any]) -> bytes:
    base = json.loads(_body(svc))
    base["rankwatch"]["incident_doc"] = doc
    base["rankwatch"]["incident"] = doc.get("id", "x") if isinstance(doc.get("id"), str) else "x"
    return json.dumps(base).encode()


def _nested(depth: int) -> bytes:
    return b'{"rankwatch": ' + b"[" * depth + b"]" * depth + b"}"


def _cases(svc: ManagerService) -> list[tuple[str, int, str | None, bytes]]:
    """(case, expected status, expected refusal reason or None, the raw request)."""
    body = _body(svc)
    good = signed(body)
    now = int(time.time())

    def post(b: bytes, h: dict[str, str] | None = None, *, path: str = "/alerts",
             raw_headers: list[tuple[bytes, bytes]] = ()) -> bytes:
        return request("POST", path, b, signed(b) if h is None else h, raw_headers=raw_headers)

    def declared(n: int) -> bytes:
        """Headers that declare a body of `n` bytes, and no body."""
        return request("POST", "/alerts", b"", good).replace(b"content-length: 0", f"content-length: {n}".encode())

    def hdrs(**change: str) -> dict[str, str]:
        return {k: v for k, v in {**good, **change}.items() if v != "-"}

    other = _body(svc, status="resolved")
    am = {"authorization": f"Bearer {TOKEN}"}
    delivery = json.dumps({"version": "4", "groupKey": "g", "status": "firing",
                           "alerts": [{"fingerprint": "f1"}]}).encode()
    return [
        ("no headers at all", 401, "missing_headers", request("POST", "/alerts", body)),
        ("no webhook-signature", 401, "missing_headers", post(body, hdrs(**{"webhook-signature": "-"}))),
        ("no webhook-timestamp", 401, "missing_headers", post(body, hdrs(**{"webhook-timestamp": "-"}))),
        ("no webhook-id", 401, "missing_headers", post(body, hdrs(**{"webhook-id": "-"}))),
        ("an id with spaces (forged log fields)", 401, "malformed_headers",
         post(body, hdrs(**{"webhook-id": "msg_1 refused /alerts x: ok"}))),
        ("an id of 15 KB", 401, "malformed_headers", post(body, hdrs(**{"webhook-id": "m" * 15000}))),
        ("a timestamp that is no number", 401, "malformed_headers", post(body, hdrs(**{"webhook-timestamp": "soon"}))),
        ("a timestamp of Latin-1 digits", 401, "malformed_headers",
         post(body, hdrs(**{"webhook-timestamp": "-"}), raw_headers=[(b"webhook-timestamp", b"\xb2\xb3\xb9")])),
        ("a timestamp of 400 digits", 401, "malformed_headers", post(body, hdrs(**{"webhook-timestamp": "9" * 400}))),
        ("a timestamp of 5,000 digits", 401, "malformed_headers",
         post(body, hdrs(**{"webhook-timestamp": "1" * 5000}))),
        ("a negative timestamp", 401, "malformed_headers", post(body, hdrs(**{"webhook-timestamp": "-5"}))),
        ("a timestamp 301 s old", 401, "stale_timestamp", post(body, signed(body, ts=now - 301))),
        ("a timestamp 400 s ahead", 401, "stale_timestamp", post(body, signed(body, ts=now + 400))),
        ("a signature header without a comma", 401, "malformed_signature",
         post(body, hdrs(**{"webhook-signature": "v1"}))),
        ("a signature that is not base64", 401, "malformed_signature",
         post(body, hdrs(**{"webhook-signature": "v1,@@not-base64@@"}))),
        ("signed with another secret", 401, "bad_signature",
         post(body, signed(body, secret="whsec_" + "QUJD" * 10))),
        ("the body changed under the signature", 401, "bad_signature", post(other, good)),
        ("a signature of another id", 401, "bad_signature",
         post(body, hdrs(**{"webhook-signature": signed(body, mid="msg_other")["webhook-signature"]}))),
        ("a declared length over the cap", 413, "too_large", declared(MAX_BODY + 1)),
        ("a declared length of 10^40 (h11 refuses it)", 400, "malformed_request", declared(10**40)),
        ("a body that is not UTF-8", 400, "malformed_body", post(b"\xff\xfe{}", good)),
        ("a body that is not JSON", 400, "malformed_body", post(b"{not json")),
        ("a JSON array", 400, "malformed_body", post(b"[1, 2]")),
        ("JSON nested 100,000 deep, signed", 400, "malformed_body", post(_nested(100_000))),
        ("JSON nested 33 deep, signed", 400, "malformed_body", post(_nested(33))),
        ("no rankwatch key", 400, "malformed_body", post(json.dumps({**json.loads(body), "rankwatch": None}).encode())),
        ("summary an object", 400, "malformed_body", post(_with_doc(svc, _incident_doc(summary={"a": 1})))),
        ("summary a list", 400, "malformed_body", post(_with_doc(svc, _incident_doc(summary=["a"])))),
        ("summary a number", 400, "malformed_body", post(_with_doc(svc, _incident_doc(summary=12345)))),
        ("onset_step a word", 400, "malformed_body", post(_with_doc(svc, _incident_doc(onset_step="soon")))),
        ("ranks holding a word", 400, "malformed_body", post(_with_doc(svc, _incident_doc(ranks=["one"])))),
        ("confidence out of range", 400, "malformed_body", post(_with_doc(svc, _incident_doc(confidence=5)))),
        ("confidence a bool", 400, "malformed_body", post(_with_doc(svc, _incident_doc(confidence=True)))),
        ("evidence rows not lists", 400, "malformed_body",
         post(_with_doc(svc, _incident_doc(evidence=[{"source": "s", "summary": "s", "columns": ["a"],
                                                       "rows": [{"a": 1}]}])))),
        ("evidence columns not strings", 400, "malformed_body",
         post(_with_doc(svc, _incident_doc(evidence=[{"source": "s", "summary": "s", "columns": [1], "rows": []}])))),
        ("another run's message", 400, "wrong_run",
         post(json.dumps({**json.loads(body), "rankwatch": {**json.loads(body)["rankwatch"], "run": "other"}}).encode())),
        ("an unknown message type", 400, "malformed_body", post(_body(svc, type_="incident.exploded"))),
        ("an unknown action", 400, "malformed_body", post(_body(svc, action="reboot_the_cluster"))),
        ("an unknown alert status", 400, "malformed_body", post(_body(svc, status="exploded"))),
        ("/alertmanager without a token", 401, "bad_token", request("POST", "/alertmanager", delivery)),
        ("/alertmanager with a wrong token", 401, "bad_token",
         request("POST", "/alertmanager", delivery, {"authorization": "Bearer nope"})),
        ("/alertmanager nested 100,000 deep", 400, "malformed_body",
         request("POST", "/alertmanager", _nested(100_000), am)),
        ("/alertmanager not an object", 400, "malformed_body", request("POST", "/alertmanager", b"[]", am)),
        ("/alertmanager a fingerprint that is a number", 400, "malformed_body",
         request("POST", "/alertmanager", json.dumps({"groupKey": "g", "status": "firing",
                                                      "alerts": [{"fingerprint": 3}]}).encode(), am)),
        ("/status without the token", 401, "bad_token", request("GET", "/status")),
        ("headers of 20 KB at once", 431, "headers_too_large",
         request("GET", "/healthz", headers={"x-pad": "p" * 20_000})),
        ("headers of 20 KB that never end", 400, "malformed_request",
         b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: " + b"p" * 20_000),
        ("a content-length that is no number", 400, "malformed_request",
         b"POST /alerts HTTP/1.1\r\nhost: x\r\ncontent-length: ten\r\nconnection: close\r\n\r\n"),
        ("not HTTP at all", 400, "malformed_request", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03hello\r\n\r\n"),
    ]


def test_every_hostile_request_is_a_4xx_with_its_reason_counted_and_never_a_5xx(
        svc: ManagerService, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rankwatch.manager")
    cases = _cases(svc)
    got: list[tuple[str, int | None, Any]] = []
    for name, code, reason, req in cases:
        status_code, data = raw(svc, req)
        json_answer = b"content-type: application/json" in data.split(b"\r\n\r\n", 1)[0].lower()
        doc = answer(data) if json_answer else None
        got.append((name, status_code, doc))
        assert status_code == code, (name, status_code, data[:300])
        if json_answer:
            assert doc["error"] == reason, (name, doc)
    assert len(cases) >= 45
    assert not [n for n, c, _ in got if c is None or c >= 500]
    refused = status(svc)["refused"]
    expected: dict[str, int] = {}
    for _, _, reason, _ in cases:
        if reason is not None:
            expected[reason] = expected.get(reason, 0) + 1
    assert refused == expected
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert len(lines) == sum(expected.values()) and all("\n" not in line and len(line) < 600 for line in lines)
    assert any('"msg_1 refused /alerts x: ok"' in line for line in lines)  # a client's id is quoted, never a field


def test_what_held_still_holds(svc: ManagerService) -> None:
    """The cases the first attack found holding: a valid decision is accepted once, replayed is a duplicate, the same
    id with another body is a conflict, an incident message is recorded, a valid Alertmanager delivery is evidence
    only and deduplicated, /healthz answers."""
    body = contract_body(svc.manager.run_dir, incident(), type_="incident.firing", action=None)
    headers = signed(body)
    first = raw(svc, request("POST", "/alerts", body, headers))
    again = raw(svc, request("POST", "/alerts", body, headers))
    assert (first[0], answer(first[1])) == (200, {"recorded": True, "id": msg_id(body)})
    assert again[0] == 200 and answer(again[1])["duplicate"] is True
    other = contract_body(svc.manager.run_dir, incident(rank=0), type_="incident.firing", action=None)
    clash = raw(svc, request("POST", "/alerts", other, signed(other, mid=msg_id(body))))
    assert clash[0] == 409 and answer(clash[1])["error"] == "replayed_id"
    delivery = json.dumps({"version": "4", "groupKey": "g", "status": "firing", "alerts": [{"fingerprint": "f"}]})
    am = {"authorization": f"Bearer {TOKEN}"}
    assert answer(raw(svc, request("POST", "/alertmanager", delivery.encode(), am))[1])["evidence_only"] is True
    assert answer(raw(svc, request("POST", "/alertmanager", delivery.encode(), am))[1])["duplicate"] is True
    assert raw(svc, request("GET", "/healthz"))[0] == 200


def test_a_stalled_body_is_answered_408_within_its_deadline(svc: ManagerService) -> None:
    body = _body(svc)
    head = request("POST", "/alerts", b"", signed(body)).replace(b"content-length: 0", b"content-length: 1000")
    t0 = time.monotonic()
    code, data = raw(svc, head + b"0123456789", timeout_s=10)
    took = time.monotonic() - t0
    assert code == 408 and answer(data)["error"] == "body_timeout", data
    assert LIMITS.body_deadline_s(1000) - 0.2 <= took < LIMITS.body_deadline_s(1000) + 2, took
    assert status(svc)["refused"] == {"body_timeout": 1}


def test_headers_sent_a_byte_a_second_are_cut_at_their_deadline(svc: ManagerService) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        t0 = time.monotonic()
        closed_after = None
        for b in b"GET /healthz HTTP/1.1\r\nhost: x\r\n":
            try:
                s.sendall(bytes([b]))
                if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - t0
                break
            time.sleep(0.25)
    assert closed_after is not None and closed_after < LIMITS.header_timeout_s + 1.0, closed_after
    wait_for(lambda: status(svc)["refused"].get("header_timeout") == 1, 5)


def test_an_idle_connection_that_sends_nothing_is_closed(svc: ManagerService) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server, no answer
        assert time.monotonic() - t0 < LIMITS.header_timeout_s + 1.0


def test_one_client_holds_at_most_its_cap_of_connections(svc: ManagerService) -> None:
    held = [socket.create_connection(("127.0.0.1", svc.port), timeout=5, source_address=("127.0.0.3", 0))
            for _ in range(LIMITS.max_connections_per_client)]
    try:
        code, data = raw(svc, request("GET", "/healthz"), source="127.0.0.3")
        assert code == 429 and answer(data)["error"] == "too_many_connections"
        assert raw(svc, request("GET", "/healthz"), source="127.0.0.4")[0] == 200  # another client is served
    finally:
        for s in held:
            s.close()
    wait_for(lambda: raw(svc, request("GET", "/healthz"), source="127.0.0.3")[0] == 200, 5)


def test_a_client_that_leaves_mid_body_is_one_log_line(svc: ManagerService,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    body = _body(svc)
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        s.sendall(request("POST", "/alerts", b"", signed(body)).replace(b"content-length: 0",
                                                                        b"content-length: 5000") + b"{\"a\":")
        time.sleep(0.2)
    wait_for(lambda: status(svc)["refused"].get("client_gone") == 1, 5)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert len([r for r in caplog.records if "client went away" in r.getMessage()]) == 1


def test_status_is_bounded_and_says_no_path() -> None:
    assert _is_loopback("127.0.0.2") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("10.0.0.1") and not _is_loopback("0.0.0.0") and not _is_loopback("example.org")
    assert shown("msg_1 refused /alerts x: ok\nforged") == '"msg_1 refused /alerts x: ok\\nforged"'
    assert len(shown("m" * 15000)) < 100


def test_status_lists_at_most_twenty_open_incidents(svc: ManagerService) -> None:
    for rank in range(30):
        body = contract_body(svc.manager.run_dir, incident(rank=rank), type_="incident.firing", action=None)
        assert raw(svc, request("POST", "/alerts", body, signed(body)))[0] == 200
    s = status(svc)
    assert s["open_incident_count"] == 30 and len(s["open_incidents"]) == 20
    assert str(svc.manager.run_dir) not in json.dumps(s)


def test_state_files_are_for_their_owner_only(svc: ManagerService) -> None:
    delivery = json.dumps({"version": "4", "groupKey": "g", "status": "firing", "alerts": []}).encode()
    raw(svc, request("POST", "/alertmanager", delivery, {"authorization": f"Bearer {TOKEN}"}))
    manager_dir = svc.manager.state_path.parent
    for p in manager_dir.iterdir():
        assert p.stat().st_mode & 0o077 == 0, (p, oct(p.stat().st_mode))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_client_still_sending_a_refused_body_reads_its_413_not_a_reset(svc: ManagerService, chunked: bool) -> None:
    # seen in CI as a ConnectionResetError instead of a 413: the server closed with the body's rest unread, the
    # client's next bytes drew a reset, and Linux discards the unread answer on a reset (`HttpLimits.linger_bytes`)
    body = _body(svc)
    rest = b" " * (MAX_BODY + 2000 - len(body))
    head = request("POST", "/alerts", b"", signed(body))
    if chunked:
        head = head.replace(b"content-length: 0", b"transfer-encoding: chunked")
        first = b"%x\r\n" % (MAX_BODY + 100) + b" " * (MAX_BODY + 100) + b"\r\n"
        later = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
    else:
        head = head.replace(b"content-length: 0", b"content-length: %d" % (len(body) + len(rest)))
        first, later = rest[:1000], rest[1000:] + body
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(head + first)
        time.sleep(0.3)  # the server has refused by now
        s.sendall(later)
        time.sleep(0.3)  # a reset, had it closed unread, is here by now
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert int(data.split(b" ", 2)[1]) == 413 and answer(data)["error"] == "too_large", data
