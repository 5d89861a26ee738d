"""The jobs' `Backend` on an OpenAI-compatible server (vLLM, SGLang, llama.cpp's server) instead of the local engine.

Ingestion and the prompts stay ours: each request is the messages the local engine reads (`jobs.request_messages`:
the document's text, then the request, as the user's turn), sent to `/v1/chat/completions` with streaming; the
server applies its model's chat template.
Batching becomes concurrency: up to `--max-concurrency` requests in flight, each retried with backoff after a
connection error or a busy answer (429, 502, 503, 504), and a request that fails costs only its own result.

Context budgeting: the server's context length comes from `--context-length`, else `/v1/models` (vLLM and SGLang
report `max_model_len`), else llama.cpp's `/props`, else from the server's own refusal of a request that was too
long. A document that fits is read in a single pass; one that does not is read in sections by the jobs
(`jobs.answer_in_sections`), each section's request sent concurrently. Each result's notes say which strategy ran.
A remote server gives no attention evidence: an answer's sources are the parts of the document holding the
question's and the answer's words (`jobs.rank_sources`).

Results are worth keeping (`jobs.ResultCache`) when the request is reproducible (greedy or seeded): the same
request on the same document, server, model and sampling is answered from the cache without a call.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import math
import re
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlsplit

from indexpool.model.errors import InputError, SettingsError
from .ingest import Document
from .jobs import (DOCUMENT_MARK, ContextTooLong, JobResult, OnResult, OnText, plain_request, rank_sources,
                   request_messages, request_question)
from .retrieval import LexicalIndex

CHARS_PER_TOKEN = 3.0  # when the server cannot count: fewer characters than English prose has per token, to over-count
COUNT_MARGIN = 1.1  # on the document's measured tokens per character, applied to a piece of it
TEMPLATE_TOKENS = 64  # reserved for the server's chat template around the user message, which we cannot see
NOTE_HEADER_TOKENS = 32  # a section result's label in the next level
BACKOFF_SECONDS = 0.5  # first wait before a retry; doubled each time, capped at BACKOFF_CAP
BACKOFF_CAP = 8.0
RETRY_STATUSES = (429, 502, 503, 504)
# What a server may send, beyond which it is misbehaving: one line of a stream (an event of a few tokens is some
# hundreds of bytes), a whole answer (a model list of thousands of entries fits), an error body (only its message
# is shown: the rest is left unread).
MAX_LINE_BYTES = 1 << 20
MAX_BODY_BYTES = 32 << 20
MAX_ERROR_BYTES = 64 << 10
# An answer far past its max_tokens: more stream events than a server sends per token (one, plus a few for the
# role, the finish and the usage), or more characters than any tokenizer's longest tokens (runs of spaces or "=").
MAX_CHUNKS_PER_TOKEN = 4
CHUNK_SLACK = 64
MAX_CHARS_PER_TOKEN = 128
CHAR_SLACK = 1024
EXCERPT_CHARS = 80  # of a malformed answer, in its message
MESSAGE_DEPTH = 8  # of an error body's nesting, where its message is looked for
CHECK_URL = "check that --base-url is the API root of an OpenAI-compatible server, e.g. http://localhost:8000/v1"
RUNAWAY_NOTE = ("the server went on far past --max-new-tokens (it ignores max_tokens): the answer is cut to about "
                "that many tokens")
STOP_REASONS = {"stop": "stop_token", "length": "max_new_tokens"}  # OpenAI finish_reason -> ours
SOURCES_NOTE = ("sources: the parts whose wording the answer repeats (a remote server gives no attention evidence, "
                "from which the local engine cites)")
# How servers word a refusal of a request longer than their context, and where they put the context length.
CONTEXT_WORDS = re.compile(r"context|too long|maximum .*length|max_model_len|n_ctx", re.IGNORECASE)
CONTEXT_LIMIT = re.compile(r"(?:maximum context length is|context window of|context length of|max_model_len"
                           r"|n_ctx)\D{0,20}?(\d{1,12})(?!\d)", re.IGNORECASE)
MESSAGE_CHARS = 2000  # of an error message, searched for the words above
T = TypeVar("T")


class RemoteError(Exception):
    """The server cannot do the work: unreachable, refused the API key, stopped answering, or answered an error.
    Exit code 1. `results` holds what completed before a failure (None where a request failed)."""

    def __init__(self, message: str, results: list[JobResult | None] | None = None):
        super().__init__(message)
        self.results = results or []


class _Retry(Exception):
    """A failure worth another try: a connection error, or a busy server. `connection` marks the former."""

    def __init__(self, message: str, connection: bool, after: float | None = None):
        super().__init__(message)
        self.connection = connection
        self.after = after  # the server's Retry-After, in seconds


class _EmptyStream(Exception):
    """A stream that ended before its first event."""


class _Cancelled(Exception):
    """The job was abandoned (Ctrl-C): a worker stops quietly."""


@dataclass(frozen=True)
class ServerAddress:
    https: bool
    host: str
    port: int
    api: str  # path of the OpenAI API, "/v1"
    root: str  # path its extra endpoints hang from (/tokenize, /props): the API path less its "/v1"

    @classmethod
    def parse(cls, url: str) -> "ServerAddress":
        parts = urlsplit(url.strip())
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 or parts.query:
            raise SettingsError(f"--base-url {url!r} is not an http(s) URL such as http://localhost:8000/v1")
        api = parts.path.rstrip("/") or "/v1"  # a bare host:port means the usual /v1
        root = api[: -len("/v1")] if api.endswith("/v1") else api
        https = parts.scheme == "https"
        return cls(https, parts.hostname, port or (443 if https else 80), api, root)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"{'https' if self.https else 'http'}://{host}:{self.port}{self.api}"


@dataclass
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int | None  # from the server's usage report, when it sends one
    completion_tokens: int
    first_seconds: float  # until the first text (queueing and reading the prompt)
    seconds: float
    runaway: bool = False  # the server went far past max_tokens: the text is cut (`_keep_asked`)


class OpenAIClient:
    """Blocking calls to an OpenAI-compatible server, safe to use from several threads. Failures come out as
    RemoteError, InputError (wrong model) or ContextTooLong, after retries where another try can help. Each call,
    its retries and their waits included, ends by the `timeout` (seconds). Once a request has spent its retries on
    connection errors the server is taken for gone: later calls fail at once."""

    def __init__(self, address: ServerAddress, api_key: str | None, timeout: float, retries: int):
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.gone: str | None = None  # why the server is taken for gone
        self.answered = False  # some call succeeded: a later connection failure means the server stopped
        self._cancel = threading.Event()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Stop every call: waits end, open connections are shut so blocked reads return."""
        self._cancel.set()
        with self._lock:
            for sock in self._open:
                _shut(sock)

    # -- the API -------------------------------------------------------------------------------------------------

    def models(self) -> list[dict]:
        return parse_models(self._call(lambda deadline: self._fetch("GET", self.address.api + "/models", deadline)))

    def props(self) -> dict | None:
        """llama.cpp's server settings (its context length among them); None where the server has no /props."""
        raw = self._call(lambda deadline: self._fetch("GET", self.address.root + "/props", deadline, optional=True))
        return _json_object(raw)

    def count_tokens(self, model: str, text: str) -> int | None:
        """Tokens in `text` by the server's tokenizer (vLLM and llama.cpp: /tokenize; llama-cpp-python:
        /extras/tokenize/count); None where it has neither."""
        body = {"model": model, "prompt": text, "content": text, "input": text, "add_special_tokens": False}
        for path in ("/tokenize", "/extras/tokenize/count"):
            data = _json_object(self._call(
                lambda deadline: self._fetch("POST", self.address.root + path, deadline, body, optional=True)))
            if data is not None:
                if _count(data.get("count")) is not None:
                    return data["count"]
                if isinstance(data.get("tokens"), list):
                    return len(data["tokens"])
        return None

    def chat(self, model: str, messages: list[dict], max_tokens: int, sampling: dict) -> Completion:
        """sampling: the request's sampling fields (`sampling_fields`)."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, **sampling,
                "stream": True, "stream_options": {"include_usage": True}}
        deadline = time.monotonic() + self.timeout  # the fallback below is the same request: one deadline
        try:
            return self._call(lambda deadline: self._stream(body, deadline), deadline)
        except _EmptyStream:
            # llama-cpp-python's server reports a failure inside a stream by ending it empty, after status 200
            # (a prompt longer than its context, say); asked again without streaming, it answers with the error.
            unstreamed = {key: value for key, value in body.items() if key != "stream_options"} | {"stream": False}
            return self._call(lambda deadline: self._complete(unstreamed, deadline), deadline)

    # -- transport -----------------------------------------------------------------------------------------------

    def _call(self, attempt: Callable[[float], T], deadline: float | None = None) -> T:
        """`attempt(deadline)`, tried again after a _Retry, with backoff, until `deadline` (time.monotonic(); by
        default the timeout from now); the server is taken for gone when connection errors outlast the retries."""
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        for tries in range(self.retries + 1):
            if self.gone:
                raise RemoteError(self.gone)
            if self._cancel.is_set():
                raise _Cancelled()
            try:
                result = attempt(deadline)
                self.answered = True
                return result
            except _Retry as e:
                failure = self._failure(e)
                if tries == self.retries:
                    if not e.connection:
                        retried = f"{self.retries} retr{'y' if self.retries == 1 else 'ies'}"
                        raise RemoteError(f"{e}, after {retried}; try again later or lower --max-concurrency") \
                            from None
                    self.gone = failure if self.answered else \
                        f"{failure}; check --base-url and that the server is running"
                    raise RemoteError(self.gone) from None
                wait = e.after if e.after is not None else min(BACKOFF_CAP, BACKOFF_SECONDS * 2 ** tries)
                if time.monotonic() + wait > deadline:  # fail now rather than sleep past the deadline
                    asked = " (the server's Retry-After)" if e.after is not None else ""
                    raise RemoteError(f"{failure}, and a retry in {wait:g}s{asked} would pass --timeout "
                                      f"({self.timeout:g}s for the whole request): try again later or raise "
                                      "--timeout") from None
                if self._cancel.wait(wait):
                    raise _Cancelled() from None
        raise AssertionError("the loop returns or raises")

    def _failure(self, e: _Retry) -> str:
        if not e.connection:
            return str(e)
        if self.answered:
            return f"the server at {self.address} stopped answering ({e})"
        return f"cannot reach the server at {self.address} ({e})"

    @contextlib.contextmanager
    def _request(self, method: str, path: str, body: dict | None,
                 deadline: float) -> Iterator[http.client.HTTPResponse]:
        """The response to one HTTP request, its connection shut at `deadline` (time.monotonic()) whatever it is
        doing: a per-read socket timeout alone never ends a server that trickles bytes or pings. Connection failures
        come out as _Retry (or _Cancelled after cancel()), the deadline and an answer that is not HTTP as
        RemoteError; the connection is closed on the way out."""
        left = deadline - time.monotonic()
        kind = http.client.HTTPSConnection if self.address.https else http.client.HTTPConnection
        conn = kind(self.address.host, self.address.port, timeout=max(left, 0.001))
        headers = {"Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        expired = threading.Event()
        sock: socket.socket | None = None  # kept here: http.client drops it from `conn` once a response owns it
        response: http.client.HTTPResponse | None = None

        def expire() -> None:
            expired.set()  # before the shutdown: a read that ends by it then sees why
            if sock is not None:
                _shut(sock)

        watchdog = threading.Timer(left, expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            conn.connect()
            sock = conn.sock
            with self._lock:
                self._open.add(sock)
            if expired.is_set():  # it fired before the socket was there to shut
                raise TimeoutError()
            if self._cancel.is_set():
                raise _Cancelled()
            conn.request(method, path, body=payload, headers=headers)
            response = conn.getresponse()
            yield response
            if expired.is_set():  # a body cut by the shutdown can look complete
                raise TimeoutError()
        except Exception as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise RemoteError(f"no complete answer from the server at {self.address} within --timeout "
                                  f"({self.timeout:g}s for the whole request, retries included); raise --timeout "
                                  "if the server is only slow") from None
            if not isinstance(e, (OSError, http.client.HTTPException)):
                raise
            if self._cancel.is_set():
                raise _Cancelled() from None
            if isinstance(e, socket.gaierror):
                raise RemoteError(f"cannot find the host of --base-url {self.address} ({e.strerror})") from None
            if isinstance(e, (OSError, http.client.IncompleteRead)):
                raise _Retry(getattr(e, "strerror", None) or str(e) or type(e).__name__, connection=True) from None
            # http.client's refusals of what is not HTTP: a garbage status line, endless headers
            raise RemoteError(f"the server at {self.address} does not answer in HTTP ({_one_line(str(e), 80)}); "
                              f"{CHECK_URL}") from None
        finally:
            watchdog.cancel()
            with self._lock:
                self._open.discard(sock)
            if response is not None:
                response.close()  # hangs up on a server still sending
            conn.close()

    def _fetch(self, method: str, path: str, deadline: float, body: dict | None = None,
               optional: bool = False) -> bytes | None:
        """The body of a 200 answer. An optional endpoint that the server does not have (404, 405) or that takes
        other arguments (400, 422) gives None; errors that matter (auth, busy, unreachable) raise."""
        with self._request(method, path, body, deadline) as response:
            status = response.status
            raw = _read_body(response, f"{method} {path}") if status == 200 else response.read(MAX_ERROR_BYTES)
            retry_after = response.getheader("Retry-After")
        if optional and status in (400, 404, 405, 422):
            return None
        if status != 200:
            error = _http_error(status, raw, retry_after, self.api_key, body.get("model") if body else None)
            if status == 404 and type(error) is RemoteError:  # no such endpoint
                raise RemoteError(f"{self.address} has no {path} (404); give --base-url as the API root, e.g. "
                                  "http://localhost:8000/v1")
            raise error
        return raw

    def _stream(self, body: dict, deadline: float) -> Completion:
        """One streamed chat completion: the `data:` lines of its server-sent events, to the end."""
        t0 = time.perf_counter()
        first = None
        events = StreamedCompletion(body["max_tokens"])
        with self._request("POST", self.address.api + "/chat/completions", body, deadline) as response:
            if response.status != 200:
                raise _http_error(response.status, response.read(MAX_ERROR_BYTES), response.getheader("Retry-After"),
                                  self.api_key, body["model"])
            for line in _lines(response):
                if self._cancel.is_set():
                    raise _Cancelled()
                more = events.feed(line)
                if first is None and events.pieces:
                    first = time.perf_counter() - t0
                if not more:
                    break  # leaving closes the connection: a server streaming on is not read to its end
        if not events.finish:
            if not events.received:
                raise _EmptyStream()
            # Cut short: llama-cpp-python's server does it to the request it streams when another one arrives.
            raise _Retry("the server ended an answer before its end", connection=False)
        seconds = time.perf_counter() - t0
        return events.completion(first if first is not None else seconds, seconds)

    def _complete(self, body: dict, deadline: float) -> Completion:
        """One chat completion, not streamed."""
        t0 = time.perf_counter()
        raw = self._fetch("POST", self.address.api + "/chat/completions", deadline, body)
        return parse_completion(raw, body["max_tokens"], time.perf_counter() - t0)


def _shut(sock: socket.socket) -> None:
    """Shut a connection so that a read blocked on it, in any thread, returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


