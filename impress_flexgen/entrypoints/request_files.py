"""Request files: one request a JSON line, read as a stream (never loaded whole).

Two formats, told apart by the first request line:

- plain: {"prompt": TEXT} | {"messages": [...]} | {"prompt_ids": [IDS]}, optionally with
  max_tokens, temperature, top_p, seed, stop and id; any bad line refuses the whole file
  before anything is served, with its line number;
- OpenAI batch, as `vllm run-batch` reads it: {"custom_id", "method": "POST", "url":
  "/v1/completions" | "/v1/chat/completions", "body": {...}}. A line that cannot be served
  (bad body, unknown url, prompt too long) is answered by an error record, as OpenAI's batch
  does; only a line without a custom_id (not JSON, not an object) refuses the file.

The file is read twice, line by line: check() looks at every line first (a plain request is
tokenised too, then dropped), entries() builds each Job again as it is about to be submitted,
so memory does not grow with the file's length (but for 8 bytes an id: ids must be unique).
Unset sampling fields take the defaults every entry point shares (defaults.py).
"""
from __future__ import annotations

import array
import dataclasses
import json
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Iterator

import numpy as np

from .. import defaults
from ..errors import UserError

PLAIN_FIELDS = {"prompt", "prompt_ids", "messages", "max_tokens", "temperature", "top_p",
                "seed", "stop", "id"}
REQUEST_FIELDS = PLAIN_FIELDS            # the name older code imports
BATCH_FIELDS = {"custom_id", "method", "url", "body"}
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_COMMON_BODY = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "user"}
BODY_FIELDS = {COMPLETIONS: _COMMON_BODY | {"prompt"},
               CHAT: _COMMON_BODY | {"messages", "max_completion_tokens"}}
# OpenAI fields accepted only at their default value (what exporters often write out).
_AT_DEFAULT = {"n": 1, "stream": False, "best_of": 1, "echo": False, "logprobs": False,
               "top_logprobs": 0, "suffix": None, "presence_penalty": 0,
               "frequency_penalty": 0, "logit_bias": {}, "stream_options": None, "tools": [],
               "tool_choice": None, "response_format": None}

_open = open   # the reads go through here (tests make them fail)


@dataclasses.dataclass
class Entry:
    """One request line: its id (plain `id`, or the batch `custom_id`), the endpoint of a
    batch line (None: plain), and a Job, or the ServiceError a batch line is answered with."""

    line: int
    id: str
    url: str | None = None
    job: object = None              # service.Job
    error: object = None            # service.ServiceError


