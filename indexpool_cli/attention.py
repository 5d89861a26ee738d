"""The attention options every generating command shares (dense or IndexPool, and IndexPool's knobs), and the
session they open."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from model.indexpool_cache import INDEX_DTYPES, KV_STORAGE, IndexPoolConfig

from .console import InputError
from .options import option_group

ATTENTION_MODES = ("auto", "dense", "indexpool")
INDEXER_KINDS = ("auto", "training-free", "trained", "hybrid")
CHAT_CONTEXT = 131072  # IndexPool capacity of an open-ended chat; memory is only touched as it fills


@dataclass
class AttentionChoice:
    attention: Annotated[str, typer.Option("--attention", help="auto (IndexPool when the input does not fit the model's context, else dense), dense or indexpool.")] = "auto"
    kpool: Annotated[int, typer.Option("--kpool", min=1, help="IndexPool: tokens merged into one pooled index key.")] = IndexPoolConfig.kpool
    topk: Annotated[int, typer.Option("--topk", min=1, help="IndexPool: far tokens each query attends to (a multiple of kpool).")] = IndexPoolConfig.topk
    window: Annotated[int, typer.Option("--window", min=1, help="IndexPool: recent tokens always attended.")] = IndexPoolConfig.window
    sinks: Annotated[int, typer.Option("--sinks", min=0, help="IndexPool: first tokens always attended.")] = IndexPoolConfig.sinks
    sink_distance: Annotated[int, typer.Option("--sink-distance", min=0, help="IndexPool: how far back the sinks sit once far tokens are selected (a gap before the far tokens, as far as the model's context allows; 0: right before them). The default keeps them past the distance where the default model makes new attention sinks (docs/benchmarks.md).")] = IndexPoolConfig.sink_distance
    indexer: Annotated[str, typer.Option("--indexer", help="IndexPool indexer: auto (hybrid where a trained indexer is shipped for the model, else training-free: it measured best, see docs/benchmarks.md), training-free, trained (the one shipped for the model), hybrid (the trained one chooses what the document's segments attend to, the training-free one what the question and the answer attend to), or an indexer file from `indexpool distill`.")] = "auto"
    prune_index: Annotated[Optional[bool], typer.Option("--prune-index/--no-prune-index", help="IndexPool, training-free indexer: store the pooled index keys projected onto the directions holding 95% of each layer's key variance (calibrated once per model, ~15 s; docs/benchmarks.md has what it does to recall and speed). Default: on for the training-free indexer.")] = None
    index_dtype: Annotated[str, typer.Option("--index-dtype", help="IndexPool pooled-index storage: bf16, fp16 or fp8.")] = IndexPoolConfig.index_dtype
    kv_storage: Annotated[str, typer.Option("--kv-storage", help="IndexPool history K/V: auto (bf16 while it takes under a quarter of RAM, else int8), bf16, int8, or full (the model's dtype: fp32 on a CPU without bf16).")] = IndexPoolConfig.kv_storage
    indexer_schedule: Annotated[str, typer.Option("--indexer-schedule", help="IndexPool: which layers score pools (full) and which reuse the selection of the full layer before them (shared), comma-separated, a pattern repeated over the layers; 'full' scores in every layer.")] = ",".join(IndexPoolConfig.schedule or ["full"])
    offload_dir: Annotated[Optional[Path], typer.Option("--offload-dir", help="IndexPool: keep history K/V in a memory-mapped file in this directory (deleted on exit).")] = None

    def settings(self) -> IndexPoolConfig:
        return IndexPoolConfig(kpool=self.kpool, topk=self.topk, window=self.window, sinks=self.sinks,
                               sink_distance=self.sink_distance,
                               index_dtype=self.index_dtype, kv_storage=self.kv_storage,
                               schedule=[kind.strip() for kind in self.indexer_schedule.split(",")],
                               offload_dir=str(self.offload_dir) if self.offload_dir else None)


attention_options = option_group(AttentionChoice, "attention")


def default_indexer(choice: AttentionChoice, loaded):
    """The indexer choosing what a query attends to (for --indexer hybrid: what the short forwards, a question and
    the generated tokens, attend to; `segment_indexer` chooses for the document's segments)."""
    from model.indexers import TrainingFreeIndexer

    kind = choice.indexer
    if kind in ("auto", "training-free", "hybrid"):  # auto: hybrid, or training-free alone (segment_indexer)
        projection = None
        if choice.prune_index is not False:  # on unless turned off: recall as whole keys, decode at 128K 17% faster
            from model.index_pruning import pruning_projection

            from .console import err_console

            projection = pruning_projection(loaded, calibrating=lambda: err_console.status(
                "calibrating the index pruning (once per model)", spinner="dots"))
        return TrainingFreeIndexer(loaded.config, choice.kpool, loaded.model.tok_embeddings.weight.device, projection)
    if choice.prune_index:
        raise typer.BadParameter("--prune-index applies to the training-free indexer (--indexer auto, "
                                 "training-free or hybrid); a trained indexer has keys of its own width")
    return _lightning_indexer(kind, loaded)


def segment_indexer(choice: AttentionChoice, loaded):
    """The indexer choosing what long forwards (the document's segments) attend to when it is not the one
    `default_indexer` gives: the shipped trained one for --indexer hybrid, and for auto when one is shipped for this
    very model file (auto reads as hybrid then: see docs/benchmarks.md); None otherwise."""
    if choice.indexer not in ("auto", "hybrid"):
        return None
    try:
        return _lightning_indexer("trained", loaded)
    except InputError:
        if choice.indexer == "hybrid":
            raise
        return None  # auto, and none shipped for this model: the training-free indexer reads the segments too


def describe_indexers(indexer, for_segments) -> str:
    """The indexer's class, and the segments' one when another reads them (hybrid), for a report's header."""
    return type(indexer).__name__ + (f" (segments: {type(for_segments).__name__})" if for_segments is not None else "")


def _lightning_indexer(kind: str, loaded):
    """The shipped trained indexer (kind "trained") or the one in the file `kind`."""
    from model.lightning_indexer import LightningIndexer, ModelFingerprint, default_indexer_path

    if kind == "trained":
        path = default_indexer_path(loaded.name)
        if path is None:
            raise InputError(f"no trained indexer is shipped for {loaded.name}; make one with `indexpool distill` "
                             "and pass it with --indexer PATH")
    else:
        path = Path(kind)
        if not path.is_file():
            raise InputError(f"indexer file {path} not found (or use --indexer {'|'.join(INDEXER_KINDS)})")
    try:
        return LightningIndexer.load(path, device=loaded.model.tok_embeddings.weight.device,
                                     model=ModelFingerprint.of(loaded))
    except ValueError as e:
        raise InputError(f"indexer {path}: {e}") from None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), capped by INDEXPOOL_MEMORY_LIMIT (bytes) when set; else None."""
    limit = os.environ.get("INDEXPOOL_MEMORY_LIMIT")
    if limit:
        try:
            cap = int(limit)
        except ValueError:
            raise InputError(f"INDEXPOOL_MEMORY_LIMIT must be a number of bytes, not {limit!r}") from None
        available = available_memory_bytes_of_machine()
        return cap if available is None else min(cap, available)
    return available_memory_bytes_of_machine()


def available_memory_bytes_of_machine() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory_budget(cache, tokens: int) -> None:
    """Refuse, before reading anything, an input whose IndexPool cache would not fit in memory."""
    sizes = cache.bytes_per_token()
    in_memory = sizes["pooled_index"] + (0 if cache.settings.offload_dir else sizes["history_kv"])
    needed = tokens * in_memory + cache.fixed_bytes()
    available = available_memory_bytes()
    if available is not None and needed > 0.9 * available:
        hint = "read less (--pages, a smaller folder)" if cache.settings.offload_dir else \
            "pass --offload-dir DIR to keep the history on disk, or read less (--pages, a smaller folder)"
        raise InputError(f"the input needs {tokens:,} tokens of cache, about {needed / 2**30:.1f} GiB, more than the "
                         f"{available / 2**30:.1f} GiB of memory available; {hint}")


def open_session(loaded, choice: AttentionChoice, needed_tokens: int | None, auto: str = "fit"):
    """A session for an input of `needed_tokens` (prompt + new tokens), or an open-ended one (None: chat).
    --attention auto means dense when the input fits the model's context (auto="fit"), or always IndexPool
    (auto="indexpool": document jobs, whose sources come from the indexer)."""
    from model.generate import Session

    for name, value, allowed in (("--attention", choice.attention, ATTENTION_MODES),
                                 ("--index-dtype", choice.index_dtype, tuple(INDEX_DTYPES)),
                                 ("--kv-storage", choice.kv_storage, KV_STORAGE)):
        if value not in allowed:
            raise typer.BadParameter(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    if loaded.config.arch == "glm5_next":
        return native_sparse_session(loaded, choice, needed_tokens)
    context = loaded.config.context_length
    settings = choice.settings()
    try:  # the knobs are checked even when this input ends up dense
        settings.validate(context)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    mode = choice.attention
    if mode == "auto":
        fits = auto == "fit" and needed_tokens is not None and needed_tokens <= context
        mode = "dense" if fits else "indexpool"
    if mode == "dense":
        if needed_tokens is not None and needed_tokens > context:
            raise InputError(f"the input needs {needed_tokens} tokens (prompt + new tokens) but dense attention holds "
                             f"the model's context of {context}; use --attention indexpool (or auto)")
        return Session(loaded.model, min(context, needed_tokens or context))
    session = Session(loaded.model, needed_tokens or CHAT_CONTEXT, attention=settings,
                      indexer=default_indexer(choice, loaded), segment_indexer=segment_indexer(choice, loaded))
    if needed_tokens is not None:
        check_memory_budget(session.cache, needed_tokens)
    return session


def native_sparse_session(loaded, choice: AttentionChoice, needed_tokens: int | None):
    """A session of a model with its own sparse attention (glm5_next: the DSA indexer over MLA latents), which
    --attention auto and dense both run; IndexPool's settings do not apply to it."""
    from model.generate import Session

    return Session(loaded.model, native_sparse_length(loaded, choice, needed_tokens))


