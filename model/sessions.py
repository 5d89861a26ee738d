"""Opening a session for an input: dense attention or IndexPool, the indexers that choose what IndexPool attends
to, and the checks that refuse an input before anything is read (the model's context, the memory available).
Errors are the engine's: `SettingsError` for a setting it cannot run with, `InputError` for an input it refuses."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch

from .errors import InputError, SettingsError
from .indexpool_cache import INDEX_DTYPES, KV_STORAGE, IndexPoolConfig

ATTENTION_MODES = ("auto", "dense", "indexpool")
INDEXER_KINDS = ("auto", "training-free", "trained", "hybrid")
MAX_SESSION_TOKENS = 1 << 22  # 4M: past the 1M IndexPool is built for; an absurd -n fails here, not in allocation
CHAT_CONTEXT = 131072  # IndexPool capacity of an open-ended chat; memory is only touched as it fills
MEMORY_LIMIT_VARIABLE = "INDEXPOOL_MEMORY_LIMIT"


@dataclass
class SessionOptions:
    """How a session attends: `attention` auto (IndexPool when the input does not fit the model's context, else
    dense), dense or indexpool; IndexPool's settings; its indexer (auto, training-free, trained, hybrid, or a
    file from `indexpool distill`) and whether the training-free one prunes its keys (None: on)."""

    attention: str = "auto"
    indexpool: IndexPoolConfig = field(default_factory=IndexPoolConfig)
    indexer: str = "auto"
    prune_index: bool | None = None

    def check(self) -> None:
        for name, value, allowed in (("--attention", self.attention, ATTENTION_MODES),
                                     ("--index-dtype", self.indexpool.index_dtype, tuple(INDEX_DTYPES)),
                                     ("--kv-storage", self.indexpool.kv_storage, KV_STORAGE)):
            if value not in allowed:
                raise SettingsError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


def default_indexer(options: SessionOptions, loaded,
                    calibrating: Callable[[], ContextManager] = contextlib.nullcontext, calibrate_now: bool = True):
    """The indexer choosing what a query attends to (for the hybrid indexer: what the short forwards, a question
    and the generated tokens, attend to; `segment_indexer` chooses for the document's segments). `calibrating()`
    wraps the one-time calibration of the index pruning (a progress display); without `calibrate_now` an indexer
    whose pruning is not calibrated yet keeps whole keys (`indexpool info`: it reads no document)."""
    from .indexers import TrainingFreeIndexer

    kind = options.indexer
    if kind in ("auto", "training-free", "hybrid"):  # auto: hybrid, or training-free alone (segment_indexer)
        projection = None
        if options.prune_index is not False:  # on unless turned off: recall as whole keys, decode at 128K 17% faster
            from .index_pruning import pruning_projection

            # A CPU emulates fp16 arithmetic: there the calibration's dense read of 8K tokens takes minutes (seconds
            # in bf16 or fp32), so it runs only when --prune-index asks for it; until then the keys stay whole.
            emulated = loaded.model.dtype == torch.float16 and loaded.model.device.type == "cpu"
            projection = pruning_projection(loaded, calibrating=calibrating,
                                            calibrate_now=calibrate_now and (bool(options.prune_index) or not emulated))
        return TrainingFreeIndexer(loaded.config, options.indexpool.kpool, loaded.model.device,
                                   projection, options.indexpool.far_distances())
    if options.prune_index:
        raise SettingsError("--prune-index applies to the training-free indexer (--indexer auto, training-free or "
                            "hybrid); a trained indexer has keys of its own width")
    return lightning_indexer(kind, loaded)


def segment_indexer(options: SessionOptions, loaded):
    """The indexer choosing what long forwards (the document's segments) attend to when it is not the one
    `default_indexer` gives: the shipped trained one for the hybrid indexer, and for auto when one is shipped for
    this very model file (auto reads as hybrid then: see docs/benchmarks.md); None otherwise."""
    if options.indexer not in ("auto", "hybrid"):
        return None
    try:
        return lightning_indexer("trained", loaded)
    except InputError:
        if options.indexer == "hybrid":
            raise
        return None  # auto, and none shipped for this model: the training-free indexer reads the segments too


def describe_indexers(indexer, for_segments) -> str:
    """The indexer's class, and the segments' one when another reads them (hybrid), for a report's header."""
    return type(indexer).__name__ + (f" (segments: {type(for_segments).__name__})" if for_segments is not None else "")


def lightning_indexer(kind: str, loaded):
    """The shipped trained indexer (kind "trained") or the one in the file `kind`."""
    from .lightning_indexer import LightningIndexer, ModelFingerprint, default_indexer_path

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
        return LightningIndexer.load(path, device=loaded.model.device,
                                     model=ModelFingerprint.of(loaded))
    except ValueError as e:
        raise InputError(f"indexer {path}: {e}") from None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), capped by INDEXPOOL_MEMORY_LIMIT (bytes) when set; else None."""
    limit = os.environ.get(MEMORY_LIMIT_VARIABLE)
    if limit:
        try:
            cap = int(limit)
        except ValueError:
            raise InputError(f"{MEMORY_LIMIT_VARIABLE} must be a number of bytes, not {limit!r}") from None
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


def open_session(loaded, options: SessionOptions, needed_tokens: int | None, auto: str = "fit",
                 calibrating: Callable[[], ContextManager] = contextlib.nullcontext):
    """A session for an input of `needed_tokens` (prompt + new tokens), or an open-ended one (None: chat).
    Attention auto means dense when the input fits the model's context (auto="fit"), or always IndexPool
    (auto="indexpool": document jobs, whose sources come from the indexer)."""
    from .generate import Session

    options.check()
    if needed_tokens is not None and needed_tokens > MAX_SESSION_TOKENS:
        raise InputError(f"the input needs {needed_tokens:,} tokens (prompt + new tokens), more than the "
                         f"{MAX_SESSION_TOKENS:,} a session holds; lower --max-new-tokens or read less")
    if loaded.config.arch == "glm5_next":
        return native_sparse_session(loaded, options, needed_tokens)
    context = loaded.config.context_length
    settings = options.indexpool
    try:  # the knobs are checked even when this input ends up dense
        settings.validate(context)
    except ValueError as e:
        raise SettingsError(str(e)) from None
    mode = options.attention
    if mode == "auto":
        fits = auto == "fit" and needed_tokens is not None and needed_tokens <= context
        mode = "dense" if fits else "indexpool"
    if mode == "dense":
        if needed_tokens is not None and needed_tokens > context:
            raise InputError(f"the input needs {needed_tokens} tokens (prompt + new tokens) but dense attention holds "
                             f"the model's context of {context}; use --attention indexpool (or auto)")
        return Session(loaded.model, min(context, needed_tokens or context))
    session = Session(loaded.model, needed_tokens or CHAT_CONTEXT, attention=settings,
                      indexer=default_indexer(options, loaded, calibrating),
                      segment_indexer=segment_indexer(options, loaded), words=loaded.tokenizer.word_ids)
    if needed_tokens is not None:
        check_memory_budget(session.cache, needed_tokens)
    return session


def native_sparse_session(loaded, options: SessionOptions, needed_tokens: int | None):
    """A session of a model with its own sparse attention (glm5_next: the DSA indexer over MLA latents), which
    attention auto and dense both run; IndexPool's settings do not apply to it."""
    from .generate import Session

    return Session(loaded.model, native_sparse_length(loaded, options, needed_tokens))


def speculative_session(loaded, options: SessionOptions, needed_tokens: int, temperature: float):
    """Greedy decoding with a glm5_next model's MTP layer drafting (`SpeculativeSession`), after the checks a
    session of that model makes."""
    from .generate import SpeculativeSession

    if getattr(loaded.model, "mtp", None) is None:
        raise SettingsError("--speculative drafts with a glm5_next model's MTP layer, and this model has none")
    if temperature != 0:
        raise SettingsError("--speculative decodes greedily: add --temperature 0")
    native_sparse_length(loaded, options, needed_tokens)
    return SpeculativeSession(loaded.model)


def native_sparse_length(loaded, options: SessionOptions, needed_tokens: int | None) -> int:
    """The cache length a glm5_next session gets for this input, or an error: IndexPool asked for, an input past
    the model's context, or a cache larger than the memory available."""
    from .glm5_next import cache_size

    if options.attention == "indexpool":
        raise SettingsError(f"{loaded.config.arch} models have their own DSA indexer, which --attention auto "
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