# -- reading the server's answers: bytes in, a result or a one-line RemoteError out ---------------------------------


class _Malformed(Exception):
    """A server's answer of the wrong shape; the message says which part."""


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(text.split())[:limit]


def _excerpt(raw: bytes) -> str:
    """The start of a server's answer, quoted on one line (repr escapes line breaks)."""
    head = raw[: 4 * EXCERPT_CHARS].decode("utf-8", "replace")  # no character takes more than 4 bytes
    more = len(head) > EXCERPT_CHARS or len(raw) > 4 * EXCERPT_CHARS
    return repr(head[:EXCERPT_CHARS]) + ("..." if more else "")


def _malformed(what: str, why: str, raw: bytes) -> RemoteError:
    return RemoteError(f"the server's answer to {what} is malformed ({why}: {_excerpt(raw)}); {CHECK_URL}")


def _load_json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise _Malformed("not JSON") from None


def _kind(value) -> str:
    """The JSON kind of a parsed value, for messages."""
    if isinstance(value, bool):
        return "true/false"
    return {dict: "an object", list: "a list", str: "a string", type(None): "null"}.get(type(value), "a number")


def _field(data: dict, key: str, kind: type):
    """data[key] when it is a `kind` (not true/false for a number); None when absent or null."""
    value = data.get(key)
    if value is None or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise _Malformed(f'"{key}" is {_kind(value)}')


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise _Malformed(f"{what} is {_kind(value)}")
    return value


