"""--backend openai against a hostile server: one that never ends an answer (pings, trickled bytes, an endless line
or body), asks for endless waits, streams past max_tokens, or answers JSON of the wrong shape. Each ends within the
--timeout with a one-line RemoteError, or keeps what was asked for; the parsers of the server's answers are fuzzed.

The server here is written on raw sockets (a library server would refuse to misbehave this way).
"""

from __future__ import annotations

import itertools
import json
import math
import socket
import threading
import time
from typing import Callable, Iterable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexpool import remote
from indexpool.console import InputError
from indexpool.ingest import Document, Part
from indexpool.jobs import ContextTooLong, answer_requests, ask_request
from indexpool.remote import (MAX_BODY_BYTES, MAX_LINE_BYTES, RUNAWAY_NOTE, Completion, OpenAIBackend, OpenAIClient,
                              RemoteError, ServerAddress, StreamedCompletion, _Cancelled, _http_error, _Retry,
                              parse_completion, parse_models, sampling_fields)
from test_cli import assert_error, indexpool

GREEDY = sampling_fields(0.0, 1.0, 0, None)
SLOW = 10.0  # seconds: a generous bound on what must end at once or by a deadline of a second or two
Pieces = Iterable["bytes | float"]  # what the server writes: bytes, or a pause (seconds)


