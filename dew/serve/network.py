"""How `dew serve` meets the network: the listening socket, bound before the model loads, and what
one client may take of the server (`Limits`).

`bind` takes the address before anything slow happens, so a bad `--host`, a port in use or a port
out of range is refused at once, and the address logged is the one held. The socket listens only
once uvicorn starts, so a client that connects while the model loads is refused, not left waiting.

uvicorn closes an idle keep-alive connection and answers 503 past `limit_concurrency`, but gives a
client forever to send a request's head and accepts every connection. `Guarded`, its HTTP/1.1
protocol with two additions, closes a connection that has not sent a whole head `read_timeout`
seconds after it opened, or after the first bytes of a later head came (with a 408 when part of a
head came), and answers a connection past `max_connections` with a 503 and closes it at once. The
body's own deadline and size are the application's (`dew.serve.app`). A client that sends a whole request
and then closes its side of the connection (a half-close, as `nc -N` does) still reads the
answer, and the connection closes after it: uvicorn took the end of its input for the
client's going away, and answered nothing.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import ipaddress
import logging
import math
import re
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("dew.serve")


def _closing_answer(status: str, text: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, written before (or without) a request."""
    body = text.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


_BUSY = _closing_answer("503 Service Unavailable",
                        "this server holds its most connections (dew serve --max-connections)\n")
_LATE = _closing_answer("408 Request Timeout", "the request head came in too slowly (dew serve --read-timeout)\n")


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client may take of the server: `max_body_bytes` of request body (413 past it),
    `read_timeout` seconds to send a request's head and again its body, `keep_alive_timeout` seconds
    an idle connection stays open between requests, and `max_connections` open at once (`dew serve`'s
    flags of those names hold the defaults)."""

    max_body_bytes: int
    read_timeout: float
    keep_alive_timeout: float
    max_connections: int

    def __post_init__(self):
        for flag, count in (("--max-body-bytes", self.max_body_bytes), ("--max-connections", self.max_connections)):
            if count < 1:
                raise ValueError(f"{flag} is {count}; it must be at least 1")
        for flag, seconds in (("--read-timeout", self.read_timeout), ("--keep-alive-timeout", self.keep_alive_timeout)):
            if not 0 < seconds < math.inf:
                raise ValueError(f"{flag} is {seconds}; it is a number of seconds above 0")

    def protocol(self):
        """The HTTP protocol uvicorn runs each connection with (its `http` setting)."""
        return functools.partial(Guarded, read_timeout=self.read_timeout, max_connections=self.max_connections)


class Guarded(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's head and a bound on connections."""

    def __init__(self, *args, read_timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self._head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            logger.warning("refused a connection: %d are open, the most dew serve --max-connections allows",
                           self.max_connections)
            transport.write(_BUSY)
            transport.close()
            return
        self._start_timer()

    def data_received(self, data: bytes) -> None:
        # The first bytes after an answer begin the next head (uvicorn's keep-alive timer covers the wait).
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start_timer()
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._stop_timer()  # a head came whole, and its request is being answered

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client closed its side. Once its request is whole and not yet answered, the connection stays open
        for the answer, then closes (True keeps asyncio's transport open); otherwise it closes now. A client gone
        entirely is found at the first write that fails, as any other."""
        if self.cycle is None or self.cycle.response_complete or self.conn.their_state is not h11.DONE:
            return None
        self.cycle.keep_alive = False  # no other request can come
        return True

    def _start_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.read_timeout, self._head_late)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # a request came and is being answered
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_LATE)  # part of a head came, too slowly
        self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: a free port), not yet listening; a ValueError (a bad
    address) or OSError (the port is taken, or needs privileges) naming the flag and the fix."""
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port: use one from 1 to 65535 (0 takes any free port)")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        if re.fullmatch(r"[\d.]+", host):
            raise ValueError(f"--host {host} is not an IPv4 address (four numbers from 0 to 255): use one, such "
                             "as 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
        try:  # a name, such as localhost
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror as error:
            raise ValueError(f"--host {host} names no address ({error.strerror}): use an IP address, such as "
                             "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    listener = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a restarted server binds while its old connections linger in TIME_WAIT.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise OSError(f"{host}:{port} is in use by another process: stop it, or choose another --port") from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise ValueError(f"--host {host} is not an address of this machine: use one of its own, 127.0.0.1 "
                             "(this machine only) or 0.0.0.0 (every interface)") from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise OSError(f"{host}:{port}: permission denied (ports below 1024 need privileges): choose --port "
                          "1024 or above") from None
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return listener
