"""Serving your own prompts: the layer under the HTTP server and request files.

    service = Service(ServiceConfig(model="smollm2-135m"))
    job = service.frontend.build(prompt="It is a truth universally acknowledged")
    done = service.complete(job)          # Completion(text, token_ids, finish_reason, stats)
    service.close()

A prompt becomes token ids (plain text, ids, or chat messages through the model's chat
template). Prefix reuse is automatic: all whole chunks of the prompt but the last token form
the engine's prefix, so every full chunk is matched against the persistent radix store and
what was not stored yet is inserted; a shared system prompt or a growing conversation is
reused by the next request, and by the next process opened on the same store.

Requests wait in a bounded queue in front of one worker thread that owns the engine (the
engine runs one request at a time through its layers anyway). A full queue refuses at once
(429); each request has a deadline and a cancel flag (a client that went away), checked as
every token is produced. Metrics go to a private Prometheus registry.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import queue
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from .errors import ServiceError, UserError
from .sampling import SamplingParams
from .store.config import CHUNK_SIZE
from .store_root import StoreOptions  # noqa: F401 - part of the service configuration

log = logging.getLogger("impress_flexgen.service")

GB = 1 << 30
MAX_STOP_STRINGS = 4   # as OpenAI's API
MAX_STOP_CHARS = 256   # each; the stop check rescans this much text per token
MAX_LOGPROBS = 20      # top log-probabilities per token, as vLLM's default limit
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
OUTCOMES = ("ok", "rejected", "invalid", "cancelled", "timeout", "error")


# -- configuration ---------------------------------------------------------------------------
DEFAULT_TIER_BYTES = (256 << 20, 1 << 30)   # a server's GPU and CPU tiers, unless sized


def _default_runtime():
    from .runtime import AUTO, RuntimeConfig

    return RuntimeConfig(placement=AUTO)


def _default_run():
    from .serving import RunConfig

    return RunConfig("full", "full")     # exact: answers never depend on a cache hit


def _default_tiers():
    from .engine import TierSizes

    return TierSizes(*DEFAULT_TIER_BYTES)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Everything a server or a run serves with, each part held once by the layer that owns
    it: the model and its placement, the policy's knobs, the tiers, the store."""

    runtime: object = dataclasses.field(default_factory=_default_runtime)   # RuntimeConfig
    run: object = dataclasses.field(default_factory=_default_run)           # serving.RunConfig
    tiers: object = dataclasses.field(default_factory=_default_tiers)       # engine.TierSizes
    store: StoreOptions = StoreOptions()
    queue_size: int = 16                    # requests waiting (the one being served aside)
    timeout_s: float = 600.0                # per request, from its arrival
    max_batch_size: int = 8                 # requests decoded together (continuous batching)
    max_batch_tokens: int = 8192            # tokens per step: decode plus prefilled prompts
    # Shorthands for the parts most often set (a model, a store root, tier sizes): each is
    # folded into the part that owns it when the config is made, and never stored apart;
    # read runtime.model, store.root, tiers.gpu_bytes and tiers.cpu_bytes.
    model: dataclasses.InitVar[str | None] = None
    store_root: dataclasses.InitVar[str | Path | None] = None
    gpu_cache_bytes: dataclasses.InitVar[int | None] = None
    cpu_cache_bytes: dataclasses.InitVar[int | None] = None

    def __post_init__(self, model, store_root, gpu_cache_bytes, cpu_cache_bytes):
        if self.queue_size < 1:
            raise UserError("the queue must hold at least 1 request")
        if not self.timeout_s > 0:   # inf: no deadline
            raise UserError("the request timeout must be a positive number of seconds")
        if self.max_batch_size < 1 or self.max_batch_tokens < 1:
            raise UserError("the batch must hold at least 1 request and 1 token")
        fold = object.__setattr__    # frozen: only here, while the object is being made
        if model is not None:
            fold(self, "runtime", dataclasses.replace(self.runtime, model=model))
        if store_root is not None:
            fold(self, "store", dataclasses.replace(self.store, root=store_root))
        for name, size in (("gpu_bytes", gpu_cache_bytes), ("cpu_bytes", cpu_cache_bytes)):
            if size is not None:
                fold(self, "tiers", dataclasses.replace(self.tiers, **{name: size}))

    @classmethod
    def from_args(cls, args, *, policy: str | None = None,
                  default_tiers: tuple[int, int] = DEFAULT_TIER_BYTES,
                  **fields) -> "ServiceConfig":
        """The configuration the flags of cli.add_model_args and cli.add_serving_args ask
        for, for the main job and the server alike. `policy`: one of --compare's (default
        --policy); `default_tiers`: GPU and CPU tier bytes where --gpu-cache-gb and
        --cpu-cache-gb are not given; `fields`: the rest (queue_size, timeout_s)."""
        from .cli import dtype_arg
        from .engine import TierSizes
        from .runtime import RuntimeConfig
        from .serving import RunConfig

        name = policy or args.policy
        run = RunConfig(
            label=name, policy=name, retention=args.retention, granularity=args.granularity,
            threshold=args.threshold, threshold_value=args.threshold_value,
            adaptive_alpha=args.adaptive_alpha, probe_heads=args.probe_heads,
            probe_format=args.probe_format, chunk_size=args.chunk_size,
            reorder_hot_fraction=args.reorder_hot_fraction, reorder_by=args.reorder_by,
            probe_queries=args.probe_queries, probe_stride=args.probe_stride,
            probe_every=args.probe_every, prefetch=args.prefetch, plan=args.plan)
        gpu, cpu = (default if gb is None else int(gb * GB) for gb, default in
                    zip((args.gpu_cache_gb, args.cpu_cache_gb), default_tiers))
        tiers = TierSizes(gpu, cpu, verify_hits=args.verify_tier_hits,
                          remote_url=args.remote_tier, remote_secret=args.remote_secret,
                          remote_ttl=args.remote_ttl)
        store = StoreOptions(root=args.store_dir, reorder_interval=args.reorder_interval,
                             disk_capacity_bytes=None if args.disk_capacity_gb is None
                             else int(args.disk_capacity_gb * GB),
                             read_limit_mb_s=args.disk_read_limit)
        runtime = RuntimeConfig(model=args.model, model_path=args.model_path,
                                placement=args.placement, offload_dir=args.offload_dir,
                                seed=args.seed, dtype=dtype_arg(args.dtype))
        batching = {k: getattr(args, k) for k in ("max_batch_size", "max_batch_tokens")
                    if getattr(args, k, None) is not None}
        return cls(runtime=runtime, run=run, tiers=tiers, store=store, **{**batching, **fields})

    def runtime_config(self):
        """The runtime's configuration, leaving room for the tiers."""
        return dataclasses.replace(self.runtime, gpu_reserve_bytes=self.tiers.gpu_bytes,
                                   cpu_reserve_bytes=self.tiers.cpu_bytes)

    def plan_line(self) -> str:
        """The plan mode, the shared pool and the disk read limit, for a start-up line."""
        plan = {"auto": "auto (load, recompute or both per request, by the cost model)",
                "both": "both (recompute the front while the rest loads)"}
        line = f"plan {plan.get(self.run.plan, self.run.plan)}; "
        line += (f"shared pool {redact_url(self.tiers.remote_url)}" if self.tiers.remote_url
                 else "no shared pool")
        if self.store.read_limit_mb_s is not None:
            line += f"; disk reads held to {self.store.read_limit_mb_s:g} MB/s"
        return line


