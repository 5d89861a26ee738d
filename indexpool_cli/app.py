"""The `indexpool` command line.

Results go to stdout, progress and messages to stderr (progress only when stderr is a terminal), `--json` prints
one JSON object per result. Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 bad input (file, model, text).
"""

from __future__ import annotations

import contextlib
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

from model.errors import ModelLoadError

from .attention import AttentionChoice, attention_options, open_session
from .console import InputError, err_console, fail, prefill_progress, read_text_input, show_stats
from .ingest import IngestError
from .options import option_group

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
DecodeWeightsOpt = Annotated[str, typer.Option("--decode-weights", help="Weights for one-token decode steps on a bf16 CPU model: auto (int4 for 4-bit files, else int8), int4, int8 or off.")]
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
        from model.generate import Sampler, SamplingParams

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
        from .doc_cache import DocumentCache

        return DocumentCache(self.cache_dir) if self.doc_cache else None


def _load(run: RunChoice):
    from model.runtime import decode_bits, default_device, load_engine, resolve_dtype, set_threads

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
    return loaded


def _stream(session, tokenizer, prompt_ids, sampler, max_new_tokens, json_out: bool, quiet: bool):
    """Generate, writing text to stdout as it comes unless JSON is wanted; returns (text, stats)."""
    from model.generate import GenerationStats

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
    session = open_session(loaded, attention, len(ids) + max_new_tokens)
    out, stats = _stream(session, tok, ids, sampler, max_new_tokens, run.json_out, run.quiet)
    if run.json_out:
        print(json.dumps({"text": out, "model": loaded.name, **_stats_json(stats)}, ensure_ascii=False))
    elif not run.quiet:
        show_stats(stats, newline=not out.endswith("\n"))


def _document_job(paths: list[str], requests: list[str], max_new_tokens: int, run: RunChoice,
                  sampling: SamplingChoice, attention: AttentionChoice, document: DocumentChoice,
                  system: str | None = None) -> None:
    """Read the document once (or restore it from the document cache), then answer each request in turn."""
    from .jobs import document_prompt, read_document, run_request, session_identity

    doc = document.load(paths)
    for note in doc.notes:
        _warn(note, run)
    if doc.skipped and not run.quiet:
        _warn(f"skipped {len(doc.skipped)} file(s) or folder(s): " + ", ".join(f"{p} ({why})" for p, why in doc.skipped[:5])
              + (" ..." if len(doc.skipped) > 5 else ""), run)
    sampler = sampling.sampler()
    loaded = _load(run)
    tok = loaded.tokenizer
    prompts = [document_prompt(tok, doc, request, system, kpool=attention.kpool) for request in requests]
    needed = max(len(p.ids) for p in prompts) + max_new_tokens
    session = open_session(loaded, attention, needed, auto="indexpool")
    identity = session_identity(loaded, session, attention)
    doc_cache = document.cache()
    description = f"{', '.join(paths)} ({prompts[0].doc_end - prompts[0].doc_start:,} tokens)"
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        with prefill_progress(prompt.reusable, enabled=run.progress) as on_progress:
            cached = read_document(session, prompt, identity, doc_cache, description, lambda m: _warn(m, run), on_progress)
        read_seconds = time.perf_counter() - t0
        if i and len(requests) > 1 and not run.json_out:
            sys.stdout.write("\n")
        on_text = None if run.json_out else _write_stdout
        budget = min(max_new_tokens, session.max_length - len(prompt.ids))
        result = run_request(session, tok, prompt, doc, sampler, budget, on_text, cached, read_seconds)
        if run.json_out:
            print(json.dumps({"request": requests[i], "model": loaded.name, **result.to_json()}, ensure_ascii=False), flush=True)
            continue
        if not result.text.endswith("\n"):
            sys.stdout.write("\n")
        if result.sources:
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


PathsArg = Annotated[list[str], typer.Argument(help="Files, folders, or '-' for stdin.")]