def _count(value) -> int | None:
    """A count of tokens: an int of at least 0, not true/false."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _usage(data: dict) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a usage report."""
    usage = _field(data, "usage", dict) or {}
    counts = [_field(usage, key, int) for key in ("prompt_tokens", "completion_tokens")]
    if any(count is not None and _count(count) is None for count in counts):
        raise _Malformed("a token count in \"usage\" is negative")
    return counts[0], counts[1]


def _runaway(max_tokens: int, chars: int, chunks: int = 1) -> bool:
    """Far more than max_tokens tokens' worth: bounds that no tokenizer's tokens (or a server's chunks per token)
    reach, so that only a server ignoring max_tokens passes them."""
    return (chunks > MAX_CHUNKS_PER_TOKEN * max_tokens + CHUNK_SLACK
            or chars > MAX_CHARS_PER_TOKEN * max_tokens + CHAR_SLACK)


def _keep_asked(text: str, max_tokens: int) -> str:
    """What was asked for of a runaway answer. Its start is the model's answer as a server honouring max_tokens
    would have ended it, so it is kept rather than failed (the local engine ends an answer at --max-new-tokens the
    same way), cut to an estimate that over-counts tokens: a section's answer must fit the budget it was given."""
    return text[: int(max_tokens * CHARS_PER_TOKEN)]