class RequestFile:
    """A request file checked and then read lazily; `max_tokens`: the default where a
    request sets none (defaults.MAX_TOKENS when None)."""

    def __init__(self, path: str | Path, frontend, max_tokens: int | None = None):
        self.path = str(path)
        self.frontend = frontend
        self.max_tokens = defaults.MAX_TOKENS if max_tokens is None else max_tokens
        self.batch: bool | None = None     # decided by the first request line
        self.requests = 0                  # lines check() found
        self.skipped: set[str] = set()     # the ids of `skip` that check() found

    # -- reading ---------------------------------------------------------------------------------
    def _lines(self) -> Iterator[tuple[int, dict]]:
        """(line number, JSON object) of every non-blank line; UserError for anything that
        is not one, or for a failed read."""
        try:
            with _open(self.path, "rb") as f:
                # Read twice: a pipe would be empty the second time.
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise UserError(f"--requests {self.path} is not a regular file (it is "
                                    "read twice: save it to a file first)")
                for n, raw in enumerate(f, 1):
                    try:
                        text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                    except UnicodeDecodeError:
                        raise UserError(f"{self.path} line {n} is not UTF-8 text") from None
                    if not text.strip():
                        continue
                    try:
                        item = json.loads(text)
                    except json.JSONDecodeError as exc:
                        raise UserError(f"{self.path} line {n}: not valid JSON "
                                        f"({exc.msg})") from None
                    except RecursionError:
                        raise UserError(f"{self.path} line {n}: JSON nested too "
                                        "deeply") from None
                    if not isinstance(item, dict):
                        raise UserError(f"{self.path} line {n}: a request is a JSON object")
                    yield n, item
        except OSError as exc:
            raise UserError(f"cannot read {self.path}: {exc.strerror or exc}") from None

    def _parse(self, n: int, item: dict, ordinal: int) -> Entry:
        """The line's id and what to build, without tokenising."""
        where = f"{self.path} line {n}"
        batch = "custom_id" in item
        if self.batch is None:
            self.batch = batch
        if batch != self.batch:
            raise UserError(f"{where}: " + ("a batch line (custom_id) in a file of plain "
                                            "requests" if batch else
                                            "every line of a batch file needs a custom_id"))
        if batch:
            cid = item["custom_id"]
            if not isinstance(cid, str) or not cid:
                raise UserError(f"{where}: custom_id must be a non-empty string")
            return Entry(n, cid, url=item.get("url"))
        unknown = sorted(set(item) - PLAIN_FIELDS)
        if unknown:
            raise UserError(f"{where}: unknown field {unknown[0]!r} (fields: "
                            f"{', '.join(sorted(PLAIN_FIELDS))})")
        rid = item.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            raise UserError(f"{where}: id must be a string or a number")
        return Entry(n, str(rid) if rid is not None else str(ordinal))

    def _build(self, entry: Entry, item: dict) -> None:
        """Tokenise and check the request: entry.job, or (batch) entry.error; a plain line
        that cannot be served is a UserError."""
        from ..errors import ServiceError

        try:
            if self.batch:
                kwargs = self._batch_kwargs(item)
            else:
                kwargs = {k: v for k, v in item.items() if k != "id"}
            for name, value in (("temperature", defaults.TEMPERATURE),
                                ("top_p", defaults.TOP_P)):
                if kwargs.get(name) is None:
                    kwargs[name] = value
            entry.job = self.frontend.build(**kwargs, default_max_tokens=self.max_tokens)
            if not self.batch:
                entry.job.id = entry.id
        except ServiceError as exc:
            if not self.batch:
                raise UserError(f"{self.path} line {entry.line}: {exc.message}") from None
            if exc.param == "prompt_ids":      # token ids arrive in OpenAI's prompt field
                exc.param = "prompt"
            entry.error = exc

    def _batch_kwargs(self, item: dict) -> dict:
        """Frontend.build's arguments for a batch line's body, or ServiceError."""
        from ..errors import ServiceError

        for key in sorted(set(item) - BATCH_FIELDS):
            raise ServiceError(400, f"unknown field {key!r} in a batch line (fields: "
                                    f"{', '.join(sorted(BATCH_FIELDS))})", param=key)
        if item.get("method") != "POST":
            raise ServiceError(400, f"method must be POST (got {item.get('method')!r})",
                               param="method")
        url = item.get("url")
        if url not in BODY_FIELDS:
            raise ServiceError(400, f"url {url!r} is not served here; use {COMPLETIONS} or "
                                    f"{CHAT}", param="url")
        body = item.get("body")
        if not isinstance(body, dict):
            raise ServiceError(400, "body must be a JSON object", param="body")
        for key, value in body.items():
            if key in BODY_FIELDS[url] or value is None:
                continue
            if key in _AT_DEFAULT:
                default = _AT_DEFAULT[key]
                if value == default and isinstance(value, bool) == isinstance(default, bool):
                    continue
                raise ServiceError(400, f"{key} is not supported in request files",
                                   param=key)
            raise ServiceError(400, f"unknown field {key!r} for {url}", param=key)
        model = body.get("model")
        served = self.frontend.spec.name
        if model is not None and model != served:
            raise ServiceError(404, f"model {model!r} is not served here; this run serves "
                                    f"{served!r}", param="model", code="model_not_found")
        kwargs = {k: body.get(k) for k in ("temperature", "top_p", "seed", "stop")}
        if url == CHAT:
            if "messages" not in body:
                raise ServiceError(400, "messages is required", param="messages")
            limit = body.get("max_completion_tokens")
            kwargs.update(messages=body["messages"],
                          max_tokens=limit if limit is not None else body.get("max_tokens"))
            return kwargs
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ServiceError(400, f"one prompt per request (got a list of "
                                        f"{len(prompt)})", param="prompt")
            prompt = prompt[0]
        if prompt is None:
            raise ServiceError(400, "prompt is required", param="prompt")
        kwargs["prompt_ids" if isinstance(prompt, list) else "prompt"] = prompt
        kwargs["max_tokens"] = body.get("max_tokens")
        return kwargs

    # -- the two passes --------------------------------------------------------------------------
    def check(self, skip=frozenset()) -> int:
        """Look at every line; the number of requests to serve (ids in `skip` left out, and
        noted in `skipped`). UserError names the first bad line; a plain request is also
        tokenised and checked against the model (then dropped), so no bad line is found
        after serving began. Ids must be unique (a result is matched to its request by id,
        --resume too): a repeated one refuses the file."""
        requests = todo = 0
        hashes = array.array("q")        # 8 bytes an id: memory stays small for long files
        self.skipped = set()
        for n, item in self._lines():
            requests += 1
            entry = self._parse(n, item, requests)
            hashes.append(hash(entry.id))
            if entry.id in skip:
                self.skipped.add(entry.id)
                continue
            todo += 1
            if not self.batch:
                self._build(entry, item)
        if not requests:
            raise UserError(f"{self.path} holds no requests")
        self._refuse_repeated_ids(hashes)
        self.requests = requests
        return todo

    def _refuse_repeated_ids(self, hashes) -> None:
        """UserError naming the first line whose id an earlier line has; the ids' hashes
        find the candidates, a second read compares the ids themselves."""
        ordered = np.sort(np.frombuffer(hashes, dtype=np.int64))
        alike = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
        if not alike:
            return
        first_line: dict[str, int] = {}
        for ordinal, (n, item) in enumerate(self._lines(), 1):
            entry = self._parse(n, item, ordinal)
            if hash(entry.id) not in alike:
                continue
            if entry.id in first_line:
                implicit = "" if self.batch or "id" in item else \
                    " (its number among the requests: it has no id of its own)"
                raise UserError(f"{self.path} line {n}: id {entry.id!r}{implicit} is also the "
                                f"id of line {first_line[entry.id]}; give each request its "
                                "own id")
            first_line[entry.id] = n

    def entries(self, skip=frozenset()) -> Iterator[Entry]:
        """Each request in file order, its Job built (tokenised) only when it is reached;
        ids in `skip` are passed over without being built."""
        ordinal = 0
        for n, item in self._lines():
            ordinal += 1
            entry = self._parse(n, item, ordinal)
            if entry.id in skip:
                continue
            self._build(entry, item)
            yield entry
        if self.requests and ordinal != self.requests:
            raise UserError(f"{self.path} changed while it was served ({self.requests} "
                            f"requests when checked, {ordinal} now)")


