"""The manager service's HTTP edge: what a client may hold of the server, for how long, and a shutdown that always ends.

A client that sends nothing, or a byte a second, or a `Content-Length` it never fills, must not keep a connection,
a worker or memory, nor keep the service from stopping. uvicorn bounds none of that by itself: it times only idle
keep-alive connections, and its graceful shutdown waits for every open connection unless told otherwise. Here:

- **connections**: at most `max_connections` open at once, and `max_connections_per_client` from one address; one
  over either is answered 429 (`Retry-After: 1`) and closed before anything is read;
- **headers**: the request line and headers must be complete `header_timeout_s` after the connection opened (or,
  on a kept-alive connection, after the next request's first byte), else the connection is closed; at most
  `max_header_bytes` of them (over that, or what is not HTTP, h11 answers 400: `malformed_request`);
- **bodies** (`read_body`, used by the routes after the headers were checked): a declared length over the cap is
  refused (413; what is left of a body up to `linger_bytes` past the cap is read and dropped first, so the client
  reads its 413 rather than a reset); the body must arrive within `body_floor_s` plus its length at `body_min_rate` bytes per
  second (408, connection closed); at most `max_body_readers` bodies are read at once (429 when no slot frees in a
  second), so stalled bodies hold at most that many buffers;
- **shutdown** (`GuardedServer`): stop accepting, close connections waiting for headers, give requests in flight
  `shutdown_timeout_s`, then cancel them; a second SIGTERM or SIGINT ends it at once.

Every refusal here goes through the `on_refuse(reason, client)` callback (the service counts it and logs one line).
"""

from __future__ import annotations

import asyncio
import math
import signal
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["BodyRefused", "Edge", "GuardedServer", "HttpLimits", "guarded_protocol", "read_body", "server_config"]