class StreamedCompletion:
    """A streamed chat completion read from its server-sent event lines, one `feed` at a time."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.pieces: list[str] = []
        self.chars = 0
        self.chunks = 0
        self.finish = ""
        self.usage: tuple[int | None, int | None] = (None, None)
        self.received = False  # some event came
        self.runaway = False

    def feed(self, line: bytes) -> bool:
        """Read one line; False once nothing more is to be read: [DONE], or the server far past max_tokens."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return True  # blank separators, ": ping" comments, event names
        data = line[len(b"data:"):].strip()
        if data == b"[DONE]":
            return False
        try:
            chunk = _object(_load_json(data), "an event")
            if chunk.get("error") is not None:
                raise _error_from_message(_error_text(chunk, data), 0, None, None)
            choices = _field(chunk, "choices", list) or []
            usage = _usage(chunk)
            for choice in choices:
                choice = _object(choice, "a choice")
                if piece := _field(_field(choice, "delta", dict) or {}, "content", str):
                    self.pieces.append(piece)
                    self.chars += len(piece)
                self.finish = _field(choice, "finish_reason", str) or self.finish
        except _Malformed as e:
            raise _malformed("POST /chat/completions (an event of its stream)", str(e), data) from None
        self.received = True
        if usage != (None, None):
            self.usage = usage
        self.chunks += 1
        if _runaway(self.max_tokens, self.chars, self.chunks):
            self.runaway, self.finish = True, "length"
            return False
        return True

    def completion(self, first_seconds: float, seconds: float) -> Completion:
        prompt_tokens, completion_tokens = self.usage
        text = "".join(self.pieces)
        if self.runaway:
            return Completion(_keep_asked(text, self.max_tokens), "length", prompt_tokens, self.max_tokens,
                              first_seconds, seconds, runaway=True)
        return Completion(text, self.finish, prompt_tokens, completion_tokens or len(self.pieces), first_seconds,
                          seconds)


