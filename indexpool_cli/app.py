"""The `indexpool` command line.

Results go to stdout, progress and messages to stderr (progress only when stderr is a terminal), `--json` prints
one JSON object per result. Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 bad input (file, model, text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from indexpool.model.errors import ModelLoadError, SettingsError

from .attention import AttentionChoice, attention_options, open_session, speculative_session
from .console import InputError, err_console, fail, prefill_progress, read_text_input, show_stats
from .ingest import IngestError
from .options import option_group
from .remote import RemoteChoice, RemoteError

app = typer.Typer(
    name="indexpool",
    help="Read very long documents with a local language model.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

def command(fn):
    """Register a command. A reader that goes away (`| head`) ends it quietly with exit 0, Ctrl-C with 130:
    handled here because click's own handlers would exit 1 for both."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
            sys.exit(0)
        except KeyboardInterrupt:
            fail("interrupted", code=130)

    return app.command()(run)


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="A .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct).", envvar="INDEXPOOL_MODEL")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto (bf16 where the CPU has it, else fp32), bf16, fp16 or fp32.")]
DecodeWeightsOpt = Annotated[str, typer.Option("--decode-weights", help="Weights for one-token decode steps on the CPU (a bf16 model, or an fp32 one where the C kernels build): auto (int4 for 4-bit files, else int8), int4, int8 or off (which also keeps an fp32 model's K/V cache in fp32; else it is bf16 where the C attention kernel runs).")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: one per physical core).", envvar="INDEXPOOL_THREADS")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate.")]
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
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 for greedy decoding.")] = 0.7
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0: all).")] = 40
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1: off).")] = 0.95
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed for reproducible sampling.")] = None

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
        document = load_document(paths, options)
        if not document.parts:
            raise InputError(f"nothing to read in {', '.join(paths)}")
        return document

    def cache(self):
        from indexpool.model.tensor_cache import TensorCache

        return TensorCache(cache_directory(self.cache_dir)) if self.doc_cache else None

    def results(self):
        """Where results from a server (--backend openai) are kept: beside the read documents."""
        from .remote import ResultCache

        return ResultCache(cache_directory(self.cache_dir) / REMOTE_RESULTS) if self.doc_cache else None


REMOTE_RESULTS = "remote-results"  # a folder of the document cache directory


def cache_directory(given: Path | None) -> Path:
    from indexpool.kernels.native_build import default_cache_dir

    return given or default_cache_dir("documents")


def _load(run: RunChoice):
    from indexpool.model.runtime import decode_bits, default_device, load_engine, resolve_dtype, set_threads

    try:
        resolve_dtype(run.dtype, default_device())
        decode_bits(run.decode_weights, 16)
        set_threads(run.threads)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    t0 = time.perf_counter()
    with err_console.status("loading model", spinner="dots") if run.progress else contextlib.nullcontext():
        loaded = load_engine(run.model, run.dtype, decode_weights=run.decode_weights)
    if run.progress:
        err_console.print(f"[dim]{loaded.name} ({loaded.model.dtype}) loaded in {time.perf_counter() - t0:.1f}s[/dim]")
    for note in getattr(loaded.model, "load_notes", []):
        _warn(note, run)
    return loaded