@command
@attention_options
@option_group(DocumentChoice, "document")
@option_group(SamplingChoice, "sampling", temperature=0.0)
@option_group(RunChoice, "run")
def ask(
    path: Annotated[str, typer.Argument(help="A file, a folder, or '-' for stdin.")],
    question: Annotated[Optional[str], typer.Argument(help="The question.")] = None,
    questions: Annotated[Optional[list[str]], typer.Option("--question", "-Q", help="More questions on the same document (repeatable); it is read once.")] = None,
    max_new_tokens: MaxNewOpt = 200,
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
    document: DocumentChoice = None,
):
    """Answer questions about a document, book, codebase or chat log, citing the pages, lines or messages the
    answer rests on. The whole input is read in one context (IndexPool); a second question on the same input
    starts from the document cache."""
    from .jobs import ask_request

    asked = ([question] if question else []) + list(questions or [])
    if not asked:
        raise typer.BadParameter("give a question (after the path, or with --question)")
    if any(not q.strip() for q in asked):
        raise typer.BadParameter("a question is empty")
    _document_job([path], [ask_request(q) for q in asked], max_new_tokens, run, sampling, attention, document)


@command
@attention_options
@option_group(DocumentChoice, "document")
@option_group(SamplingChoice, "sampling", temperature=0.0)
@option_group(RunChoice, "run")
def summarize(
    paths: PathsArg,
    length: Annotated[str, typer.Option("--length", help="short, medium or long.")] = "medium",
    focus: Annotated[Optional[str], typer.Option("--focus", help="A topic to focus on.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate (default: by --length).")] = None,
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
    document: DocumentChoice = None,
):
    """Summarize documents in one pass over the whole text (IndexPool). Several paths are read as one document."""
    from .jobs import SUMMARY_LENGTHS, summary_request

    if length not in SUMMARY_LENGTHS:
        raise typer.BadParameter(f"--length must be one of {', '.join(SUMMARY_LENGTHS)}, not {length!r}")
    _document_job(list(paths), [summary_request(length, focus)], max_new_tokens or SUMMARY_LENGTHS[length][1], run,
                  sampling, attention, document)