def parse_completion(raw: bytes, max_tokens: int, seconds: float) -> Completion:
    """A chat completion from the body of the server's 200 answer, not streamed."""
    try:
        data = _object(_load_json(raw), "the answer")
        if data.get("error") is not None:
            raise _error_from_message(_error_text(data, raw), 0, None, None)
        choices = _field(data, "choices", list)
        if not choices:
            raise _Malformed('no "choices"')
        choice = _object(choices[0], "a choice")
        text = _field(_object(choice.get("message"), '"message"'), "content", str) or ""
        finish = _field(choice, "finish_reason", str) or ""
        prompt_tokens, completion_tokens = _usage(data)
    except _Malformed as e:
        raise _malformed("POST /chat/completions", str(e), raw) from None
    if _runaway(max_tokens, len(text)):
        return Completion(_keep_asked(text, max_tokens), "length", prompt_tokens, max_tokens, seconds, seconds,
                          runaway=True)
    return Completion(text, finish, prompt_tokens, completion_tokens or 0, seconds, seconds)


def parse_models(raw: bytes) -> list[dict]:
    """The served models (each an object with a string "id") from the body of GET /models."""
    try:
        models = _field(_object(_load_json(raw), "the answer"), "data", list)
        if models is None:
            raise _Malformed('no "data" list')
    except _Malformed as e:
        raise _malformed("GET /models", f"{e}, not a model list", raw) from None
    return [m for m in models if isinstance(m, dict) and isinstance(m.get("id"), str)]


def _json_object(raw: bytes | None) -> dict | None:
    """An optional endpoint's JSON object; None where it answered something else, as where it has none."""
    try:
        data = _load_json(raw) if raw is not None else None
    except _Malformed:
        return None
    return data if isinstance(data, dict) else None


def _read_body(response: http.client.HTTPResponse, what: str) -> bytes:
    raw = response.read(MAX_BODY_BYTES + 1)
    if len(raw) > MAX_BODY_BYTES:
        raise RemoteError(f"the server's answer to {what} is longer than {MAX_BODY_BYTES >> 20} MiB; {CHECK_URL}")
    return raw