def response(status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    head = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    lines = [f"HTTP/1.1 {status} Whatever"] + [f"{name}: {value}" for name, value in head.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
UNSIZED_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"  # ends at close


def event(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def piece(text: str, finish: str | None = None) -> bytes:
    return event({"choices": [{"delta": {"content": text}, "finish_reason": finish}]})


def forever(*pieces: bytes | float) -> Iterator[bytes | float]:
    return itertools.cycle(pieces)


MODELS = response(200, json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode())


class Hostile:
    """A loopback server: GET /v1/models answers `models`, GET /props `props` (404 when None), POST
    /v1/chat/completions `chat(request body)`, anything else 404. An answer's pieces are written as they come, until
    they end or the client hangs up."""

    def __init__(self, chat: Callable[[dict], Pieces], models: Pieces = (MODELS,), props: Pieces | None = None):
        self.chat = chat
        self.models = models
        self.props = props
        self.chats = 0
        self.hung_up = threading.Event()  # a client closed the connection before the end of an answer
        self.closed = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def handle(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as reader:
            method, path, _ = reader.readline().decode().split(" ", 2)
            length = 0
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            body = reader.read(length)
            if method == "GET" and path == "/v1/models":
                pieces = self.models
            elif method == "GET" and path == "/props" and self.props is not None:
                pieces = self.props
            elif method == "POST" and path == "/v1/chat/completions":
                self.chats += 1
                pieces = self.chat(json.loads(body))
            else:
                pieces = [response(404, b'{"detail": "Not Found"}')]
            try:
                for item in pieces:
                    if self.closed.is_set():
                        return
                    if isinstance(item, float):
                        self.closed.wait(item)
                    else:
                        conn.sendall(item)
            except OSError:
                self.hung_up.set()

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def serve():
    servers: list[Hostile] = []

    def start(chat: Callable[[dict], Pieces], models: Pieces = (MODELS,), props: Pieces | None = None) -> Hostile:
        servers.append(Hostile(chat, models, props))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def client(server: Hostile, timeout: float = 30.0, retries: int = 0) -> OpenAIClient:
    return OpenAIClient(ServerAddress.parse(server.url), None, timeout, retries)


def chat(server: Hostile, max_tokens: int = 8, **options) -> Completion:
    return client(server, **options).chat("m", [{"role": "user", "content": "q"}], max_tokens, GREEDY)


def fails(call: Callable[[], object]) -> tuple[str, float]:
    """The one-line message of the RemoteError `call` raises, and the seconds it took."""
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        call()
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and len(message) < 600, message
    return message, time.monotonic() - t0


def timed_out(server: Hostile, timeout: float) -> str:
    return (f"no complete answer from the server at {server.url} within --timeout ({timeout:g}s for the whole "
            "request, retries included); raise --timeout if the server is only slow")


# -- the timeout is a deadline for the whole request ------------------------------------------------------------------


ENDLESS = {  # answers that never end, though bytes keep coming
    "pings": lambda body: itertools.chain([STREAM_HEAD], forever(b": ping\n\n", 0.05)),
    "a trickled line": lambda body: itertools.chain([STREAM_HEAD, b"data: {"], forever(b" ", 0.05)),
    "trickled headers": lambda body: itertools.chain([b"HTTP/1.1 200 OK\r\nX-Slow: "], forever(b"z", 0.05)),
    "a trickled body": lambda body: itertools.chain([UNSIZED_HEAD], forever(b" ", 0.05)),
    "text then pings": lambda body: itertools.chain([STREAM_HEAD, piece("a")], forever(b": ping\n\n", 0.05)),
}


@pytest.mark.parametrize("answer", ENDLESS.values(), ids=ENDLESS.keys())
def test_an_answer_that_never_ends_stops_at_the_timeout(serve, answer):
    server = serve(answer)
    message, seconds = fails(lambda: chat(server, timeout=0.3))
    assert message == timed_out(server, 0.3)
    assert seconds < SLOW


def test_cancel_ends_a_read_of_an_answer_that_lasts_until_the_server_closes(serve):
    """http.client lets go of the socket of such an answer: cancel() (Ctrl-C) must still reach it."""
    server = serve(ENDLESS["pings"])
    caller = client(server, timeout=60.0)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            caller.chat("m", [{"role": "user", "content": "q"}], 8, GREEDY)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    t0 = time.monotonic()
    while not server.chats and time.monotonic() - t0 < SLOW:
        time.sleep(0.01)
    time.sleep(0.1)  # into the read, mostly: a cancel before it ends the call the same way
    caller.cancel()
    thread.join(SLOW)
    assert not thread.is_alive() and [type(e) for e in outcome] == [_Cancelled]


def test_a_long_retry_after_fails_at_once_instead_of_sleeping(serve):
    server = serve(lambda body: [response(503, b'{"error": {"message": "overloaded"}}', {"Retry-After": "99999"})])
    message, seconds = fails(lambda: chat(server, timeout=30.0, retries=3))
    assert message == ("the server answered 503 (overloaded), and a retry in 99999s (the server's Retry-After) would "
                       "pass --timeout (30s for the whole request): try again later or raise --timeout")
    assert seconds < SLOW and server.chats == 1


def test_retries_and_their_waits_stop_at_the_deadline(serve):
    server = serve(lambda body: [response(503, b'{"error": {"message": "overloaded"}}')])  # backoff 0.5s, 1s, 2s...
    message, seconds = fails(lambda: chat(server, timeout=0.8, retries=20))
    assert message.startswith("the server answered 503 (overloaded), and a retry in ")
    assert message.endswith("s would pass --timeout (0.8s for the whole request): try again later or raise --timeout")
    assert seconds < SLOW and 1 <= server.chats <= 3  # not the 21 tries the retries allow


def test_a_retry_after_that_is_not_seconds_is_left_to_the_backoff(serve, monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_SECONDS", 0.01)
    answers = iter([response(503, b"busy", {"Retry-After": "\u00b2"}), response(503, b"busy", {"Retry-After": "inf"}),
                    STREAM_HEAD + piece("ok", "stop")])
    server = serve(lambda body: [next(answers)])
    assert chat(server, retries=2).text == "ok" and server.chats == 3


# -- an answer far past max_tokens ----------------------------------------------------------------------------------


def test_a_stream_past_max_tokens_keeps_what_was_asked_for_and_hangs_up(serve):
    server = serve(lambda body: itertools.chain([STREAM_HEAD], forever(piece("word "))))
    done = chat(server, max_tokens=8)
    assert done.runaway and done.finish_reason == "length" and done.completion_tokens == 8
    assert done.text == ("word " * 8)[:24]  # 3 characters a token: no more than 8 tokens of it
    assert server.hung_up.wait(SLOW)


def test_one_event_of_far_too_many_characters_is_cut(serve):
    server = serve(lambda body: [STREAM_HEAD, piece("y" * 300_000), b"data: [DONE]\n\n"])
    done = chat(server, max_tokens=8)
    assert done.runaway and done.text == "y" * 24 and done.finish_reason == "length"


def test_long_tokens_within_max_tokens_are_kept_whole(serve):
    """Tokens of 100 characters (runs of spaces in code), as many as asked for: not a runaway."""
    events = [piece(" " * 99 + str(i)) for i in range(8)]
    usage = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 8}})
    server = serve(lambda body: [STREAM_HEAD, *events, piece("", "length"), usage, b"data: [DONE]\n\n"])
    done = chat(server, max_tokens=8)
    assert not done.runaway and len(done.text) == 800 and done.text.endswith("7")
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", 5, 8)


def test_an_unstreamed_answer_past_max_tokens_is_cut():
    raw = json.dumps({"choices": [{"message": {"content": "q" * 5000}, "finish_reason": "stop"}]}).encode()
    done = parse_completion(raw, 8, 0.5)
    assert done.runaway and done.text == "q" * 24 and done.finish_reason == "length" and done.completion_tokens == 8
    kept = parse_completion(raw, 100, 0.5)
    assert not kept.runaway and len(kept.text) == 5000 and kept.finish_reason == "stop"


def test_a_runaway_answer_is_noted_in_the_result(serve):
    server = serve(lambda body: itertools.chain([STREAM_HEAD], forever(piece("on and on "))))
    document = Document([Part("The harbour opens at six.", "a.txt", "a.txt:1")], [], [])
    (result,) = answer_requests(OpenAIBackend(server.url, GREEDY), document, [ask_request("When?")], 10,
                                on_result=lambda i, r: None)
    assert result.stop_reason == "max_new_tokens" and len(result.text) == 30
    assert RUNAWAY_NOTE in result.notes


# -- endless lines and bodies ---------------------------------------------------------------------------------------


def test_an_endless_stream_line_is_refused(serve):
    server = serve(lambda body: itertools.chain([STREAM_HEAD, b"data: "], forever(b"a" * 65536)))
    message, seconds = fails(lambda: chat(server))
    assert message.startswith(f"the server streamed a line longer than {MAX_LINE_BYTES >> 10} KiB; check that "
                              "--base-url")
    assert seconds < SLOW and server.hung_up.wait(SLOW)


def test_an_endless_stream_of_comments_is_refused(serve):
    server = serve(lambda body: itertools.chain([STREAM_HEAD], forever(b": " + b"p" * 4094 + b"\n")))
    message, seconds = fails(lambda: chat(server))
    assert message.startswith(f"the server streamed more than {MAX_BODY_BYTES >> 20} MiB for one answer; check that")
    assert seconds < SLOW


def test_an_endless_body_is_refused(serve):
    server = serve(lambda body: [], models=itertools.chain([UNSIZED_HEAD], forever(b" " * 65536)))
    message, seconds = fails(client(server).models)
    assert message.startswith(f"the server's answer to GET /v1/models is longer than {MAX_BODY_BYTES >> 20} MiB; "
                              "check that --base-url")
    assert seconds < SLOW


def test_an_endless_error_body_gives_its_start(serve):
    head = b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n"
    server = serve(lambda body: itertools.chain([head, b"no good "], forever(b"e" * 65536)))
    message, seconds = fails(lambda: chat(server))
    assert message.startswith("the server answered 400: no good eee") and seconds < SLOW


NOT_HTTP = {
    "an endless status line": (lambda body: forever(b"H" * 65536), "got more than 65536 bytes"),
    "endless headers": (lambda body: itertools.chain([b"HTTP/1.1 200 OK\r\n"], forever(b"X-A: b\r\n")),
                        "got more than 100 headers"),
    "another protocol": (lambda body: [b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], "SSH-2.0-OpenSSH_9.6"),
}


@pytest.mark.parametrize("answer, why", NOT_HTTP.values(), ids=NOT_HTTP.keys())
def test_an_answer_that_is_not_http_is_refused(serve, answer, why):
    server = serve(answer)
    message, seconds = fails(lambda: chat(server, retries=2))
    assert message.startswith(f"the server at {server.url} does not answer in HTTP (") and why in message
    assert message.endswith("check that --base-url is the API root of an OpenAI-compatible server, e.g. "
                            "http://localhost:8000/v1")
    assert seconds < SLOW and server.chats == 1  # not retried: another try gives the same


# -- answers of the wrong shape -------------------------------------------------------------------------------------


COMPLETIONS = {  # an unstreamed answer -> why it is malformed
    b"<html>busy</html>": "not JSON",
    b"[]": "the answer is a list",
    b"{}": 'no "choices"',
    b'{"choices": "abc"}': '"choices" is a string',
    b'{"choices": [7]}': "a choice is a number",
    b'{"choices": [{"message": null}]}': '"message" is null',
    b'{"choices": [{"message": {"content": 5}}]}': '"content" is a number',
    b'{"choices": [{"message": {"content": "a"}, "finish_reason": ["stop"]}]}': '"finish_reason" is a list',
    b'{"choices": [{"message": {"content": "a"}}], "usage": [1]}': '"usage" is a list',
    b'{"choices": [{"message": {"content": "a"}}], "usage": {"prompt_tokens": "12"}}': '"prompt_tokens" is a string',
    b'{"choices": [{"message": {"content": "a"}}], "usage": {"completion_tokens": true}}':
        '"completion_tokens" is true/false',
    b'{"choices": [{"message": {"content": "a"}}], "usage": {"completion_tokens": -3}}':
        'a token count in "usage" is negative',
    b"[" * 100_000: "not JSON",  # nested deeper than the parser goes
}

EVENTS = {  # one event of a stream -> why it is malformed
    b"data: {not json": "not JSON",
    b"data: [1, 2]": "an event is a list",
    b'data: "text"': "an event is a string",
    b'data: {"choices": {"delta": {}}}': '"choices" is an object',
    b'data: {"choices": [null]}': "a choice is null",
    b'data: {"choices": [{"delta": ["a"]}]}': '"delta" is a list',
    b'data: {"choices": [{"delta": {"content": 3.5}}]}': '"content" is a number',
    b'data: {"choices": [], "usage": {"prompt_tokens": {}}}': '"prompt_tokens" is an object',
}

MODEL_LISTS = {
    b"<html>": "not JSON",
    b"[]": "the answer is a list",
    b'{"object": "list"}': 'no "data" list',
    b'{"data": {"id": "m"}}': '"data" is an object',
}


def malformed(what: str, why: str, message: str) -> None:
    assert message.startswith(f"the server's answer to {what} is malformed ({why}"), message
    assert message.endswith("; check that --base-url is the API root of an OpenAI-compatible server, e.g. "
                            "http://localhost:8000/v1"), message


@pytest.mark.parametrize("raw, why", COMPLETIONS.items(), ids=[repr(raw[:30]) for raw in COMPLETIONS])
def test_a_malformed_completion_is_a_one_line_error(raw, why):
    message, _ = fails(lambda: parse_completion(raw, 16, 0.1))
    malformed("POST /chat/completions", why, message)


@pytest.mark.parametrize("line, why", EVENTS.items(), ids=[repr(line) for line in EVENTS])
def test_a_malformed_stream_event_is_a_one_line_error(line, why):
    events = StreamedCompletion(16)
    assert events.feed(piece("fine")) is True
    message, _ = fails(lambda: events.feed(line))
    malformed("POST /chat/completions (an event of its stream)", why, message)


@pytest.mark.parametrize("raw, why", MODEL_LISTS.items(), ids=[repr(raw) for raw in MODEL_LISTS])
def test_a_malformed_model_list_is_a_one_line_error(raw, why):
    message, _ = fails(lambda: parse_models(raw))
    malformed("GET /models", why, message)


def test_a_malformed_answer_is_quoted_briefly():
    message, _ = fails(lambda: parse_completion(b'{"choices": "' + b"x\n" * 1_000_000 + b'"}', 16, 0.1))
    assert "'{\"choices\": \"x\\nx\\nx" in message and len(message) < 400


def test_models_of_no_usable_kind_are_left_out():
    raw = json.dumps({"data": [{"id": 7}, "m", {"name": "x"}, {"id": "real", "max_model_len": True}]}).encode()
    assert parse_models(raw) == [{"id": "real", "max_model_len": True}]


def test_a_server_of_the_wrong_shape_ends_in_one_line_through_the_client(serve):
    """The parsers are the client's: a model list, a stream event, and the unstreamed answer asked for after an
    empty stream."""
    shapes = serve(lambda body: [STREAM_HEAD, b"data: [7]\n\n"], models=[response(200, b'{"data": {}}')])
    message, _ = fails(client(shapes).models)
    malformed("GET /models", '"data" is an object', message)
    message, _ = fails(lambda: chat(shapes))
    malformed("POST /chat/completions (an event of its stream)", "an event is a list", message)
    unstreamed = serve(lambda body: [STREAM_HEAD] if body["stream"] else
                       [response(200, b'{"choices": [{"message": null}]}')])
    message, _ = fails(lambda: chat(unstreamed))
    malformed("POST /chat/completions", '"message" is null', message)


@pytest.mark.parametrize("props, context", [(b"[512]", None), (b'{"n_ctx": false}', None), (b"<html>", None),
                                            (b'{"default_generation_settings": [1], "n_ctx": 512}', 512)])
def test_a_context_length_that_is_not_a_count_is_not_taken(serve, props, context):
    """A model list's true or negative context length, and a /props of the wrong shape, leave the context unknown
    (the server's refusal teaches it)."""
    listing = json.dumps({"data": [{"id": "m", "max_model_len": True, "context_length": -5}]}).encode()
    server = serve(lambda body: [], models=[response(200, listing)], props=[response(200, props)])
    assert OpenAIBackend(server.url, GREEDY).model.context == context


# -- fuzzing: whatever the bytes, a result or a one-line error ------------------------------------------------------


KEYS = ["choices", "delta", "message", "content", "finish_reason", "usage", "prompt_tokens", "completion_tokens",
        "error", "detail", "data", "id", "n_ctx", "max_model_len"]
scalars = (st.none() | st.booleans() | st.integers(-2, 2) | st.integers(-2 ** 70, 2 ** 70) | st.floats()
           | st.text(max_size=12) | st.sampled_from(["stop", "length", "the maximum context length is 512 tokens"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), inner, max_size=4),
                           max_leaves=12)


def some(**fields) -> st.SearchStrategy:
    """Objects with some of these fields, or any JSON value in their place."""
    return st.fixed_dictionaries({}, optional=fields) | json_values


def listed(items: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(items, max_size=3) | json_values


usage = some(prompt_tokens=scalars, completion_tokens=scalars)
shapes = {  # near the answers the parsers expect, each part of it possibly of the wrong kind
    "completion": some(choices=listed(some(message=some(content=scalars), finish_reason=scalars)), usage=usage,
                       error=scalars),
    "event": some(choices=listed(some(delta=some(content=scalars), finish_reason=scalars)), usage=usage,
                  error=scalars),
    "models": some(data=listed(some(id=scalars, max_model_len=scalars))),
    "error": some(error=some(message=scalars, n_ctx=scalars), message=scalars, detail=listed(some(msg=scalars)),
                  n_ctx=scalars),
}


def answers(shape: str) -> st.SearchStrategy:
    """The bytes of a server's answer: JSON near the shape, the same with a few bytes changed, or any bytes."""
    encoded = shapes[shape].map(lambda value: json.dumps(value).encode())
    mutated = st.builds(lambda raw, at, junk: raw[:at] + junk + raw[at + 1:], encoded, st.integers(0, 60),
                        st.binary(max_size=3))
    return st.one_of(encoded, encoded, mutated, st.binary(max_size=80))


FUZZ = settings(max_examples=60, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def clean(error: Exception) -> None:
    """A failure the command line reports as it should: a RemoteError, or an InputError (a refusal naming the
    context, ContextTooLong, or the model), on one short line."""
    assert isinstance(error, (RemoteError, InputError)), repr(error)
    message = str(error)
    assert message and len(message.splitlines()) == 1 and len(message) < 1500, message


def well_formed(done: Completion, max_tokens: int) -> None:
    assert isinstance(done.text, str) and isinstance(done.finish_reason, str)
    assert done.prompt_tokens is None or (type(done.prompt_tokens) is int and done.prompt_tokens >= 0)
    assert type(done.completion_tokens) is int and done.completion_tokens >= 0
    assert len(done.text) <= 128 * max_tokens + 1024


@FUZZ
@given(answers("completion"), st.integers(1, 64))
def test_fuzz_unstreamed_completions(raw, max_tokens):
    try:
        done = parse_completion(raw, max_tokens, 0.1)
    except Exception as e:
        clean(e)
    else:
        well_formed(done, max_tokens)


@FUZZ
@given(st.lists(answers("event").map(lambda raw: b"data: " + raw) | st.sampled_from([b"data: [DONE]", b": ping", b""])
                | st.binary(max_size=40), max_size=6), st.integers(1, 64))
def test_fuzz_streams(lines, max_tokens):
    events = StreamedCompletion(max_tokens)
    try:
        for line in lines:
            if not events.feed(line):
                break
    except Exception as e:
        clean(e)
    else:
        well_formed(events.completion(0.1, 0.2), max_tokens)


@FUZZ
@given(answers("models"))
def test_fuzz_model_lists(raw):
    try:
        models = parse_models(raw)
    except Exception as e:
        clean(e)
    else:
        assert all(isinstance(m, dict) and isinstance(m["id"], str) for m in models)


@FUZZ
@given(st.sampled_from([400, 401, 403, 404, 413, 422, 429, 500, 502, 503]) | st.integers(100, 999), answers("error"),
       st.none() | st.text(st.characters(max_codepoint=255), max_size=12), st.none() | st.just("key"),
       st.none() | st.just("m"))
def test_fuzz_error_answers(status, raw, retry_after, api_key, model):
    error = _http_error(status, raw, retry_after, api_key, model)
    if isinstance(error, _Retry):
        assert len(str(error).splitlines()) == 1
        assert error.after is None or (math.isfinite(error.after) and error.after >= 0)
    else:
        clean(error)
        if isinstance(error, ContextTooLong):
            assert error.limit is None or (type(error.limit) is int and error.limit >= 1)


# -- the command line -----------------------------------------------------------------------------------------------


CLI_CASES = {  # a server -> what the one line says
    "pings": (ENDLESS["pings"], (MODELS,), "no complete answer from the server at"),
    "retry-after": (lambda body: [response(503, b"{}", {"Retry-After": "99999"})], (MODELS,),
                    "(the server's Retry-After) would pass --timeout"),
    "endless line": (lambda body: itertools.chain([STREAM_HEAD, b"data: "], forever(b"a" * 65536)), (MODELS,),
                     "the server streamed a line longer than"),
    "model list": (lambda body: [], [response(200, b'{"data": "m"}')], "the server's answer to GET /models is "
                   "malformed"),
    "stream event": (lambda body: [STREAM_HEAD, b'data: {"choices": [{"delta": {"content": 1}}]}\n\n'], (MODELS,),
                     "the server's answer to POST /chat/completions (an event of its stream) is malformed"),
}


@pytest.mark.parametrize("chat_answer, models, says", CLI_CASES.values(), ids=CLI_CASES.keys())
def test_cli_a_hostile_server_is_one_line_and_exit_1(serve, tmp_path, chat_answer, models, says):
    server = serve(chat_answer, models)
    document = tmp_path / "doc.txt"
    document.write_text("The harbour opens at six.\n")
    t0 = time.monotonic()
    line = assert_error(indexpool("ask", str(document), "When does it open?", "--backend", "openai", "--base-url",
                                  server.url, "--timeout", "0.5", "--cache-dir", str(tmp_path / "cache")), 1)
    assert says in line and time.monotonic() - t0 < SLOW
