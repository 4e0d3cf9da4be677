"""The HTTP server under the OpenAI application: uvicorn's h11 protocol and server, with the
connection hygiene uvicorn leaves out.

    server = http_server(app, "info", graceful_s=600, options=ServerOptions())
    server.run(sockets=[sock])

- A deadline for reading each whole request, headers and body, counted from the
  connection's start or the end of its previous answer: a client that sends half a request
  (or nothing) is closed when it passes, with a 408 if it had sent anything. uvicorn's
  keep-alive timeout only starts after an answer, and an ASGI middleware never sees a
  request whose headers have not all arrived, so the deadline lives in the protocol.
- A cap on open connections below the process's descriptor limit (less room for the store's
  files, the shared pool's sockets and the rest): at the cap nothing more is accepted, so
  accept() never runs out of descriptors. A connection waiting in the backlog then takes the
  place of the open one that has waited longest for its request (a slow client), so slow
  clients cannot lock out a normal one; connections with a request in flight are never
  closed for room. uvicorn's limit_concurrency cannot do this: it counts connections only
  after accepting them, and answers 503 on one that could have been served.
- A small listen backlog, and accept errors ("Too many open files") logged at most once a
  second: asyncio's own accept loop logs one traceback per failed accept.

Accepting is this module's: uvicorn starts without sockets and the listening socket is read
by an Acceptor that hands each connection to uvicorn's protocol (loop.connect_accepted_socket).
"""
from __future__ import annotations

import asyncio
import collections
import errno
import logging
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .guard import ServerOptions

log = logging.getLogger("uvicorn.error")   # uvicorn's own lines: its format and level
# Descriptors kept for the rest of the process: the store's reader keeps up to 256 files
# open (disk_layout.reader), plus SQLite, weights, the shared pool's sockets, logs.
FD_HEADROOM = 384
MIN_CONNECTIONS = 16
ACCEPT_BATCH = 32         # accepts per wake-up, so that accepting never starves answering
ACCEPT_RETRY_S = 0.25     # after an accept error that a moment may cure (EMFILE, ENOBUFS)
MIN_WAIT_S = 0.1          # a connection may be closed for room after waiting this long
HEADER_BYTES = 16 * 1024  # h11's limit on a request's headers; larger ones get 400
KEEP_ALIVE_S = 5
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                   b"content-length: 24\r\nconnection: close\r\n\r\nrequest not read in time")