# The shared pool's counters exported as shared_pool_events{event=...}.
POOL_EVENTS = ("skipped_requests", "corrupt_values", "incomplete_chunks")


def redact_url(url: str) -> str:
    """A pool's url fit to print: a password in it (userinfo or query) is replaced by ***."""
    from .tiers.remote_url import redact_url as redact

    return redact(url)


# -- prompts in ------------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    """One validated request: token ids, how to split them, how to generate."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    id: str = ""
    chunk_size: int = CHUNK_SIZE
    # Whose stored prefixes this request may match and fill: "" is the shared default; an
    # opaque string per API key and cache salt keeps tenants' prefixes apart.
    namespace: str = ""
    logprobs: int | None = None     # per generated token: its log-probability and the top k
    prompt_logprobs: bool = False   # the prompt's own log-probabilities (computed whole)
    min_tokens: int = 0             # no stop string before this many tokens

    def split(self) -> tuple[list[int], list[int]]:
        """(prefix, query): every whole chunk before the last token is prefix (matched and
        stored); a prompt shorter than a chunk keeps all but its last token as prefix. The
        prompt's log-probabilities need logits at every prompt position: the whole prompt
        is then the query, computed."""
        if self.prompt_logprobs:
            return [], list(self.ids)
        c = self.chunk_size
        cut = (len(self.ids) - 1) // c * c or len(self.ids) - 1
        return self.ids[:cut], self.ids[cut:]


