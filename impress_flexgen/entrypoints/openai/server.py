"""An OpenAI-compatible HTTP server over the prefix store.

    python -m impress_flexgen.serve --model smollm2-135m --port 8000   # or: impress-flexgen serve
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

Every full chunk of every prompt is matched against and inserted into the store (service.py),
so a shared system prompt or a growing conversation is read back instead of recomputed, also
by a later server on the same --store-dir. The default policy is exact (full). The routes are
openai_app.py's. The port is bound before the model loads (a busy port fails at once).
SIGTERM stops accepting, lets requests in flight finish, then closes the engine (and its
shared pool) and the store.
"""
from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time

from ...errors import UserError, require
from ..args import (ArgumentParser, add_model_args, add_serving_args, check_serving_args,
                    finite_float, int_range)
from ..process import run_main
from .app import create_app
from .guard import BACKLOG, DEFAULT_MAX_BODY_BYTES, READ_TIMEOUT_S, ServerOptions

def bind(host: str, port: int) -> socket.socket:
    """A bound socket for the server (before the model loads, so a busy port fails fast)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise UserError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}"
                        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _uvicorn_server(service, log_level: str, graceful_s: float | None,
                   options: ServerOptions | None = None):
    """uvicorn with a read deadline, a connection cap and quiet accept errors
    (http_server.py)."""
    from .http import http_server

    options = options or ServerOptions()
    return http_server(create_app(service, options), log_level, graceful_s, options)


@contextlib.contextmanager
def background_server(service, host: str = "127.0.0.1", port: int = 0,
                      log_level: str = "warning", startup_s: float = 30.0,
                      options: ServerOptions | None = None):
    """Serve `service` over HTTP from a background thread (tests, benchmarks); yields the
    base URL, e.g. http://127.0.0.1:PORT. The service stays open: close it yourself."""
    sock = bind(host, port)
    server = _uvicorn_server(service, log_level, graceful_s=5, options=options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="http-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        bound = sock.getsockname()
        yield f"http://{bound[0]}:{bound[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def parse_args(argv):
    p = ArgumentParser(prog="python -m impress_flexgen.serve",
                       description="An OpenAI-compatible server whose prompts reuse a "
                                   "persistent multi-tier prefix KV store.")
    add_model_args(p, default_model="smollm2-135m")
    # Exact by default: an answer never depends on whether its prefix was stored. The
    # selective policies (impress and the rest) trade accuracy for bytes and are opt-in.
    add_serving_args(p, "default 256 MiB", "default 1 GiB", default_policy=(
        "full", "exact: the whole stored KV, through the tiers and the planner"))
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    s.add_argument("--port", type=int_range(0, 65535), default=8000,
                   help="port to listen on (8000; 0: any free port)")
    s.add_argument("--queue-size", type=int_range(1), default=16, metavar="N",
                   help="requests that may wait for the engine; beyond them a request gets "
                        "429 (16)")
    s.add_argument("--timeout-s", type=finite_float(0, low_open=True), default=600.0,
                   metavar="S", help="per request, from its arrival: past it a request ends "
                                     "with finish_reason timeout, or 504 if still queued (600)")
    s.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"),
                   default="info", help="the HTTP server's log level (info)")
    s.add_argument("--max-body-bytes", type=int_range(1024), default=DEFAULT_MAX_BODY_BYTES,
                   metavar="N", help="largest request body taken; a larger one gets 413 "
                                     f"({DEFAULT_MAX_BODY_BYTES})")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="a client key (may be given several times): requests need "
                        "'Authorization: Bearer KEY', and each key's stored prefixes are its "
                        "own; without any, no key is asked for and clients share prefixes "
                        "(unless they send a cache_salt)")
    s.add_argument("--return-cache-stats", action="store_true",
                   help="add the per-request block 'impress_flexgen' (matched tokens, plan, "
                        "bytes read, timings) to responses; off by default, as it tells "
                        "clients what the store held")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="return usage.prompt_tokens_details.cached_tokens for every request "
                        "(default: only for requests with a cache_salt, as it tells whether "
                        "a prompt was stored by anyone sharing the namespace)")
    s.add_argument("--metrics-key", default=None, metavar="KEY",
                   help="/metrics needs 'Authorization: Bearer KEY' (default: none needed "
                        "without --api-key; with --api-key and no metrics key, /metrics is "
                        "closed, as its counters span every tenant)")
    c = p.add_argument_group("connections")
    c.add_argument("--read-timeout-s", type=finite_float(0, 3600, low_open=True),
                   default=READ_TIMEOUT_S, metavar="S",
                   help="a connection must send each whole request, headers and body, within "
                        f"S seconds of opening or of its previous answer, or it is closed "
                        f"({READ_TIMEOUT_S:g})")
    c.add_argument("--max-connections", type=int_range(1), default=None, metavar="N",
                   help="connections open at once; beyond them, one waiting longest for its "
                        "request gives way (default and most: the descriptor limit less "
                        "room for the store's files)")
    c.add_argument("--backlog", type=int_range(1, 65535), default=BACKLOG, metavar="N",
                   help=f"connections the kernel holds before accepting ({BACKLOG})")
    args = p.parse_args(argv)
    check_serving_args(p, args, [args.policy])
    if any(not k.strip() for k in args.api_key):
        p.error("argument --api-key: a key must not be empty")
    if args.metrics_key is not None and (not args.metrics_key.strip() or
                                         args.metrics_key.strip() in
                                         [k.strip() for k in args.api_key]):
        p.error("argument --metrics-key: must not be empty nor one of the API keys")
    return args


