"""What stands in front of the server's routes: a body-size limit that no request body can
get past (whatever its Content-Length says, chunked or not), tenants by API key and cache
salt, and /metrics behind a key of its own once keys are set.

A body is read into memory only up to the limit; past it the rest is read and dropped (so a
client sending it still reads the answer) for a bounded time and size, then the request gets
413 with OpenAI's error body. The event loop never parses or holds more than the limit, so a
huge body delays no other request.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import time

MiB = 1 << 20
DEFAULT_MAX_BODY_BYTES = 8 * MiB
DRAIN_BYTES = 256 * MiB     # read and dropped past the limit, at most, before hanging up
DRAIN_S = 5.0
READ_TIMEOUT_S = 30.0       # to read a whole request, headers and body
BACKLOG = 128               # connections the kernel holds for accepting


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How the HTTP server guards and answers (the engine's options are ServiceConfig)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_keys: tuple[str, ...] = ()       # empty: no key needed, one shared namespace
    cache_stats: bool = False            # add the non-standard per-request stats block
    read_timeout_s: float = READ_TIMEOUT_S
    max_connections: int | None = None   # None: what the descriptor limit leaves room for
    backlog: int = BACKLOG
    # usage.prompt_tokens_details.cached_tokens for every request (else only for requests
    # with a cache_salt): it tells whether a prompt was stored, in a namespace others share.
    prompt_tokens_details: bool = False
    metrics_key: str | None = None       # /metrics needs it; with API keys and none, closed

    def __post_init__(self):
        if self.max_body_bytes < 1:
            raise ValueError("the body limit must be at least 1 byte")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if not self.read_timeout_s > 0 or self.backlog < 1 or \
                (self.max_connections is not None and self.max_connections < 1):
            raise ValueError("the read timeout, backlog and connection cap must be positive")
        if self.metrics_key is not None and (not self.metrics_key or
                                             self.metrics_key in self.api_keys):
            raise ValueError("the metrics key must be set and differ from every API key")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": code}}).encode()


class Guard:
    """ASGI middleware: with API keys set, a /v1 request without a valid bearer key ends in
    401; so does /metrics without the metrics key, when there is one or there are API keys
    (its counters sum every tenant's matched tokens: a tenant's key does not open it);
    bodies over `limit` bytes end in 413; each before the app sees the request."""

    def __init__(self, app, limit: int, api_keys: tuple[str, ...] = (), on_refused=None,
                 metrics_key: str | None = None):
        self.app = app
        self.limit = limit
        self.api_keys = api_keys
        self.on_refused = on_refused
        self.metrics_key = metrics_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if path.startswith("/metrics") and (self.api_keys or self.metrics_key is not None):
            if self.metrics_key is None or \
                    not known_key(bearer_key(headers), (self.metrics_key,)):
                body = error_body("/metrics needs the metrics key: Authorization: Bearer <key>"
                                  if self.metrics_key is not None else
                                  "/metrics is closed on a server with API keys unless it is "
                                  "started with --metrics-key", code="invalid_api_key")
                return await self._answer(receive, send, 401, body)
        elif self.api_keys and not path.startswith("/health"):
            key = bearer_key(headers)
            if not known_key(key, self.api_keys):
                body = error_body("a valid API key is needed: Authorization: Bearer <key>"
                                  if key is None else "the API key is not valid",
                                  code="invalid_api_key")
                return await self._answer(receive, send, 401, body)
        if scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
        if declared is not None and declared > self.limit:
            return await self._refuse(receive, send, declared)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                chunks.clear()
                return await self._refuse(receive, send, None, more=message.get("more_body"))
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay():
            nonlocal replayed, body
            if not replayed:
                replayed = True
                message, body = {"type": "http.request", "body": body, "more_body": False}, b""
                return message
            return await receive()     # then a disconnect, when the client goes

        await self.app(scope, replay, send)

    async def _refuse(self, receive, send, declared, more=True):
        if self.on_refused is not None:
            self.on_refused()
        size = f"{declared} bytes" if declared is not None else "more bytes"
        body = error_body(f"the request body has {size}; this server takes at most "
                          f"{self.limit} bytes", code="request_too_large")
        await self._answer(receive, send, 413, body, more)

    @staticmethod
    async def _answer(receive, send, status: int, body: bytes, more: bool = True):
        # Drop what the client is still sending (bounded), so it gets to read the answer.
        dropped, deadline = 0, time.monotonic() + DRAIN_S
        while more and dropped < DRAIN_BYTES and time.monotonic() < deadline:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            dropped += len(message.get("body", b""))
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def bearer_key(headers) -> str | None:
    value = headers.get("authorization") or ""
    scheme, _, key = value.partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def known_key(key: str | None, keys: tuple[str, ...]) -> bool:
    """Compared in constant time against every key (no early exit reveals which)."""
    if key is None:
        return False
    found = False
    for k in keys:
        found |= hmac.compare_digest(key.encode(), k.encode())
    return found


def namespace(key: str | None, salt: str | None) -> str:
    """The opaque namespace of an API key and a cache salt ("" for neither: the shared one).
    Stable across restarts, so a tenant's stored prefixes stay its own."""
    if not key and not salt:
        return ""
    raw = json.dumps(["impress_flexgen namespace", key or "", salt or ""]).encode()
    return hashlib.sha256(raw).hexdigest()[:32]
