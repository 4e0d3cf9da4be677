"""What a user sends, made a job; what the engine makes, made text.

    frontend = Frontend(runtime.spec, runtime.tokenizer)
    job = frontend.build(prompt="It is a truth", max_tokens=16, stop=["."])
    job.split()          # (prefix, query): the prefix is matched and stored, chunk by chunk

A prompt becomes token ids (plain text, ids, or chat messages through the model's chat
template), checked against the model's positions and vocabulary; every mistake is a
ServiceError naming the field (HTTP 400 with OpenAI's error body). On the way out,
TextStream detokenises as tokens come, holding back what could still be a stop string or
half a character; log-probabilities come from the engine as numbers (scores.py). The
Frontend needs only the model's spec and tokenizer: a request file is checked before the
model is built.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from .errors import ServiceError
from .sampling import SamplingParams
from .store.config import CHUNK_SIZE

MAX_STOP_STRINGS = 4   # as OpenAI's API
MAX_STOP_CHARS = 256   # each; the stop check rescans this much text per token
MAX_LOGPROBS = 20      # top log-probabilities per token, as vLLM's default limit
# Log-probability entries (a token's own and its top k) one response may carry over its
# prompt's tokens, every choice counted (each repeats the prompt's): what bounds a scored
# prompt's length, since its logits are bounded by the piece (engine.scheduler). Its text is
# made under the GIL beside the server's other work, about 5 us an entry on the 2-core CPU:
# 2**18 entries are about a second and 8 MB of JSON. One choice with the top 20 over a
# prompt filling smollm2's 8,192 positions is 171,990 entries; 16 choices, 780 tokens.
MAX_SCORED_ENTRIES = 1 << 18


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
    prompt_logprobs: bool = False   # the prompt's own log-probabilities (all computed)
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

    def check_scored(self, job: Job, choices: int) -> None:
        """A scored prompt whose answer stays bounded: 400 when its tokens after the first,
        each with its own log-probability and the top k, in every choice, come to more
        than MAX_SCORED_ENTRIES entries."""
        if not job.prompt_logprobs:
            return
        per_token = 1 + (job.logprobs or 0)
        entries = (len(job.ids) - 1) * per_token * choices
        if entries > MAX_SCORED_ENTRIES:
            most = MAX_SCORED_ENTRIES // (per_token * choices) + 1
            raise ServiceError(400, f"scoring a {len(job.ids)}-token prompt with logprobs "
                                    f"{job.logprobs or 0} and n {choices} returns {entries} "
                                    f"log-probability entries, more than the "
                                    f"{MAX_SCORED_ENTRIES} a response carries: at most "
                                    f"{most} prompt tokens here (fewer choices, each of "
                                    "which repeats the prompt's, or a smaller logprobs "
                                    "allow more)", param="prompt",
                               code="context_length_exceeded")

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
    # Per generated token (token, log-probability, [(token, log-probability)] * top k)
    logprobs: list | None = None
    prompt_scores: object = None    # scores.TokenScores of the prompt's tokens after its first

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def record(self) -> dict:
        """The request file's output line."""
        return {"id": self.id, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "stats": self.stats}
