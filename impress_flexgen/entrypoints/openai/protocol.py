"""The OpenAI request bodies the server takes and the pieces of its answers: the fields
vLLM serves for completions and chat, strictly typed, unknown fields refused (400 naming
the field), and the log-probability blocks of both APIs."""
from typing import Any

from pydantic import BaseModel, ConfigDict

from ...errors import ServiceError

MAX_N = 16     # choices per request


class Common(BaseModel):
    # Strict: "3" or true for max_tokens is a 400, never coerced; unknown fields are a 400.
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    n: int | None = None
    user: str | None = None
    cache_salt: str | None = None
    # Taken at their neutral values only.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None


class CompletionBody(Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(Common):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def refuse_unsupported(body: Common) -> None:
    """400 naming the first field asked for that is not served here."""
    neutral = {"presence_penalty": body.presence_penalty in (None, 0),
               "frequency_penalty": body.frequency_penalty in (None, 0),
               "logit_bias": not body.logit_bias}
    if isinstance(body, CompletionBody):
        neutral.update(best_of=body.best_of in (None, 1), suffix=not body.suffix)
    for field, ok in neutral.items():
        if not ok:
            raise ServiceError(400, f"{field} is not supported by this server", param=field)
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise ServiceError(400, f"n must be from 1 to {MAX_N} (got {body.n})", param="n")
    if body.stream_options is not None:
        if not body.stream:
            raise ServiceError(400, "stream_options needs stream: true", param="stream_options")
        extra = sorted(set(body.stream_options) - {"include_usage"})
        if extra:
            raise ServiceError(400, f"stream_options.{extra[0]} is not supported by this "
                                    "server", param="stream_options")
        if not isinstance(body.stream_options.get("include_usage", False), bool):
            raise ServiceError(400, "stream_options.include_usage must be true or false",
                               param="stream_options")
    wants_logprobs = body.logprobs not in (None, False)
    if body.stream and wants_logprobs:
        raise ServiceError(400, "logprobs with stream is not supported by this server",
                           param="logprobs")
    if isinstance(body, CompletionBody) and body.stream and body.echo:
        raise ServiceError(400, "echo with stream is not supported by this server",
                           param="echo")
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        raise ServiceError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def completion_logprobs(piece, done, top: int, prompt: dict | None = None) -> dict:
    """The completions API's block of a choice: the echoed prompt's (prompt_block) when
    given, then the generated tokens'."""
    at = prompt["text_offset"][-1] + len(prompt["tokens"][-1]) if prompt else 0
    mine = logprobs_block(piece, done.logprobs or [], top, at)
    return {key: prompt[key] + mine[key] for key in mine} if prompt else mine


def prompt_block(piece, prompt_ids, scores, top: int) -> dict:
    """The echoed prompt's part of the block, from its scores (scores.TokenScores): made
    once and shared by every choice."""
    return logprobs_block(piece, [(prompt_ids[0], None, None), *scores.rows()], top)


def logprobs_block(piece, rows, top: int, at: int = 0) -> dict:
    """The completions API's block of `rows`, (token, log-probability, top k) each (None
    and None for the prompt's first token): tokens, token_logprobs, top_logprobs and
    text_offset counted from `at`."""
    tokens, values, tops, offsets = [], [], [], []
    for token, lp, best in rows:
        text = piece(token)
        tokens.append(text)
        values.append(lp)
        tops.append(None if best is None else {piece(t): v for t, v in best[:top]})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(piece, done, top: int) -> dict:
    """The chat API's block: one entry per generated token, with its top alternatives."""
    def entry(token, lp):
        text = piece(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in best[:top]]}
                        for t, lp, best in done.logprobs or []]}


def usage(dones, details: bool = False) -> dict:
    """Usage of a request's choices: the prompt counted once, every choice's tokens; with
    `details`, how many prompt tokens were read from the store (prompt_tokens_details, null
    otherwise, as vLLM without --enable-prompt-tokens-details)."""
    prompt = dones[0].prompt_tokens
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": dones[0].stats["cached_tokens"]}
            if details else None}


def validation_message(exc) -> tuple[str, str | None]:
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
    if e.get("type") == "extra_forbidden":
        return f"{'.'.join(loc)} is not supported by this server", field
    return f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}", field


def package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("impress_flexgen")
    except metadata.PackageNotFoundError:   # run from a checkout
        import tomllib
        from pathlib import Path

        try:
            with open(Path(__file__).resolve().parents[3] / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"]
        except (OSError, KeyError, ValueError):
            return "unknown"
