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
from typing import Callable, Iterator
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
STOP_REASONS = {"stop": "stop_token", "length": "max_new_tokens"}  # OpenAI finish_reason -> ours
SOURCES_NOTE = ("sources: the parts whose wording the answer repeats (a remote server gives no attention evidence, "
                "from which the local engine cites)")
# How servers word a refusal of a request longer than their context, and where they put the context length.
CONTEXT_WORDS = re.compile(r"context|too long|maximum .*length|max_model_len|n_ctx", re.IGNORECASE)
CONTEXT_LIMIT = re.compile(r"(?:maximum context length is|context window of|context length of|max_model_len"
                           r"|n_ctx)\D{0,20}?(\d+)", re.IGNORECASE)


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


class OpenAIClient:
    """Blocking calls to an OpenAI-compatible server, safe to use from several threads. Failures come out as
    RemoteError, InputError (wrong model) or ContextTooLong, after retries where another try can help. Once a
    request has spent its retries on connection errors the server is taken for gone: later calls fail at once."""

    def __init__(self, address: ServerAddress, api_key: str | None, timeout: float, retries: int):
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.gone: str | None = None  # why the server is taken for gone
        self.answered = False  # some call succeeded: a later connection failure means the server stopped
        self._cancel = threading.Event()
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Stop every call: waits end, open connections are shut so blocked reads return."""
        self._cancel.set()
        with self._lock:
            for conn in self._open:
                if conn.sock is not None:
                    try:
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    # -- the API -------------------------------------------------------------------------------------------------

    def models(self) -> list[dict]:
        data = self._call(lambda: self._json("GET", self.address.api + "/models"))
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise RemoteError(f"{self.address} is not an OpenAI-compatible API (GET /models gave no model list); "
                              "give --base-url as the API root, e.g. http://localhost:8000/v1")
        return [m for m in data["data"] if isinstance(m, dict) and "id" in m]

    def props(self) -> dict | None:
        """llama.cpp's server settings (its context length among them); None where the server has no /props."""
        return self._call(lambda: self._json("GET", self.address.root + "/props", optional=True))

    def count_tokens(self, model: str, text: str) -> int | None:
        """Tokens in `text` by the server's tokenizer (vLLM and llama.cpp: /tokenize; llama-cpp-python:
        /extras/tokenize/count); None where it has neither."""
        body = {"model": model, "prompt": text, "content": text, "input": text, "add_special_tokens": False}
        for path in ("/tokenize", "/extras/tokenize/count"):
            data = self._call(lambda: self._json("POST", self.address.root + path, body, optional=True))
            if isinstance(data, dict):
                if isinstance(data.get("count"), int):
                    return data["count"]
                if isinstance(data.get("tokens"), list):
                    return len(data["tokens"])
        return None

    def chat(self, model: str, messages: list[dict], max_tokens: int, sampling: dict) -> Completion:
        """sampling: the request's sampling fields (`sampling_fields`)."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, **sampling,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            return self._call(lambda: self._stream(body))
        except _EmptyStream:
            # llama-cpp-python's server reports a failure inside a stream by ending it empty, after status 200
            # (a prompt longer than its context, say); asked again without streaming, it answers with the error.
            unstreamed = {key: value for key, value in body.items() if key != "stream_options"} | {"stream": False}
            return self._call(lambda: self._complete(unstreamed))

    # -- transport -----------------------------------------------------------------------------------------------

    def _call(self, attempt: Callable):
        """`attempt()`, tried again after a _Retry, with backoff; the server is taken for gone when connection
        errors outlast the retries."""
        for tries in range(self.retries + 1):
            if self.gone:
                raise RemoteError(self.gone)
            if self._cancel.is_set():
                raise _Cancelled()
            try:
                result = attempt()
                self.answered = True
                return result
            except _Retry as e:
                if tries == self.retries:
                    if not e.connection:
                        retried = f"{self.retries} retr{'y' if self.retries == 1 else 'ies'}"
                        raise RemoteError(f"{e}, after {retried}; try again later or lower --max-concurrency") \
                            from None
                    self.gone = (f"the server at {self.address} stopped answering ({e})" if self.answered else
                                 f"cannot reach the server at {self.address} ({e}); check --base-url and that the "
                                 "server is running")
                    raise RemoteError(self.gone) from None
                wait = e.after if e.after is not None else min(BACKOFF_CAP, BACKOFF_SECONDS * 2 ** tries)
                if self._cancel.wait(wait):
                    raise _Cancelled() from None
        raise AssertionError("the loop returns or raises")

    @contextlib.contextmanager
    def _request(self, method: str, path: str, body: dict | None) -> Iterator[http.client.HTTPResponse]:
        """The response to one HTTP request. Connection failures come out as _Retry (or _Cancelled after
        cancel()), a silent server as RemoteError; the connection is closed on the way out."""
        kind = http.client.HTTPSConnection if self.address.https else http.client.HTTPConnection
        conn = kind(self.address.host, self.address.port, timeout=self.timeout)
        headers = {"Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        with self._lock:
            self._open.add(conn)
        try:
            conn.request(method, path, body=payload, headers=headers)
            yield conn.getresponse()
        except TimeoutError:
            raise RemoteError(f"the server at {self.address} sent nothing for {self.timeout:g}s (--timeout)") from None
        except socket.gaierror as e:
            raise RemoteError(f"cannot find the host of --base-url {self.address} ({e.strerror})") from None
        except (OSError, http.client.HTTPException) as e:
            if self._cancel.is_set():
                raise _Cancelled() from None
            raise _Retry(getattr(e, "strerror", None) or str(e) or type(e).__name__, connection=True) from None
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _json(self, method: str, path: str, body: dict | None = None, optional: bool = False) -> dict | None:
        """The JSON answer. An optional endpoint that the server does not have (404, 405) or that takes other
        arguments (400, 422) gives None; errors that matter (auth, busy, unreachable) raise."""
        with self._request(method, path, body) as response:
            raw = response.read()
        if optional and response.status in (400, 404, 405, 422):
            return None
        if response.status != 200:
            error = _http_error(response, raw, self.api_key, body.get("model") if body else None)
            if response.status == 404 and type(error) is RemoteError:  # no such endpoint
                raise RemoteError(f"{self.address} has no {path} (404); give --base-url as the API root, e.g. "
                                  "http://localhost:8000/v1")
            raise error
        try:
            return json.loads(raw)
        except ValueError:
            raise RemoteError(f"the server's answer to {method} {path} is not JSON: {raw[:80]!r}") from None

    def _stream(self, body: dict) -> Completion:
        """One streamed chat completion: the `data:` lines of its server-sent events, to the end."""
        t0 = time.perf_counter()
        pieces: list[str] = []
        finish = ""
        usage: dict = {}
        first = None
        received = False
        with self._request("POST", self.address.api + "/chat/completions", body) as response:
            if response.status != 200:
                raise _http_error(response, response.read(), self.api_key, model=body["model"])
            while line := response.readline():
                if self._cancel.is_set():
                    raise _Cancelled()
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, ": ping" comments, event names
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise RemoteError(f"the server sent a stream line that is not JSON: {data[:80]!r}") from None
                received = True
                if "error" in chunk:
                    raise _error_from_message(_message_of(chunk), 0, self.api_key, body["model"])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if piece := (choice.get("delta") or {}).get("content"):
                        pieces.append(piece)
                        if first is None:
                            first = time.perf_counter() - t0
                    finish = choice.get("finish_reason") or finish
        if not finish:
            if not received:
                raise _EmptyStream()
            # Cut short: llama-cpp-python's server does it to the request it streams when another one arrives.
            raise _Retry("the server ended an answer before its end", connection=False)
        seconds = time.perf_counter() - t0
        return Completion("".join(pieces), finish, usage.get("prompt_tokens"),
                          usage.get("completion_tokens") or len(pieces), first if first is not None else seconds,
                          seconds)

    def _complete(self, body: dict) -> Completion:
        """One chat completion, not streamed."""
        t0 = time.perf_counter()
        data = self._json("POST", self.address.api + "/chat/completions", body)
        choice = (data.get("choices") or [{}])[0]
        usage = data.get("usage") or {}
        text = (choice.get("message") or {}).get("content") or ""
        seconds = time.perf_counter() - t0
        return Completion(text, choice.get("finish_reason") or "", usage.get("prompt_tokens"),
                          usage.get("completion_tokens") or 0, seconds, seconds)


def _message_of(data) -> str:
    """The error text of an OpenAI-style ({"error": {"message"}}), vLLM ({"message"}) or FastAPI ({"detail"})
    error body."""
    if isinstance(data, dict):
        for key in ("error", "message", "detail"):
            if key in data:
                inner = data[key]
                return _message_of(inner) if isinstance(inner, (dict, list)) else str(inner)
        return json.dumps(data)[:300]
    if isinstance(data, list) and data:
        return _message_of(data[0])
    return str(data)


def _http_error(response: http.client.HTTPResponse, raw: bytes, api_key: str | None, model: str | None = None):
    """The exception for a non-200 answer."""
    try:
        data = json.loads(raw)
    except ValueError:
        data = raw.decode("utf-8", "replace").strip()[:300]
    message = _message_of(data)
    if response.status in RETRY_STATUSES:
        after = response.getheader("Retry-After")
        return _Retry(f"the server answered {response.status} ({message})", connection=False,
                      after=float(after) if after and after.replace(".", "", 1).isdigit() else None)
    limit = data.get("n_ctx") if isinstance(data, dict) else None  # llama.cpp's server puts it beside the message
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        limit = data["error"].get("n_ctx", limit)
    return _error_from_message(message, response.status, api_key, model, limit if isinstance(limit, int) else None)


def _error_from_message(message: str, status: int, api_key: str | None, model: str | None,
                        limit: int | None = None) -> Exception:
    one_line = " ".join(message.split())[:300]
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
            limit = int(match.group(1))
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
        if isinstance(entry.get(key), int):
            return ServerModel(name, entry[key], "the server's /models")
    props = client.props() or {}
    settings = props.get("default_generation_settings") or {}
    context = settings.get("n_ctx", props.get("n_ctx"))
    if isinstance(context, int):
        return ServerModel(name, context, "the server's /props")
    return ServerModel(name, None, "")


class OpenAIBackend:
    """The jobs' `Backend` on an OpenAI-compatible server at `base_url` (its API root, e.g.
    http://localhost:8000/v1). Up to `max_concurrency` requests in flight; `timeout`: seconds to wait for the
    server's next bytes; `retries` after a connection error or a busy server; `context_length` where the server does
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
                               notes=[f"single pass: {self.context_note(document_tokens)}", SOURCES_NOTE])
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
                               notes=[SOURCES_NOTE])
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