def _lines(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """A streamed answer's lines, up to MAX_LINE_BYTES each and MAX_BODY_BYTES in all."""
    total = 0
    while line := response.readline(MAX_LINE_BYTES + 1):
        total += len(line)
        if len(line) > MAX_LINE_BYTES:
            raise RemoteError(f"the server streamed a line longer than {MAX_LINE_BYTES >> 10} KiB; {CHECK_URL}")
        if total > MAX_BODY_BYTES:
            raise RemoteError(f"the server streamed more than {MAX_BODY_BYTES >> 20} MiB for one answer; {CHECK_URL}")
        yield line


def _message_of(data) -> str | None:
    """The error text of an OpenAI-style ({"error": {"message"}}), vLLM ({"message"}) or FastAPI ({"detail"})
    error body; None where it has none."""
    for _ in range(MESSAGE_DEPTH):
        if isinstance(data, list) and data:
            data = data[0]
        elif isinstance(data, dict) and (key := next((k for k in ("error", "message", "detail")
                                                      if data.get(k) is not None), None)):
            data = data[key]
        elif data is None or isinstance(data, (dict, list)):
            return None
        else:
            return str(data)
    return None


def _error_text(data, raw: bytes) -> str:
    """The message of an error answer (`data`: its JSON, None where it is not JSON), else its text."""
    return _message_of(data) or raw.decode("utf-8", "replace").strip() or "no message"


def _seconds(value: str | None) -> float | None:
    """A Retry-After of seconds (its other form, a date, is left to the backoff)."""
    if value is None or not re.fullmatch(r"[0-9]{1,9}(?:\.[0-9]{0,6})?", value.strip()):
        return None
    return float(value)


def _http_error(status: int, raw: bytes, retry_after: str | None, api_key: str | None,
                model: str | None = None) -> Exception:
    """The exception for a non-200 answer: its status, its body (or the start of it), its Retry-After header."""
    try:
        data = _load_json(raw)
    except _Malformed:
        data = None
    message = _error_text(data, raw)
    if status in RETRY_STATUSES:
        return _Retry(f"the server answered {status} ({_one_line(message)})", connection=False,
                      after=_seconds(retry_after))
    limit = data.get("n_ctx") if isinstance(data, dict) else None  # llama.cpp's server puts it beside the message
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        limit = data["error"].get("n_ctx", limit)
    return _error_from_message(message, status, api_key, model, _positive(limit))


def _positive(value) -> int | None:
    """A context length: an int of at least 1, not true/false."""
    return value if _count(value) else None


def _error_from_message(message: str, status: int, api_key: str | None, model: str | None,
                        limit: int | None = None) -> Exception:
    one_line = _one_line(message)
    message = message[:MESSAGE_CHARS]  # a server's page of text: the patterns below would crawl through it
    if status in (401, 403):
        if api_key:
            return RemoteError(f"the server refused the API key ({status}: {one_line}); pass the right one with "
                               "--api-key or INDEXPOOL_API_KEY")
        return RemoteError(f"the server wants an API key ({status}: {one_line}); pass it with --api-key or "
                           "INDEXPOOL_API_KEY")
    if status == 404 and model and "model" in message.lower():
        return InputError(f"the server has no model {model!r} ({one_line}); see --model-name")
    if status in (0, 400, 413, 422) and CONTEXT_WORDS.search(message):
        if limit is None and (match := CONTEXT_LIMIT.search(message)):
            limit = _positive(int(match.group(1)))
        return ContextTooLong(f"the request is longer than the server's context ({one_line})", limit)
    return RemoteError(f"the server answered {status or 'an error'}: {one_line}")

# -- the job --------------------------------------------------------------------------------------------------------


@dataclass
class ServerModel:
    name: str
    context: int | None  # tokens, None while unknown
    context_source: str  # where the context came from, for the notes


def find_model(client: OpenAIClient, model_name: str | None, context_length: int | None) -> ServerModel:
    """The model to use and its context: checks the name against the server's list."""
    models = client.models()
    names = [m["id"] for m in models]
    if not names:
        raise RemoteError(f"the server at {client.address} lists no model")
    name = model_name or names[0]
    if name not in names:
        raise InputError(f"the server at {client.address} has no model {name!r}; it serves "
                         f"{', '.join(repr(n) for n in names[:5])} (--model-name)")
    if context_length:
        return ServerModel(name, context_length, "--context-length")
    entry = models[names.index(name)]
    for key in ("max_model_len", "context_length", "context_window", "max_context_length"):
        if context := _positive(entry.get(key)):
            return ServerModel(name, context, "the server's /models")
    props = client.props() or {}
    settings = props.get("default_generation_settings")
    settings = settings if isinstance(settings, dict) else {}
    if context := _positive(settings.get("n_ctx", props.get("n_ctx"))):
        return ServerModel(name, context, "the server's /props")
    return ServerModel(name, None, "")


class OpenAIBackend:
    """The jobs' `Backend` on an OpenAI-compatible server at `base_url` (its API root, e.g.
    http://localhost:8000/v1). Up to `max_concurrency` requests in flight; `timeout`: seconds a request may take,
    its retries included; `retries` after a connection error or a busy server; `context_length` where the server does
    not report it; `sampling`: the request's sampling fields (`sampling_fields`). The server is first asked when a
    job needs it."""

    def __init__(self, base_url: str, sampling: dict, api_key: str | None = None, model_name: str | None = None,
                 max_concurrency: int = 4, timeout: float = 600.0, retries: int = 3, context_length: int | None = None):
        self.client = OpenAIClient(ServerAddress.parse(base_url), api_key, timeout, retries)
        self.base_url = base_url
        self.sampling = sampling
        self.model_name = model_name
        self.context_length = context_length
        self.max_concurrency = max_concurrency
        self._model: ServerModel | None = None
        self._counted: dict[str, int] = {}  # a document's tokens (hash of its text -> count)
        self.tokens_per_char = 1 / CHARS_PER_TOKEN
        self.counted_by = "estimated"
        self._learn = threading.Lock()

    @property
    def model(self) -> ServerModel:
        if self._model is None:
            self._model = find_model(self.client, self.model_name, self.context_length)
        return self._model

    @property
    def name(self) -> str:
        return self.model.name

    def identity(self) -> dict:
        return {"server": self.base_url, "model": self.model.name, "context": self.model.context,
                "sampling": self.sampling}

    def keeps_results(self) -> bool:
        return self.sampling.get("temperature") == 0 or self.sampling.get("seed") is not None

    def extracts(self) -> bool:
        return False  # a server's model writes its answers

    def document_tokens(self, document: Document) -> int:
        """The document's tokens by the server's tokenizer (estimated where it cannot count); its tokens per
        character then estimate the pieces of it (`count_tokens`)."""
        text = document.text
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in self._counted:
            counted = self.client.count_tokens(self.model.name, text)
            if counted is not None and text:
                self.tokens_per_char = COUNT_MARGIN * counted / len(text)
                self.counted_by = "counted by the server"
            self._counted[key] = counted if counted is not None else math.ceil(len(text) / CHARS_PER_TOKEN)
        return self._counted[key]

    def count_tokens(self, text: str) -> int:
        return math.ceil(len(text) * self.tokens_per_char)

    def fits(self, document: Document, request: str, max_new_tokens: int) -> bool:
        context = self.model.context
        return context is None or (self.document_tokens(document) + self.count_tokens(request) + TEMPLATE_TOKENS
                                   + max_new_tokens <= context)

    reads_whole = fits  # the server's context is all one pass reads

    def section_budget(self, request: str, max_new_tokens: int) -> int:
        context = self.model.context
        request_tokens = self.count_tokens(request)
        budget = context - max_new_tokens - TEMPLATE_TOKENS - request_tokens
        if budget < 2 * (max_new_tokens + NOTE_HEADER_TOKENS):  # two answers must fit, or no level shrinks
            most = max(0, (context - TEMPLATE_TOKENS - request_tokens - 2 * NOTE_HEADER_TOKENS) // 3)
            raise ContextTooLong(f"the server's context of {context:,} tokens is too small to read the document in "
                                 f"sections with --max-new-tokens {max_new_tokens}: use at most {most}, or serve the "
                                 "model with a longer context", context)
        return budget

    def context_note(self, document_tokens: int) -> str:
        model = self.model
        if model.context is None:
            return (f"the document's {document_tokens:,} tokens ({self.counted_by}) fit the server's context (it "
                    "does not report its length)")
        fit = "fit" if document_tokens <= model.context else "do not fit"
        return (f"the document's {document_tokens:,} tokens ({self.counted_by}) {fit} the server's context of "
                f"{model.context:,} ({model.context_source})")

    def send(self, document_text: str, request: str, max_new_tokens: int, calls: ThreadPoolExecutor) -> Future:
        """One request on the calls pool: the messages the local engine reads (`jobs.request_messages`), the
        document's text in its place (the server quotes nothing: `jobs.plain_request`)."""
        messages = [{**message, "content": message["content"].replace(DOCUMENT_MARK, document_text)}
                    for message in request_messages(plain_request(request))]
        return calls.submit(self.client.chat, self.model.name, messages, max_new_tokens, self.sampling)

    def answer(self, document: Document, requests: list[str], max_new_tokens: int, extract: bool,
               on_result: OnResult, on_text: OnText | None = None) -> list[JobResult]:
        """The requests sent concurrently, each with the whole document; on_result gets each result in request
        order as soon as it and those before it are done (nothing is streamed). When some fail, the others still
        complete and reach on_result, then the first failure is raised (RemoteError: exit 1; InputError,
        ContextTooLong among them: exit 3) with `.results` (None where failed). A refusal that names the server's
        context teaches it (ContextTooLong with its `limit`: the jobs read the document in sections)."""
        index = LexicalIndex.of_parts([part.text for part in document.parts])
        document_tokens = self.document_tokens(document)

        def one(request: str, calls: ThreadPoolExecutor) -> JobResult:
            try:
                done = self.send(document.text, request, max_new_tokens, calls).result()
            except ContextTooLong as e:
                if e.limit is None:
                    raise ContextTooLong(f"{e}; the server does not say its context length: pass it with "
                                         "--context-length to read the document in sections") from None
                with self._learn:
                    self.model.context = min(e.limit, self.model.context or e.limit)
                    self.model.context_source = "the server's refusal of the whole document"
                raise
            result = JobResult(done.text, prompt_tokens=done.prompt_tokens or document_tokens + self.count_tokens(request),
                               document_tokens=document_tokens, new_tokens=done.completion_tokens,
                               read_seconds=done.first_seconds, answer_seconds=done.seconds - done.first_seconds,
                               stop_reason=STOP_REASONS.get(done.finish_reason, done.finish_reason),
                               notes=[f"single pass: {self.context_note(document_tokens)}", SOURCES_NOTE,
                                      *([RUNAWAY_NOTE] if done.runaway else [])])
            result.sources = rank_sources(document, index, request_question(request), done.text)
            return result

        return self.run([lambda calls, r=r: one(r, calls) for r in requests], on_result)

    def answer_each(self, documents: list[Document], request: str, max_new_tokens: int,
                    what: str) -> list[JobResult]:
        def one(document: Document, calls: ThreadPoolExecutor) -> JobResult:
            done = self.send(document.text, request, max_new_tokens, calls).result()
            result = JobResult(done.text, prompt_tokens=done.prompt_tokens or 0,
                               document_tokens=self.count_tokens(document.text), new_tokens=done.completion_tokens,
                               read_seconds=done.first_seconds, answer_seconds=done.seconds - done.first_seconds,
                               stop_reason=STOP_REASONS.get(done.finish_reason, done.finish_reason),
                               notes=[SOURCES_NOTE, *([RUNAWAY_NOTE] if done.runaway else [])])
            index = LexicalIndex.of_parts([part.text for part in document.parts])
            result.sources = rank_sources(document, index, request_question(request), done.text)
            return result

        return self.run([lambda calls, d=d: one(d, calls) for d in documents], lambda i, r: None)

    def run(self, jobs: list[Callable[[ThreadPoolExecutor], JobResult]], on_result: OnResult) -> list[JobResult]:
        """Each job (given the calls pool), up to max_concurrency at once; results in order (see `answer`)."""
        results: list[JobResult | None] = [None] * len(jobs)
        failures: list[Exception] = []
        calls = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="indexpool-remote")
        orchestrators = ThreadPoolExecutor(min(len(jobs), self.max_concurrency), thread_name_prefix="indexpool-job")
        try:
            futures = [orchestrators.submit(job, calls) for job in jobs]
            for i, future in enumerate(futures):  # in order, each as soon as it and those before it are done
                try:
                    results[i] = future.result()
                except (RemoteError, InputError) as e:
                    failures.append(e)
                    continue
                on_result(i, results[i])
        except BaseException:  # Ctrl-C, or on_result failing (a closed pipe): stop the work in flight
            self.client.cancel()
            raise
        finally:
            orchestrators.shutdown(wait=True, cancel_futures=True)
            calls.shutdown(wait=True, cancel_futures=True)
        if failures:
            first = failures[0]
            done = len(jobs) - len(failures)
            message = str(first) if not done else \
                f"{first} ({len(failures)} of {len(jobs)} requests failed; the other {done} completed)"
            if isinstance(first, RemoteError):
                raise RemoteError(message, results)
            error = ContextTooLong(message, first.limit) if isinstance(first, ContextTooLong) else InputError(message)
            error.results = results
            raise error
        return results  # type: ignore[return-value]  (no None left when nothing failed)


def sampling_fields(temperature: float, top_p: float, top_k: int, seed: int | None) -> dict:
    """The request fields for our sampling options: temperature, top_p and seed are OpenAI's; top_k is an
    extension that vLLM, SGLang and llama.cpp's servers accept (left out when 0: no limit)."""
    fields = {"temperature": temperature, "top_p": top_p}
    if top_k:
        fields["top_k"] = top_k
    if seed is not None:
        fields["seed"] = seed
    return fields