OnRefuse = Callable[[str, str], None]
"""(reason, client address) for a request or connection refused at the edge."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HttpLimits:
    max_connections: int = 4096
    """Open connections, all clients together (each is a file descriptor and a few KiB)."""
    max_connections_per_client: int = 64
    """Open connections from one client address."""
    header_timeout_s: float = 5.0
    """Seconds from a request's first byte (or the connection's opening) to the end of its headers."""
    max_header_bytes: int = 16 * 1024
    """Bytes of request line and headers."""
    body_floor_s: float = 5.0
    """Seconds any body may take, however short."""
    body_min_rate: float = 64 * 1024
    """Bytes per second a body must arrive at, beyond `body_floor_s`."""
    max_body_readers: int = 16
    """Bodies read at once; their buffers are what stalled bodies can hold."""
    keep_alive_s: int = 5
    """Seconds an idle keep-alive connection stays open (uvicorn's own timer)."""
    shutdown_timeout_s: float = 3.0
    """Seconds requests in flight get to finish at shutdown before they are cancelled."""
    linger_bytes: int = 64 * 1024
    """A body refused as too large is still read, and dropped, up to this many bytes past the cap (within
    `linger_s`) before the 413 and the close: a connection closed with unread data sends the client a reset, which
    on Linux discards the 413 it had not read yet (nginx's `lingering_close` for the same reason). A body longer than
    that is refused unread, and its client may see the reset instead."""
    linger_s: float = 1.0
    """Seconds the drain of a refused body may take."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_client", "max_header_bytes", "max_body_readers",
                     "keep_alive_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name}={getattr(self, name)}: must be >= 1")
        if self.linger_bytes < 0:
            raise ValueError(f"HttpLimits.linger_bytes={self.linger_bytes}: must be >= 0")
        for name in ("header_timeout_s", "body_floor_s", "body_min_rate", "shutdown_timeout_s", "linger_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name}={getattr(self, name)}: must be > 0")

    def body_deadline_s(self, length: int) -> float:
        return self.body_floor_s + length / self.body_min_rate


def _too_many() -> bytes:
    body = b'{"error":"too_many_connections","detail":"too many open connections; retry later"}'
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Edge:
    """What the connections and requests of one server share: who holds how many connections, the body-reader
    slots, and whether the server is closing (a body read in progress then ends at once, answered 503)."""

    def __init__(self, limits: HttpLimits, on_refuse: OnRefuse) -> None:
        self.limits = limits
        self.on_refuse = on_refuse
        self.total = 0
        self.by_client: Counter[str] = Counter()
        self.readers = asyncio.Semaphore(limits.max_body_readers)
        self.closing = asyncio.Event()


def guarded_protocol(edge: Edge) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the connection caps and the header deadline of the edge's limits."""
    limits, on_refuse = edge.limits, edge.on_refuse

    class Guarded(H11Protocol):
        _client = ""
        _counted = False
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._client = self.client[0] if self.client else "-"
            edge.total += 1
            edge.by_client[self._client] += 1
            self._counted = True
            if edge.total > limits.max_connections or edge.by_client[self._client] > limits.max_connections_per_client:
                on_refuse("too_many_connections", self._client)
                transport.write(_too_many())
                transport.close()
                return
            self._arm()

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                on_refuse("header_timeout", self._client)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_headers():
                self._arm()
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()

        def send_400_response(self, msg: str) -> None:
            on_refuse("malformed_request", self._client)  # not HTTP h11 can read (headers over the cap, a bad length)
            super().send_400_response(msg)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # idle now: uvicorn's keep-alive timer owns the connection until the next request

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted:
                self._counted = False
                edge.total -= 1
                edge.by_client[self._client] -= 1
                if edge.by_client[self._client] <= 0:
                    del edge.by_client[self._client]
            super().connection_lost(exc)

    return Guarded


class BodyRefused(Exception):
    """A body not read to its end: `status` and `reason` say why (413 too large, 408 too slow, 429 no reader slot,
    400 a declared length that is not a number); `reason` None when the client went away (nothing to answer)."""

    def __init__(self, status: int, reason: str | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail


async def read_body(stream: AsyncIterator[bytes], declared: str | None, *, max_body: int, edge: Edge) -> bytes:
    """The body of a request whose headers were checked: at most `max_body` bytes, within the deadline its length
    gives (module docstring), holding one of the edge's body-reader slots while it reads. BodyRefused otherwise,
    also when the server starts closing (503: a stalled body must not hold the shutdown up)."""
    limits = edge.limits
    if declared is not None:
        if not (declared.isascii() and declared.isdigit() and len(declared) <= 12):
            raise BodyRefused(400, "malformed_headers", "content-length is not a byte count")
        if int(declared) > max_body:
            if int(declared) <= max_body + limits.linger_bytes:
                await _linger(aiter(stream), limits.linger_bytes + max_body, limits.linger_s)
            raise BodyRefused(413, "too_large", f"body over {max_body} bytes")
    length = int(declared) if declared is not None else max_body
    late = f"body not complete within {limits.body_deadline_s(length):.0f} s"
    try:
        await asyncio.wait_for(edge.readers.acquire(), 1.0)
    except TimeoutError:
        raise BodyRefused(429, "too_many_connections", "every body-reader slot is busy; retry later") from None
    loop = asyncio.get_running_loop()
    closing = loop.create_task(edge.closing.wait())
    chunk_task: asyncio.Task[bytes] | None = None
    try:
        deadline = loop.time() + limits.body_deadline_s(length)
        buf = bytearray()
        chunks = aiter(stream)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise BodyRefused(408, "body_timeout", late)
            chunk_task = loop.create_task(anext(chunks))  # type: ignore[arg-type]
            done, _ = await asyncio.wait({chunk_task, closing}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if chunk_task not in done:
                raise BodyRefused(503, "shutting_down", "the service is stopping") if closing in done \
                    else BodyRefused(408, "body_timeout", late)
            try:
                chunk = chunk_task.result()
            except StopAsyncIteration:
                return bytes(buf)
            chunk_task = None
            buf += chunk
            if len(buf) > max_body:
                await _linger(chunks, limits.linger_bytes, min(limits.linger_s, max(0.0, deadline - loop.time())))
                raise BodyRefused(413, "too_large", f"body over {max_body} bytes")
    finally:
        for t in (closing, chunk_task):
            if t is not None and not t.done():
                t.cancel()
        edge.readers.release()


async def _linger(chunks: AsyncIterator[bytes], budget: int, seconds: float) -> None:
    """Read and drop what is left of a refused body: up to `budget` bytes, for at most `seconds`
    (`HttpLimits.linger_bytes`). Never raises: a client gone or too slow just ends it."""
    loop = asyncio.get_running_loop()
    end, seen = loop.time() + seconds, 0
    try:
        while seen <= budget and loop.time() < end:
            seen += len(await asyncio.wait_for(anext(chunks), max(0.0, end - loop.time())))
    except Exception:  # StopAsyncIteration (the end), TimeoutError, the client gone
        return


class GuardedServer(uvicorn.Server):
    """uvicorn's server whose shutdown always ends: body reads in progress end at once (`Edge.closing`), requests in
    flight get `config.timeout_graceful_shutdown` seconds, and a second SIGTERM or SIGINT (not only a second SIGINT,
    as uvicorn has it) ends it at once."""

    def __init__(self, config: uvicorn.Config, edge: Edge) -> None:
        super().__init__(config)
        self.edge = edge

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.edge.closing.set()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig in (signal.SIGTERM, signal.SIGINT):
            self.force_exit = True
        super().handle_exit(sig, frame)


def server_config(app: Any, *, host: str, port: int, edge: Edge, log_level: str) -> uvicorn.Config:
    """The uvicorn config of a guarded server: the guarded h11 protocol, the header cap, the keep-alive and the
    bounded graceful shutdown of the edge's limits; no lifespan, no websockets, no access log (the service logs
    refusals)."""
    limits = edge.limits
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off", ws="none",
                          access_log=False, http=guarded_protocol(edge),
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_keep_alive=limits.keep_alive_s,
                          timeout_graceful_shutdown=max(1, math.ceil(limits.shutdown_timeout_s)))