@command
@attention_options
@option_group(SamplingChoice, "sampling")
@option_group(RunChoice, "run")
def chat(
    system: Annotated[Optional[str], typer.Option("--system", help="A system message.")] = None,
    max_new_tokens: MaxNewOpt = 512,
    run: RunChoice = None,
    sampling: SamplingChoice = None,
    attention: AttentionChoice = None,
):
    """A minimal interactive chat: one message per line on stdin; /reset starts over, /exit or Ctrl-D ends.
    With IndexPool (the default) a conversation can grow to 128K tokens; with dense attention the oldest exchanges
    are dropped when it outgrows the model's context."""
    sampler = sampling.sampler()
    loaded = _load(run)
    tok = loaded.tokenizer
    session = open_session(loaded, attention, None)
    base = [{"role": "system", "content": system}] if system else []
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
        ids = tok.encode_chat(messages)
        # Drop the oldest exchanges when the conversation no longer fits, keeping room for the reply.
        while len(ids) + max_new_tokens > session.max_length and len(messages) > len(base) + 1:
            del messages[len(base) : len(base) + 2]
            ids = tok.encode_chat(messages)
        if len(ids) >= session.max_length:
            raise InputError(f"the message has {len(ids)} tokens; the model's context is {session.max_length}")
        reply, stats = _stream(session, tok, ids, sampler, min(max_new_tokens, session.max_length - len(ids)), run.json_out, quiet=True)
        messages.append({"role": "assistant", "content": reply})
        if run.json_out:
            print(json.dumps({"text": reply, "model": loaded.name, **_stats_json(stats)}, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()


cache_app = typer.Typer(help="The document cache: documents already read, kept for the next request.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")
CacheDirOpt = Annotated[Optional[Path], typer.Option("--cache-dir", help="Document cache directory.", envvar="INDEXPOOL_CACHE_DIR")]


@cache_app.command("list")
def cache_list(cache_dir: CacheDirOpt = None, json_out: JsonOpt = False):
    """List cached documents, most recently used first."""
    from .doc_cache import DocumentCache

    cache = DocumentCache(cache_dir)
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
    """Delete every cached document."""
    from .doc_cache import DocumentCache

    cache = DocumentCache(cache_dir)
    freed = cache.clear()
    err_console.print(f"freed {freed / 2**20:.1f} MiB in {cache.directory}", markup=False)


@command
@option_group(RunChoice, "run")
def info(run: RunChoice = None):
    """Describe the model: size, dtype, threads, context length and cache bytes per token (dense and IndexPool)."""
    import torch

    from model.quant import DecodeQuantLinear

    loaded = _load(RunChoice(run.model, run.dtype, run.decode_weights, run.threads, run.json_out, quiet=True))
    json_out = run.json_out
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
        "context_length": cfg.context_length,
        "layers": cfg.n_layers,
        "hidden_size": cfg.dim,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "kv_cache_bytes_per_token": cfg.kv_bytes_per_token(m.dtype),
        "decode_weights": "+".join(f"int{b}" for b in sorted({q.bits for q in m.modules() if isinstance(q, DecodeQuantLinear)})) or "same as dtype",
    }
    facts.update(_indexpool_bytes(loaded))
    if json_out:
        print(json.dumps(facts))
        return
    width = max(map(len, facts))
    for key, value in facts.items():
        shown = f"{value:,}" if isinstance(value, int) and key not in ("threads",) else value
        print(f"{key.replace('_', ' '):<{width}}  {shown}")


def _indexpool_bytes(loaded) -> dict:
    """IndexPool cache bytes per token (all layers) with the default settings and indexer, per storage choice."""
    import torch

    from model.indexpool import per_token_index_bytes
    from model.indexpool_cache import IndexPoolCache

    from .attention import default_indexer

    choice = AttentionChoice()
    indexer = default_indexer(choice, loaded)
    parts = {}
    for kv_storage, index_dtype in (("bf16", "bf16"), ("int8", "fp8")):
        settings = choice.settings()
        settings.kv_storage, settings.index_dtype = kv_storage, index_dtype
        try:
            cache = IndexPoolCache(loaded.config, settings, indexer, 4 * settings.kpool, loaded.model.dtype)
        except ValueError:  # a model whose context cannot hold the default window, topk and segment
            return {}
        sizes = cache.bytes_per_token()
        parts[f"indexpool_history_kv_{kv_storage}_bytes_per_token"] = sizes["history_kv"]
        parts[f"indexpool_pooled_index_{index_dtype}_bytes_per_token"] = sizes["pooled_index"]
    parts["indexpool_indexer"] = type(indexer).__name__
    parts["per_token_index_bf16_bytes_per_token"] = per_token_index_bytes(indexer.key_dim, torch.bfloat16) * loaded.config.n_layers
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
    json_out: JsonOpt = False,
):
    """Benchmark our engine against transformers (and llama.cpp if installed) on the same weights."""
    from .bench import ENGINES, run_bench

    chosen = engines.split(",")
    if unknown := [e for e in chosen if e not in ENGINES]:
        raise typer.BadParameter(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    run_bench(model, [int(c) for c in contexts.split(",")], prefill_length, decode_tokens, repeats, chosen, json_out)


from .distill import distill  # noqa: E402  (the command's heavy imports happen when it runs)

command(distill)


def main() -> None:
    try:
        app()
    except (ModelLoadError, InputError, IngestError) as e:
        fail(str(e), code=3)
    except Exception as e:  # anything else is our bug or the machine's; still one line, no traceback
        fail(f"{type(e).__name__}: {e}", code=1)
