"""The `indexpool` command line.

Results go to stdout, progress and messages to stderr (progress only when stderr is a terminal), `--json` prints
one JSON object per result. Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 bad input (file, model, text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from indexpool.model.errors import ModelLoadError, ModelOutputError, SettingsError

from .attention import AttentionChoice, attention_options, calibrating
from .console import GuardedStdout, InputError, OutputError, err_console, fail, hint_terminal_stdin, prefill_progress, read_message, read_text_input, show_stats
from .ingest import IngestError
from .options import SEED_MAX, finite, option_group
from .remote import RemoteError

app = typer.Typer(
    name="indexpool",
    help="Read very long documents with a local language model.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

def command(fn=None, *, group: typer.Typer = app, name: str | None = None):
    """Register a command (in `group`, as `name`: by default the app's, named after the function). A reader that
    goes away (`| head`) ends it quietly with exit 0, Ctrl-C with 130: handled here because click's own handlers
    would exit 1 for both."""

    def register(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except BrokenPipeError:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
                sys.exit(0)
            except KeyboardInterrupt:
                fail("interrupted", code=130)

        return group.command(name)(run)

    return register if fn is None else register(fn)


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct).", envvar="INDEXPOOL_MODEL")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 where the CPU has it, else fp32), bf16, fp16 or fp32.")]
DecodeWeightsOpt = Annotated[str, typer.Option("--decode-weights", help="How the CPU holds the weights: gguf (a GGUF file's own blocks, memory-mapped, computed on in place: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), int4 or int8 (a bf16 model, or an fp32 one where the C kernels build: dequantized weights plus quantized copies for decode steps), off (dequantized weights only; also keeps an fp32 model's K/V cache in fp32, else it is bf16 where the C attention kernel runs), or auto: gguf for GGUF models of 500M weights or more, else int4 for 4-bit files and int8 for others.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: one per physical core).", envvar="INDEXPOOL_THREADS")]
MAX_NEW_TOKENS = 1 << 20  # 1M: as long as the longest context IndexPool is built for; more is a typo
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, max=MAX_NEW_TOKENS, help="Most tokens to generate.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object per result instead of streaming text.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or statistics on stderr.")]


@dataclass
class RunChoice:
    """Which model, how it runs, and how results are shown: options every model command takes."""

    model: ModelOpt = None
    dtype: DtypeOpt = "auto"
    decode_weights: DecodeWeightsOpt = "auto"
    threads: ThreadsOpt = None
    json_out: JsonOpt = False
    quiet: QuietOpt = False

    @property
    def progress(self) -> bool:
        return err_console.is_terminal and not self.quiet


@dataclass
class SamplingChoice:
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, callback=finite, help="0 for greedy decoding.")] = 0.7
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0: all).")] = 40
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1: off).")] = 0.95
    seed: Annotated[Optional[int], typer.Option("--seed", min=0, max=SEED_MAX, help="Seed for reproducible sampling (0 to 2**64-1).")] = None

    def sampler(self):
        from indexpool.model.generate import Sampler, SamplingParams

        if self.top_p == 0:
            raise typer.BadParameter("--top-p must be greater than 0")
        return Sampler(SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed))


@dataclass
class DocumentChoice:
    """How inputs are read, and the document cache."""

    pages: Annotated[Optional[str], typer.Option("--pages", help="PDF pages to read, e.g. 10-40 or 1-5,9.")] = None
    password: Annotated[Optional[str], typer.Option("--password", help="Password of an encrypted PDF.", envvar="INDEXPOOL_PDF_PASSWORD")] = None
    input_format: Annotated[str, typer.Option("--format", help="Force the reader: auto, text, markdown, rst, html, epub, pdf, chat or code (stdin is text unless told).")] = "auto"
    include_hidden: Annotated[bool, typer.Option("--include-hidden", help="Folders: read dot files and dot folders too.")] = False
    doc_cache: Annotated[bool, typer.Option("--cache/--no-cache", help="Save a read document, and reuse it for the next request on it.", envvar="INDEXPOOL_CACHE")] = True
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Document cache directory (default ~/.cache/indexpool/documents).", envvar="INDEXPOOL_CACHE_DIR")] = None

    def load(self, paths: list[str]):
        from .ingest import IngestOptions, load_document

        options = IngestOptions(pages=self.pages, password=self.password, format=self.input_format,
                                include_hidden=self.include_hidden)
        if "-" in paths:
            hint_terminal_stdin()
        document = load_document(paths, options)
        if not document.parts:
            raise InputError(f"nothing to read in {', '.join(paths)}")
        return document

    def cache(self):
        from indexpool.model.tensor_cache import TensorCache

        return TensorCache(cache_directory(self.cache_dir)) if self.doc_cache else None

    def results(self):
        """Where results from a server (--backend openai) are kept: beside the read documents."""
        from .jobs import ResultCache

        return ResultCache(cache_directory(self.cache_dir) / RESULTS) if self.doc_cache else None


RESULTS = "remote-results"  # a folder of the document cache directory: the result cache
BACKENDS = ("local", "openai")


@dataclass
class RemoteChoice:
    backend: Annotated[str, typer.Option("--backend", help="local (the model runs here) or openai (send the work to an OpenAI-compatible server: vLLM, SGLang, llama.cpp).")] = "local"
    base_url: Annotated[Optional[str], typer.Option("--base-url", envvar="INDEXPOOL_BASE_URL", help="--backend openai: the server's API root, e.g. http://localhost:8000/v1.")] = None
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar=["INDEXPOOL_API_KEY", "OPENAI_API_KEY"], show_default=False, help="--backend openai: the server's API key.")] = None
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="--backend openai: the served model to use (default: the one the server lists first).")] = None
    max_concurrency: Annotated[int, typer.Option("--max-concurrency", min=1, help="--backend openai: most requests in flight at once.")] = 4
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, callback=finite, help="--backend openai: seconds a request may take in all, its retries and their waits included.")] = 600.0
    retries: Annotated[int, typer.Option("--retries", min=0, help="--backend openai: retries of a request after a connection error or a busy server (429/503), with backoff.")] = 3
    context_length: Annotated[Optional[int], typer.Option("--context-length", min=1, help="--backend openai: the server's context in tokens, where it does not report it (vLLM and SGLang do).")] = None

    def check(self) -> None:
        """Usage errors (exit 2) before anything is read or sent."""
        from .remote import ServerAddress

        if self.backend not in BACKENDS:
            raise typer.BadParameter(f"--backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.backend == "openai" and not self.base_url:
            raise typer.BadParameter("--backend openai needs --base-url (or INDEXPOOL_BASE_URL), e.g. "
                                     "http://localhost:8000/v1")
        if self.base_url:
            ServerAddress.parse(self.base_url)


def cache_directory(given: Path | None) -> Path:
    from indexpool.kernels.native_build import default_cache_dir

    return given or default_cache_dir("documents")


def _check_run(run: RunChoice) -> None:
    """Usage errors in the run options, before anything is read or loaded."""
    from indexpool.model.runtime import decode_bits, default_device, resolve_dtype, set_threads

    try:
        resolve_dtype(run.dtype, default_device())
        decode_bits(run.decode_weights, 16)
        set_threads(run.threads)
    except ValueError as e:
        raise SettingsError(str(e)) from None


def _load(run: RunChoice):
    from indexpool.model.runtime import load_engine

    _check_run(run)
    t0 = time.perf_counter()
    with err_console.status("loading model", spinner="dots") if run.progress else contextlib.nullcontext():
        loaded = load_engine(run.model, run.dtype, decode_weights=run.decode_weights)
    if run.progress:
        err_console.print(f"[dim]{loaded.name} ({loaded.model.dtype}) loaded in {time.perf_counter() - t0:.1f}s[/dim]")
    for note in getattr(loaded.model, "load_notes", []):
        _warn(note, run)
    return loaded


def _events(run: RunChoice):
    """The engine's messages and progress, on stderr."""
    from .local import Events

    def progress(message: str) -> None:
        if run.progress:
            err_console.print(f"[dim]{message}[/dim]")

    return Events(warn=lambda message: _warn(message, run), progress=progress,
                  reading=lambda total: prefill_progress(total, run.progress), calibrating=calibrating)


def _local(run: RunChoice, sampling: SamplingChoice, attention: AttentionChoice, document: DocumentChoice | None = None):
    """The local engine as the jobs' backend; the model is loaded when a job first needs it."""
    from .local import LocalBackend

    _check_run(run)
    options = attention.options()
    options.check()
    return LocalBackend(lambda: _load(run), options, sampling.sampler(), document.cache() if document else None,
                        _events(run))


def _backend(run: RunChoice, sampling: SamplingChoice, attention: AttentionChoice, document: DocumentChoice,
             remote: RemoteChoice):
    """The backend the options choose: the local engine, or an OpenAI-compatible server."""
    if remote.backend == "openai":
        from .remote import OpenAIBackend, sampling_fields

        sampling.sampler()  # its usage errors, as the local engine gives them
        fields = sampling_fields(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed)
        return OpenAIBackend(remote.base_url, fields, remote.api_key, remote.model_name, remote.max_concurrency,
                             remote.timeout, remote.retries, remote.context_length)
    return _local(run, sampling, attention, document)


def _stats_json(stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": stats.new_tokens,
        "stop_reason": stats.stop_reason,
        "timings": {
            "prefill_seconds": round(stats.prefill_seconds, 4),
            "decode_seconds": round(stats.decode_seconds, 4),
            "prefill_tokens_per_second": round(stats.prefill_tokens_per_second, 2),
            "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
        },
    }


@command
@attention_options
@option_group(DocumentChoice, "document")
@option_group(SamplingChoice, "sampling")
@option_group(RunChoice, "run")
def complete(
    prompt: Annotated[Optional[str], typer.Argument(help="Text to continue ('-' or a pipe reads stdin); with --file, the repository or document the file belongs to.")] = None,
    file: Annotated[Optional[str], typer.Option("--file", help="Complete inside this file (path as listed in the folder), with the rest of the folder as context.")] = None,
    line: Annotated[Optional[int], typer.Option("--line", min=1, help="With --file: continue after this line (default: the end of the file).")] = None,
    max_new_tokens: MaxNewOpt = 256,
    speculative: Annotated[bool, typer.Option("--speculative", help="glm5_next models: greedy decoding (needs --temperature 0) with the model's MTP layer drafting a token that the next forward checks; the same text, in fewer forwards when drafts are right.")] = False,
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
    document: DocumentChoice = None,
):
    """Continue raw text (no chat template), streaming only the new text to stdout. Inputs longer than the model's
    context are read with IndexPool sparse attention. With --file, PROMPT is a folder (or document) and the model
    continues that file at --line, with the rest of the folder read first."""
    from .jobs import completion_context

    backend = _local(run, sampling, attention)
    if file is None:
        if line is not None:
            raise typer.BadParameter("--line needs --file")
        text = read_text_input(prompt)
    else:
        if prompt is None:
            raise typer.BadParameter("give the folder or document that holds --file")
        text = completion_context(document.load([prompt]), file, line)
    out, stats = backend.complete(text, max_new_tokens, None if run.json_out else _write_stdout, speculative)
    if run.json_out:
        drafts = {"drafts": {"checked": stats.drafted, "kept": stats.accepted}} if speculative else {}
        print(json.dumps({"text": out, "model": backend.name, **_stats_json(stats), **drafts}, ensure_ascii=False))
    elif not run.quiet:
        show_stats(stats, newline=not out.endswith("\n"))


class ResultWriter:
    """A job's results on stdout in request order: each text as it is written (or at once when it comes whole),
    then its sources line, notes and statistics (`_show_result`); --json: one object per result. With several
    inputs each result is headed "==> label <==", as head(1) heads files."""

    def __init__(self, run: RunChoice, backend, requests: list[str], labels: list[str | None] | None = None):
        self.run = run
        self.backend = backend
        self.requests = requests
        self.labels = labels or [None] * len(requests)
        self.started: set[int] = set()

    def start(self, i: int) -> None:
        if i in self.started or self.run.json_out:
            return
        self.started.add(i)
        if self.labels[i] is not None:
            sys.stdout.write(("\n" if i else "") + f"==> {self.labels[i]} <==\n")
        elif i:
            sys.stdout.write("\n")

    def text(self, i: int, piece: str) -> None:
        self.start(i)
        _write_stdout(piece)

    @property
    def on_text(self):
        return None if self.run.json_out else self.text

    def result(self, i: int, result) -> None:
        if i not in self.started and not self.run.json_out:
            self.start(i)
            sys.stdout.write(result.text)
        _show_result(result, self.requests[i], self.backend.name, self.run, self.labels[i])


def _show_result(result, request: str, model: str | None, run: RunChoice, label: str | None = None) -> None:
    """The end of a document job's result (its text was written already unless --json): sources, notes, stats.
    `label`: the input it is about, one of several."""
    if run.json_out:
        about = {} if label is None else {"path": label}
        print(json.dumps({**about, "request": request, "model": model, **result.to_json()}, ensure_ascii=False),
              flush=True)
        return
    if not result.text.endswith("\n"):
        sys.stdout.write("\n")
    if result.sources and not result.cites_inline:
        sys.stdout.write("Sources: " + "; ".join(s["cite"] for s in result.sources) + "\n")
    sys.stdout.flush()
    for note in result.notes:
        _warn(note, run)
    if run.progress:
        how = "from the document cache" if result.cached else "read"
        err_console.print(f"[dim]{result.document_tokens:,} document tokens {how} in {result.read_seconds:.1f}s, "
                          f"{result.new_tokens} new tokens in {result.answer_seconds:.1f}s ({result.stop_reason})[/dim]")


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _warn(message: str, run: RunChoice) -> None:
    if not run.quiet:
        err_console.print(f"indexpool: {message}", markup=False, soft_wrap=True)


def _read(document: DocumentChoice, paths: list[str], run: RunChoice):
    """The inputs as one document, its notes and what a folder walk skipped told on stderr."""
    doc = document.load(paths)
    for note in doc.notes:
        _warn(note, run)
    if doc.skipped and not run.quiet:
        _warn(f"skipped {len(doc.skipped)} file(s) or folder(s): " + ", ".join(f"{p} ({why})" for p, why in doc.skipped[:5])
              + (" ..." if len(doc.skipped) > 5 else ""), run)
    return doc


def document_command(fn):
    """A command over documents (ask, summarize): every option group, greedy decoding by default."""
    for decorate in (option_group(RunChoice, "run"), option_group(SamplingChoice, "sampling", temperature=0.0),
                     option_group(DocumentChoice, "document"), attention_options, option_group(RemoteChoice, "remote"),
                     command):
        fn = decorate(fn)
    return fn


PathsArg = Annotated[list[str], typer.Argument(help="Files, folders, or '-' for stdin.")]


@document_command
def ask(
    path: Annotated[str, typer.Argument(help="A file, a folder, or '-' for stdin.")],
    question: Annotated[Optional[str], typer.Argument(help="The question.")] = None,
    questions: Annotated[Optional[list[str]], typer.Option("--question", "-Q", help="More questions on the same document (repeatable): it is read once, and the questions decode as one batch.")] = None,
    quote: Annotated[bool, typer.Option("--quote/--no-quote", help="Read the question first, then quote to the model the passages its words and its reading point to (beyond a neutral question's) before it answers (documents over 1,024 tokens, IndexPool; in --json as \"quotes\").")] = True,
    answer: Annotated[str, typer.Option("--answer", help="extract: the answer is the document's passage that the question's words and the model's reading point to most; generate: the model writes it from the document and the quoted passages; auto: extract for models under 1B parameters (the default model's own answers rarely held the fact: docs/benchmarks.md), else generate. --no-quote generates.")] = "auto",
    max_new_tokens: MaxNewOpt = 200,
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
    document: DocumentChoice = None,
    remote: RemoteChoice = None,
):
    """Answer questions about a document, book, codebase or chat log, citing the pages, lines or messages the
    answer rests on. The whole input is read in one context (IndexPool); a second question on the same input
    starts from the document cache."""
    from . import jobs

    asked = ([question] if question else []) + list(questions or [])
    if not asked:
        raise typer.BadParameter("give a question (after the path, or with --question)")
    jobs.choice(answer, jobs.ANSWER_MODES, "--answer")
    remote.check()
    doc = _read(document, [path], run)
    backend = _backend(run, sampling, attention, document, remote)
    out = ResultWriter(run, backend, [jobs.plain_request(jobs.ask_request(q)) for q in asked])
    jobs.ask(backend, doc, asked, max_new_tokens, answer, quote, out.result, out.on_text, document.results())


@document_command
def summarize(
    paths: PathsArg,
    length: Annotated[str, typer.Option("--length", help="short, medium or long.")] = "medium",
    focus: Annotated[Optional[str], typer.Option("--focus", help="A topic to focus on.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, max=MAX_NEW_TOKENS, help="Most tokens to generate (default: by --length).")] = None,
    strategy: Annotated[str, typer.Option("--strategy", help="single (one pass over the whole text, IndexPool), hierarchical (summaries of sections that fit the model's context, then of those), or auto: single when the document fits the model's context, else hierarchical (benchmarks/summary_coverage.py: the default model's one-pass summaries of longer documents degenerate).")] = "auto",
    section_tokens: Annotated[Optional[int], typer.Option("--section-tokens", min=64, help="Hierarchical: most tokens per section (default: the model's context less 1024).")] = None,
    together: Annotated[bool, typer.Option("--together", help="Several paths: read them as one document and write one summary (default: a summary of each, those that fit the model's context decoded as one batch).")] = False,
    summary: Annotated[str, typer.Option("--summary", help="extract: an outline of the document taken from it, its top-level sections (headings, files, log entries) each with the sentence that represents it best and its citation; generate: the model writes the summary; auto: extract for models under 1B parameters (the default model's own summaries named few of a document's sections: docs/benchmarks.md), else generate. With --backend openai, auto generates.")] = "auto",
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
    document: DocumentChoice = None,
    remote: RemoteChoice = None,
):
    """Summarize documents, citing the pages, lines or sections each summary draws on most. Several paths get a
    summary each (headed "==> path <==", or "path" in --json), unless --together."""
    from . import jobs

    jobs.choice(length, jobs.SUMMARY_LENGTHS, "--length")
    jobs.choice(summary, jobs.ANSWER_MODES, "--summary")
    jobs.choice(strategy, jobs.SUMMARY_STRATEGIES, "--strategy")
    remote.check()
    each = len(paths) > 1 and not together
    inputs = [[p] for p in paths] if each else [list(paths)]
    docs = [_read(document, p, run) for p in inputs]  # every input read before any work: a bad one fails first
    backend = _backend(run, sampling, attention, document, remote)
    request = jobs.summary_request(length, focus)
    out = ResultWriter(run, backend, [request] * len(docs), [p[0] for p in inputs] if each else None)
    jobs.summarize(backend, docs, length, focus, max_new_tokens, strategy, section_tokens, summary, out.result,
                   out.on_text, document.results())


CHAT_COMMAND = re.compile(r"/[A-Za-z]+")  # a line that can only be meant as a chat command


@command
@attention_options
@option_group(DocumentChoice, "document")
@option_group(SamplingChoice, "sampling")
@option_group(RunChoice, "run")
def chat(
    paths: Annotated[Optional[list[str]], typer.Argument(help="Files or folders to talk about (read once, kept for the whole conversation).")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message.")] = None,
    max_new_tokens: MaxNewOpt = 512,
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
    document: DocumentChoice = None,
):
    """A minimal interactive chat: one message per line on stdin; /reset starts over, /exit or Ctrl-D ends.
    With IndexPool (the default) a conversation can grow to 128K tokens; with dense attention the oldest exchanges
    are dropped when it outgrows the model's context. With PATHS, the conversation is about those documents: they
    are read once (or restored from the document cache) and every answer cites its sources."""
    from .local import Conversation

    if paths and "-" in paths:
        raise typer.BadParameter("chat reads its messages from stdin, so a document cannot come from stdin too")
    doc = _read(document, paths, run) if paths else None
    conversation = Conversation(_local(run, sampling, attention, document), doc, system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            err_console.print("[bold cyan]you>[/bold cyan] ", end="")
        line = read_message(sys.stdin)
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            conversation.reset()
            continue
        if CHAT_COMMAND.fullmatch(line):  # a mistyped command is not a message to the model
            err_console.print(f"indexpool: {line}: the chat's commands are /reset (start over) and /exit (or Ctrl-D); "
                              "a message of one word starting with / needs a second word", markup=False, soft_wrap=True)
            continue
        reply = conversation.say(line, max_new_tokens, None if run.json_out else _write_stdout)
        name = conversation.backend.name
        if reply.result is None:
            record = {"text": reply.text, "model": name, **_stats_json(reply.stats)}
        else:
            record = {"model": name, **reply.result.to_json(), "fed_tokens": reply.fed_tokens}
            if not run.json_out and reply.result.sources:
                sys.stdout.write(("" if reply.text.endswith("\n") else "\n") + "Sources: "
                                 + "; ".join(s["cite"] for s in reply.result.sources))
        if run.json_out:
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()


cache_app = typer.Typer(help="The document cache: documents already read, kept for the next request.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CacheDirOpt = Annotated[Optional[Path], typer.Option("--cache-dir", help="Document cache directory.", envvar="INDEXPOOL_CACHE_DIR")]


@command(group=cache_app, name="list")
def cache_list(cache_dir: CacheDirOpt = None, json_out: JsonOpt = False):
    """List cached documents, most recently used first."""
    from indexpool.model.tensor_cache import TensorCache, orphaned_temporaries

    cache = TensorCache(cache_directory(cache_dir))
    entries = cache.entries()
    if json_out:
        for e in entries:
            print(json.dumps({"key": e.key, "bytes": e.size, "last_used": e.last_used, "description": e.description,
                              "path": str(e.path)}))
        return
    for e in entries:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        print(f"{e.key[:12]}  {e.size / 2**20:9.1f} MiB  {used}  {e.description}")
    if err_console.is_terminal:
        err_console.print(f"[dim]{len(entries)} entries, {sum(e.size for e in entries) / 2**20:.1f} MiB in {cache.directory} "
                          f"(limit {cache.limit_bytes / 2**30:.0f} GiB)[/dim]")
    orphans = orphaned_temporaries(cache.directory)
    if orphans:
        size = sum(path.stat().st_size for path in orphans if path.exists())
        err_console.print(f"{len(orphans)} unfinished files of interrupted saves ({size / 2**20:.1f} MiB): the next "
                          "save or `indexpool cache clear` removes them", markup=False)


@command(group=cache_app, name="clear")
def cache_clear(cache_dir: CacheDirOpt = None):
    """Delete every cached document, and the results kept from servers (--backend openai). Only files the cache
    wrote, in a directory it made (tagged with CACHEDIR.TAG), are deleted."""
    from indexpool.model.tensor_cache import TensorCache

    from .jobs import ResultCache

    cache = TensorCache(cache_directory(cache_dir))
    freed = cache.clear() + ResultCache(cache.directory / RESULTS).clear()
    err_console.print(f"freed {freed / 2**20:.1f} MiB in {cache.directory}", markup=False)


@command
@option_group(RunChoice, "run")
def info(
    config: Annotated[Optional[Path], typer.Option("--config", help="A glm5_next config.json, or the folder holding it: describe that model's cache from the config alone, no weights (e.g. the released GLM-5.3-Flash's).")] = None,
    tokens: Annotated[str, typer.Option("--tokens", help="Comma-separated context lengths for the cache size table (K = 1024, M = 1024K).")] = "128K,1M",
    run: RunChoice = None,
):
    """Describe the model: size, dtype, threads, context length, cache bytes per token (dense and IndexPool, or
    glm5_next's own cache) and the cache size at --tokens."""
    import torch

    from indexpool.kernels import gguf_blocks
    from indexpool.kernels.cpu_attention import decode_attention_path, prefill_attention_path
    from indexpool.model.gguf_weights import block_parts, weight_count, weight_formats
    from indexpool.model.quant import DecodeQuantLinear, decode_weights_path

    lengths = _token_counts(tokens)
    if config is not None:
        if run.model:
            raise typer.BadParameter("give --model or --config, not both")
        _print_facts({"config": str(config), **_glm5_next_facts(_read_glm5_next_config(config), torch.bfloat16, lengths)},
                     run.json_out)
        return
    loaded = _load(RunChoice(run.model, run.dtype, run.decode_weights, run.threads, run.json_out, quiet=True))
    cfg, m = loaded.config, loaded.model
    facts = {
        "model": loaded.name,
        "source": str(loaded.source),
        "architecture": cfg.arch,
        "parameters": weight_count(m),
        "file_bytes": loaded.file_bytes,
        "weights": ", ".join(f"{kind} {_gib(size)}" for kind, size in weight_formats(m).items()),
        "dtype": str(m.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
    }
    if cfg.arch == "glm5_next":
        facts |= _glm5_next_facts(cfg, m.dtype, lengths)
        facts["notes"] = m.load_notes
        _print_facts(facts, run.json_out)
        return
    kv_dtype = m.cache_dtype or m.dtype  # the dense cache's (`Transformer.new_cache`)
    facts |= {
        "context_length": cfg.context_length,
        "layers": cfg.n_layers,
        "hidden_size": cfg.dim,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "kv_cache_bytes_per_token": cfg.kv_bytes_per_token(kv_dtype),
        "decode_weights": ("the file's blocks, memory-mapped" if block_parts(m) else
                           "+".join(f"int{b}" for b in sorted({q.bits for q in m.modules() if isinstance(q, DecodeQuantLinear)}))
                           or "same as dtype"),
        "decode_linear": gguf_blocks.path() if block_parts(m) else decode_weights_path(m),
        "prefill_linear": _prefill_linear(m),
        "decode_attention": decode_attention_path(next(m.parameters()).device, kv_dtype, cfg.head_dim),
        "decode_step": m.decode_step_path(),
        "prefill_attention": prefill_attention_path(next(m.parameters()).device, m.dtype, cfg.head_dim),
    }
    facts.update(_indexpool_bytes(loaded))
    facts["cache_bytes"] = {str(n): _llama_cache_bytes(facts, n) for n in lengths}
    _print_facts(facts, run.json_out)


def _prefill_linear(model) -> str:
    """How a prompt's layers multiply: on the file's blocks, int8 products for the formats the prompt kernel takes
    (fp32), GEMMs for the others (of dequantized slices, or float rows as they lie); else torch's matmuls of the
    weights in memory."""
    from indexpool.kernels import gguf_blocks
    from indexpool.model.gguf_weights import block_parts

    dtype = str(model.dtype).removeprefix("torch.")
    formats = {part.format: gguf_blocks.int8_prompts(part.qtype, model.dtype)
               for part in block_parts(model) if part.blocks is not None}
    if not formats:
        return f"torch matmuls ({dtype})"
    ways = [("int8 prompt kernel", [f for f, int8 in formats.items() if int8]),
            (f"{dtype} GEMMs", [f for f, int8 in formats.items() if not int8])]
    return "; ".join(f"{way}: {', '.join(sorted(names))}" for way, names in ways if names)


def _token_counts(text: str) -> list[int]:
    units = {"k": 1024, "m": 1024**2}
    try:
        counts = [int(t[:-1]) * units[t[-1].lower()] if t[-1:].lower() in units else int(t)
                  for t in text.replace(" ", "").split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or max(counts) > MAX_TABLE_TOKENS:
        raise typer.BadParameter(f"--tokens takes token counts from 1 to 1024M like 131072,1M, not {text!r}")
    return counts


MAX_TABLE_TOKENS = 1 << 30  # 1024M: a thousand times the longest context IndexPool is built for; more is a typo


def _print_facts(facts: dict, json_out: bool) -> None:
    """One JSON object, or a line per fact, a line per note and a line per row of the cache size table."""
    if json_out:
        print(json.dumps(facts))
        return
    width = max(map(len, facts))
    for key, value in facts.items():
        if key == "cache_bytes":
            for n, parts in value.items():
                shown = ", ".join(f"{part.replace('_', ' ')} {_gib(b)}" for part, b in parts.items())
                print(f"{f'cache at {int(n):,} tokens':<{width}}  {shown}")
        elif key == "notes":
            for note in value:
                print(f"{'note':<{width}}  {note}")
        else:
            # numbers with thousands separators (a pooled index's bytes per token are fractions of a pool's)
            shown = f"{value:,}" if isinstance(value, int) and key != "threads" else \
                f"{value:,.10g}" if isinstance(value, float) else value
            print(f"{key.replace('_', ' '):<{width}}  {shown}")


def _gib(n_bytes: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= size:
            return f"{n_bytes / size:,.2f} {unit}"
    return f"{n_bytes:,} bytes"


def _llama_cache_bytes(facts: dict, n: int) -> dict:
    """Dense K/V, and IndexPool's cache (history K/V, pooled index and its fixed buffers) per storage choice."""
    sizes = {"dense_kv": facts["kv_cache_bytes_per_token"] * n}
    if "indexpool_fixed_bytes" in facts:
        for kv_storage, index_dtype in (("bf16", "bf16"), ("int8", "fp8")):
            per_token = (facts[f"indexpool_history_kv_{kv_storage}_bytes_per_token"]
                         + facts[f"indexpool_pooled_index_{index_dtype}_bytes_per_token"])
            sizes[f"indexpool_{kv_storage}_{index_dtype}"] = round(n * per_token + facts["indexpool_fixed_bytes"])
    return sizes


def _read_glm5_next_config(path: Path):
    from indexpool.model.glm5_next import Glm5NextConfig
    from indexpool.model.loader import read_json_file

    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise InputError(f"{file} not found: give a glm5_next config.json, or the model directory holding it")
    config = read_json_file(file)  # a regular file of a bounded size: a pipe or a device is refused, not read
    if not isinstance(config, dict):
        raise InputError(f"{file}: not a glm5_next config (its JSON is not an object)")
    try:
        return Glm5NextConfig.from_hf(config)
    except (ValueError, TypeError) as e:
        raise InputError(f"{file}: not a glm5_next config ({' '.join(str(e).split())})") from None


def _glm5_next_facts(cfg, dtype, lengths: list[int]) -> dict:
    """glm5_next's shape and cache, as this engine stores it (MLA latents in `dtype`, pooled indexer keys in bf16):
    per token, the latents of every MLA layer and one pooled key per kpool tokens of every indexer layer; per
    sequence, a fixed state (KDA recurrent and conv states, indexer tails); and the total at each length, next to
    the totals with a per-token DSA indexer and with dense MLA."""
    import torch

    from indexpool.model.glm5_next import cache_size
    from indexpool.kernels.index_math import FP8_DTYPE

    kpool = cfg.index_kpool
    one_pool, one_pool_fp8 = cache_size(cfg, kpool, dtype), cache_size(cfg, kpool, dtype, FP8_DTYPE)
    facts = {
        "architecture": cfg.arch,
        "context_length": cfg.context_length,
        "layers": cfg.n_layers,
        "kda_layers": len(cfg.kda_layers),
        "mla_layers": len(cfg.mla_layers),
        "indexer_layers": len(cfg.indexer_layers),
        "mtp_layers": cfg.num_nextn_predict_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size,
        "index_kpool": kpool,
        "index_topk": cfg.index_topk,
        "cache_dtype": str(dtype).removeprefix("torch."),
        "mla_latent_bytes_per_token": one_pool.latent_bytes // kpool,
        "pooled_index_bf16_bytes_per_token": one_pool.index_bytes / kpool,
        "pooled_index_fp8_bytes_per_token": one_pool_fp8.index_bytes / kpool,
        "fixed_state_bytes": one_pool.fixed_bytes,
    }
    facts["cache_bytes"] = {}
    for n in lengths:
        size = cache_size(cfg, n, dtype, torch.bfloat16)
        facts["cache_bytes"][str(n)] = {
            "mla_latent": size.latent_bytes, "pooled_index": size.index_bytes, "fixed_state": size.fixed_bytes,
            "total": size.total_bytes,
            # the same model with a DSA indexer keeping one bf16 key per token, and with dense MLA (no indexer)
            "per_token_dsa_total": cache_size(cfg, n, dtype, torch.bfloat16, "per_token").total_bytes,
            "dense_mla_total": cache_size(cfg, n, dtype, index="none").total_bytes,
        }
    return facts


def _indexpool_bytes(loaded) -> dict:
    """IndexPool cache bytes per token (all layers) with the default settings and indexer, per storage choice. The
    index pruning is not calibrated here (a dense read: minutes for an 8B model): before the first read of a
    document the index figures are those of whole keys, and say so."""
    from indexpool.model.indexpool_cache import IndexPoolCache

    from indexpool.model.sessions import default_indexer, segment_indexer

    options = AttentionChoice().options()
    indexer = default_indexer(options, loaded, calibrate_now=False)
    for_segments = segment_indexer(options, loaded)
    parts = {}
    if options.prune_index is not False and getattr(indexer, "projection", False) is None:
        parts["indexpool_index_pruning"] = ("not calibrated yet (the first read of a document calibrates it once): "
                                            "the pooled index figures are of whole keys, pruning makes them smaller")
    for kv_storage, index_dtype in (("bf16", "bf16"), ("int8", "fp8")):
        settings = dataclasses.replace(options.indexpool, kv_storage=kv_storage, index_dtype=index_dtype)
        try:
            cache = IndexPoolCache(loaded.config, settings, indexer, 4 * settings.kpool, loaded.model.dtype,
                                   segment_indexer=for_segments)
        except ValueError:  # a model whose context cannot hold the default window, topk and segment
            return {}
        sizes = cache.bytes_per_token()
        parts[f"indexpool_history_kv_{kv_storage}_bytes_per_token"] = sizes["history_kv"]
        parts[f"indexpool_pooled_index_{index_dtype}_bytes_per_token"] = sizes["pooled_index"]
        if index_dtype == "bf16":  # the same indexers keeping one key per token, for comparison
            parts["per_token_index_bf16_bytes_per_token"] = cache.unpooled_index_bytes()
    parts["indexpool_indexer"] = type(indexer).__name__
    if for_segments is not None:
        parts["indexpool_segment_indexer"] = type(for_segments).__name__
    parts["indexpool_fixed_bytes"] = cache.fixed_bytes()
    return parts


@command
def bench(
    model: ModelOpt = None,
    contexts: Annotated[str, typer.Option("--contexts", help="Comma-separated context lengths for decode.")] = "512,4096",
    prefill_length: Annotated[int, typer.Option("--prefill-length", help="Prompt length for the prefill figure.")] = 4096,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Tokens timed per decode run.")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Runs per figure; the median is reported.")] = 3,
    engines: Annotated[str, typer.Option("--engines", help="Comma-separated: indexpool, transformers, llama.cpp (skipped if not installed).")] = "indexpool,transformers,llama.cpp",
    decode_weights: Annotated[str, typer.Option("--decode-weights", help="Comma-separated --decode-weights choices for our engine, each run in turn (auto, gguf, int4, int8, off); the ratios are the first one's.")] = "auto",
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads for every engine (default: one per physical core).", envvar="INDEXPOOL_THREADS")] = None,
    json_out: JsonOpt = False,
):
    """Benchmark our engine against transformers (and llama.cpp if installed) on the same weights."""
    from indexpool.model.runtime import decode_bits, set_threads

    from .bench import ENGINES, run_bench

    chosen = engines.split(",")
    if unknown := [e for e in chosen if e not in ENGINES]:
        raise typer.BadParameter(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    weights = tuple(decode_weights.split(","))
    try:
        for choice in weights:
            decode_bits(choice, 16)  # checked before any run
        set_threads(threads)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_bench(model, [int(c) for c in contexts.split(",")], prefill_length, decode_tokens, repeats, chosen, json_out,
              weights, threads)


from .distill import distill  # noqa: E402  (the command's heavy imports happen when it runs)

command(distill)


def _given_by(e) -> str:
    """Where a refused value came from when the command line did not give it: ' (from the environment variable X)'
    or ' (from the config file F)'; '' otherwise."""
    from .settings import config_path

    ctx, param = e.ctx, getattr(e, "param", None)  # an unknown option's error has no parameter
    if ctx is None or param is None or not param.name:
        return ""
    source = ctx.get_parameter_source(param.name)
    if source is not None and source.name == "ENVIRONMENT":
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
        if ctx.auto_envvar_prefix:
            names.append(f"{ctx.auto_envvar_prefix}_{param.name.upper()}")
        given = next((n for n in names if os.environ.get(n)), None)
        return f" (from the environment variable {given})" if given else " (from the environment)"
    if source is not None and source.name == "DEFAULT_MAP":
        return f" (from the config file {config_path()})"
    return ""


def main() -> None:
    """Run the command line with one error path: every failure ends as one line `indexpool: error: ...` with its
    exit code (usage 2, bad input 3, runtime 1, interrupted 130), Click's usage errors included."""
    if sys.stdin is None:  # started with stdin closed (`<&-`): reading it gives no input, as from /dev/null
        sys.stdin = open(os.devnull)
    if sys.stdout is None:
        fail("standard output is closed (`>&-`); send it to a file or to /dev/null", code=2)
    stdout = sys.stdout
    sys.stdout = GuardedStdout(stdout)
    try:
        _run()
    finally:
        sys.stdout = stdout


def _run() -> None:
    """The command, each failure mapped to its line and exit code (`main`)."""
    import typer.main

    from .settings import ConfigError, default_map

    # Click's exception classes as the installed typer raises them (its own copy of click in recent versions)
    usage_error, click_exception = typer.BadParameter.__mro__[1:3]
    help_only = getattr(sys.modules[usage_error.__module__], "NoArgsIsHelpError", ())  # a group run bare
    try:
        group = typer.main.get_command(app)
        try:
            defaults = default_map(group)
        except ConfigError as e:
            fail(str(e), code=2)
        code = group.main(prog_name="indexpool", default_map=defaults, auto_envvar_prefix="INDEXPOOL",
                          standalone_mode=False)
        sys.stdout.flush()  # here, where a full disk's error is reported, not at exit
    except help_only as e:
        err_console.print(e.format_message(), markup=False, highlight=False)
        sys.exit(2)
    except usage_error as e:
        where = e.ctx.command_path if e.ctx else "indexpool"
        fail(f"{' '.join(e.format_message().split())}{_given_by(e)} (see '{where} --help')", code=2)
    except click_exception as e:
        fail(" ".join(e.format_message().split()), code=e.exit_code)
    except typer.Abort:  # end of input at a prompt
        fail("interrupted", code=130)
    except SettingsError as e:  # a setting the engine cannot run with: a usage error
        fail(str(e), code=2)
    except (ModelLoadError, ModelOutputError, InputError, IngestError) as e:
        fail(str(e), code=3)
    except RemoteError as e:
        fail(str(e), code=1)
    except OutputError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is still buffered goes nowhere at exit
        fail(str(e), code=1)
    except RecursionError:
        fail("the input is nested too deeply to read", code=3)
    except MemoryError:
        fail("out of memory; read less (--pages, a smaller folder) or use a smaller model", code=1)
    except Exception as e:  # anything else is our bug or the machine's; still one line, no traceback
        fail(f"{type(e).__name__}: {' '.join(str(e).split())}", code=1)
    if code == 130:  # Ctrl-C while the options were parsed (click's own exit code for it)
        fail("interrupted", code=130)
    if isinstance(code, int) and code:
        sys.exit(code)
