"""--backend openai: the document jobs on an OpenAI-compatible server.

The server is llama-cpp-python's (`python -m llama_cpp.server`), started here on a free loopback port with the
default model, as a user would run it: ask, summarize and --json through it, hierarchical reading when the document
does not fit, a bounded load test, the server killed mid-run, and every error with its one-line message. A few
client behaviours that a healthy llama.cpp server never shows (busy answers, silence) are checked against a stub
server written here.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib.util
import io
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from indexpool.console import InputError
from indexpool.ingest import Document, Part, load_document
from indexpool.jobs import (DOCUMENT_MARK, ContextTooLong, JobResult, ResultCache, answer_requests, ask_request,
                            plain_request, rank_sources, request_messages, summary_request)
from indexpool.remote import OpenAIBackend, OpenAIClient, RemoteError, ServerAddress, sampling_fields
from indexpool.retrieval import LexicalIndex
from doc_fixtures import write_planted_report
from test_cli import assert_error, cli_env, indexpool, ok

FACT = "The access code of the glass tower is 41729."
QUESTION = "What is the access code of the glass tower?"
API_KEY = "loopback-test-key"
SERVER_START_SECONDS = 180
LLAMA_CPP_MISSING = importlib.util.find_spec("llama_cpp") is None
needs_llama_cpp = pytest.mark.skipif(LLAMA_CPP_MISSING, reason="llama-cpp-python[server] is not installed: "
                                     "`make setup` installs it (the test server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-cpp-python's OpenAI-compatible server on the default model, on a free loopback port."""

    def __init__(self, log_dir: Path, n_ctx: int, api_key: str = API_KEY):
        from indexpool.model.default_model import default_model_path

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.api_key = api_key
        self.log = log_dir / f"llama-server-{self.port}.log"
        # One thread: the machine's other core belongs to the test runner. A new request must not cut the one
        # being streamed (the server's default), or concurrent requests would keep ending each other.
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(default_model_path()),
                   "--host", "127.0.0.1", "--port", str(self.port), "--n_ctx", str(n_ctx), "--n_threads", "1",
                   "--n_threads_batch", "1", "--interrupt_requests", "False", "--api_key", api_key]
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the test server exited ({self.process.returncode}):\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {self.api_key}"})
                if conn.getresponse().status == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the test server did not answer within {SERVER_START_SECONDS}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        """Die as a crashed server does: no goodbye to the open connections."""
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def serve(tmp_path_factory, name: str, n_ctx: int):
    if LLAMA_CPP_MISSING:
        pytest.skip("llama-cpp-python[server] is not installed: `make setup` installs it (the test server)")
    running = LlamaServer(tmp_path_factory.mktemp(name), n_ctx=n_ctx)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, "server", 2048)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """A server whose context (512 tokens) the document does not fit."""
    yield from serve(tmp_path_factory, "small-server", 512)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """About 800 tokens of prose with the fact in the middle."""
    return write_planted_report(tmp_path_factory.mktemp("docs"), FACT, topics=3, lines=70)


@pytest.fixture(scope="module")
def document(report) -> Document:
    return load_document([str(report)])


def fact_cite(document: Document) -> str:
    """Where the planted fact is: the cite of the part holding it."""
    (cite,) = [part.cite for part in document.parts if FACT in part.text]
    return cite


GREEDY = sampling_fields(0.0, 1.0, 0, None)


def backend(url: str, sampling: dict = GREEDY, **options) -> OpenAIBackend:
    return OpenAIBackend(url, sampling, **options)


def remote(server: LlamaServer, **options) -> OpenAIBackend:
    return backend(server.url, api_key=server.api_key, **options)


def run(document: Document, requests: list[str], server: OpenAIBackend, max_new_tokens: int = 24,
        kind: str = "ask") -> tuple[list[JobResult], list[int]]:
    """The job's results (as `indexpool ask` / `summarize` run them), and the request indexes in the order
    on_result saw them."""
    seen: list[int] = []
    label = {"ask": "Answer from", "summarize": "Summary of"}[kind]
    results = answer_requests(server, document, requests, max_new_tokens, on_result=lambda i, _: seen.append(i),
                              label=label)
    return results, seen


