"""An OpenAI-compatible HTTP server over the prefix store.

    python -m impress_flexgen.serve --model smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent events),
GET /v1/models, /health and /metrics (Prometheus). Every full chunk of every prompt is
matched against and inserted into the store (service.py), so a shared system prompt or a
growing conversation is read back instead of recomputed, also by a later server on the same
--store-dir. Errors are OpenAI's error bodies with a 4xx status; a full queue is 429.
SIGTERM stops accepting, lets requests in flight finish, then closes the engine (and its
shared pool) and the store.
"""
# No `from __future__ import annotations`: FastAPI reads the request models of the routes
# below from their annotations, and those models are local to create_app.
import asyncio
import contextlib
import socket
import sys
import threading
import time
import uuid
from typing import Any

from .cli import (ArgumentParser, add_model_args, add_serving_args, check_serving_args,
                  finite_float, int_range, run_main)
from .errors import UserError
from .serve_guard import DEFAULT_MAX_BODY_BYTES, ServerOptions

COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256          # the chat default (OpenAI's runs to the context's end)
_END = object()


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    from fastapi.responses import JSONResponse

    from .service import ServiceError

    return JSONResponse(ServiceError(status, message, param, code).body(), status_code=status)


def _validation_message(exc) -> tuple[str, str | None]:
    """One line (and the offending field) from FastAPI's validation errors."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        why = (e.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON{': ' + why if why else ''}", None
    if not loc:   # the body itself: missing, or not an object
        return "the request body must be a JSON object (Content-Type: application/json)", None
    field = loc[0] if loc else None
    if e.get("type") == "missing":
        return f"{'.'.join(loc)} is required", field
    return f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}", field


def create_app(service, options: ServerOptions | None = None):
    """The FastAPI application serving `service` (a service.Service)."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict
    from starlette.exceptions import HTTPException

    from .serve_guard import Guard, bearer_key, namespace
    from .service import ServiceError

    options = options or ServerOptions()
    app = FastAPI(title="impress_flexgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, limit=options.max_body_bytes, api_keys=options.api_keys,
                       on_refused=lambda: service.count("invalid"))
    name = service.model_name

    class Common(BaseModel):
        # Strict: "3" or true for max_tokens is a 400, never silently coerced.
        model_config = ConfigDict(extra="ignore", strict=True)
        model: str
        cache_salt: str | None = None
        max_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        seed: int | None = None
        stop: str | list[str] | None = None
        stream: bool | None = False
        stream_options: dict | None = None
        n: int | None = None
        # Refused unless left at their defaults: not implemented here.
        best_of: int | None = None
        echo: bool | None = None
        logprobs: Any = None
        top_logprobs: int | None = None
        suffix: str | None = None
        presence_penalty: float | None = None
        frequency_penalty: float | None = None
        logit_bias: dict | None = None
        tools: list | None = None

    class CompletionBody(Common):
        prompt: str | list[int] | list[str] | list[list[int]]

    class ChatBody(Common):
        messages: list[Any]
        max_completion_tokens: int | None = None

    @app.exception_handler(ServiceError)
    async def service_error(request, exc: ServiceError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        service.count("invalid")
        message, param = _validation_message(exc)
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        return _error(500, f"internal error: {type(exc).__name__}")

    def refuse_unsupported(body: Common) -> None:
        if body.model != name:
            raise ServiceError(404, f"model {body.model!r} is not served here; this server "
                                    f"serves {name!r}", param="model", code="model_not_found")
        if body.n not in (None, 1):
            raise ServiceError(400, "n must be 1: one choice per request", param="n")
        unsupported = {
            "best_of": body.best_of not in (None, 1), "echo": bool(body.echo),
            "logprobs": body.logprobs not in (None, False),
            "top_logprobs": body.top_logprobs not in (None, 0),
            "suffix": bool(body.suffix), "presence_penalty": bool(body.presence_penalty),
            "frequency_penalty": bool(body.frequency_penalty),
            "logit_bias": bool(body.logit_bias), "tools": bool(body.tools)}
        for field, used in unsupported.items():
            if used:
                raise ServiceError(400, f"{field} is not supported by this server",
                                   param=field)

    def tenant(body: Common, request: Request) -> str:
        """The request's namespace: its API key's (checked by the guard) and cache salt's."""
        if body.cache_salt is not None and not body.cache_salt:
            raise ServiceError(400, "cache_salt must not be empty", param="cache_salt")
        if body.cache_salt is not None:
            try:
                body.cache_salt.encode("utf-8")
            except UnicodeEncodeError:
                raise ServiceError(400, "cache_salt is not valid Unicode",
                                   param="cache_salt") from None
        key = bearer_key(request.headers) if options.api_keys else None
        return namespace(key, body.cache_salt)

    async def build(body: Common, request: Request, **prompt):
        try:
            refuse_unsupported(body)
            ns = tenant(body, request)
            # In a worker thread: tokenising a long prompt holds up no other request.
            job = await run_in_threadpool(
                service.frontend.build, **prompt,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=body.top_p, seed=body.seed, stop=body.stop)
            job.namespace = ns
            return job
        except ServiceError as exc:
            service.count("invalid")
            if exc.param == "prompt_ids":     # token ids arrive in OpenAI's prompt field
                exc.param = "prompt"
            raise

    async def wait(ticket, request: Request):
        """The completion, or None if the client went away first (the job is cancelled)."""
        fut = asyncio.wrap_future(ticket.future)
        while True:
            done, _ = await asyncio.wait({fut}, timeout=0.25)
            if done:
                return fut.result()
            if await request.is_disconnected():
                ticket.cancel()
                # Nobody reads its outcome now: take it, so it is not logged as lost.
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
                return None

    def submit_streaming(job):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def push(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:   # the event loop is gone: nobody is listening
                pass

        ticket = service.submit(job, listener=push)
        ticket.future.add_done_callback(lambda _: push(_END))
        return ticket, events

    def usage(done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.stats["cached_tokens"]}}

    def extra(done) -> dict:
        """The non-standard stats block, only where the operator asked for it: it tells
        what the store held, which is not every client's business."""
        return {"impress_flexgen": done.stats} if options.cache_stats else {}

    def stream(ticket, events, rid: str, created: int, chunk) -> StreamingResponse:
        """Server-sent events: `chunk(delta_text, finish_reason)` -> one event's object."""
        import json

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def gen():
            try:
                first = chunk(None, None)
                if first is not None:
                    yield sse(first)
                while True:
                    item = await events.get()
                    if item is _END:
                        break
                    yield sse(chunk(item, None))
                try:
                    done = ticket.future.result()
                except ServiceError as exc:
                    yield sse(exc.body())
                else:
                    last = chunk("", done.finish_reason)
                    last["usage"] = usage(done)
                    last.update(extra(done))
                    yield sse(last)
                yield "data: [DONE]\n\n"
            finally:
                if not ticket.future.done():
                    ticket.cancel()     # the client went away mid-stream

        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                service.count("invalid")
                raise ServiceError(400, "one prompt per request (got a list of "
                                        f"{len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, list):
            kw = {"prompt_ids": prompt}
        else:
            kw = {"prompt": prompt}
        job = await build(body, request, **kw, max_tokens=body.max_tokens,
                          default_max_tokens=COMPLETION_MAX_TOKENS)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, finish):
            if text is None:
                return None
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": text, "logprobs": None,
                                 "finish_reason": finish}]}

        if body.stream:
            ticket, events = submit_streaming(job)
            return stream(ticket, events, rid, created, chunk)
        done = await wait(service.submit(job), request)
        if done is None:
            return Response(status_code=499)
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": 0, "text": done.text, "logprobs": None,
                             "finish_reason": done.finish_reason}],
                "usage": usage(done), **extra(done)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        limit = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        job = await build(body, request, messages=body.messages, max_tokens=limit,
                          default_max_tokens=CHAT_MAX_TOKENS)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(text, finish):
            delta = {"role": "assistant", "content": ""} if text is None else \
                ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": name, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}]}

        if body.stream:
            ticket, events = submit_streaming(job)
            return stream(ticket, events, rid, created, chunk)
        done = await wait(service.submit(job), request)
        if done is None:
            return Response(status_code=499)
        return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                             "logprobs": None, "finish_reason": done.finish_reason}],
                "usage": usage(done), **extra(done)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model",
                                            "created": service.created,
                                            "owned_by": "impress_flexgen"}]}

    @app.get("/health")
    async def health():
        if service.closing:
            return JSONResponse({"status": "draining", "model": name}, status_code=503)
        return {"status": "ready", "model": name}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(service.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return app


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
    import uvicorn

    config = uvicorn.Config(create_app(service, options), log_level=log_level,
                            access_log=False,
                            timeout_graceful_shutdown=graceful_s, lifespan="off")
    return uvicorn.Server(config)


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
    add_serving_args(p, "default 256 MiB", "default 1 GiB")
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
    args = p.parse_args(argv)
    check_serving_args(p, args, [args.policy])
    if any(not k.strip() for k in args.api_key):
        p.error("argument --api-key: a key must not be empty")
    return args


def server_options(args) -> ServerOptions:
    return ServerOptions(max_body_bytes=args.max_body_bytes,
                         api_keys=tuple(k.strip() for k in args.api_key),
                         cache_stats=args.return_cache_stats)


def main(argv=None) -> int:
    args = parse_args(argv)
    from .runtime import resolve_spec
    from .service import Service, ServiceConfig

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
        server = _uvicorn_server(service, args.log_level, graceful_s=args.timeout_s,
                                 options=server_options(args))
        # Listening from now on: connections wait in the backlog while uvicorn starts.
        sock.listen(2048)
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
