"""An OpenAI-compatible HTTP server over the prefix store.

    python -m impress_flexgen.serve --model smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent events),
as vLLM serves them (logprobs, echo with prompt log-probabilities, n, top_k, min_p, ...; an
unknown field is a 400), GET /v1/models[/{id}], POST /tokenize and /detokenize, GET /version,
/health and /metrics (Prometheus). Every full chunk of every prompt is matched against and
inserted into the store (service.py), so a shared system prompt or a growing conversation is
read back instead of recomputed, also by a later server on the same --store-dir. The default
policy is exact (full). Errors are OpenAI's error bodies with a 4xx status; a full queue is
429 with Retry-After. Bodies are limited and API keys checked before a route runs
(serve_guard.py). SIGTERM stops accepting, lets requests in flight finish, then closes the
engine (and its shared pool) and the store.
"""
# No `from __future__ import annotations`: FastAPI reads the request models of the routes
# below from their annotations.
import asyncio
import contextlib
import dataclasses
import socket
import sys
import threading
import time
import uuid

from .cli import (ArgumentParser, add_model_args, add_serving_args, check_serving_args,
                  finite_float, int_range, run_main)
from .errors import UserError
from .serve_guard import DEFAULT_MAX_BODY_BYTES, ServerOptions

_END = object()


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    from fastapi.responses import JSONResponse

    from .service import ServiceError

    return JSONResponse(ServiceError(status, message, param, code).body(), status_code=status)