class CountingChats:
    """Wraps OpenAIClient.chat: the user messages sent (their content), and the most requests in flight at once."""

    def __init__(self, monkeypatch):
        self.sent: list[str] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()
        chat = OpenAIClient.chat
        counter = self

        def counted(client, model, messages, max_tokens, sampling):
            with counter.lock:
                counter.sent.append(messages[-1]["content"])
                counter.in_flight += 1
                counter.most_in_flight = max(counter.most_in_flight, counter.in_flight)
            try:
                return chat(client, model, messages, max_tokens, sampling)
            finally:
                with counter.lock:
                    counter.in_flight -= 1

        monkeypatch.setattr(OpenAIClient, "chat", counted)


def server_token_count(server: LlamaServer, text: str) -> int:
    """Tokens in `text` by the server's own tokenizer (llama-cpp-python: /extras/tokenize/count)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/extras/tokenize/count", body=json.dumps({"input": text}),
                 headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())["count"]


# -- the jobs through a real server ----------------------------------------------------------------------------------


@needs_llama_cpp
def test_ask_answers_from_the_document_in_a_single_pass(server, document):
    results, seen = run(document, [ask_request(QUESTION)], remote(server))
    (result,) = results
    assert seen == [0]
    assert "41729" in result.text
    assert result.document_tokens == server_token_count(server, document.text)  # counted by the server
    assert 1 <= result.new_tokens <= 24 and result.stop_reason in ("stop_token", "max_new_tokens")
    assert [s["cite"] for s in result.sources][:1] == [fact_cite(document)]  # the part the answer quotes
    assert result.notes[0].startswith("single pass: the document's") and "counted by the server" in result.notes[0]
    assert any(note.startswith("sources: the parts whose wording") for note in result.notes)


@needs_llama_cpp
def test_summarize_through_the_server(server, document):
    (result,), _ = run(document, [summary_request("short", None)], remote(server), max_new_tokens=60,
                       kind="summarize")
    assert len(result.text.split()) >= 5
    assert result.new_tokens <= 60
    assert result.notes[0].startswith("single pass")


@needs_llama_cpp
def test_32_questions_at_concurrency_4_none_lost(server, document, monkeypatch):
    chats = CountingChats(monkeypatch)
    questions = [ask_request(f"{QUESTION} (Question {i + 1} of 32.)") for i in range(32)]
    results, seen = run(document, questions, remote(server, max_concurrency=4), max_new_tokens=4)
    assert seen == list(range(32))  # every result, in request order
    assert all(result.new_tokens >= 1 and result.text for result in results)
    local_prompts = [request_messages(plain_request(q))[-1]["content"].replace(DOCUMENT_MARK, document.text)
                     for q in questions]
    assert sorted(chats.sent) == sorted(local_prompts)  # each sent once, as the local engine reads it (no quote)
    assert chats.most_in_flight == 4


@needs_llama_cpp
def test_a_document_larger_than_the_context_is_read_in_sections(server, document, monkeypatch):
    chats = CountingChats(monkeypatch)
    context = 400
    (result,), _ = run(document, [ask_request(QUESTION)], remote(server, context_length=context))
    note = result.notes[0]
    assert note.startswith("hierarchical:") and f"context of {context}" in note and "(--context-length)" in note
    sections = int(note.split(" sections were answered")[0].rsplit(" ", 1)[1])
    assert sections >= 2 and len(chats.sent) == sections + 1 == int(note.split(" requests)")[0].rsplit(" ", 1)[1])
    for content in chats.sent:  # every request, with its answer, fits the context it was given
        assert server_token_count(server, content) + 24 <= context
    sent = "".join(chats.sent)
    assert all(line in sent for line in document.text.splitlines())  # no line left out (parts are cut at line ends)
    assert result.text


@needs_llama_cpp
def test_the_context_is_learned_from_the_servers_refusal(small_server, document):
    (result,), _ = run(document, [summary_request("short", None)], remote(small_server), max_new_tokens=40,
                       kind="summarize")
    assert result.notes[0].startswith("hierarchical:")
    assert "context of 512 (the server's refusal of the whole document)" in result.notes[0]
    assert result.text


@needs_llama_cpp
def test_a_context_too_small_for_sections_is_a_one_line_input_error(small_server, document):
    with pytest.raises(ContextTooLong) as caught:
        run(document, [ask_request(QUESTION)], remote(small_server), max_new_tokens=300)
    message = str(caught.value)
    assert isinstance(caught.value, InputError) and "\n" not in message
    assert "context of 512 tokens" in message and "--max-new-tokens 300" in message


@needs_llama_cpp
def test_a_server_killed_mid_run_gives_a_clean_error_and_keeps_completed_results(document, tmp_path):
    doomed = LlamaServer(tmp_path, n_ctx=2048)
    seen = []

    def kill_after_first(i, result):
        seen.append(i)
        doomed.kill()

    # One at a time, long answers after the first: none can finish between the first answer and the kill.
    requests = [ask_request(QUESTION)] + [summary_request("long", None)] * 5
    t0 = time.monotonic()
    try:
        with pytest.raises(RemoteError) as caught:
            answer_requests(remote(doomed, max_concurrency=1, retries=2), document, requests, 64,
                            on_result=kill_after_first)
    finally:
        doomed.stop()
    assert time.monotonic() - t0 < 60
    message = str(caught.value)
    assert "\n" not in message and f"the server at {doomed.url} stopped answering" in message
    assert seen == [0] and "5 of 6 requests failed; the other 1 completed" in message
    results = caught.value.results
    assert isinstance(results[0], JobResult) and results[0].text and results[1:] == [None] * 5


# -- errors ----------------------------------------------------------------------------------------------------------


def test_an_unreachable_server_is_a_one_line_error(document):
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RemoteError) as caught:
        run(document, [ask_request(QUESTION)], backend(url, retries=0))
    assert str(caught.value) == (f"cannot reach the server at {url} (Connection refused); check --base-url and "
                                 "that the server is running")


@needs_llama_cpp
def test_a_wrong_model_name_is_an_input_error_naming_the_served_model(server, document):
    with pytest.raises(InputError) as caught:
        run(document, [ask_request(QUESTION)], remote(server, model_name="no-such-model"))
    message = str(caught.value)
    assert "has no model 'no-such-model'" in message and "--model-name" in message and "\n" not in message
    served = OpenAIClient(ServerAddress.parse(server.url), server.api_key, 30, 0).models()
    assert repr(served[0]["id"]) in message


@needs_llama_cpp
@pytest.mark.parametrize("key, expected", [("wrong-key", "the server refused the API key (401"),
                                           (None, "the server wants an API key (401")])
def test_a_bad_or_missing_api_key_is_a_one_line_error(server, document, key, expected):
    with pytest.raises(RemoteError) as caught:
        run(document, [ask_request(QUESTION)], backend(server.url, api_key=key))
    assert str(caught.value).startswith(expected) and "--api-key" in str(caught.value)


# -- the command line -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_wired():
    if "--backend" not in indexpool("ask", "--help").stdout.decode():
        pytest.skip("`indexpool ask` has no --backend option yet (the lead wires the remote runner into the CLI)")


def remote_env(**extra: str) -> dict[str, str]:
    """The environment without any API key or server of the user's."""
    ours = ("INDEXPOOL_API_KEY", "OPENAI_API_KEY", "INDEXPOOL_BASE_URL")
    return {k: v for k, v in cli_env().items() if k not in ours} | extra