def descriptor_limit() -> int | None:
    """The process's soft limit on open descriptors (None: unlimited or unknown)."""
    try:
        import resource
    except ImportError:      # not a Unix
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def connection_cap(requested: int | None, limit: int | None = None) -> int:
    """At most `requested` connections (None: as many as fit), and never more than the
    descriptor limit less the process's own headroom (half the limit, at most FD_HEADROOM)."""
    limit = descriptor_limit() if limit is None else limit
    fits = 65536 if limit is None else max(MIN_CONNECTIONS,
                                           limit - min(FD_HEADROOM, limit // 2))
    return fits if requested is None else min(requested, fits)


class ThrottledLog:
    """Warnings of one kind at most once every `interval_s`; the next one says how many were
    left out. A flood of failing accepts or slow clients writes a line a second, not a
    traceback each."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0, clock=time.monotonic):
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str) -> bool:
        now = self.clock()
        last, left_out = self._last.get(kind, (float("-inf"), 0))
        if now - last < self.interval_s:
            self._last[kind] = (last, left_out + 1)
            return False
        if left_out:
            message += f" ({left_out} more like it since the last such line)"
        self.logger.warning(message)
        self._last[kind] = (now, 0)
        return True


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, with a deadline for reading each whole request; tells its
    Acceptor while it waits for a request (a candidate to close for room) and when it
    closes."""

    def __init__(self, config, server_state, app_state, *, read_timeout_s: float,
                 acceptor: "Acceptor", notes: ThrottledLog):
        super().__init__(config, server_state, app_state)
        self.read_timeout_s = read_timeout_s
        self.acceptor = acceptor
        self.notes = notes
        self._deadline: asyncio.TimerHandle | None = None
        self._partial = False       # bytes of the awaited request have come
        self.connected = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.connected = True
        self._await_request()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)
        self.acceptor.lost(self)

    def data_received(self, data: bytes) -> None:
        self._partial = self._partial or bool(data)
        super().data_received(data)
        if self._deadline is not None and not self._reading():
            self._disarm()          # the whole request is in: the app has it now

    def on_response_complete(self) -> None:
        super().on_response_complete()      # may start a pipelined next request
        if not self.transport.is_closing() and self._deadline is None and self._reading():
            self._await_request()

    def _reading(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def _await_request(self) -> None:
        self._disarm()
        self._partial = self.conn.their_state is h11.SEND_BODY
        self._deadline = self.loop.call_later(self.read_timeout_s, self.expire, False)
        self.acceptor.reading(self)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.acceptor.served(self)

    def expire(self, for_room: bool) -> None:
        """Close the connection: its request did not arrive in time, or (for_room) a new
        connection takes its place. A client that sent part of a request reads a 408."""
        self._disarm()
        if self.transport.is_closing():
            return
        if self._partial and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(_TIMEOUT_ANSWER)   # no answer begun: this one is whole
        self.transport.close()
        if for_room:
            self.notes.warning("room", "at the connection cap: closed the connection that "
                                       "waited longest for its request")
        else:
            self.notes.warning("deadline", "closed a connection that sent no whole request "
                                           f"within {self.read_timeout_s:g} s")


class Acceptor:
    """Accepts connections from a listening socket while fewer than `cap` are open."""

    def __init__(self, loop, sock, make_protocol, cap: int, notes: ThrottledLog):
        self.loop, self.sock, self.make_protocol = loop, sock, make_protocol
        self.cap, self.notes = cap, notes
        self.open = 0
        # The connections waiting for a request, oldest first, with when they began to.
        self.waiting: collections.OrderedDict = collections.OrderedDict()
        self._listening = self._stopped = False

    def start(self) -> None:
        self.sock.setblocking(False)
        self._listen()

    def stop(self) -> None:
        self._stopped = True
        self._unlisten()

    def _listen(self) -> None:
        if not self._listening and not self._stopped:
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self._listening = True

    def _unlisten(self) -> None:
        if self._listening:
            self.loop.remove_reader(self.sock.fileno())
            self._listening = False

    def _accept(self) -> None:
        if self.open >= self.cap:
            self._unlisten()        # called while full: a connection waits
            self._make_room()
            return
        for _ in range(ACCEPT_BATCH):
            if self.open >= self.cap:
                return          # still listening: a next call finds out whether one waits
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                self.notes.warning("accept", f"cannot accept a connection: {exc.strerror or exc}"
                                             f" ({self.open} open); trying again")
                if exc.errno in _RESOURCE_ERRORS:
                    self._unlisten()
                    self.loop.call_later(ACCEPT_RETRY_S, self._listen)
                return
            self.open += 1
            conn.setblocking(False)
            self.loop.create_task(self._connect(conn))

    def _make_room(self) -> None:
        """Close the connection that has waited longest for its request, once it has waited
        MIN_WAIT_S (a connection just accepted has not had the time to send one); listening
        resumes when it is gone. With none to close yet, look again shortly."""
        now = self.loop.time()
        for oldest, since in self.waiting.items():
            if now - since >= MIN_WAIT_S:
                oldest.expire(for_room=True)
                return
            self.loop.call_later(MIN_WAIT_S - (now - since), self._listen)
            return
        self.loop.call_later(MIN_WAIT_S, self._listen)   # all busy, or not started yet

    async def _connect(self, conn) -> None:
        made = []

        def protocol():
            made.append(self.make_protocol(self))
            return made[0]

        try:
            await self.loop.connect_accepted_socket(protocol, conn)
        except Exception as exc:  # noqa: BLE001 - one connection lost; keep accepting
            conn.close()
            if not (made and made[0].connected):   # else connection_lost told us
                self._release()
            self.notes.warning("connect", f"a connection failed to start: {exc}")

    def reading(self, protocol) -> None:
        self.waiting.pop(protocol, None)
        self.waiting[protocol] = self.loop.time()

    def served(self, protocol) -> None:
        self.waiting.pop(protocol, None)

    def lost(self, protocol) -> None:
        self.waiting.pop(protocol, None)
        self._release()

    def _release(self) -> None:
        self.open -= 1
        self._listen()


class HttpServer(uvicorn.Server):
    """uvicorn's server, whose sockets are read by Acceptors (see the module's notes)."""

    def __init__(self, config: uvicorn.Config, options: ServerOptions):
        super().__init__(config)
        self.options = options
        self.cap = connection_cap(options.max_connections)
        self.acceptors: list[Acceptor] = []
        self.notes = ThrottledLog(log)

    async def startup(self, sockets=None) -> None:
        if not sockets:
            raise ValueError("HttpServer serves the sockets it is given")
        await super().startup(sockets=[])     # everything but uvicorn's accept loop
        loop = asyncio.get_running_loop()
        config, state, app_state = self.config, self.server_state, self.lifespan.state

        def make_protocol(acceptor):
            return DeadlineProtocol(config, state, app_state, acceptor=acceptor,
                                    read_timeout_s=self.options.read_timeout_s,
                                    notes=self.notes)

        for sock in sockets:
            sock.listen(self.options.backlog)
            acceptor = Acceptor(loop, sock, make_protocol, self.cap, self.notes)
            acceptor.start()
            self.acceptors.append(acceptor)

    async def shutdown(self, sockets=None) -> None:
        for acceptor in self.acceptors:
            acceptor.stop()
        await super().shutdown(sockets=sockets)


def http_server(app, log_level: str, graceful_s: float | None,
                options: ServerOptions) -> HttpServer:
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=graceful_s, http="h11",
                            backlog=options.backlog, h11_max_incomplete_event_size=HEADER_BYTES,
                            timeout_keep_alive=min(KEEP_ALIVE_S,
                                                   max(1, int(options.read_timeout_s))))
    return HttpServer(config, options)