def speculative_session(loaded, choice: AttentionChoice, needed_tokens: int, sampler):
    """`complete --speculative`: greedy decoding with a glm5_next model's MTP layer drafting (`SpeculativeSession`),
    after the checks a session of that model makes."""
    from model.generate import SpeculativeSession

    if getattr(loaded.model, "mtp", None) is None:
        raise typer.BadParameter("--speculative drafts with a glm5_next model's MTP layer, and this model has none")
    if sampler.params.temperature != 0:
        raise typer.BadParameter("--speculative decodes greedily: add --temperature 0")
    native_sparse_length(loaded, choice, needed_tokens)
    return SpeculativeSession(loaded.model)


def native_sparse_length(loaded, choice: AttentionChoice, needed_tokens: int | None) -> int:
    """The cache length a glm5_next session gets for this input, or a one-line error: IndexPool asked for, an input
    past the model's context, or a cache larger than the memory available."""
    from model.glm5_next import cache_size

    if choice.attention == "indexpool":
        raise typer.BadParameter(f"{loaded.config.arch} models have their own DSA indexer, which --attention auto "
                                 "and dense run; IndexPool does not apply to them")
    context = loaded.config.context_length
    if needed_tokens is not None and needed_tokens > context:
        raise InputError(f"the input needs {needed_tokens} tokens (prompt + new tokens); the model's context is "
                         f"{context}")
    length = min(context, needed_tokens or CHAT_CONTEXT)
    needed = cache_size(loaded.config, length, loaded.model.dtype).total_bytes
    available = available_memory_bytes()
    if available is not None and needed > 0.9 * available:
        raise InputError(f"the input needs {length:,} tokens of cache, about {needed / 2**30:.1f} GiB, more than the "
                         f"{available / 2**30:.1f} GiB of memory available; read less (--pages, a smaller folder)")
    return length