@needs_llama_cpp
def test_cli_ask_json_through_the_server(cli_wired, server, report):
    proc = indexpool("ask", str(report), QUESTION, "--question", "What is the glass tower's access code?",
                     "--backend", "openai", "--base-url", server.url, "--json", "--quiet", "-n", "24",
                     env=remote_env(INDEXPOOL_API_KEY=server.api_key))
    first, second = [json.loads(line) for line in ok(proc).splitlines()]
    assert QUESTION in first["request"] and "glass tower's access code" in second["request"]  # in order
    assert "41729" in first["text"]
    for result in (first, second):
        assert result["tokens"]["new"] >= 1 and result["notes"][0].startswith("single pass")
    assert first["sources"][0]["cite"] == fact_cite(load_document([str(report)]))


@needs_llama_cpp
def test_cli_summarize_through_the_server(cli_wired, server, report):
    out = ok(indexpool("summarize", str(report), "--length", "short", "--backend", "openai", "--base-url",
                       server.url, "--api-key", server.api_key, "-n", "60", env=remote_env()))
    assert len(out.split()) >= 5


def test_cli_unreachable_server_exits_1(cli_wired, report):
    url = f"http://127.0.0.1:{free_port()}/v1"
    line = assert_error(indexpool("ask", str(report), QUESTION, "--backend", "openai", "--base-url", url,
                                  "--retries", "0", env=remote_env()), 1)
    assert f"cannot reach the server at {url}" in line