class Frontend:
    """Turns what a user sends into a Job, or a ServiceError saying what is wrong. Needs only
    the model's spec and tokenizer (a request file is checked before the model is built).
    Thread-safe without a lock: the tokenizer is only read, so requests tokenise in parallel
    and a long prompt delays no other."""

    def __init__(self, spec, tokenizer, chunk_size: int = CHUNK_SIZE):
        self.spec = spec
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        eos = getattr(tokenizer.hf, "eos_token_id", None)
        self.stop_token_ids = (eos,) if isinstance(eos, int) and \
            0 <= eos < spec.config.vocab_size else ()
        hf = tokenizer.hf
        vocab = hf.get_vocab() if hasattr(hf, "get_vocab") else {}
        # No token covers more characters than its longest vocabulary entry, so a text
        # longer than that times the positions cannot fit: refused before tokenising.
        self.chars_per_token_max = max(map(len, vocab), default=0) or 64
        self.special_texts = tuple(t for t in getattr(hf, "all_special_tokens", ()) if t)
        self._split = None         # a tokenizer that reads special-token text as text

    @property
    def max_positions(self) -> int:
        return self.spec.config.max_seq_len

    @property
    def max_chars(self) -> int:
        return self.chars_per_token_max * self.max_positions

    def check_text(self, text: str, param: str) -> None:
        """A text fit to tokenise: valid Unicode, not longer than the positions allow."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ServiceError(400, f"{param} is not valid Unicode (a lone surrogate)",
                               param=param) from None
        if len(text) > self.max_chars:
            raise ServiceError(400, f"{param} has {len(text)} characters, more than "
                                    f"{self.spec.name}'s {self.max_positions} positions can "
                                    f"hold (at most {self.chars_per_token_max} characters a "
                                    "token)", param=param, code="context_length_exceeded")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids)

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer.hf, "chat_template", None))

    def chat_ids(self, messages) -> list[int]:
        if not self.has_chat_template():
            raise ServiceError(400, f"{self.spec.name} has no chat template; send the prompt "
                                    "to /v1/completions instead", param="messages")
        if not isinstance(messages, list) or not messages:
            raise ServiceError(400, "messages must be a non-empty list", param="messages")
        clean = []
        chars = 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ServiceError(400, f"messages[{i}] must be an object with a role and "
                                        "content", param="messages")
            content = m.get("content")
            if isinstance(content, list):   # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):
                    raise ServiceError(400, f"messages[{i}].content: only text parts are "
                                            "supported", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ServiceError(400, f"messages[{i}].content must be a string",
                                   param="messages")
            if m["role"] not in ("system", "user", "assistant"):
                raise ServiceError(400, f"messages[{i}].role must be system, user or "
                                        f"assistant (got {m['role']!r})", param="messages")
            chars += len(content)
            self.check_text(content, "messages")
            clean.append({"role": m["role"], "content": content})
        if chars > self.max_chars:
            raise ServiceError(400, f"messages have {chars} characters, more than "
                                    f"{self.spec.name}'s {self.max_positions} positions can "
                                    "hold", param="messages", code="context_length_exceeded")
        if any(t in m["content"] for m in clean for t in self.special_texts):
            return self._chat_ids_split(clean)
        text = self._render(clean)
        return self.tokenizer.encode(text)

    def _render(self, clean: list[dict]) -> str:
        try:
            return self.tokenizer.hf.apply_chat_template(clean, tokenize=False,
                                                         add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - a template's own complaint
            raise ServiceError(400, f"the chat template refused these messages: {exc}",
                               param="messages") from None

    def _chat_ids_split(self, clean: list[dict]) -> list[int]:
        """Chat ids where only the template's own text can yield control tokens: each
        message's content is rendered as a marker, and the content tokenised with special
        tokens read as plain text (`<|im_start|>system` typed by a user stays text)."""
        import re

        marked = [{"role": m["role"], "content": f"\ue000{i}\ue001"}
                  for i, m in enumerate(clean)]
        parts = re.split("\ue000(\\d+)\ue001", self._render(marked))
        found = [int(x) for x in parts[1::2]]
        split = self._split_tokenizer()
        if split is None or sorted(found) != list(range(len(clean))):
            raise ServiceError(400, "message content holds the text of a control token "
                                    "(such as " + repr(self.special_texts[0]) + "), which "
                                    "this model's chat template cannot keep as text",
                               param="messages")
        ids = []
        for k, piece in enumerate(parts):
            if k % 2 == 0:
                ids += self.tokenizer.encode(piece) if piece else []
            else:
                ids += self._fold(split.encode(clean[int(piece)]["content"],
                                               add_special_tokens=False).ids)
        return ids

    def _split_tokenizer(self):
        """A private copy of the fast tokenizer with special tokens split (never changed
        after it is made, so threads share it); None where there is no fast tokenizer."""
        if self._split is None:
            backend = getattr(self.tokenizer.hf, "_tokenizer", None)
            if backend is None or not hasattr(backend, "to_str"):
                return None
            from tokenizers import Tokenizer as Backend

            split = Backend.from_str(backend.to_str())
            split.no_truncation()
            split.no_padding()
            split.encode_special_tokens = True
            self._split = split
        return self._split

    def _fold(self, ids: list[int]) -> list[int]:
        tok = self.tokenizer
        return [i % tok.vocab_size for i in ids] if getattr(tok, "folded", False) else ids

    def build(self, *, prompt=None, prompt_ids=None, messages=None, max_tokens=None,
              temperature=None, top_p=None, seed=None, stop=None, id=None,
              default_max_tokens: int = 16, top_k=None, min_p=None, min_tokens=None,
              ignore_eos=False, stop_token_ids=None, logprobs=None,
              prompt_logprobs=False) -> Job:
        """Exactly one of prompt (text), prompt_ids and messages. Unset sampling fields mean
        greedy decoding; max_tokens defaults to `default_max_tokens` (less if the model's
        positions run out); 0 only with prompt_logprobs (the prompt is scored, nothing
        generated)."""
        given = [name for name, v in (("prompt", prompt), ("prompt_ids", prompt_ids),
                                      ("messages", messages)) if v is not None]
        if len(given) != 1:
            raise ServiceError(400, "give exactly one of prompt, prompt_ids or messages",
                               param=given[1] if len(given) > 1 else "prompt")
        what = given[0]
        if messages is not None:
            ids = self.chat_ids(messages)
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise ServiceError(400, "prompt must be a string", param="prompt")
            if not prompt:
                raise ServiceError(400, "the prompt is empty", param="prompt")
            self.check_text(prompt, "prompt")
            ids = self.encode(prompt)
        else:
            if not isinstance(prompt_ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
                raise ServiceError(400, "prompt_ids must be a list of integers", param=what)
            ids = list(prompt_ids)
            vocab = self.spec.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ServiceError(400, f"token id {bad[0]} is outside the vocabulary "
                                        f"(0..{vocab - 1})", param=what)
        if not ids:
            raise ServiceError(400, "the prompt is empty: it has no tokens", param=what)
        limit = self.max_positions
        if len(ids) >= limit:
            raise ServiceError(400, f"the prompt has {len(ids)} tokens; {self.spec.name} has "
                                    f"{limit} positions, room for at most {limit - 1} prompt "
                                    "tokens and 1 new token", param=what,
                               code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max_tokens, limit - len(ids))
        least = 0 if prompt_logprobs else 1
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or \
                max_tokens < least:
            why = "" if least == 0 else " (0 only to score the prompt: echo with logprobs)"
            raise ServiceError(400, f"max_tokens must be an integer of at least {least} (got "
                                    f"{max_tokens!r}){why}", param="max_tokens")
        if len(ids) + max_tokens > limit:
            raise ServiceError(400, f"{len(ids)} prompt tokens + max_tokens {max_tokens} need "
                                    f"{len(ids) + max_tokens} positions, more than "
                                    f"{self.spec.name}'s {limit}", param="max_tokens",
                               code="context_length_exceeded")
        stops = self._stop_token_ids(stop_token_ids, ignore_eos)
        params = sampling_params(temperature, top_p, seed, stops, top_k=top_k, min_p=min_p,
                                 min_tokens=min_tokens)
        if params.min_tokens > max_tokens:
            raise ServiceError(400, f"min_tokens ({params.min_tokens}) is more than max_tokens "
                                    f"({max_tokens})", param="min_tokens")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(
                logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ServiceError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS} "
                                    f"(got {logprobs!r})", param="logprobs")
        return Job(ids, max_tokens, params, stop_strings(stop), id or "", self.chunk_size,
                   logprobs=logprobs, prompt_logprobs=bool(prompt_logprobs),
                   min_tokens=params.min_tokens)

    def _stop_token_ids(self, extra, ignore_eos: bool) -> tuple[int, ...]:
        """The end-of-sequence token (unless ignored) and the request's own stop tokens."""
        ids = [] if ignore_eos else list(self.stop_token_ids)
        if extra is not None:
            vocab = self.spec.config.vocab_size
            if not isinstance(extra, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                    for t in extra):
                raise ServiceError(400, f"stop_token_ids must be a list of token ids "
                                        f"(0..{vocab - 1})", param="stop_token_ids")
            ids += [t for t in extra if t not in ids]
        return tuple(ids)


