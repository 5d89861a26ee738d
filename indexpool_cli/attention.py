"""The attention options every generating command shares (dense or IndexPool, and IndexPool's knobs), as the
engine's `SessionOptions` (`indexpool.model.sessions` opens the session)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from indexpool.model.indexpool_cache import IndexPoolConfig
from indexpool.model.sessions import SessionOptions

from .console import err_console
from .options import option_group


@dataclass
class AttentionChoice:
    attention: Annotated[str, typer.Option("--attention", help="auto (IndexPool when the input does not fit the model's context, else dense), dense or indexpool.")] = "auto"
    kpool: Annotated[int, typer.Option("--kpool", min=1, help="IndexPool: tokens merged into one pooled index key.")] = IndexPoolConfig.kpool
    topk: Annotated[int, typer.Option("--topk", min=1, help="IndexPool: far tokens each query attends to (a multiple of kpool).")] = IndexPoolConfig.topk
    query_topk: Annotated[int, typer.Option("--query-topk", min=0, help="IndexPool: far tokens each token of the question and the answer attends to once there are more than --topk to choose from (a multiple of kpool; --topk caps it; fewer, better-ranked far tokens distract the model less: docs/benchmarks.md).")] = IndexPoolConfig.query_topk
    question_pools: Annotated[int, typer.Option("--question-pools", min=0, help="IndexPool: the question is read twice, first to find the pools of the document its tokens point to most; this many of them (each with its neighbours: 32 tokens) are kept, after the places --question-matches finds and as far as the question's far tokens go, in the selection of the question's and the answer's tokens (0, with --question-matches 0: read once; docs/benchmarks.md).")] = IndexPoolConfig.question_pools
    question_matches: Annotated[int, typer.Option("--question-matches", min=0, help="IndexPool: also keep up to this many places of the document holding the question's rarest word pairs (each with its neighbours: 32 tokens), ahead of --question-pools (0: none; docs/benchmarks.md).")] = IndexPoolConfig.question_matches
    window: Annotated[int, typer.Option("--window", min=1, help="IndexPool: recent tokens always attended.")] = IndexPoolConfig.window
    sinks: Annotated[int, typer.Option("--sinks", min=0, help="IndexPool: first tokens always attended.")] = IndexPoolConfig.sinks
    sink_distance: Annotated[int, typer.Option("--sink-distance", min=0, help="IndexPool: how far back the sinks sit once far tokens are selected (a gap before the far tokens, as far as the model's context allows; 0: right before them). The default keeps them past the distance where the default model makes new attention sinks (docs/benchmarks.md).")] = IndexPoolConfig.sink_distance
    indexer: Annotated[str, typer.Option("--indexer", help="IndexPool indexer: auto (hybrid where a trained indexer is shipped for the model, else training-free: it measured best, see docs/benchmarks.md), training-free, trained (the one shipped for the model), hybrid (the trained one chooses what the document's segments attend to, the training-free one what the question and the answer attend to), or an indexer file from `indexpool distill`.")] = "auto"
    prune_index: Annotated[Optional[bool], typer.Option("--prune-index/--no-prune-index", help="IndexPool, training-free indexer: store the pooled index keys projected onto the directions holding 95% of each layer's key variance (calibrated once per model, ~15 s; with --dtype fp16 on a CPU, which emulates fp16 and takes minutes, only when this flag is given; docs/benchmarks.md has what it does to recall and speed). Default: on for the training-free indexer.")] = None
    index_dtype: Annotated[str, typer.Option("--index-dtype", help="IndexPool pooled-index storage: bf16, fp16 or fp8.")] = IndexPoolConfig.index_dtype
    kv_storage: Annotated[str, typer.Option("--kv-storage", help="IndexPool history K/V: auto (bf16 while it takes under a quarter of RAM, else int8), bf16, int8, or full (the model's dtype: fp32 on a CPU without bf16).")] = IndexPoolConfig.kv_storage
    indexer_schedule: Annotated[str, typer.Option("--indexer-schedule", help="IndexPool: which layers score pools (full) and which reuse the selection of the full layer before them (shared), comma-separated, a pattern repeated over the layers; 'full' scores in every layer.")] = ",".join(IndexPoolConfig.schedule or ["full"])
    offload_dir: Annotated[Optional[Path], typer.Option("--offload-dir", help="IndexPool: keep history K/V in a memory-mapped file in this directory (deleted on exit).")] = None

    def settings(self) -> IndexPoolConfig:
        return IndexPoolConfig(kpool=self.kpool, topk=self.topk, query_topk=self.query_topk,
                               question_pools=self.question_pools, question_matches=self.question_matches,
                               window=self.window,
                               sinks=self.sinks, sink_distance=self.sink_distance,
                               index_dtype=self.index_dtype, kv_storage=self.kv_storage,
                               schedule=[kind.strip() for kind in self.indexer_schedule.split(",")],
                               offload_dir=str(self.offload_dir) if self.offload_dir else None)

    def options(self) -> SessionOptions:
        return SessionOptions(self.attention, self.settings(), self.indexer, self.prune_index)


attention_options = option_group(AttentionChoice, "attention")


def calibrating():
    """The spinner shown while the index pruning is calibrated (once per model)."""
    return err_console.status("calibrating the index pruning (once per model)", spinner="dots")