@needs_llama_cpp
def test_cli_wrong_model_name_exits_3(cli_wired, server, report):
    line = assert_error(indexpool("ask", str(report), QUESTION, "--backend", "openai", "--base-url", server.url,
                                  "--api-key", server.api_key, "--model-name", "no-such-model", env=remote_env()), 3)
    assert "has no model 'no-such-model'" in line


@needs_llama_cpp
def test_cli_bad_api_key_exits_1(cli_wired, server, report):
    line = assert_error(indexpool("ask", str(report), QUESTION, "--backend", "openai", "--base-url", server.url,
                                  env=remote_env(OPENAI_API_KEY="wrong-key")), 1)
    assert "refused the API key (401" in line


def test_cli_openai_backend_without_a_url_is_a_usage_error(cli_wired, report):
    proc = indexpool("ask", str(report), QUESTION, "--backend", "openai", env=remote_env())
    assert proc.returncode == 2 and b"--base-url" in proc.stderr


# -- what a healthy llama.cpp server never does: busy answers, silence -----------------------------------------------


class StubServer:
    """A loopback server with one model ("stub", context 4096) whose chat endpoint answers 503 `busy` times, then
    streams "ok" (after `delay` seconds)."""

    def __init__(self, busy: int = 0, delay: float = 0.0):
        self.busy = busy
        self.chats = 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                    **(headers or {})}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.send_json(200, {"data": [{"id": "stub", "max_model_len": 4096}]})
                else:
                    self.send_json(404, {"detail": "Not Found"})

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/v1/chat/completions":
                    self.send_json(404, {"detail": "Not Found"})
                    return
                stub.chats += 1
                if stub.chats <= stub.busy:
                    self.send_json(503, {"error": {"message": "server busy"}}, {"Retry-After": "0"})
                    return
                time.sleep(delay)
                chunks = [{"choices": [{"delta": {"content": "ok"}, "finish_reason": None}]},
                          {"choices": [{"delta": {}, "finish_reason": "stop"}]}]
                data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address):
                pass  # a client that gave up (the timeout test) leaves a broken pipe behind: expected

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub_server(request):
    stub = StubServer(**request.param)
    yield stub
    stub.close()


@pytest.mark.parametrize("stub_server", [{"busy": 2}], indirect=True)
def test_busy_answers_are_retried(stub_server, document):
    (result,), _ = run(document, [ask_request(QUESTION)], backend(stub_server.url, retries=2))
    assert result.text == "ok" and stub_server.chats == 3
    assert "context of 4,096 (the server's /models)" in result.notes[0] and "estimated" in result.notes[0]