def server_options(args) -> ServerOptions:
    return ServerOptions(max_body_bytes=args.max_body_bytes,
                         api_keys=tuple(k.strip() for k in args.api_key),
                         cache_stats=args.return_cache_stats,
                         read_timeout_s=args.read_timeout_s,
                         max_connections=args.max_connections, backlog=args.backlog,
                         prompt_tokens_details=args.enable_prompt_tokens_details,
                         metrics_key=args.metrics_key and args.metrics_key.strip())


def main(argv=None) -> int:
    args = parse_args(argv)
    # The server stack is imported only when serving: a missing one is said before the
    # model loads.
    require("fastapi", "the OpenAI-compatible server", "fastapi==0.165.0")
    require("uvicorn", "the OpenAI-compatible server", "uvicorn==0.54.0")
    from ...config import ServiceConfig
    from ...models.runtime import resolve_spec
    from ...service import Service

    config = ServiceConfig.from_args(args, queue_size=args.queue_size, timeout_s=args.timeout_s)
    resolve_spec(config.runtime_config())      # an unknown model fails before anything else
    sock = bind(args.host, args.port)
    try:
        service = Service(config)
    except BaseException:
        sock.close()
        raise
    try:
        for line in service.describe():
            print(line, flush=True)
        for warning in service.warnings:
            print(f"python -m impress_flexgen.serve: warning: {warning}", file=sys.stderr,
                  flush=True)
        options = server_options(args)
        server = _uvicorn_server(service, args.log_level, graceful_s=args.timeout_s,
                                 options=options)
        # Listening from now on: connections wait in the backlog while uvicorn starts.
        sock.listen(options.backlog)
        print(f"connections: at most {server.cap} open, each request read within "
              f"{options.read_timeout_s:g} s, backlog {options.backlog}", flush=True)
        if options.max_connections is not None and server.cap < options.max_connections:
            print(f"python -m impress_flexgen.serve: warning: --max-connections "
                  f"{options.max_connections} is more than the descriptor limit leaves room "
                  f"for; serving at most {server.cap}", file=sys.stderr, flush=True)
        host, port = sock.getsockname()[:2]
        print(f"serving {service.model_name} on http://{host}:{port}/v1 (OpenAI-compatible; "
              "also /health, /metrics)", flush=True)
        # SIGTERM / Ctrl-C: uvicorn stops accepting and waits for requests in flight.
        server.run(sockets=[sock])
    finally:
        service.close()
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(run_main("python -m impress_flexgen.serve", main))