def _stream(session, tokenizer, prompt_ids, sampler, max_new_tokens, json_out: bool, quiet: bool):
    """Generate, writing text to stdout as it comes unless JSON is wanted; returns (text, stats)."""
    from indexpool.model.generate import GenerationStats

    stats = GenerationStats()
    decoder = tokenizer.stream_decoder()
    pieces = []
    with prefill_progress(len(prompt_ids), enabled=err_console.is_terminal and not quiet) as on_progress:
        tokens = session.generate(prompt_ids, sampler, max_new_tokens, tokenizer.stop_ids, stats, on_progress)
        first = next(tokens, None)
    for token in () if first is None else itertools.chain([first], tokens):
        piece = decoder.push(token)
        pieces.append(piece)
        if piece and not json_out:
            sys.stdout.write(piece)
            sys.stdout.flush()
    tail = decoder.flush()
    pieces.append(tail)
    if not json_out:
        sys.stdout.write(tail)
        sys.stdout.flush()
    return "".join(pieces), stats


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
    sampler = sampling.sampler()
    if file is None:
        if line is not None:
            raise typer.BadParameter("--line needs --file")
        text = read_text_input(prompt)
    else:
        from .jobs import completion_context

        if prompt is None:
            raise typer.BadParameter("give the folder or document that holds --file")
        text = completion_context(document.load([prompt]), file, line)
    loaded = _load(run)
    tok = loaded.tokenizer
    ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(text)
    if not ids:
        raise InputError("the prompt is empty")
    if speculative:
        session = speculative_session(loaded, attention, len(ids) + max_new_tokens, sampler)
    else:
        session = open_session(loaded, attention, len(ids) + max_new_tokens)
    out, stats = _stream(session, tok, ids, sampler, max_new_tokens, run.json_out, run.quiet)
    if run.json_out:
        drafts = {"drafts": {"checked": stats.drafted, "kept": stats.accepted}} if speculative else {}
        print(json.dumps({"text": out, "model": loaded.name, **_stats_json(stats), **drafts}, ensure_ascii=False))
    elif not run.quiet:
        show_stats(stats, newline=not out.endswith("\n"))