def read_requests(path: str | Path, frontend, default_max_tokens: int | None = None) -> list:
    """Every request of a file as a Job, all at once (for small files and tests; run
    serves a file as a stream). UserError names the first bad line; a batch line that
    cannot be served is a UserError here too."""
    requests = RequestFile(path, frontend, default_max_tokens)
    requests.check()
    jobs = []
    for entry in requests.entries():
        if entry.error is not None:
            raise UserError(f"{path} line {entry.line}: {entry.error.message}")
        jobs.append(entry.job)
    return jobs


# -- OpenAI batch output ---------------------------------------------------------------------------
def batch_record(entry: Entry, model: str, done=None, error=None) -> dict:
    """A batch output line: the response body a server would have sent, or its error (also
    in `error`, where vLLM's run-batch puts it)."""
    request_id = f"req_{uuid.uuid4().hex[:24]}"
    record = {"id": f"batch_req_{uuid.uuid4().hex[:24]}", "custom_id": entry.id}
    if done is None:
        body = error.body()
        record["response"] = {"status_code": error.status, "request_id": request_id,
                              "body": body}
        record["error"] = {"code": error.code or error.kind, "message": error.message}
        return record
    usage = {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
             "total_tokens": done.prompt_tokens + done.completion_tokens}
    created = int(time.time())
    if entry.url == CHAT:
        body = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                             "logprobs": None, "finish_reason": done.finish_reason}]}
    else:
        body = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion",
                "created": created, "model": model,
                "choices": [{"index": 0, "text": done.text, "logprobs": None,
                             "finish_reason": done.finish_reason}]}
    body["usage"] = usage
    body["impress_flexgen"] = done.stats
    record["response"] = {"status_code": 200, "request_id": request_id, "body": body}
    record["error"] = None
    return record