def create_app(service, options: ServerOptions | None = None):
    """The FastAPI application serving `service` (a service.Service)."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from . import defaults
    from .openai_api import (ChatBody, Common, CompletionBody, DetokenizeBody, TokenizeBody,
                             chat_logprobs, completion_logprobs, package_version,
                             refuse_unsupported, usage, validation_message)
    from .serve_guard import Guard, bearer_key, namespace
    from .service import ServiceError

    options = options or ServerOptions()
    app = FastAPI(title="impress_flexgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, limit=options.max_body_bytes, api_keys=options.api_keys,
                       on_refused=lambda: service.count("invalid"))
    name = service.model_name
    frontend = service.frontend

    @app.exception_handler(ServiceError)
    async def service_error(request, exc: ServiceError):
        # A full queue: come back in a second (the engine serves a request in about that).
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc):
        service.count("invalid")
        message, param = validation_message(exc)
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        return _error(500, f"internal error: {type(exc).__name__}")

    def check_model(model: str | None) -> None:
        if model is not None and model != name:
            raise ServiceError(404, f"model {model!r} is not served here; this server "
                                    f"serves {name!r}", param="model", code="model_not_found")

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

    async def build(body: Common, request: Request, **prompt) -> list:
        """The request's jobs, one per choice (n): tokenised once, seeds apart."""
        try:
            check_model(body.model)
            refuse_unsupported(body)
            ns = tenant(body, request)
            # In a worker thread: tokenising a long prompt holds up no other request.
            job = await run_in_threadpool(
                frontend.build, **prompt, default_max_tokens=defaults.MAX_TOKENS,
                temperature=defaults.TEMPERATURE if body.temperature is None
                else body.temperature,
                top_p=defaults.TOP_P if body.top_p is None else body.top_p, seed=body.seed,
                stop=body.stop, top_k=body.top_k, min_p=body.min_p,
                min_tokens=body.min_tokens, ignore_eos=bool(body.ignore_eos),
                stop_token_ids=body.stop_token_ids)
        except ServiceError as exc:
            service.count("invalid")
            if exc.param == "prompt_ids":     # token ids arrive in OpenAI's prompt field
                exc.param = "prompt"
            raise
        job.namespace = ns
        jobs = [job]
        for i in range(1, body.n or 1):
            seed = None if job.sampling.seed is None else job.sampling.seed + i
            jobs.append(dataclasses.replace(
                job, sampling=dataclasses.replace(job.sampling, seed=seed)))
        return jobs

    def submit(jobs, listeners=None) -> list:
        """Queue every choice, or none (429 for all if the queue fills part-way)."""
        tickets = []
        try:
            for i, job in enumerate(jobs):
                tickets.append(service.submit(job, listener=listeners[i] if listeners
                                              else None))
        except ServiceError:
            for t in tickets:
                t.cancel()
            raise
        return tickets

    async def wait(tickets, request: Request):
        """The completions, or None if the client went away first (the jobs are cancelled)."""
        futs = [asyncio.wrap_future(t.future) for t in tickets]
        while True:
            done, pending = await asyncio.wait(futs, timeout=0.25)
            if not pending:
                return [f.result() for f in futs]
            if await request.is_disconnected():
                for t in tickets:
                    t.cancel()
                # Nobody reads their outcome now: take it, so it is not logged as lost.
                for f in futs:
                    f.add_done_callback(lambda f: f.cancelled() or f.exception())
                return None

    def extra(dones) -> dict:
        """The non-standard stats block, only where the operator asked for it: it tells
        what the store held, which is not every client's business."""
        return {"impress_flexgen": dones[0].stats} if options.cache_stats else {}

    def piece(token: int) -> str:
        return frontend.decode([token])

    def stream(jobs, body: Common, rid: str, created: int, chunk) -> StreamingResponse:
        """Server-sent events for every choice: `chunk(index, delta_text, finish_reason)`
        -> one event's object; with stream_options.include_usage a last event with no
        choices carries the usage (OpenAI's rule), otherwise no event does."""
        import json

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def pusher(i):
            def push(item) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (i, item))
                except RuntimeError:   # the event loop is gone: nobody is listening
                    pass
            return push

        listeners = [pusher(i) for i in range(len(jobs))]
        tickets = submit(jobs, listeners)
        for i, t in enumerate(tickets):
            t.future.add_done_callback(lambda _, push=listeners[i]: push(_END))
        include_usage = bool((body.stream_options or {}).get("include_usage"))

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def gen():
            try:
                for i in range(len(jobs)):
                    first = chunk(i, None, None)
                    if first is not None:
                        yield sse(first)
                left, dones = len(tickets), [None] * len(tickets)
                while left:
                    i, item = await events.get()
                    if item is not _END:
                        yield sse(chunk(i, item, None))
                        continue
                    left -= 1
                    try:
                        dones[i] = tickets[i].future.result()
                    except ServiceError as exc:
                        yield sse(exc.body())
                        continue
                    last = chunk(i, "", dones[i].finish_reason)
                    if i == 0 and not include_usage:
                        last.update(extra(dones))
                    yield sse(last)
                if include_usage and all(dones):
                    yield sse({"id": rid, "object": chunk(0, "", None)["object"],
                               "created": created, "model": name, "choices": [],
                               "usage": usage(dones), **extra(dones)})
                yield "data: [DONE]\n\n"
            finally:
                for t in tickets:
                    if not t.future.done():
                        t.cancel()     # the client went away mid-stream

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
        kw = {"prompt_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        scored = bool(body.echo) and body.logprobs is not None
        jobs = await build(body, request, **kw, max_tokens=body.max_tokens,
                           logprobs=body.logprobs, prompt_logprobs=scored)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(i, text, finish):
            if text is None:
                return None
            return {"id": rid, "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": i, "text": text, "logprobs": None,
                                 "finish_reason": finish}]}

        if body.stream:
            return stream(jobs, body, rid, created, chunk)
        dones = await wait(submit(jobs), request)
        if dones is None:
            return Response(status_code=499)
        echoed = ""
        if body.echo:
            echoed = prompt if isinstance(prompt, str) else \
                await run_in_threadpool(frontend.decode, jobs[0].ids)
        choices = [{"index": i, "text": echoed + d.text,
                    "logprobs": None if body.logprobs is None else completion_logprobs(
                        piece, jobs[0].ids, d, body.logprobs),
                    "finish_reason": d.finish_reason} for i, d in enumerate(dones)]
        return {"id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": choices, "usage": usage(dones), **extra(dones)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        limit = body.max_completion_tokens if body.max_completion_tokens is not None \
            else body.max_tokens
        top = body.top_logprobs or 0
        jobs = await build(body, request, messages=body.messages, max_tokens=limit,
                           logprobs=top if body.logprobs else None)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def chunk(i, text, finish):
            delta = {"role": "assistant", "content": ""} if text is None else \
                ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": name, "choices": [{"index": i, "delta": delta, "logprobs": None,
                                                "finish_reason": finish}]}

        if body.stream:
            return stream(jobs, body, rid, created, chunk)
        dones = await wait(submit(jobs), request)
        if dones is None:
            return Response(status_code=499)
        choices = [{"index": i, "message": {"role": "assistant", "content": d.text},
                    "logprobs": chat_logprobs(piece, d, top) if body.logprobs else None,
                    "finish_reason": d.finish_reason} for i, d in enumerate(dones)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": choices, "usage": usage(dones), **extra(dones)}

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": service.created,
                "owned_by": "impress_flexgen", "max_model_len": frontend.max_positions}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ServiceError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            ids = await run_in_threadpool(frontend.chat_ids, body.messages)
        else:
            frontend.check_text(body.prompt, "prompt")
            ids = await run_in_threadpool(frontend.encode, body.prompt)
        return {"count": len(ids), "max_model_len": frontend.max_positions, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        check_model(body.model)
        vocab = service.rt.spec.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ServiceError(400, f"token id {bad[0]} is outside the vocabulary "
                                    f"(0..{vocab - 1})", param="tokens")
        return {"prompt": await run_in_threadpool(frontend.decode, body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": package_version()}

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
    # Exact by default: an answer never depends on whether its prefix was stored. The
    # selective policies (impress and the rest) trade accuracy for bytes and are opt-in.
    policy = p._option_string_actions["--policy"]
    policy.default = "full"
    policy.help = policy.help.split("(default")[0].rstrip("; ") + \
        "; default full (exact: the whole stored KV, through the tiers and the planner)"
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