def _document_job(paths: list[str], requests: list[str], max_new_tokens: int, run: RunChoice,
                  sampling: SamplingChoice, attention: AttentionChoice, document: DocumentChoice,
                  system: str | None = None, doc=None, loaded=None, remote: RemoteChoice | None = None,
                  kind: str = "ask", label: str | None = None, answer: str = "generate") -> None:
    """Read the document once (or restore it from the document cache), then answer the requests: extracted from
    the document where `answer` (`jobs.answer_mode`) says so and a passage is found (`jobs.extract_answer`), else
    generated: together, as branches of the held document, when the session allows (`jobs.batch_size`), else in
    turn. `doc` and `loaded` when the caller has them already; `remote` sends the requests to a server instead;
    `label` names the input in --json (one of several). Results are shown in the requests' order."""
    from indexpool.model.sessions import available_memory_bytes
    from .jobs import (PROBE_QUESTION, DocumentTokens, answer_mode, ask_request, batch_size, document_prompt,
                       evidence_baseline, extract_answer, plain_request, read_document, request_messages, run_batch,
                       run_request, session_identity)

    doc = doc or document.load(paths)
    for note in doc.notes:
        _warn(note, run)
    if doc.skipped and not run.quiet:
        _warn(f"skipped {len(doc.skipped)} file(s) or folder(s): " + ", ".join(f"{p} ({why})" for p, why in doc.skipped[:5])
              + (" ..." if len(doc.skipped) > 5 else ""), run)
    if remote is not None and remote.backend == "openai":
        from types import SimpleNamespace

        from .remote import run_remote_job

        served = SimpleNamespace(name=remote.model_name or remote.base_url)

        def show(i, result):  # in request order, as each completes; the remote path does not stream
            if i and not run.json_out:
                sys.stdout.write("\n")
            if not run.json_out:
                sys.stdout.write(result.text)
            _show_result(result, plain_request(requests[i]), served, run, label)

        from .remote import sampling_fields

        fields = sampling_fields(sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed)
        run_remote_job(doc, requests, max_new_tokens, remote, fields, show, kind, document.results())
        return
    sampler = sampling.sampler()
    loaded = loaded or _load(run)
    tok = loaded.tokenizer
    doc_tokens = DocumentTokens.encode(tok, doc)
    prompts = [document_prompt(tok, doc_tokens, request_messages(request, system), attention.kpool) for request in requests]
    needed = max(p.max_tokens for p in prompts) + max_new_tokens
    session = open_session(loaded, attention, needed, auto="indexpool")
    identity = session_identity(loaded, session, attention)
    doc_cache = document.cache()
    description = f"{', '.join(paths)} ({prompts[0].doc_end - prompts[0].doc_start:,} tokens)"
    t0 = time.perf_counter()
    with prefill_progress(prompts[0].reusable, enabled=run.progress) as on_progress:
        cached = read_document(session, prompts[0], identity, doc_cache, description, lambda m: _warn(m, run), on_progress)
    probe = request_messages(ask_request(PROBE_QUESTION), system)
    baseline = evidence_baseline(session, tok, doc_tokens, prompts[0], probe, identity, doc_cache, description,
                                 lambda m: _warn(m, run))
    read_seconds = time.perf_counter() - t0
    extracted = [None] * len(prompts)
    if answer_mode(answer, loaded.model) == "extract":
        extracted = [extract_answer(session, tok, p, doc, cached, read_seconds, baseline) for p in prompts]
    shown = 0  # results shown so far, in request order

    def show_extracted(before: int) -> None:  # the extracted results ahead of request `before`
        for j in range(shown, before):
            if extracted[j] is not None:
                show(j, extracted[j])

    def show(i: int, result, streamed: bool = False) -> None:
        nonlocal shown
        show_extracted(i)
        if i:  # the document was read (or restored) once, for the first request; later ones found it held
            result.cached, result.read_seconds = True, 0.0
        if not run.json_out and not streamed:
            sys.stdout.write(("\n" if i else "") + result.text)
        _show_result(result, plain_request(requests[i]), loaded, run, label)
        shown = i + 1

    pending = [i for i, result in enumerate(extracted) if result is None]
    budget = min(max_new_tokens, session.max_length - max(p.max_tokens for p in prompts))
    size = batch_size(session, [prompts[i] for i in pending], budget, available_memory_bytes()) if pending else 1
    for first in range(0, len(pending), size):  # every prompt starts with the document, which the session holds
        rows = pending[first : first + size]
        if size > 1:  # decoded together: each answer is shown when the batch is done
            if run.progress:
                err_console.print(f"[dim]answering {len(rows)} requests as one batch[/dim]")
            for i, result in zip(rows, run_batch(session, tok, [prompts[i] for i in rows], doc, sampler, budget,
                                                 cached, read_seconds, baseline)):
                show(i, result)
            continue
        i = rows[0]
        streamed = not run.json_out
        if streamed:  # what comes before this answer, as it is written
            show_extracted(i)
            if i:
                sys.stdout.write("\n")
        show(i, run_request(session, tok, prompts[i], doc, sampler, budget, _write_stdout if streamed else None,
                            cached, read_seconds, baseline=baseline), streamed)
    show_extracted(len(prompts))