@pytest.mark.parametrize("stub_server", [{"busy": 2}], indirect=True)
def test_busy_answers_beyond_the_retries_are_an_error(stub_server, document):
    with pytest.raises(RemoteError) as caught:
        run(document, [ask_request(QUESTION)], backend(stub_server.url, retries=1))
    assert str(caught.value) == ("the server answered 503 (server busy), after 1 retry; try again later or lower "
                                 "--max-concurrency")
    assert stub_server.chats == 2


@pytest.mark.parametrize("stub_server", [{"delay": 3.0}], indirect=True)
def test_a_silent_server_times_out(stub_server, document):
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as caught:
        run(document, [ask_request(QUESTION)], backend(stub_server.url, timeout=0.5))
    assert str(caught.value) == (f"no complete answer from the server at {stub_server.url} within --timeout (0.5s "
                                 "for the whole request, retries included); raise --timeout if the server is only slow")
    assert time.monotonic() - t0 < 2.5


class RecordingStub(StubServer):
    """The stub server, keeping the JSON body of every chat request."""

    def __init__(self):
        super().__init__()
        self.bodies: list[dict] = []
        handler = self.httpd.RequestHandlerClass
        original = handler.do_POST
        stub = self

        def do_post(handler_self):
            length = int(handler_self.headers["Content-Length"])
            body = handler_self.rfile.read(length)
            if handler_self.path == "/v1/chat/completions":
                stub.bodies.append(json.loads(body))
            handler_self.rfile = io.BytesIO(body)  # read again by the stub's own handler
            original(handler_self)

        handler.do_POST = do_post


def test_sampling_options_reach_the_server_and_reproducible_results_are_kept(document, tmp_path):
    """temperature, top_p, top_k and seed go in the request; a greedy (or seeded) result is kept and the same request
    is answered from the cache, without a call; a sampled one without a seed is asked again."""
    stub = RecordingStub()
    try:
        results = ResultCache(tmp_path / "results")
        seen = []
        greedy = sampling_fields(0.0, 0.9, 20, 7)

        def ask(sampling):
            return answer_requests(backend(stub.url, sampling), document, [ask_request(QUESTION)], 16,
                                   on_result=lambda i, r: seen.append(r), results=results)[0]

        first = ask(greedy)
        assert {k: stub.bodies[0][k] for k in ("temperature", "top_p", "top_k", "seed")} == \
            {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "seed": 7}
        again = ask(greedy)
        assert stub.chats == 1 and not first.cached and again.cached and again.text == first.text == "ok"
        assert any(note.startswith("from the result cache") for note in again.notes)
        sampled = sampling_fields(0.7, 0.95, 0, None)
        ask(sampled), ask(sampled)
        assert stub.chats == 3 and "top_k" not in stub.bodies[-1] and "seed" not in stub.bodies[-1]
        for damaged in (tmp_path / "results").glob("*.json"):
            damaged.write_text("{not json")
        assert not ask(greedy).cached and stub.chats == 4  # an unreadable entry is asked again, then rewritten
        assert ask(greedy).cached
    finally:
        stub.close()


def test_without_attention_evidence_sources_are_the_parts_holding_the_answer_s_words():
    parts = [Part("The harbour opens at six. Ships unload grain.", "a.txt", "a.txt:1-2"),
             Part("The access code of the glass tower is 41729.", "a.txt", "a.txt:3"),
             Part("Nothing here is about towers.", "a.txt", "a.txt:4")]
    document = Document(parts, [], [])
    index = LexicalIndex.of_parts([part.text for part in parts])
    (source,) = rank_sources(document, index, None, "The access code is 41729.")
    assert source["cite"] == "a.txt:3" and source["text"] == parts[1].text.strip()
    assert rank_sources(document, index, None, "Completely unrelated words.") == []
    # A question's words count with the answer's: "when" and "harbour" point to the first part.
    assert rank_sources(document, index, "When does the harbour open?", "At six.")[0]["cite"] == "a.txt:1-2"
