"""uvicorn's h11 protocol with two limits on connections: a deadline for each request's headers, and a cap on
open connections.

uvicorn limits a request's body (our guard does) and an idle kept-alive connection, but not the time a client
takes to send its headers: a client trickling partial headers holds a connection for ever. Here a connection
that has not sent a request's complete headers within `header_timeout` seconds of opening, or of the previous
response, is closed. A connection past `max_connections` open ones is answered a 503 in OpenAI's error body and
closed before its request is read (uvicorn's own limit answers in plain text).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from dsaserve.server.app import RETRY_AFTER


def _too_many_connections(limit: int) -> bytes:
    body = json.dumps({"error": {"message": f"the server has {limit} open connections, its limit "
                                            "(--max-connections); retry shortly", "type": "service_unavailable",
                                 "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: {RETRY_AFTER}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class LimitedH11Protocol(H11Protocol):
    header_timeout = 30.0
    max_connections: int | None = None
    _headers_due: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.write(_too_many_connections(self.max_connections))
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request's headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request's headers; armed first: a pipelined request, handled below, disarms it
        super().on_response_complete()

    def _arm(self) -> None:
        self._disarm()
        self._headers_due = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def _headers_late(self) -> None:
        self._headers_due = None
        if not self.transport.is_closing():
            self.transport.close()


def limited_protocol(header_timeout: float, max_connections: int | None) -> type[LimitedH11Protocol]:
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"header_timeout": header_timeout, "max_connections": max_connections})