def _show_result(result, request: str, loaded, run: RunChoice, label: str | None = None) -> None:
    """The end of a document job's result (its text was streamed already unless --json): sources, notes, stats.
    `label`: the input it is about, one of several."""
    if run.json_out:
        about = {} if label is None else {"path": label}
        print(json.dumps({**about, "request": request, "model": loaded.name, **result.to_json()}, ensure_ascii=False),
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


def document_command(fn):
    """A command over documents (ask, summarize): every option group, greedy decoding by default."""
    for decorate in (option_group(RunChoice, "run"), option_group(SamplingChoice, "sampling", temperature=0.0),
                     option_group(DocumentChoice, "document"), attention_options, option_group(RemoteChoice, "remote"),
                     command):
        fn = decorate(fn)
    return fn


PathsArg = Annotated[list[str], typer.Argument(help="Files, folders, or '-' for stdin.")]
SUMMARY_STRATEGIES = ("auto", "single", "hierarchical")
DOCUMENT_CHAT_TOKENS = 65536  # room for a conversation about a document, on top of the document


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
    from .jobs import ANSWER_MODES, ask_request, plain_request

    asked = ([question] if question else []) + list(questions or [])
    if not asked:
        raise typer.BadParameter("give a question (after the path, or with --question)")
    if any(not q.strip() for q in asked):
        raise typer.BadParameter("a question is empty")
    if answer not in ANSWER_MODES:
        raise typer.BadParameter(f"--answer must be one of {', '.join(ANSWER_MODES)}, not {answer!r}")
    remote.check()
    requests = [ask_request(q) if quote else plain_request(ask_request(q)) for q in asked]
    _document_job([path], requests, max_new_tokens, run, sampling, attention, document, remote=remote, kind="ask",
                  answer=answer)


@document_command
def summarize(
    paths: PathsArg,
    length: Annotated[str, typer.Option("--length", help="short, medium or long.")] = "medium",
    focus: Annotated[Optional[str], typer.Option("--focus", help="A topic to focus on.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate (default: by --length).")] = None,
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
    from .jobs import ANSWER_MODES, SUMMARY_LENGTHS, answer_mode, summary_request

    if length not in SUMMARY_LENGTHS:
        raise typer.BadParameter(f"--length must be one of {', '.join(SUMMARY_LENGTHS)}, not {length!r}")
    if summary not in ANSWER_MODES:
        raise typer.BadParameter(f"--summary must be one of {', '.join(ANSWER_MODES)}, not {summary!r}")
    if strategy not in SUMMARY_STRATEGIES:
        raise typer.BadParameter(f"--strategy must be one of {', '.join(SUMMARY_STRATEGIES)}, not {strategy!r}")
    remote.check()
    request, budget = summary_request(length, focus), max_new_tokens or SUMMARY_LENGTHS[length][1]
    each = len(paths) > 1 and not together
    inputs = [[p] for p in paths] if each else [list(paths)]
    docs = [document.load(p) for p in inputs]  # every input read before any work: a bad one fails first
    labels = [p[0] for p in inputs] if each else [None]
    loaded = None
    if summary == "auto" and remote.backend != "openai":
        loaded = _load(run)
        summary = answer_mode(summary, loaded.model, "--summary")
    if summary == "extract":  # no model needed: given --summary extract, none is loaded
        _show_outlines(docs, labels, length, focus, request, loaded.name if loaded else None, run)
        return
    if remote.backend == "openai":  # the server's context decides one pass or sections
        for i, (path, doc, label) in enumerate(zip(inputs, docs, labels)):
            _show_label(label, i, run)
            _document_job(path, [request], budget, run, sampling, attention, document, doc=doc, remote=remote,
                          kind="summarize", label=label)
        return
    loaded = loaded or _load(run)
    counts = [sum(len(loaded.tokenizer.encode(part.text)) for part in doc.parts) for doc in docs]
    strategies = [_summary_strategy(strategy, loaded, n) for n in counts]
    batched = _summarize_batched(loaded, docs, counts, strategies, request, budget, sampling, attention, run) \
        if each else {}
    for i, (path, doc, label) in enumerate(zip(inputs, docs, labels)):
        _show_label(label, i, run)
        if i in batched:
            if not run.json_out:
                sys.stdout.write(batched[i].text)
            _show_result(batched[i], request, loaded, run, label)
        elif strategies[i] == "single":
            _document_job(path, [request], budget, run, sampling, attention, document, doc=doc, loaded=loaded,
                          label=label)
        else:
            _summarize_hierarchical(loaded, doc, request, budget, section_tokens, run, sampling, attention, label)


def _show_outlines(docs, labels: list[str | None], length: str, focus: str | None, request: str,
                   model: str | None, run: RunChoice) -> None:
    """Each input's extractive summary (`jobs.outline_summary`), shown as a generated one is."""
    from types import SimpleNamespace

    from .jobs import outline_summary

    for i, (doc, label) in enumerate(zip(docs, labels)):
        for note in doc.notes:
            _warn(note, run)
        _show_label(label, i, run)
        result = outline_summary(doc, length, focus)
        if not run.json_out:
            sys.stdout.write(result.text)
        _show_result(result, request, SimpleNamespace(name=model), run, label)


def _summary_strategy(strategy: str, loaded, document_tokens: int) -> str:
    """auto: one pass when the document fits the model's own context, else hierarchical."""
    from .jobs import SECTION_RESERVE

    if strategy != "auto":
        return strategy
    return "single" if document_tokens <= loaded.config.context_length - SECTION_RESERVE else "hierarchical"


def _summarize_batched(loaded, docs, counts: list[int], strategies: list[str], request: str, budget: int,
                       sampling: SamplingChoice, attention: AttentionChoice, run: RunChoice) -> dict:
    """The summaries of the inputs that fit the model's context (one pass), decoded together on a dense session
    in batches as large as memory allows; {input index: JobResult}. Empty when fewer than two fit, or when
    --attention indexpool asks for IndexPool (a batch of different documents is dense)."""
    from indexpool.model.sessions import available_memory_bytes
    from .jobs import (SECTION_RESERVE, DocumentTokens, document_prompt, generate_each, request_messages,
                       section_batch_size)
    from .remote import matched_sources

    tok, context = loaded.tokenizer, loaded.config.context_length
    chosen = [i for i, (n, s) in enumerate(zip(counts, strategies)) if s == "single" and n <= context - SECTION_RESERVE]
    if len(chosen) < 2 or attention.attention == "indexpool":
        return {}
    prompts = [document_prompt(tok, DocumentTokens.encode(tok, docs[i]), request_messages(request)) for i in chosen]
    session = open_session(loaded, dataclasses.replace(attention, attention="dense"), context)
    batch = section_batch_size(session, [len(p.ids) for p in prompts], budget, available_memory_bytes())

    def show(rows: range, total: int) -> None:
        if run.progress:
            err_console.print(f"[dim]summarizing inputs {rows.start + 1}-{rows.stop} of {total} fitting the model's "
                              f"context as one batch[/dim]" if len(rows) > 1 else
                              f"[dim]summarizing input {rows.start + 1} of {total}[/dim]")

    results = generate_each(session, tok, prompts, [docs[i] for i in chosen], sampling.sampler(), budget, batch, show)
    for i, result in zip(chosen, results):
        result.sources = matched_sources(result.text, docs[i])
        result.notes.append("decoded in a batch with other inputs: sources are the parts whose wording the summary "
                            "repeats (a batch keeps no attention evidence)")
    return dict(zip(chosen, results))


def _summarize_hierarchical(loaded, doc, request: str, budget: int, section_tokens: int | None, run: RunChoice,
                            sampling: SamplingChoice, attention: AttentionChoice, label: str | None) -> None:
    from .jobs import summarize_hierarchical

    dense = dataclasses.replace(attention, attention="dense")
    result = summarize_hierarchical(
        loaded, doc, request, budget, sampling.sampler(), section_tokens,
        lambda needed: open_session(loaded, dense, needed),
        lambda needed: open_session(loaded, attention, needed, auto="indexpool"),
        on_text=None if run.json_out else _write_stdout,
        on_section=_show_sections if run.progress else None)
    _show_result(result, request, loaded, run, label)


def _show_label(label: str | None, index: int, run: RunChoice) -> None:
    """The heading of one input's result among several (text output), as head(1) heads files."""
    if label is not None and not run.json_out:
        sys.stdout.write(("\n" if index else "") + f"==> {label} <==\n")
        sys.stdout.flush()


def _show_sections(batch: range, total: int) -> None:
    which = f"section {batch.start + 1}" if len(batch) == 1 else f"sections {batch.start + 1}-{batch.stop}"
    err_console.print(f"[dim]summarizing {which}/{total}[/dim]")


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
    from .jobs import (DOCUMENT_MARK, PROBE_QUESTION, DocumentTokens, document_prompt, evidence_baseline,
                       read_document, run_request, session_identity)

    if paths and "-" in paths:
        raise typer.BadParameter("chat reads its messages from stdin, so a document cannot come from stdin too")
    doc = document.load(paths) if paths else None
    sampler = sampling.sampler()
    loaded = _load(run)
    tok = loaded.tokenizer
    base = [{"role": "system", "content": system}] if system else []
    if doc is None:
        session = open_session(loaded, attention, None)
    else:
        doc_tokens = DocumentTokens.encode(tok, doc)
        base += [{"role": "user", "content": f"{DOCUMENT_MARK}\nThis is the document we will talk about."},
                 {"role": "assistant", "content": "I have read it. What would you like to know?"}]
        prompt = document_prompt(tok, doc_tokens, base, attention.kpool)
        session = open_session(loaded, attention, len(prompt.ids) + DOCUMENT_CHAT_TOKENS, auto="indexpool")
        identity, doc_cache = session_identity(loaded, session, attention), document.cache()
        description = f"{', '.join(paths)} ({len(doc_tokens.ids):,} tokens)"
        with prefill_progress(prompt.reusable, enabled=run.progress) as on_progress:
            read_document(session, prompt, identity, doc_cache, description, lambda m: _warn(m, run), on_progress)
        probe = base + [{"role": "user", "content": PROBE_QUESTION}]
        baseline = evidence_baseline(session, tok, doc_tokens, prompt, probe, identity, doc_cache, description,
                                     lambda m: _warn(m, run))

    def encode(conversation):
        if doc is None:
            return tok.encode_chat(conversation)
        return document_prompt(tok, doc_tokens, conversation, attention.kpool)

    def length(encoded) -> int:
        return len(encoded if doc is None else encoded.ids)

    messages = list(base)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            err_console.print("[bold cyan]you>[/bold cyan] ", end="")
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(base)
            continue
        messages.append({"role": "user", "content": line})
        encoded = encode(messages)
        # Drop the oldest exchanges (never the document) when the conversation no longer fits, keeping room for
        # the reply.
        while length(encoded) + max_new_tokens > session.max_length and len(messages) > len(base) + 1:
            del messages[len(base) : len(base) + 2]
            encoded = encode(messages)
        if length(encoded) >= session.max_length:
            raise InputError(f"the message has {length(encoded)} tokens; the model's context is {session.max_length}")
        budget = min(max_new_tokens, session.max_length - length(encoded))
        if doc is None:
            reply, stats = _stream(session, tok, encoded, sampler, budget, run.json_out, quiet=True)
            record = {"text": reply, "model": loaded.name, **_stats_json(stats)}
        else:
            result = run_request(session, tok, encoded, doc, sampler, budget, None if run.json_out else _write_stdout,
                                 True, 0.0, baseline=baseline)
            reply = result.text
            record = {"model": loaded.name, **result.to_json(), "fed_tokens": session.last_fed_tokens}
            if not run.json_out and result.sources:
                sys.stdout.write(("" if reply.endswith("\n") else "\n") + "Sources: "
                                 + "; ".join(s["cite"] for s in result.sources))
        messages.append({"role": "assistant", "content": reply})
        if run.json_out:
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()


cache_app = typer.Typer(help="The document cache: documents already read, kept for the next request.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CacheDirOpt = Annotated[Optional[Path], typer.Option("--cache-dir", help="Document cache directory.", envvar="INDEXPOOL_CACHE_DIR")]


@cache_app.command("list")
def cache_list(cache_dir: CacheDirOpt = None, json_out: JsonOpt = False):
    """List cached documents, most recently used first."""
    from indexpool.model.tensor_cache import TensorCache

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


@cache_app.command("clear")
def cache_clear(cache_dir: CacheDirOpt = None):
    """Delete every cached document, and the results kept from servers (--backend openai)."""
    from indexpool.model.tensor_cache import TensorCache

    cache = TensorCache(cache_directory(cache_dir))
    freed = cache.clear()
    for kept in (cache.directory / REMOTE_RESULTS).glob("*.json"):
        freed += kept.stat().st_size
        kept.unlink()
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

    from indexpool.kernels.cpu_attention import decode_attention_path, prefill_attention_path
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
    params = sum(p.numel() for p in {id(p): p for p in m.parameters()}.values())
    facts = {
        "model": loaded.name,
        "source": str(loaded.source),
        "architecture": cfg.arch,
        "parameters": params,
        "file_bytes": loaded.file_bytes,
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
        "decode_weights": "+".join(f"int{b}" for b in sorted({q.bits for q in m.modules() if isinstance(q, DecodeQuantLinear)})) or "same as dtype",
        "decode_linear": decode_weights_path(m),
        "decode_attention": decode_attention_path(next(m.parameters()).device, kv_dtype, cfg.head_dim),
        "decode_step": m.decode_step_path(),
        "prefill_attention": prefill_attention_path(next(m.parameters()).device, m.dtype, cfg.head_dim),
    }
    facts.update(_indexpool_bytes(loaded))
    facts["cache_bytes"] = {str(n): _llama_cache_bytes(facts, n) for n in lengths}
    _print_facts(facts, run.json_out)


def _token_counts(text: str) -> list[int]:
    units = {"k": 1024, "m": 1024**2}
    try:
        counts = [int(t[:-1]) * units[t[-1].lower()] if t[-1:].lower() in units else int(t)
                  for t in text.replace(" ", "").split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"--tokens takes token counts like 131072,1M, not {text!r}")
    return counts


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
            shown = f"{value:,}" if isinstance(value, int) and key not in ("threads",) else value
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

    file = path / "config.json" if path.is_dir() else path
    try:
        return Glm5NextConfig.from_hf(json.loads(file.read_text()))
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
        raise InputError(f"{file}: not a glm5_next config ({type(e).__name__}: {e})") from None


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
    """IndexPool cache bytes per token (all layers) with the default settings and indexer, per storage choice."""
    from indexpool.model.indexpool_cache import IndexPoolCache

    from indexpool.model.sessions import default_indexer, segment_indexer

    from .attention import calibrating

    options = AttentionChoice().options()
    indexer, for_segments = default_indexer(options, loaded, calibrating), segment_indexer(options, loaded)
    parts = {}
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
    decode_weights: Annotated[str, typer.Option("--decode-weights", help="Comma-separated --decode-weights choices for our engine, each run in turn (auto, int4, int8, off); the ratios are the first one's.")] = "auto",
    json_out: JsonOpt = False,
):
    """Benchmark our engine against transformers (and llama.cpp if installed) on the same weights."""
    from indexpool.model.runtime import decode_bits

    from .bench import ENGINES, run_bench

    chosen = engines.split(",")
    if unknown := [e for e in chosen if e not in ENGINES]:
        raise typer.BadParameter(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    weights = tuple(decode_weights.split(","))
    try:
        for choice in weights:
            decode_bits(choice, 16)  # checked before any run
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_bench(model, [int(c) for c in contexts.split(",")], prefill_length, decode_tokens, repeats, chosen, json_out,
              weights)


from .distill import distill  # noqa: E402  (the command's heavy imports happen when it runs)

command(distill)


def main() -> None:
    import typer.main

    from .settings import ConfigError, default_map

    try:
        group = typer.main.get_command(app)
        try:
            defaults = default_map(group)
        except ConfigError as e:
            fail(str(e), code=2)
        group.main(prog_name="indexpool", default_map=defaults, auto_envvar_prefix="INDEXPOOL")
    except SettingsError as e:  # a setting the engine cannot run with: a usage error
        fail(str(e), code=2)
    except (ModelLoadError, InputError, IngestError) as e:
        fail(str(e), code=3)
    except RemoteError as e:
        fail(str(e), code=1)
    except Exception as e:  # anything else is our bug or the machine's; still one line, no traceback
        fail(f"{type(e).__name__}: {e}", code=1)