def sampling_params(temperature=None, top_p=None, seed=None, stop_token_ids=(), *,
                    top_k=None, min_p=None, min_tokens=None) -> SamplingParams:
    """SamplingParams from user values (None: greedy, whole distribution, no seed)."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < -1):
        raise ServiceError(400, f"top_k must be an integer, -1 or 0 for all (got {top_k!r})",
                           param="top_k")
    if min_p is not None and (isinstance(min_p, bool) or not isinstance(min_p, (int, float))
                              or not 0 <= min_p <= 1):
        raise ServiceError(400, f"min_p must be in [0, 1] (got {min_p!r})", param="min_p")
    if min_tokens is not None and (isinstance(min_tokens, bool) or not isinstance(
            min_tokens, int) or min_tokens < 0):
        raise ServiceError(400, f"min_tokens must be an integer >= 0 (got {min_tokens!r})",
                           param="min_tokens")
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ServiceError(400, f"{name} must be a number (got {value!r})", param=name)
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ServiceError(400, f"temperature must be a finite number >= 0 (got {temperature})",
                           param="temperature")
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ServiceError(400, f"top_p must be in (0, 1] (got {top_p})", param="top_p")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ServiceError(400, f"seed must be an integer (got {seed!r})", param="seed")
    return SamplingParams(float(temperature or 0.0), float(1.0 if top_p is None else top_p),
                          seed, tuple(stop_token_ids), top_k=max(0, top_k or 0),
                          min_p=float(min_p or 0.0), min_tokens=min_tokens or 0)


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ServiceError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise ServiceError(400, f"at most {MAX_STOP_STRINGS} stop strings (got {len(stops)})",
                           param="stop")
    if any(s == "" for s in stops):
        raise ServiceError(400, "a stop string must not be empty", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ServiceError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters",
                           param="stop")
    for s in stops:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise ServiceError(400, "stop is not valid Unicode (a lone surrogate)",
                               param="stop") from None
    return tuple(stops)


# -- text out ----------------------------------------------------------------------------------
def token_logprobs(logits, tokens: list[int], top: int) -> list[tuple]:
    """(token, log-probability, [(token, log-probability)] of the `top` likeliest) for each
    token under the logits row that predicted it (the model's own distribution)."""
    import torch

    out = []
    for row, token in zip(logits, tokens):
        lp = torch.log_softmax(row.double(), dim=-1)
        best = lp.topk(top) if top else None
        out.append((int(token), float(lp[token]),
                    [] if best is None else list(zip(best.indices.tolist(),
                                                     best.values.tolist()))))
    return out


class TextStream:
    """Incremental detokenization with stop strings. push(token) returns False once a stop
    string has appeared (the text ends before it). Text that could still turn out to be the
    start of a stop string, or half of a multi-byte character, is held back until it cannot.
    Before `min_tokens` tokens no stop string counts."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (),
                 emit: Callable[[str], None] | None = None, min_tokens: int = 0):
        self.decode = decode
        self.stop = stop
        self.emit = emit
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""           # the final text so far (what has been or will be emitted)
        self.sent = ""           # what emit() has had
        self.stopped = False

    def push(self, token: int) -> bool:
        if self.stopped:
            return False
        self.ids.append(token)
        text = self.decode(self.ids)
        if self.stop and len(self.ids) >= self.min_tokens:
            start = max(0, len(self.sent) - max(map(len, self.stop)))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = text[:min(hits)]
                self.stopped = True
                self._send(self.text)
                return False
        self.text = text
        self._send(text[:len(text) - self._held(text)])
        return True

    def finish(self) -> str:
        """Emit what was held back (generation is over); the final text."""
        if not self.stopped:
            self._send(self.text)
        return self.text

    def _held(self, text: str) -> int:
        """Characters at the end of `text` that must wait."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:n]):
                    held = n
                    break
        partial = len(text) - len(text.rstrip("\ufffd"))   # an incomplete UTF-8 sequence
        return max(held, partial)

    def _send(self, upto: str) -> None:
        # A decode may revise earlier text (bytes completing a character): send only what
        # extends what was sent.
        if len(upto) > len(self.sent) and upto.startswith(self.sent):
            delta, self.sent = upto[len(self.sent):], upto
            if self.emit is not None:
                self.emit(delta)


@dataclasses.dataclass
class Completion:
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str            # stop, length, timeout or cancelled
    prompt_tokens: int
    stats: dict
    logprobs: list | None = None          # token_logprobs() of the generated tokens
    prompt_logprobs: list | None = None   # None, then token_logprobs() of the prompt's rest

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def record(self) -> dict:
        """The request file's output line."""
        return {"id": self.id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "stats": self.stats}


class Ticket:
    """A submitted job: its result (a Future), its cancel flag and its deadline."""

    def __init__(self, job: Job, timeout_s: float, listener: Callable[[str], None] | None):
        self.job = job
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout_s
        self.listener = listener
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop at the next token (or skip it, if still queued)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def _ratio(counters: dict) -> float:
    """hits / (hits + misses) of a tier's counters (0 before any access)."""
    total = counters.get("hits", 0) + counters.get("misses", 0)
    return counters.get("hits", 0) / total if total else 0.0


# -- the service ---------------------------------------------------------------------------------
class Service:
    def __init__(self, config: ServiceConfig | None = None, runtime=None, tokenizer=None):
        """Builds the runtime (unless one is given: then it stays the caller's to close),
        opens the store, builds the engine (its planner calibrated, its shared pool asked
        once) and starts the worker."""
        from policies import POLICY_NAMES, make_policy

        from .engine import Engine, open_store
        from .store_root import _store_name, claim_store_root
        from .runtime import Runtime, resolve_spec
        from .serving import start_engine

        config = self.config = config if config is not None else ServiceConfig()
        run = config.run
        if run.policy.partition(":")[0] not in POLICY_NAMES:
            raise UserError(f"unknown policy '{run.policy}'; choose from "
                            f"{', '.join(POLICY_NAMES)}")
        self._owns_runtime = runtime is None
        if runtime is None:
            rcfg = config.runtime_config()
            spec = resolve_spec(rcfg)
            root = config.store.root_for(spec, run.chunk_size)
            claim_store_root(root)
            runtime = Runtime(rcfg, spec=spec, tokenizer=tokenizer)
        else:
            root = config.store.root_for(runtime.spec, run.chunk_size)
            claim_store_root(root)
        self.rt = runtime
        self.store = None
        self.engine = None
        try:
            self.model_name = runtime.spec.name
            self.frontend = Frontend(runtime.spec, tokenizer or runtime.tokenizer,
                                     run.chunk_size)
            self.policy = make_policy(run.policy, run.serving())
            if run.tier_policy is not None:
                self.policy.tier_policy = run.tier_policy
            self.store_dir = root / _store_name(run.policy, run) if self.policy.reuse else None
            if self.store_dir is not None:
                try:
                    self.store = open_store(
                        self.store_dir, runtime, run.serving(), self.policy,
                        **{**config.store.open_options(), **run.store_options()})
                except OSError as exc:
                    raise UserError(f"cannot open the store in {self.store_dir}: "
                                    f"{exc.strerror or exc}") from None
            self.engine = Engine(runtime, self.store, self.policy, config.tiers)
            # Before any request: none pays for calibrating, none waits on a dead pool.
            self.warnings = start_engine(self.engine)
        except BaseException:
            self._close_engine_store_and_runtime()
            raise
        self.created = int(time.time())
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue_size)
        self._lock = threading.Lock()
        self._closing = False
        self._closed = False
        from .scheduler import Scheduler, SchedulerConfig

        self.scheduler = Scheduler(self.engine, SchedulerConfig(
            config.max_batch_size, config.max_batch_tokens))
        self._layers = [0, 0]          # prefix layers served from the store, of them fallen back
        self._fallbacks_seen = 0       # the engine's shared-pool fallbacks already counted
        self._init_metrics()
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    def describe(self) -> list[str]:
        """Lines for a user: what is served, from where, how."""
        import torch

        spec = self.rt.spec
        weights = f"random (seed {spec.seed})" if spec.random_weights else "real"
        device = "cuda" if torch.cuda.is_available() else "cpu only"
        return [f"model {spec.name} ({spec.family}, {spec.config.dtype.__name__}, {device}), "
                f"weights {weights}, {spec.config.max_seq_len} positions",
                f"placement: {self.rt.cfg.placement.describe()}",
                *self.describe_serving(),
                f"queue: {self.config.queue_size} requests, timeout "
                f"{self.config.timeout_s:g} s"]

    def describe_serving(self) -> list[str]:
        """The policy, its store and tiers; the plan mode and the shared pool."""
        if self.store is None:
            return [f"policy {self.policy.name}: no store (prefixes are recomputed)"]
        held = len(self.store.tree)
        tiers = self.config.tiers
        plan = self.config.plan_line()
        if self.engine.shared is None and tiers.remote_url:
            plan += " (not used: this policy reads no store)"
        elif self.engine.shared is not None and self.engine.shared.tier.metrics()["down"]:
            plan += " (not answering: requests are served locally)"
        return [f"policy {self.policy.name}, store {self.store_dir} "
                f"({held} stored prefix nodes{', reused' if held else ''}); tiers GPU "
                f"{tiers.gpu_bytes / 2**20:.0f} MiB, CPU {tiers.cpu_bytes / 2**20:.0f} MiB",
                plan]

    # -- metrics --------------------------------------------------------------------------------
    def _init_metrics(self) -> None:
        from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                                       disable_created_metrics)

        from .serving import PLAN_KINDS
        from .tiers import REMOTE

        disable_created_metrics()   # no *_created series: they only repeat the start time
        r = self.registry = CollectorRegistry()
        ns = "impress_flexgen"
        self.m_ttft = Histogram("ttft_seconds", "Arrival to first token, queueing included",
                                namespace=ns, registry=r, buckets=TTFT_BUCKETS)
        self.m_prefill = Histogram("engine_ttft_seconds",
                                   "Engine time to first token (match, load, compute)",
                                   namespace=ns, registry=r, buckets=TTFT_BUCKETS)
        self.m_latency = Histogram("request_seconds", "Arrival to last token", namespace=ns,
                                   registry=r, buckets=TTFT_BUCKETS)
        self.m_queue = Gauge("queue_length", "Requests waiting for the engine", namespace=ns,
                             registry=r)
        self.m_queue.set_function(self._queue.qsize)
        self.m_running = Gauge("requests_running", "Requests in the engine (prefilled, "
                               "decoding)", namespace=ns, registry=r)
        self.m_running.set_function(lambda: len(self.scheduler.running))
        self.m_waiting = Gauge("requests_waiting", "Requests waiting: queued, or taken for "
                               "the next step but not yet admitted", namespace=ns, registry=r)
        self.m_waiting.set_function(lambda: self._queue.qsize() + len(self.scheduler.waiting))
        self.m_batch = Histogram("batch_size", "Requests in each decode step", namespace=ns,
                                 registry=r, buckets=BATCH_BUCKETS)
        self.m_tpot = Histogram("time_per_output_token_seconds", "Per request, decode time "
                                "per generated token after the first", namespace=ns,
                                registry=r, buckets=TPOT_BUCKETS)
        self.m_requests = Counter("requests", "Requests by outcome", ["outcome"], namespace=ns,
                                  registry=r)
        for outcome in OUTCOMES:
            self.m_requests.labels(outcome)
        self.m_prompt = Counter("prompt_tokens", "Prompt tokens, by whether the store had "
                                "their KV (matched), the shared pool had it (shared), or they "
                                "were computed", ["source"], namespace=ns, registry=r)
        self.m_completion = Counter("completion_tokens", "Generated tokens", namespace=ns,
                                    registry=r)
        self.m_bytes = Counter("kv_bytes_read", "Prefix KV bytes read, by tier", ["tier"],
                               namespace=ns, registry=r)
        self.m_probe = Counter("probe_bytes_read", "Probe-key bytes read", namespace=ns,
                               registry=r)
        for tier in self.engine.tier_names:
            self.m_bytes.labels(tier)
        for source in ("matched", "shared", "computed"):
            self.m_prompt.labels(source)
        self.m_plans = Counter("plans", "Requests with a stored prefix, by how it was served "
                               "(load it, recompute it, or both)", ["plan"], namespace=ns,
                               registry=r)
        for plan in PLAN_KINDS:
            self.m_plans.labels(plan)
        self.m_hit = Gauge("tier_hit_ratio", "Chunk hits / accesses of a tier since start",
                           ["tier"], namespace=ns, registry=r)
        memory = self.store.tiers.cache.tier_names if self.store is not None and \
            self.store.tiers.cache is not None else ()
        for tier in memory:
            self.m_hit.labels(tier).set_function(lambda tier=tier: self._hit_ratio(tier))
        self.m_store = Gauge("store_bytes", "Bytes of the store's files on disk", namespace=ns,
                             registry=r)
        self.m_store.set_function(lambda: self.store.disk_bytes() if self.store else 0)
        self.m_nodes = Gauge("store_nodes", "Prefix nodes in the store", namespace=ns,
                             registry=r)
        self.m_nodes.set_function(lambda: len(self.store.tree) if self.store else 0)
        self.m_fallback = Gauge("fallback_ratio", "Layers of stored prefixes that fell back "
                                "to loading the whole prefix, of all such layers",
                                namespace=ns, registry=r)
        self.m_fallback.set_function(lambda: self._layers[1] / self._layers[0]
                                     if self._layers[0] else 0.0)
        if self.engine.shared is not None:
            pool = self.engine.shared.tier
            self.m_hit.labels(REMOTE).set_function(lambda: _ratio(pool.metrics()))
            self.m_down = Gauge("shared_pool_down", "1 while the shared pool does not answer "
                                "(requests are then served locally)", namespace=ns,
                                registry=r)
            self.m_down.set_function(lambda: pool.metrics()["down"])
            self.m_pool_fallbacks = Counter(
                "shared_pool_fallbacks", "Requests served again without the shared pool (a "
                "chunk it had could not be fetched whole)", namespace=ns, registry=r)
            self.m_pool_events = Counter(
                "shared_pool_events", "Shared pool: requests that skipped it as slower than "
                "computing, values refused by their checksum or HMAC, chunks found missing a "
                "layer", ["event"], namespace=ns, registry=r)
            self._pool_seen = dict.fromkeys(POOL_EVENTS, 0)

    def _hit_ratio(self, tier: str) -> float:
        if self.store is None or self.store.tiers.cache is None:
            return 0.0
        return _ratio(self.store.tiers.cache.metrics[tier])

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def count(self, outcome: str) -> None:
        self.m_requests.labels(outcome).inc()

    # -- requests -----------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job, listener: Callable[[str], None] | None = None) -> Ticket:
        """Queue a job; `listener` gets the text as it is generated (on the worker thread).
        ServiceError 429 when the queue is full, 503 once closing."""
        ticket = Ticket(job, self.config.timeout_s, listener)
        with self._lock:
            if self._closing:
                raise ServiceError(503, "the server is shutting down", kind="server_error",
                                   code="shutting_down")
            try:
                self._queue.put_nowait(ticket)
            except queue.Full:
                self.count("rejected")
                raise ServiceError(429, f"server busy: {self._queue.qsize()} requests "
                                        "queued; retry later", kind="rate_limit_error",
                                   code="rate_limit_exceeded") from None
        return ticket

    def complete(self, job: Job) -> Completion:
        """Serve one job and wait for it (ServiceError if it could not be served)."""
        return self.submit(job).future.result()

    def _work(self) -> None:
        """The scheduler loop: take queued tickets while the batch has room (blocking when
        nothing runs), then one scheduler step (admit, prefill, one decode step)."""
        sched = self.scheduler
        closing = False
        while True:
            while not closing and sched.room():
                try:
                    ticket = self._queue.get() if not sched.busy else self._queue.get_nowait()
                except queue.Empty:
                    break
                if ticket is None:
                    closing = True     # after every queued request: serve them, then stop
                    break
                self._admit(ticket)
            if not sched.busy:
                if closing:
                    return
                continue
            batch_before = sched.steps
            sched.step()
            if sched.steps != batch_before:
                self.m_batch.observe(sched.last_batch)

    def _admit(self, ticket: Ticket) -> None:
        """Hand a ticket to the scheduler (or fail it now: cancelled, expired)."""
        from .scheduler import Work

        try:
            request, ended = self._request(ticket)
        except ServiceError as exc:
            ticket.future.set_exception(exc)
            return
        started = time.monotonic()

        def on_done(resp, error) -> None:
            try:
                if error is not None:
                    raise error
                ticket.future.set_result(self._complete(ticket, resp, ended, started))
            except ServiceError as exc:
                ticket.future.set_exception(exc)
            except UserError as exc:
                self.count("invalid")
                ticket.future.set_exception(ServiceError(400, str(exc)))
            except Exception as exc:  # noqa: BLE001 - one request failed; keep serving
                log.error("request failed", exc_info=exc)
                self.count("error")
                ticket.future.set_exception(ServiceError(500, f"internal error: {exc}"))

        self.scheduler.add(Work(request, on_done, query_logits=ticket.job.prompt_logprobs))

    def _request(self, ticket: Ticket):
        """The engine request of a ticket, with its streaming, stop strings, cancellation
        and deadline in on_token; ServiceError if cancelled or expired while queued."""
        from .engine import Request

        job = ticket.job
        started = time.monotonic()
        if ticket.cancelled:
            self.count("cancelled")
            raise ServiceError(499, "the request was cancelled", code="cancelled")
        if started > ticket.deadline:
            self.count("timeout")
            raise ServiceError(504, f"the request waited longer than the "
                                    f"{self.config.timeout_s:g} s timeout", code="timeout",
                               kind="timeout_error")
        stream = TextStream(self.frontend.decode, job.stop, ticket.listener, job.min_tokens)
        ended = {"stream": stream}  # why generation ended early, and when the first token came

        def on_token(token: int) -> bool:
            ended.setdefault("first", time.monotonic())
            if job.max_tokens == 0:     # the prompt scored; the one token made is dropped
                return False
            if not stream.push(token):
                ended["reason"] = "stop"
                return False
            if ticket.cancelled:
                ended["reason"] = "cancelled"
                return False
            if time.monotonic() > ticket.deadline:
                ended["reason"] = "timeout"
                return False
            return True

        prefix, query = job.split()
        # max_tokens 0 (echo: the prompt's log-probabilities only) still computes one token,
        # dropped from the completion.
        return Request(prefix, query, max(1, job.max_tokens), sampling=job.sampling,
                       on_token=on_token, namespace=job.namespace), ended

    def _complete(self, ticket: Ticket, resp, ended: dict, started: float) -> Completion:
        job = ticket.job
        stream = ended["stream"]
        done = time.monotonic()
        tokens = list(resp.tokens)[:job.max_tokens]
        reason = ended.get("reason") if job.max_tokens else "length"
        if reason is None:
            if tokens and tokens[-1] in job.sampling.stop_token_ids:
                reason = "stop"
            else:
                reason = "length"
        if tokens and tokens[-1] in job.sampling.stop_token_ids:
            tokens.pop()   # the stop token is not part of the completion
        text = stream.finish()
        first = ended.get("first", done)
        st = resp.stats
        stats = {"ttft_s": first - ticket.arrived, "queue_s": started - ticket.arrived,
                 "total_s": done - ticket.arrived, "engine_ttft_s": st.ttft_s,
                 "prefix_tokens": st.prefix_tokens, "matched_tokens": st.matched_tokens,
                 "computed_tokens": st.computed_tokens, "bytes_read": dict(st.bytes_read),
                 "probe_bytes": st.probe_bytes, "layers_fallback": st.layers_fallback,
                 "layers": st.layers if st.matched_tokens else 0,
                 "decode_s_per_token": st.decode_s_per_token,
                 "plan": st.plan if st.matched_tokens else None, "plan_split": st.plan_split,
                 "plan_reason": st.plan_reason if st.matched_tokens else None,
                 "predicted_ttft_s": st.predicted_ttft_s, "shared_tokens": st.shared_tokens,
                 # Prompt tokens whose KV was read (store or shared pool), not computed:
                 # matched tokens a plan recomputed are not among them.
                 "cached_tokens": max(0, len(job.ids) - st.computed_tokens)}
        self._observe(ticket, stats, len(tokens), reason)
        if len(resp.tokens) > 1:
            self.m_tpot.observe(st.decode_s_per_token)
        completion = Completion(job.id or f"cmpl-{uuid.uuid4().hex[:24]}", text, tokens,
                                reason, len(job.ids), stats)
        if job.logprobs is not None:
            completion.logprobs = token_logprobs(resp.step_logits, tokens, job.logprobs)
        if job.prompt_logprobs:
            completion.prompt_logprobs = [None] + token_logprobs(
                resp.query_logits[:-1], job.ids[1:], job.logprobs or 0)
        return completion

    def _observe(self, ticket: Ticket, stats: dict, n_tokens: int, reason: str) -> None:
        self.count({"cancelled": "cancelled", "timeout": "timeout"}.get(reason, "ok"))
        self.m_ttft.observe(stats["ttft_s"])
        self.m_prefill.observe(stats["engine_ttft_s"])
        self.m_latency.observe(stats["total_s"])
        self.m_prompt.labels("matched").inc(stats["cached_tokens"] - stats["shared_tokens"])
        self.m_prompt.labels("shared").inc(stats["shared_tokens"])
        self.m_prompt.labels("computed").inc(stats["computed_tokens"])
        if stats["plan"] is not None:
            self.m_plans.labels(stats["plan"]).inc()
        if self.engine.shared is not None:
            fallbacks = self.engine.shared_fallbacks
            self.m_pool_fallbacks.inc(fallbacks - self._fallbacks_seen)
            self._fallbacks_seen = fallbacks
            pool = self.engine.shared.tier.metrics()
            for event in POOL_EVENTS:
                self.m_pool_events.labels(event).inc(pool[event] - self._pool_seen[event])
                self._pool_seen[event] = pool[event]
        self.m_completion.inc(n_tokens)
        for tier, n in stats["bytes_read"].items():
            self.m_bytes.labels(tier).inc(n)
        self.m_probe.inc(stats["probe_bytes"])
        self._layers[0] += stats["layers"]
        self._layers[1] += stats["layers_fallback"]

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Refuse new requests, serve those already queued, then close the store and (if
        this service built it) the runtime."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._closed = True
        self._queue.put(None)     # after every queued request
        self._worker.join()
        self._close_engine_store_and_runtime()

    def _close_engine_store_and_runtime(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()       # the shared pool's threads
        finally:
            try:
                if self.store is not None:
                    self.store.close()
            finally:
                if self._owns_runtime and self.rt is not None:
                    self.rt.close()

    def __enter__(self) -> "Service":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- request files -----------------------------------------------------------------------------
# Read as a stream in request_files.py; these names stay importable from here.
from .request_files import REQUEST_FIELDS, read_requests  # noqa: E402,F401
