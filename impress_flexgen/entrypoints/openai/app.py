"""The OpenAI-compatible HTTP application over a service (service.Service).

    app = create_app(service, ServerOptions(api_keys=("KEY",)))

POST /v1/completions and /v1/chat/completions (with "stream": true as server-sent events),
as vLLM serves them (logprobs, echo with prompt log-probabilities, n, top_k, min_p, ...; an
unknown field is a 400), GET /v1/models[/{id}], POST /tokenize and /detokenize, GET /version,
/health and /metrics (Prometheus). Errors are OpenAI's error bodies with a 4xx status; a full
queue is 429 with Retry-After. Bodies are limited and API keys checked before a route runs
(serve_guard.py). The request bodies are openai_api.py's; the program that serves this
application is openai_server.py.
"""
# No `from __future__ import annotations`: FastAPI reads the request models of the routes
# below from their annotations.
import asyncio
import dataclasses
import functools
import time
import uuid

from .guard import ServerOptions

_END = object()


def _error(status: int, message: str, param: str | None = None, code: str | None = None):
    from fastapi.responses import JSONResponse

    from ...errors import ServiceError

    return JSONResponse(ServiceError(status, message, param, code).body(), status_code=status)


def create_app(service, options: ServerOptions | None = None):
    """The FastAPI application serving `service` (a service.Service)."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    from ... import defaults
    from ...errors import ServiceError
    from .guard import Guard, bearer_key, namespace
    from .protocol import (ChatBody, Common, CompletionBody, DetokenizeBody, TokenizeBody,
                           chat_logprobs, completion_logprobs, package_version, prompt_block,
                           refuse_unsupported, usage, validation_message)

    options = options or ServerOptions()
    app = FastAPI(title="impress_flexgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Guard, limit=options.max_body_bytes, api_keys=options.api_keys,
                       on_refused=lambda: service.count("invalid"),
                       metrics_key=options.metrics_key)
    name = service.model_name
    frontend = service.frontend

    @app.exception_handler(ServiceError)
    async def service_error(request, exc: ServiceError):
        # A full queue: come back when it has drained, by the rate it drains at (service).
        headers = {"Retry-After": str(exc.retry_after_s or 1)} if exc.status == 429 else None
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
        """The request's jobs, one per choice (n): tokenised once, seeds apart (the
        choices of a scored prompt then share its prefill: service.submit_choices)."""
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
            frontend.check_scored(job, body.n or 1)
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
        """Queue every choice together, or none (429)."""
        return service.submit_choices(jobs, listeners)

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

    def counted(dones, body: Common) -> dict:
        """The usage; cached_tokens only where the operator asked for it or the request's
        namespace is its own salt's: elsewhere it would tell one client whether another's
        prompt was stored (a right guess of a stored secret reads more cached tokens)."""
        return usage(dones, options.prompt_tokens_details or body.cache_salt is not None)

    def extra(dones) -> dict:
        """The non-standard stats block, only where the operator asked for it: it tells
        what the store held, which is not every client's business."""
        return {"impress_flexgen": dones[0].stats} if options.cache_stats else {}

    def piece(token: int) -> str:
        return frontend.decode([token])

    def pieces():
        """piece() remembering what it decoded: a scored prompt's block names each of
        its tokens and their alternatives, mostly the same few."""
        return functools.lru_cache(maxsize=1 << 16)(piece)

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
                               "usage": counted(dones, body), **extra(dones)})
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
        scored_prompt = bool(body.echo) and body.logprobs is not None
        jobs = await build(body, request, **kw, max_tokens=body.max_tokens,
                           logprobs=body.logprobs, prompt_logprobs=scored_prompt)
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

        def answer() -> JSONResponse:
            # Text of every token and its alternatives, then JSON: a scored prompt's are
            # many, so in a worker thread, neither the engine's nor the event loop's.
            echoed = ""
            if body.echo:
                echoed = prompt if isinstance(prompt, str) else frontend.decode(jobs[0].ids)
            named = pieces()
            scored = None
            if scored_prompt:
                scored = prompt_block(named, jobs[0].ids, dones[0].prompt_scores,
                                      body.logprobs)
            choices = [{"index": i, "text": echoed + d.text,
                        "logprobs": None if body.logprobs is None else completion_logprobs(
                            named, d, body.logprobs, scored),
                        "finish_reason": d.finish_reason} for i, d in enumerate(dones)]
            return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                                 "model": name, "choices": choices,
                                 "usage": counted(dones, body),
                                 **extra(dones)})

        return await run_in_threadpool(answer)

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
                "choices": choices, "usage": counted(dones, body), **extra(dones)}

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
