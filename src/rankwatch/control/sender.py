"""Sending alerts: a `Transport` (HTTP, or in memory for tests), and `AlertSender` — an `Outbox`, a transport and a
`Signer` on a background thread that never raises into the monitor loop."""

from __future__ import annotations

import email.utils
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timezone
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING, Any


from rankwatch.control.outbox import DETAIL_MAX, DeliveryResult, Outbox, OutboxStats, Outcome, Reply, RetryConfig, Send
from rankwatch.control.signer import Signer, load_secret
from rankwatch.control.wire import AlertConfigError, Message

if TYPE_CHECKING:
    pass

log = logging.getLogger("rankwatch.alerts")


class Transport(ABC):
    """Posts one signed body; never raises (a failure is a `Reply` with status None)."""

    @abstractmethod
    def post(self, body: bytes, headers: Mapping[str, str]) -> Reply: ...


def _first_line(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace").strip()
    return (text.splitlines()[0] if text else "")[:DETAIL_MAX]


def _retry_after(value: str | None, now: float) -> float | None:
    """Seconds from a Retry-After header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, when.timestamp() - now)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a 3xx comes back as an HTTPError: a signed POST is not re-sent elsewhere


_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


class HttpTransport(Transport):
    """urllib POST with a short timeout; redirects are not followed; a loopback URL never goes through the
    environment's HTTP proxy."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise AlertConfigError(f"webhook URL {url!r}: not an http:// or https:// URL with a host")
        if timeout_s <= 0:
            raise ValueError(f"HttpTransport: timeout_s {timeout_s} must be > 0")
        self.url, self.timeout_s = url, timeout_s
        handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
        if parts.hostname in _LOOPBACK:
            handlers.append(urllib.request.ProxyHandler({}))
        self._opener = urllib.request.build_opener(*handlers)

    def post(self, body: bytes, headers: Mapping[str, str]) -> Reply:
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={**headers, "user-agent": "rankwatch-alerts/1"})
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                return Reply(status=resp.status, detail=_first_line(resp.read(4096)))
        except urllib.error.HTTPError as exc:
            try:
                data = exc.read(4096)
            except (OSError, HTTPException):
                data = b""
            finally:
                exc.close()
            return Reply(status=exc.code, detail=_first_line(data) or str(exc.reason),
                         retry_after_s=_retry_after(exc.headers.get("Retry-After"), time.time()))
        except urllib.error.URLError as exc:
            return Reply(status=None, detail=f"{self.url}: {exc.reason}"[:DETAIL_MAX])
        except (OSError, HTTPException, ValueError) as exc:
            return Reply(status=None, detail=f"{self.url}: {type(exc).__name__}: {exc}"[:DETAIL_MAX])


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    body: bytes
    headers: dict[str, str]


class MemoryTransport(Transport):
    """A fake: records every request; answers from `replies` in turn (an int is a status), then `default`."""

    def __init__(self, replies: Iterable[Reply | int] = (), *, default: Reply | int = 200) -> None:
        self._replies = [r if isinstance(r, Reply) else Reply(status=r) for r in replies]
        self._default = default if isinstance(default, Reply) else Reply(status=default)
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def post(self, body: bytes, headers: Mapping[str, str]) -> Reply:
        with self._lock:
            self.requests.append(Request(body=body, headers=dict(headers)))
            return self._replies.pop(0) if self._replies else self._default


def signed_send(transport: Transport, signer: Signer, *, clock: Callable[[], float] = time.time) -> Send:
    """A send function for `Outbox.deliver_due`: signs each attempt with the current time, then posts."""
    def send(message: Message) -> Reply:
        return transport.post(message.body, signer.headers(message.id, message.body, timestamp=int(clock())))
    return send


