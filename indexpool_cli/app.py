"""The `indexpool` command line.

Results go to stdout, progress and messages to stderr (progress only when stderr is a terminal), `--json` prints
one JSON object per result. Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 bad input (file, model, text).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated, Optional

import contextlib
import functools
import itertools

import typer

from model.errors import ModelLoadError

from .attention import AttentionChoice, attention_options, open_session
from .console import InputError, err_console, fail, prefill_progress, read_text_input, show_stats

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
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: one per physical core).")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens to generate.")]
TempOpt = Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 for greedy decoding.")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0: all).")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1: off).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Seed for reproducible sampling.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of streaming text.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or statistics on stderr.")]


def _load(model: str | None, dtype: str, threads: int | None, quiet: bool, decode_weights: str = "auto"):
    from model.runtime import decode_bits, default_device, load_engine, resolve_dtype, set_threads

    try:
        resolve_dtype(dtype, default_device())
        decode_bits(decode_weights, 16)
        set_threads(threads)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    t0 = time.perf_counter()
    with err_console.status("loading model", spinner="dots") if err_console.is_terminal and not quiet else contextlib.nullcontext():
        loaded = load_engine(model, dtype, decode_weights=decode_weights)
    if err_console.is_terminal and not quiet:
        err_console.print(f"[dim]{loaded.name} ({loaded.model.dtype}) loaded in {time.perf_counter() - t0:.1f}s[/dim]")
    return loaded


def _sampler(temperature: float, top_k: int, top_p: float, seed: int | None):
    from model.generate import Sampler, SamplingParams

    if top_p == 0:
        raise typer.BadParameter("--top-p must be greater than 0")
    return Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))


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
def complete(
    prompt: Annotated[Optional[str], typer.Argument(help="Text to continue; '-' or a pipe reads stdin.")] = None,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = 256,
    temperature: TempOpt = 0.7,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    seed: SeedOpt = None,
    dtype: DtypeOpt = "auto",
    decode_weights: DecodeWeightsOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    attention: AttentionChoice = None,
):
    """Continue raw text (no chat template), streaming only the new text to stdout. Inputs longer than the model's
    context are read with IndexPool sparse attention."""
    text = read_text_input(prompt)
    sampler = _sampler(temperature, top_k, top_p, seed)
    loaded = _load(model, dtype, threads, quiet, decode_weights)
    tok = loaded.tokenizer
    ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(text)
    if not ids:
        raise InputError("the prompt is empty")
    session = open_session(loaded, attention, len(ids) + max_new_tokens)
    out, stats = _stream(session, tok, ids, sampler, max_new_tokens, json_out, quiet)
    if json_out:
        print(json.dumps({"text": out, "model": loaded.name, **_stats_json(stats)}, ensure_ascii=False))
    elif not quiet:
        show_stats(stats, newline=not out.endswith("\n"))


@command
@attention_options
def chat(
    model: ModelOpt = None,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message.")] = None,
    max_new_tokens: MaxNewOpt = 512,
    temperature: TempOpt = 0.7,
    top_k: TopKOpt = 40,
    top_p: TopPOpt = 0.95,
    seed: SeedOpt = None,
    dtype: DtypeOpt = "auto",
    decode_weights: DecodeWeightsOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    attention: AttentionChoice = None,
):
    """A minimal interactive chat: one message per line on stdin; /reset starts over, /exit or Ctrl-D ends.
    With IndexPool (the default) a conversation can grow to 128K tokens; with dense attention the oldest exchanges
    are dropped when it outgrows the model's context."""
    sampler = _sampler(temperature, top_k, top_p, seed)
    loaded = _load(model, dtype, threads, quiet, decode_weights)
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
        reply, stats = _stream(session, tok, ids, sampler, min(max_new_tokens, session.max_length - len(ids)), json_out, quiet=True)
        messages.append({"role": "assistant", "content": reply})
        if json_out:
            print(json.dumps({"text": reply, "model": loaded.name, **_stats_json(stats)}, ensure_ascii=False), flush=True)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()


@command
def info(
    model: ModelOpt = None,
    dtype: DtypeOpt = "auto",
    decode_weights: DecodeWeightsOpt = "auto",
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
):
    """Describe the model: size, dtype, threads, context length and cache bytes per token (dense and IndexPool)."""
    import torch

    from model.quant import DecodeQuantLinear

    loaded = _load(model, dtype, threads, quiet=True, decode_weights=decode_weights)
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
    except (ModelLoadError, InputError) as e:
        fail(str(e), code=3)
    except Exception as e:  # anything else is our bug or the machine's; still one line, no traceback
        fail(f"{type(e).__name__}: {e}", code=1)