class AlertSender:
    """Delivers an outbox on a background thread. `submit` stores a message (committed) and wakes the thread; it
    never raises: a message that cannot be stored (a full disk) is kept in memory and stored at the next chance.
    Rejected and dead messages, and the first failure of an outage, are said through `say` (a line each)."""

    def __init__(self, outbox: Outbox, transport: Transport, signer: Signer, *,
                 clock: Callable[[], float] = time.time, say: Callable[[str], None] | None = None,
                 idle_s: float = 1.0) -> None:
        if idle_s <= 0:
            raise ValueError(f"AlertSender: idle_s {idle_s} must be > 0")
        self.outbox = outbox
        self._send = signed_send(transport, signer, clock=clock)
        self._clock = clock
        self._say = say or log.warning
        self._idle_s = idle_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._unsaved: list[Message] = []
        self._unsaved_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing: set[str] = set()
        self.errors = 0
        """Exceptions the sender caught (storing, delivering) instead of raising them."""

    @classmethod
    def open(cls, url: str, secret_file: Path | str, outbox: Path | str, *, retry: RetryConfig = RetryConfig(),
             timeout_s: float = 5.0, say: Callable[[str], None] | None = None, idle_s: float = 1.0) -> AlertSender:
        """The monitor's sender: raises `AlertConfigError` (one line) for a bad URL, secret file or outbox, at
        start — never later."""
        signer = Signer(load_secret(secret_file))
        transport = HttpTransport(url, timeout_s=timeout_s)
        return cls(Outbox(outbox, retry), transport, signer, say=say, idle_s=idle_s)

    def start(self) -> AlertSender:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rankwatch-alerts", daemon=True)
            self._thread.start()
        return self

    def submit(self, message: Message) -> bool:
        """Store `message` for delivery; False when it was stored before (or could not be stored yet)."""
        try:
            new = self.outbox.enqueue(message, now=self._clock())
        except Exception as exc:
            self.errors += 1
            self._say(f"alerts: could not store {message.id} in {self.outbox.path} ({type(exc).__name__}: {exc}); "
                      "kept in memory, trying again")
            with self._unsaved_lock:
                self._unsaved.append(message)
            new = False
        self._wake.set()
        return new

    def submit_all(self, messages: Iterable[Message]) -> int:
        """Submit in order; returns how many were new."""
        return sum(self.submit(m) for m in messages)

    def stats(self) -> OutboxStats:
        try:
            s = self.outbox.stats()
        except Exception:
            self.errors += 1
            return OutboxStats(pending=len(self._unsaved))
        return OutboxStats(pending=s.pending + len(self._unsaved), delivered=s.delivered, rejected=s.rejected,
                           dead=s.dead)

    def flush(self, timeout_s: float) -> bool:
        """Wait until nothing is pending (True) or `timeout_s` passed (False). Without a running thread, delivers in
        the caller's thread."""
        deadline = time.monotonic() + timeout_s
        while True:
            inline = self._thread is None or not self._thread.is_alive()
            if inline:
                self._pass()
            if self.stats().pending == 0:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if inline:
                time.sleep(max(0.0, min(self._wait_s(), left)))
            else:
                self._wake.set()
                time.sleep(min(0.02, left))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (after its current attempt) and close the outbox; pending messages stay stored."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self.outbox.close()
        except Exception:
            self.errors += 1

    def __enter__(self) -> AlertSender:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _save_unsaved(self) -> None:
        with self._unsaved_lock:
            waiting, self._unsaved = self._unsaved, []
        for i, m in enumerate(waiting):
            try:
                self.outbox.enqueue(m, now=self._clock())
            except Exception:
                self.errors += 1
                with self._unsaved_lock:
                    self._unsaved[:0] = waiting[i:]
                return

    def _pass(self) -> None:
        try:
            self._save_unsaved()
            for r in self.outbox.deliver_due(self._send, now=self._clock()):
                self._report(r)
        except Exception as exc:
            self.errors += 1
            self._say(f"alerts: delivery pass failed ({type(exc).__name__}: {exc}); trying again")

    def _report(self, r: DeliveryResult) -> None:
        if r.outcome is Outcome.RETRY:
            if r.run not in self._failing:
                self._failing.add(r.run)
                self._say(f"alerts: {r.line()}")
            return
        if r.outcome is Outcome.DELIVERED:
            if r.run in self._failing:
                self._failing.discard(r.run)
                self._say(f"alerts: {r.line()}")
            return
        self._say(f"alerts: {r.line()}")

    def _wait_s(self) -> float:
        try:
            due = self.outbox.next_due()
        except Exception:
            self.errors += 1
            return self._idle_s
        if self._unsaved:
            return min(self._idle_s, 0.5)
        return self._idle_s if due is None else min(self._idle_s, max(0.0, due - self._clock()))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self._pass()
            if self._stop.is_set():
                return
            self._wake.wait(self._wait_s())
