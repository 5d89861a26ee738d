"""The IndexPool cache: sparse attention over a long history for llama-family models, in bounded memory.

A query at position p attends exactly to three parts of the history:
  - sinks: the first `sinks` tokens (attention sinks), always;
  - the recent window ("L1"): every token from ws to p, ws = (p - window) rounded down to a pool boundary;
  - far tokens: the `topk` tokens of the best `topk // kpool` complete pools in [sinks, ws), chosen by an indexer
    (`model/indexers.py`) scoring the pooled index ("L2", `PooledIndexCache`: one pooled key per kpool tokens).
    While [sinks, ws) holds at most topk tokens, all of it is taken. topk 0 takes none and scores nothing: sinks
    and the recent window alone (StreamingLLM), the no-retrieval baseline of benchmarks/ruler.py. A short forward
    (a question, an answer's tokens) takes fewer once it selects: `query_topk`. Every far token beside the ones a
    question needs dilutes them: with a RULER-style needle's sentence forced into the selection at 32K, the
    default model answered 1 of 4 with 2,048 far tokens and 3 of 4 with 512 (docs/benchmarks.md).

Storage, per layer: the un-rotated K and V of every token in a `HistoryStore` (bf16 or int8 with one scale per
token and KV head; in memory or in a memory-mapped file), where the sinks and far tokens are gathered from; the
recent window in an exact bf16 buffer (its keys already rotated); the pooled index keys.

Positions. While everything before the window is taken, every token sits at its true position: a short input gets
exactly dense attention. Otherwise the selected far tokens keep their order but close up into one contiguous block
just before the window, with the sinks before them, at least `sink_distance` before a forward's first query (a gap
between sinks and far tokens makes up the difference, as far as the trained context allows), so no query-key
distance exceeds the trained context: sinks + topk + window + segment must fit in it, and the gap takes only what
they leave. (InfLLM puts all far tokens at one distance; here a number spread over several far tokens keeps its
digit order, which a copy needs.) Why the gap: the default model turns some tokens (the filler haystack's
sentence-opening " The") that see the first token ~3,600 back into attention sinks of their own, with keys far off
their kind's; with the sinks right before the far tokens, every prefill segment put its tokens at one offset there,
a few hundred such tokens at 512K, and a question's far selection, taking the keys that stand out, let them outbid
the needle in the layers that copy it (docs/benchmarks.md).

Kernels. The backend (`kernels.kernel_backend`: Triton on CUDA, torch elsewhere, INDEXPOOL_KERNELS to force one) is
chosen once per cache. On Triton, the far part and the window go through `kernels.sparse_attention` (gather, RoPE
at the placed positions, one online softmax) and pools are compressed by `kernels.pool_compress`; the torch code
here is the CPU path and the reference.

Selection. A forward of at most `query_tokens` tokens (a decode step, the last tokens of a prompt: the question)
selects per block of `query_block` consecutive queries (their scores summed; default 1: per query). In a longer
prefill segment each block of `segment_block` consecutive queries (default: the whole segment) shares one selection,
from the summed scores of `segment_queries` of its queries (`_block_pools`): a per-query scan of every pool for
thousands of queries would cost more than the attention it saves. Smaller blocks buy little perplexity for their
prefill time (measured from the mean query: 8K +2.2% against dense with one selection per 2048-token segment,
+2.0% with blocks of 256, which read 32K 10% slower; docs/benchmarks.md).
A per-query selection (`cumulative_scores`) ranks pools by the query's scores summed over the layers of this forward
that have scored so far, not by its own layer's alone: a layer's own scores single a needle out in a few layers
only, and a different few for each needle, while the sum keeps it ranked in the layers after them
(docs/benchmarks.md, "Long-context retrieval beyond passkey").
Questions (`question_pools`). `Session.prefill` reads a prompt's last tokens (a question: a short forward of two tokens
or more) twice. The first read (`read_question`) finds the pools its tokens single out most: for each pool, the
largest of its queries' scores for it, each summed over the scoring layers. Those few pools, with their neighbours
(`QUESTION_SPAN`), are kept ahead of every other in each per-query selection of the second read and of the answer's
tokens after it, and so, ahead of them, are the places where the document holds the question's rarest wording
(`question_matches`, `matching_pools`: pairs of consecutive question tokens met at most 32 times in the document,
or once per 4,096 tokens past 128K, each weighted by its rarity, the recent window's too where it holds what came
before the question: a place matching only part of a better place's phrase, a look-alike key, is passed over: not
read, and left out of the window these forwards attend; a far place joining in one run words that the question
keeps apart, holding only what the places taken hold together (a key made of words of two asked keys), is not read;
a place holding no phrase of the question, only pairs met by chance, is not read either, but the window keeps it;
another entry of a template around a taken place, a frame of the question's own words too common to rank places
with the same words around it (a word at a line's start and within a line taken for one, where the session has the
tokenizer's `word_ids`), is passed over as a look-alike is, where the caller says where its question begins,
`Session.prefill(question_from=...)`). Matched places, then scored ones, are cut at those forwards' far tokens
(query_topk), so a place no match finds goes to a scored pool's span, not to 4-token pieces of scattered places
(frequent-word answers copied garbled words from those); the pools the question scores best after those fill what
overlapping spans leave, none left to each query's own choice. At 128K the question's scored pools held 2 of a
multi-value needle's 4 values, its rarest pairs all 4; and the queries' own choices, beside kept pools that held
every needle, took the answers off them, where the needles alone were copied (docs/benchmarks.md).
A question names what it asks for (a needle's key), and the tokens that name it find the key's few occurrences;
the query that must write the answer matches the needle's form ("the number is:"), not its key, and ranks the
key's pool far lower (RULER-style niah_single at 32K, the default model, 10 samples: the answer's
first query selected the value's pool in none of the 15 scoring layers in 3 samples, its median rank 100-1,900 of
7,800; the question's kept pools held it in 9; docs/benchmarks.md).
An optional second indexer (`segment_indexer`: `--indexer hybrid`), with a pooled index of its own, makes the
shared selections (a segment's blocks, a forward read with one selection); the first one makes the per-query ones.
Layers alternate by default between a "full" indexer and a "shared" one that reuses the layer before's selection
(`IndexPoolConfig.schedule`, as GLM-5.2's IndexShare): scoring every pool in every layer was most of a decode
step at 128K, and adjacent layers choose alike (docs/benchmarks.md: perplexity at 8K +1.5% against
dense, +1.4% with every layer full; a 128K decode step ~40% shorter). Shared layers keep no pooled index.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from indexpool.kernels import kernel_backend
from indexpool.kernels.index_math import FP8_DTYPE
from indexpool.kernels.rope import apply_rope, rope_at
from indexpool.kernels.cpu_attention import attention_with_lse, merge_attention, native_attention

from .indexers import Indexer
from .indexpool import PooledIndexCache, indexer_source_layers, layer_schedule, per_token_index_bytes
from .llama import LlamaConfig, inverse_frequencies, zeroed

# Around each of a question's best pools, the pools kept with it: a needle's key sits a few tokens before its value,
# and the pool a question's tokens single out is the key's (from 12 tokens before it to 20 after).
QUESTION_SPAN = range(-3, 5)
# A pair of consecutive tokens met more often than this in a document names nothing in particular (`matching_pools`),
# nor, past 128K tokens, one met more often than once per MATCH_SPARSE tokens: a frame repeated around many keys (a
# reference's entries, a suite's needles) stays part of what ties a key's look-alikes to the place asked for.
MATCH_MAX_COUNT = 32
MATCH_SPARSE = 4096
# Tokens around a frame too common to rank places that its other places must share with a taken place's, for
# those to be another key's entries of one template (`_frame_look_alikes`); one fewer where more entries share them
# than a pair may be met and still name something (a template repeated that often is no document's recurring words).
FRAME_TEMPLATE = 3
TOKEN_PAIR_BASE = 1 << 32  # a pair of token ids as one int64: first * base + second
INDEX_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8_DTYPE}
KV_STORAGE = ("auto", "bf16", "int8", "full")


@dataclass
class IndexPoolConfig:
    kpool: int = 4
    topk: int = 2048  # far tokens per query (topk // kpool pools); 0: none, sinks and the recent window only
    query_topk: int = 256  # far tokens per query in short forwards (a question, an answer); topk caps it
    window: int = 1024  # recent tokens always attended ("L1")
    sinks: int = 64  # first tokens always attended
    sink_distance: int = 4096  # once far tokens are selected, the sinks sit at least this far back (module docstring)
    segment: int = 2048  # prefill tokens per forward; they share one far selection
    query_tokens: int = 64  # forwards of at most this many tokens select per block of query_block queries
    query_block: int = 1  # in such forwards, this many consecutive queries share one selection
    segment_block: int = 2048  # in longer forwards, this many consecutive queries share one selection,
    segment_queries: int = 32  # scored by this many of them (evenly spaced; `IndexPoolCache._block_pools`)
    segment_candidates: int = 2048  # among the pools the block's mean query scores best, when there are more
    index_dtype: str = "bf16"  # pooled index storage: bf16, fp16 or fp8 (e4m3, one scale per pooled key)
    # history K/V: bf16, int8, full (the model's dtype), or auto (bf16 while it takes under a quarter of RAM)
    kv_storage: str = "auto"
    offload_dir: str | None = None  # keep history K/V in a memory-mapped file in this directory
    schedule: Sequence[str] | None = ("full", "shared")  # a pattern repeated over the layers; None: all full
    cumulative_scores: bool = True  # per-query selections rank pools by their scores summed over the layers so far
    # A question's best pools, each with QUESTION_SPAN around it, kept for it and its answer after the matched places
    # as far as short_topk goes (8 spans: all of it when no place matches).
    question_pools: int = 8
    question_matches: int = 4  # places holding the question's rarest token pairs (`matching_pools`), kept likewise
    match_repeat_share: float = 0.9  # such a place holding a share of a better one's pairs, and no others: passed over

    def sink_gap(self, context_length: int) -> int:
        """Positions left empty between the sinks and the far tokens while far tokens are selected: what puts the
        sinks `sink_distance` before a forward's first query, as far as the trained context allows."""
        slack = context_length - (self.sinks + self.topk + self.window + self.segment + self.kpool)
        return max(0, min(self.sink_distance - self.window - self.topk, slack))

    def short_topk(self) -> int:
        """Far tokens a query of a short forward (at most query_tokens: a question, an answer) attends to once
        there are more than topk to choose from."""
        return min(self.query_topk, self.topk)

    def far_distances(self) -> tuple[int, int]:
        """How far back of a short forward's query the selected far tokens are read: closed up just before the
        window (module docstring), from the window's length to the window's and `short_topk`'s."""
        return self.window, self.window + self.short_topk()

    def validate(self, context_length: int) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.kpool >= 1, "kpool must be >= 1")
        need(self.topk >= 0 and self.topk % self.kpool == 0, f"topk must be 0 or a positive multiple of kpool={self.kpool}")
        need(self.query_topk >= 0 and self.query_topk % self.kpool == 0,
             f"query topk must be 0 or a positive multiple of kpool={self.kpool}")
        need(self.sinks >= 0 and self.sinks % self.kpool == 0, f"sinks must be a multiple of kpool={self.kpool}")
        need(min(self.window, self.segment, self.query_tokens, self.query_block, self.segment_block) >= 1,
             "window, segment, query tokens, query block and segment block must be >= 1")
        need(self.sink_distance >= 0, "sink distance must be >= 0")
        # Remapped sinks and far tokens sit just before the window: the longest distance a query sees is
        # sinks + topk + window + segment (+ the pool rounding of the window start), all inside what the model
        # was trained on; the sink gap only takes what that leaves.
        span = self.sinks + self.topk + self.window + self.segment + self.kpool
        need(span <= context_length,
             f"sinks + topk + window + segment ({self.sinks} + {self.topk} + {self.window} + {self.segment}) must "
             f"fit in the model's trained context of {context_length} tokens (with a pool to spare)")
        need(self.segment_queries >= 1, "segment queries must be >= 1")
        need(self.question_pools >= 0 and self.question_matches >= 0, "question pools and matches must be >= 0")
        need(0 <= self.match_repeat_share <= 1, "match repeat share must be between 0 and 1")
        need(self.segment_candidates >= self.topk // self.kpool,
             f"segment candidates must be at least the pools selected (topk / kpool = {self.topk // self.kpool})")
        need(self.index_dtype in INDEX_DTYPES, f"index dtype must be one of {', '.join(INDEX_DTYPES)}")
        need(self.kv_storage in KV_STORAGE, f"kv storage must be one of {', '.join(KV_STORAGE)}")
        if self.schedule:
            indexer_source_layers(self.schedule)  # raises on an unknown kind or a leading "shared"
        if self.offload_dir is not None:
            need(os.path.isdir(self.offload_dir), f"offload directory {self.offload_dir} does not exist")


def question_pools(tops: torch.Tensor, n_pools: int) -> torch.Tensor:
    """The pools (indices into n_pools) a question keeps: each of `tops` (best first) with the pools of
    QUESTION_SPAN around it, once each, in that order."""
    span = torch.tensor(QUESTION_SPAN, device=tops.device)
    spans = (tops[:, None] + span).flatten().clamp(0, n_pools - 1)
    return torch.tensor(list(dict.fromkeys(spans.tolist())), dtype=torch.long, device=tops.device)


class Matches(NamedTuple):
    places: torch.Tensor  # pools, best first
    look_alikes: torch.Tensor  # pools passed over holding part of a taken place's phrases, in the order met
    strays: torch.Tensor  # pools passed over holding question pairs on their own only (met by chance), likewise
    framed: torch.Tensor  # pools passed over holding another entry of a taken place's template (`_frame_look_alikes`)


def common_pair_count(pairs: int) -> int:
    """How often a pair of consecutive tokens may occur among a document's `pairs` and still count as naming
    something: MATCH_MAX_COUNT, or once per MATCH_SPARSE pairs where that is more."""
    return max(MATCH_MAX_COUNT, pairs // MATCH_SPARSE)


def matching_pools(document: torch.Tensor, question: torch.Tensor, kpool: int, count: int,
                   repeat_share: float = 0.0, uncounted_from: int | None = None,
                   frame_from: int | None = None, words: torch.Tensor | None = None) -> Matches:
    """Where `document` (token ids, starting at a pool boundary) holds the question's rarest wording: the pools
    (indices into document's complete pools, best first, no two within a QUESTION_SPAN of each other) holding pairs
    of consecutive question tokens, until `count` of them lie before pool `uncounted_from` (those from there, the
    recent window's, are read whole anyway: taken without counting), and the places passed over on the way.
    Each occurrence of a pair met at most `common_pair_count` times in the document (before pool `uncounted_from`)
    adds log(pairs there / its count) to its pool; a pool ranks by its own sum, twice, and its two neighbours' (a
    phrase spans pool boundaries). A place is passed over when its span holds in phrases (runs of the question's
    pairs, three tokens or more) only pairs that a place taken before holds too, weighing (each pair once) less
    than `repeat_share` of that place's: a look-alike, a distractor sharing part of the asked key's wording; or a
    stray, holding no phrase at all (its pairs met by chance). An exact repeat is kept, and a pair on its own beside
    a phrase (two words of the question met by chance) tells the two apart no more. A place before the window
    holding a joint, two counted pairs of the question's own words (question[frame_from:]; all of it where None) in
    a row whose three tokens the question does not hold in that order, is passed over too when its phrases hold
    only pairs that the places taken hold together, weighing less than `repeat_share` of theirs: a key made of
    words of two asked keys; taken before the places it joins (ranking above them), it is passed over once they are
    taken, and the next place taken in its stead. (In the window, read whole, the question's line breaks joined to
    its answer's first word made joints of section breaks.)
    A phrase of the question's own words (question[frame_from:]; None: none) too common to rank places, a frame
    repeated around many keys (a table's rows, a suite's needles), still ties to a taken place the places holding
    only it (`_frame_look_alikes`), listed apart: `framed`. (Not a question's first tokens, which may be the
    document's last: a section break there would make every section's start one.) `words`: each token id's word
    (`Tokenizer.word_ids`), by which the tokens around a frame are compared; None: by the ids themselves."""
    n_pools = len(document) // kpool
    if count <= 0 or n_pools == 0 or len(question) < 2:
        none = torch.empty(0, dtype=torch.long, device=document.device)
        return Matches(none, none, none, none)
    pairs = document[:-1] * TOKEN_PAIR_BASE + document[1:]
    wanted = torch.unique(question[:-1] * TOKEN_PAIR_BASE + question[1:])
    every_at = torch.isin(pairs, wanted).nonzero().flatten()
    distinct, every_which = torch.unique(pairs[every_at], return_inverse=True)
    # Pairs are counted where the places that count lie (a window's few tokens would tip pairs of the far document
    # over MATCH_MAX_COUNT); a pair met only in the window counts once.
    before = len(pairs) if uncounted_from is None else max(1, min(len(pairs), uncounted_from * kpool - 1))
    counts = torch.bincount(every_which[every_at < before], minlength=len(distinct)).clamp_min(1)
    rare = counts[every_which] <= common_pair_count(before)
    pair_weights = torch.log(before / counts.double())  # of each distinct pair
    # A pair next to another of the question's: part of a phrase of three tokens or more that it holds.
    every_phrased = torch.isin(every_at - 1, every_at) | torch.isin(every_at + 1, every_at)
    at, which, phrased = every_at[rare], every_which[rare], every_phrased[rare]
    own = torch.zeros(n_pools + 1, dtype=torch.float64, device=document.device)
    own.index_add_(0, at // kpool, pair_weights[which])  # a pair starting in the last, incomplete pool: spare slot
    own = own[:n_pools]
    score = 2 * own
    score[1:] += own[:-1]
    score[:-1] += own[1:]
    candidates = score.nonzero().flatten()
    chosen: list[int] = []
    counted = 0
    look_alikes: list[int] = []
    strays: list[int] = []
    framed: list[int] = []
    held: list[tuple[set[int], float, bool]] = []  # each chosen place's `phrase`
    weights = pair_weights.tolist()
    reach = len(QUESTION_SPAN) - 1  # two chosen pools further apart than this keep spans that do not overlap

    # Where two consecutive counted pairs of the question's own words join tokens that the question does not hold
    # in that order (a key made of words of two asked keys: "sleek-island" for "sleek-canyon" and "golden-island").
    asked = question if frame_from is None else question[frame_from:]
    asked_pairs = asked[:-1] * TOKEN_PAIR_BASE + asked[1:]
    links = torch.searchsorted(wanted, question[:-1] * TOKEN_PAIR_BASE + question[1:])
    links = links[:-1] * len(wanted) + links[1:]
    next_to = (at[1:] == at[:-1] + 1).nonzero().flatten()
    next_to = next_to[torch.isin(pairs[at[next_to]], asked_pairs) & torch.isin(pairs[at[next_to + 1]], asked_pairs)]
    ranks = torch.searchsorted(wanted, distinct)[which]
    joints = at[next_to[~torch.isin(ranks[next_to] * len(wanted) + ranks[next_to + 1], links)]]

    def far(pool: int) -> bool:  # before the recent window: a place that counts
        return uncounted_from is None or pool < uncounted_from

    def phrase(pool: int) -> tuple[set[int], float, bool]:
        """Its span's distinct counted pairs in phrases, their weight, and whether it is far and holds a joint."""
        lo, hi = max(pool + QUESTION_SPAN.start, 0) * kpool, min(pool + QUESTION_SPAN.stop, n_pools) * kpool
        first, last = (int(torch.searchsorted(at, bound)) for bound in (lo, hi))
        ids = set(which[first:last][phrased[first:last]].tolist())
        joined = far(pool) and int(torch.searchsorted(joints, lo)) < int(torch.searchsorted(joints, hi))
        return ids, sum(weights[i] for i in ids), joined

    def looks_like(ids: set[int], weight: float, joined: bool, taken: Sequence[tuple[set[int], float, bool]]) -> bool:
        """Part of one taken place's phrases, lighter than it by the share; or, holding a joint, of what the places
        taken hold together, lighter than they are together."""
        if any(ids <= other and weight < repeat_share * other_weight for other, other_weight, _ in taken):
            return True
        if not joined:
            return False
        together = set().union(*(other for other, _, _ in taken))
        return ids <= together and weight < repeat_share * sum(weights[i] for i in together)

    ranked = iter(candidates[score[candidates].argsort(descending=True, stable=True)].tolist())
    while True:
        for pool in ranked:
            if any(abs(pool - other) <= reach for other in chosen):
                continue
            held_here = phrase(pool)
            if looks_like(*held_here, held):
                (look_alikes if held_here[0] else strays).append(pool)
                continue
            chosen.append(pool)
            held.append(held_here)
            counted += far(pool)
            if counted == count:
                break
        # A joint taken before the places whose pairs it joins (it may rank above them: it holds the rare pairs of
        # two) is passed over once they are taken, the next candidate taken in its stead: among 200 needles at
        # 128K, 16 of 17 wrong copies in multi-query answers were such keys.
        joining = [j for j in range(len(chosen)) if held[j][2] and looks_like(*held[j], held[:j] + held[j + 1:])]
        if not joining:
            break
        pool = chosen.pop(joining[-1])
        held.pop(joining[-1])
        counted -= far(pool)
        look_alikes.append(pool)
    if frame_from is not None:
        frame = every_phrased & ~rare & torch.isin(pairs[every_at], asked_pairs)
        listed = set(look_alikes) | set(strays)
        as_words = document if words is None else words[document]
        for pool, taken in _frame_look_alikes(as_words, every_at, frame, chosen, held, kpool,
                                              common_pair_count(before)):
            if pool not in listed and all(abs(pool - other) > reach for other in chosen) and \
                    looks_like(*phrase(pool), [taken]):
                framed.append(pool)
                listed.add(pool)
    return Matches(*(torch.tensor(pools, dtype=torch.long, device=document.device)
                     for pools in (chosen, look_alikes, strays, framed)))


def _frame_look_alikes(words: torch.Tensor, at: torch.Tensor, frame: torch.Tensor, chosen: list[int],
                       held: list[tuple[set[int], float, bool]], kpool: int, common: int):
    """For `matching_pools`: (pool, the taken place's held phrase) for each other place of a frame that a taken
    place's span holds: a run of frame occurrences (`frame`: among `at`, the question's pairs' ascending positions,
    those phrased and too common to rank places) repeated as the same words, inside a template of the
    document's: at least FRAME_TEMPLATE words around it (before and after, as far as they run on alike; `words`,
    the document's tokens as words) the same as around the taken place's, or one fewer where over `common` places
    share that many. Placed where the taken place lies relative to its frame (a template repeated around many keys
    puts each key at the same offset from it). In turn for each taken place and each of its frames, in the
    document's order. A word met around the document (a library's name in its manual, 'UTF-8') is a frame by
    count, but the tokens around it run on differently from one place to the next."""
    spots = at[frame]
    if not len(spots) or not chosen:
        return
    n_pools = len(words) // kpool
    starts = torch.ones(len(spots), dtype=torch.bool, device=at.device)
    starts[1:] = spots[1:] != spots[:-1] + 1
    ends = torch.ones_like(starts)
    ends[:-1] = starts[1:]
    first, last = spots[starts], spots[ends]  # each frame's first and last pair
    reach = FRAME_TEMPLATE
    padded = F.pad(words, (reach, reach), value=-1)  # not a word: never alike

    def around(position: torch.Tensor, tokens: int) -> torch.Tensor:  # each frame's tokens and `reach` either side
        return padded[position[:, None] + torch.arange(tokens + 2 * reach, device=at.device)]

    for place, taken in zip(chosen, held):
        lo = max(place + QUESTION_SPAN.start, 0) * kpool
        hi = min(place + QUESTION_SPAN.stop, n_pools) * kpool
        for mine in ((first >= lo) & (first < hi)).nonzero().flatten().tolist():
            tokens = int(last[mine] - first[mine]) + 2
            alike = (last - first == last[mine] - first[mine]).nonzero().flatten()
            alike = alike[alike != mine]
            theirs = around(first[alike], tokens)
            equal = (theirs == around(first[mine: mine + 1], tokens)) & (theirs >= 0)
            core = equal[:, reach: reach + tokens].all(1)
            shared = equal[:, :reach].flip(1).cumprod(1).sum(1) + equal[:, reach + tokens:].cumprod(1).sum(1)
            near = core & (shared >= FRAME_TEMPLATE - 1)
            entries = near if int(near.sum()) > common else near & (shared >= FRAME_TEMPLATE)
            offset = place - int(first[mine]) // kpool
            for start in first[alike[entries]].tolist():
                yield min(max(start // kpool + offset, 0), n_pools - 1), taken


def keep_question_pools(scores: torch.Tensor, pools: torch.Tensor) -> torch.Tensor:
    """scores (..., P) with `pools` (indices into P, best first; those outside it skipped) ranked above every other
    pool and in their order, so that a top-k takes them first; a new tensor."""
    pools = pools[(pools >= 0) & (pools < scores.shape[-1])]
    scores = scores.clone()
    # Above any score (a sum of softmax probabilities over heads and layers), still exact in fp32 for the order.
    scores[..., pools] = 1e6 + torch.arange(len(pools), 0, -1, dtype=scores.dtype, device=scores.device)
    return scores


MASKED = -1e30  # finite: a row with nothing to see (a branch whose window starts at 0 has no far tokens) then
# gets a log-sum-exp near -1e30 and weight 0 in the merge, where -inf would give NaN


def additive_mask(hidden: torch.Tensor, device) -> torch.Tensor:
    """An additive fp32 attention mask on `device`: MASKED where hidden, 0 elsewhere."""
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden.to(device), MASKED)


def place_far_tokens(slots: torch.Tensor, ws, n_attended, n_sinks, gap: int) -> torch.Tensor:
    """RoPE positions of the attended tokens before the window (slot i: the sinks, then the far tokens, in order):
    at their true positions 0..ws-1 when all of them are taken (n_attended == ws); else closed up just before the
    window start ws, the sinks `gap` further back (the module docstring). ws, n_attended, n_sinks: ints, or tensors
    broadcasting against slots (one per branch)."""
    selecting = n_attended < ws
    return slots + (ws - n_attended) - gap * ((slots < n_sinks) & selecting)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, directory: str | None, device) -> torch.Tensor:
    """A tensor in memory (`zeroed`), or mapped from a file in `directory` (deleted at once: the mapping keeps it
    alive until the tensor is freed, and nothing is left behind if the process dies)."""
    if directory is None:
        return zeroed(shape, dtype, device)
    numel = math.prod(shape)
    fd, path = tempfile.mkstemp(prefix="indexpool-kv-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, numel * dtype.itemsize)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    finally:
        os.close(fd)
        os.unlink(path)


def history_dtype(storage: str, compute_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The dtype a history store of this kind holds: int8; "full", the compute dtype; "bf16", the compute dtype
    where that has 16 bits, and bf16 for an fp32 model on the torch backend (a CPU), which reads it widened: half
    the bytes of fp32, and the C decode kernel reads it as it lies. (An fp32 model on Triton keeps fp32: its kernels
    take the query's dtype.)"""
    if storage == "int8":
        return torch.int8
    if storage == "full" or compute_dtype.itemsize == 2 or backend != "torch":
        return compute_dtype
    return torch.bfloat16


class HistoryStore:
    """Un-rotated K and V of every token, (n_layers, max_tokens, kv_heads * head_dim), in `history_dtype`: 16 bits,
    the compute dtype, or int8.

    int8 keeps one absmax scale per token and KV head (fp32), so each head's vector is quantized on its own range.
    Reads give the compute dtype.
    """

    def __init__(self, n_layers: int, max_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 compute_dtype: torch.dtype, directory: str | None = None, device=None):
        self.kv_heads, self.head_dim, self.compute_dtype = kv_heads, head_dim, compute_dtype
        self.quantized = dtype == torch.int8
        shape = (n_layers, max_tokens, kv_heads * head_dim)
        self.k, self.v = (_allocate(shape, dtype, directory, device) for _ in range(2))
        if self.quantized:
            self.k_scale, self.v_scale = (torch.empty(n_layers, max_tokens, kv_heads, device=device) for _ in range(2))

    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        n_layers, _, width = self.k.shape
        scales = 2 * n_layers * self.kv_heads * 4 if self.quantized else 0
        return 2 * n_layers * width * self.k.element_size() + scales

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        scale = x.abs().amax(dim=-1).clamp_min(1e-12) / 127
        return (x / scale[..., None]).round_().to(torch.int8).flatten(-2), scale

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (T, kv_heads, head_dim) for positions [start, start + T)."""
        end = start + k.shape[0]
        if self.quantized:
            self.k[layer, start:end], self.k_scale[layer, start:end] = self._quantize(k)
            self.v[layer, start:end], self.v_scale[layer, start:end] = self._quantize(v)
        else:
            self.k[layer, start:end] = k.flatten(-2)
            self.v[layer, start:end] = v.flatten(-2)

    def _read(self, values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        values = values.unflatten(-1, (self.kv_heads, self.head_dim))
        if scale is None:
            return values.to(self.compute_dtype)
        return (values.float() * scale[..., None]).to(self.compute_dtype)

    def gather(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at positions (any shape S) as (*S, kv_heads, head_dim) in the compute dtype."""
        flat = positions.reshape(-1)
        k = self.k[layer].index_select(0, flat)
        v = self.v[layer].index_select(0, flat)
        if self.quantized:
            k = self._read(k, self.k_scale[layer].index_select(0, flat))
            v = self._read(v, self.v_scale[layer].index_select(0, flat))
        else:
            k, v = self._read(k, None), self._read(v, None)
        return k.view(*positions.shape, *k.shape[1:]), v.view(*positions.shape, *v.shape[1:])

    def heads(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's stored K and V as (1, kv_heads, tokens, head_dim) views (bf16/fp32 storage only)."""
        return tuple(t[layer].view(t.shape[1], self.kv_heads, self.head_dim).transpose(0, 1)[None]
                     for t in (self.k, self.v))

    def read(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end), (T, kv_heads, head_dim)."""
        scales = (self.k_scale[layer, start:end], self.v_scale[layer, start:end]) if self.quantized else (None, None)
        return self._read(self.k[layer, start:end], scales[0]), self._read(self.v[layer, start:end], scales[1])


def choose_kv_storage(setting: str, max_tokens: int, config: LlamaConfig, dtype: torch.dtype, backend: str) -> str:
    """auto: "bf16" while the history K/V takes under a quarter of the machine's memory, else int8."""
    if setting != "auto":
        return setting
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 16 << 30
    stored = history_dtype("bf16", dtype, backend)
    return "int8" if max_tokens * config.kv_bytes_per_token(stored) > memory // 4 else "bf16"


class IndexPoolCache:
    """Drop-in replacement for the dense `KVCache` (same begin/attend/truncate), batch size 1."""

    def __init__(self, config: LlamaConfig, settings: IndexPoolConfig, indexer: Indexer, max_length: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, segment_indexer: Indexer | None = None):
        settings.validate(config.context_length)
        for kind in (indexer, segment_indexer):
            if kind is not None and kind.kpool != settings.kpool:
                raise ValueError(f"the indexer pools {kind.kpool} tokens, the settings ask for kpool={settings.kpool}")
        self.config, self.settings, self.indexer = config, settings, indexer
        self.max_length, self.dtype = max_length, dtype
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.context_length = config.context_length
        self.sink_gap = settings.sink_gap(config.context_length)
        n_layers = config.n_layers
        self.backend = kernel_backend(device or "cpu")
        self.kv_storage = choose_kv_storage(settings.kv_storage, max_length, config, dtype, self.backend)
        self.store = HistoryStore(n_layers, max_length, config.n_kv_heads, config.head_dim,
                                  history_dtype(self.kv_storage, dtype, self.backend), dtype,
                                  settings.offload_dir, device)
        self.sources = indexer_source_layers(layer_schedule(settings.schedule, n_layers))
        # Layers with a "shared" indexer never score, so the pooled index holds the "full" ones only.
        self.index_slots = {layer: slot for slot, layer in enumerate(sorted(set(self.sources)))}
        full_layers = list(self.index_slots)
        self.index = PooledIndexCache(indexer.ape[full_layers], max_length, 1, INDEX_DTYPES[settings.index_dtype],
                                      device)
        # Optionally a second indexer (and pooled index) for the shared selections (see the module docstring).
        self.segment_indexer = segment_indexer
        self.segment_index = None if segment_indexer is None else \
            PooledIndexCache(segment_indexer.ape[full_layers], max_length, 1, INDEX_DTYPES[settings.index_dtype],
                             device)
        self.indexes = [self.index] + ([] if self.segment_index is None else [self.segment_index])
        # The window, plus a segment, plus the up to kpool - 1 tokens by which ws is rounded down.
        self.recent_capacity = settings.window + settings.segment + settings.kpool
        recent_shape = (n_layers, config.n_kv_heads, self.recent_capacity, config.head_dim)
        self.recent_k = torch.zeros(recent_shape, dtype=dtype, device=device)  # rotated at true positions
        self.recent_v = torch.zeros(recent_shape, dtype=dtype, device=device)
        self.recent_start = 0  # position held by slot 0
        self.inv_freq = inverse_frequencies(config).to(device)
        self.length = 0  # tokens held
        self.selections: dict[int, torch.Tensor] = {}  # far positions chosen by each layer in this forward
        # How the forwards inside `reading` read (none outside it): where short forwards (a question, an answer)
        # look, whether the queries of a forward share one selection however short it is, and a hook called as
        # on_select(layer, query_positions, far_positions) after each layer's selection.
        self.evidence: AttentionEvidence | None = None
        self.shared_selection = False
        self.on_select: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        # The last question's pools (`read_question`): absolute pool indices, best first; the positions in its
        # window it leaves out (look-alikes); where the question lies; the first read's best score per pool so far,
        # and whether one is on.
        self.question_pools: torch.Tensor | None = None
        self.question_hidden: torch.Tensor | None = None
        self.question_start = self.question_end = 0
        self.scouted: torch.Tensor | None = None
        self.scouting_question = False
        # Each token id's word (`Tokenizer.word_ids`), by which a question's frames are compared (`matching_pools`).
        self.words: torch.Tensor | None = None

    @contextmanager
    def reading(self, evidence: AttentionEvidence | None = None, shared_selection: bool = False,
                on_select: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None):
        """The forwards inside the block read this way (see __init__); as before once it ends."""
        saved = self.evidence, self.shared_selection, self.on_select
        self.evidence, self.shared_selection, self.on_select = evidence, shared_selection, on_select
        try:
            yield self
        finally:
            self.evidence, self.shared_selection, self.on_select = saved

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes per token over all layers: history K/V, pooled index (amortised over a pool)."""
        return {"history_kv": self.store.bytes_per_token(),
                "pooled_index": sum(index.bytes_per_token() for index in self.indexes) * len(self.index_slots)}

    def unpooled_index_bytes(self) -> float:
        """What the pooled index would take per token over all layers as plain DSA keeps it (one key per token, each
        indexer's width, the same dtype), the comparison for `bytes_per_token()["pooled_index"]`."""
        indexers = [i for i in (self.indexer, self.segment_indexer) if i is not None]
        return sum(per_token_index_bytes(i.key_dim, self.index.dtype) for i in indexers) * len(self.index_slots)

    def fixed_bytes(self) -> int:
        """Buffers whose size does not grow with the input: the recent window, the index tail."""
        tensors = (self.recent_k, self.recent_v, *(t for index in self.indexes for t in (index._tail_keys, index._tail_gates)))
        return sum(t.numel() * t.element_size() for t in tensors)

    def truncate(self, length: int) -> int:
        """Keep the first `length` tokens or fewer (down to a pool boundary); returns how many are kept. The last
        question's pools stay while `length` covers the question (the tokens re-read up to it are the same)."""
        if length < self.question_end:  # the question's tokens are not all kept: its pools go with it
            self.question_pools = self.question_hidden = None
        length = min(length, self.length)
        length -= length % self.settings.kpool
        if length == self.length:
            return length
        for index in self.indexes:
            index.truncate(length)
        ws = self._window_start(length)
        if ws < self.recent_start:  # the window's start has left the buffer: refill it from the store
            self.recent_start = ws
            self._refill_recent(ws, length)
        self.length = length
        return length

    def export_state(self, length: int) -> dict[str, torch.Tensor]:
        """What resuming from the `length` tokens held needs (a pool boundary, so there is no raw index tail):
        history K/V, the pooled index and the recent window as held (rotated; exact even when the history is
        int8), as views: copy them before writing to this cache again."""
        if length != self.length:
            raise ValueError(f"the cache holds {self.length} tokens, not {length}")
        return self._state_views(length, self.recent_start)

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Resume from `export_state` of a cache with the same settings; raises ValueError on any mismatch."""
        n = state["history_k"].shape[1] if "history_k" in state else -1
        ws = self._window_start(max(n, 0))
        if n < 0 or n % self.settings.kpool or n > self.max_length or \
                {k: t.shape for k, t in state.items()} != {k: t.shape for k, t in self._state_views(n, ws).items()}:
            raise ValueError("the saved cache state does not match this model and these settings")
        for name, target in self._state_views(n, ws).items():
            target.copy_(state[name])
        self._set_held(n)

    def _set_held(self, n: int) -> None:
        """Bookkeeping of a cache whose buffers hold the state of n tokens as `_state_views(n, window start)` lays
        it out; the state itself is the caller's to have written."""
        self.recent_start = self._window_start(n)
        for index in self.indexes:
            index._n_tokens = [n] * index.n_layers
        self.length = n
        self.question_pools = self.question_hidden = None

    def _state_views(self, n: int, recent_start: int) -> dict[str, torch.Tensor]:
        """Views of the state of n tokens, with the recent buffer's slot 0 holding position recent_start."""
        kpool = self.settings.kpool
        if n % kpool:
            raise ValueError(f"a cache state is taken at a pool boundary (kpool={kpool}), not after {n} tokens")
        recent = slice(self._window_start(n) - recent_start, n - recent_start)
        views = {"history_k": self.store.k[:, :n], "history_v": self.store.v[:, :n],
                 **{name: index._pooled[:, :, : n // kpool] for name, index in self._named_indexes()},
                 "recent_k": self.recent_k[:, :, recent], "recent_v": self.recent_v[:, :, recent]}
        if self.store.quantized:
            views["history_k_scale"], views["history_v_scale"] = self.store.k_scale[:, :n], self.store.v_scale[:, :n]
        for name, index in self._named_indexes():
            if index._scales is not None:
                views[f"{name}_scale"] = index._scales[:, :, : n // kpool]
        return views

    def _named_indexes(self) -> list[tuple[str, PooledIndexCache]]:
        return list(zip(["pooled_index", "segment_pooled_index"], self.indexes))

    def _refill_recent(self, start: int, end: int) -> None:
        cos, sin = rope_at(self.inv_freq, torch.arange(start, end, device=self.inv_freq.device))
        for layer in range(self.config.n_layers):
            k, v = self.store.read(layer, start, end)
            self.recent_k[layer, :, : end - start] = apply_rope(k.float(), cos, sin).to(self.dtype).transpose(0, 1)
            self.recent_v[layer, :, : end - start] = v.transpose(0, 1)

    def _window_start(self, position: int) -> int:
        kpool = self.settings.kpool
        return max(0, (position - self.settings.window) // kpool * kpool)

    def begin(self, start: int, length: int) -> None:
        if start != self.length:
            raise ValueError(f"the cache holds {self.length} tokens; truncate it before writing at {start}")
        if start + length > self.max_length:
            raise ValueError(f"cache holds {self.max_length} tokens; asked for positions up to {start + length}")
        s = self.settings
        self.start, self.end = start, start + length
        self.ws = self._window_start(start)
        if self.end - self.recent_start > self.recent_capacity:  # slide: keep [ws, start), make room after it
            if self.end - self.ws > self.recent_capacity:
                raise ValueError(f"a forward of {length} tokens exceeds the segment length {s.segment}")
            keep = slice(self.ws - self.recent_start, start - self.recent_start)
            self.recent_k[:, :, : start - self.ws] = self.recent_k[:, :, keep].clone()
            self.recent_v[:, :, : start - self.ws] = self.recent_v[:, :, keep].clone()
            self.recent_start = self.ws
        self.n_sinks, self.n_far, self.far_topk, one_block, self.per_query = self._reading_plan(self.ws, length)
        if length > s.query_tokens and not self.shared_selection:  # more document, or a next message: the last
            self.question_pools = self.question_hidden = None  # question and its answer are over
        self.query_block = length if one_block else min(s.query_block if self.per_query else s.segment_block, length)
        device = self.inv_freq.device
        self.positions = torch.arange(start, self.end, device=device)
        self.cos, self.sin = rope_at(self.inv_freq, self.positions)
        n_attended = self.n_sinks + min(self.n_far, self.far_topk)  # sinks, then far tokens, in ascending order
        placed = place_far_tokens(torch.arange(n_attended, device=device), self.ws, n_attended, self.n_sinks,
                                  self.sink_gap)
        if self.backend == "triton":
            from indexpool.kernels import far_rope_tables

            self.far_rope = far_rope_tables(self.inv_freq, placed)
        cos, sin = rope_at(self.inv_freq, placed)
        half = self.head_dim // 2
        # For rotating by roll: x * cos + roll(x, half) * [-sin | sin] is rotate-half RoPE.
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)
        self.far_cos, self.far_sin_signed = cos.to(self.dtype), sin_signed.to(self.dtype)
        self.far_rope_fp32 = cos[:, 0], sin_signed[:, 0]  # (N, D) each, for the C decode kernel
        # Built once per forward rather than in every layer: the positions taken whole (the sinks, or everything
        # before the window while it fits in topk) and a pool's token offsets.
        self.fixed_positions = torch.arange(self.ws if self.n_far <= self.far_topk else self.n_sinks, device=device)
        self.pool_offsets = torch.arange(s.kpool, device=device)
        self.selections = {}
        self.layer_scores = None  # per-query forwards: the scores summed over the layers that scored so far
        # The question's look-alikes in the window (`read_question`): its second read and its answer leave them out.
        self.window_mask = None
        if self.question_hidden is not None and not self.scouting_question:
            window_end = start if length > 1 else self.end
            hidden = self.question_hidden[(self.question_hidden >= self.ws) & (self.question_hidden < window_end)]
            if len(hidden):
                window = torch.arange(self.ws, window_end, device=hidden.device)
                self.window_mask = additive_mask(torch.isin(window, hidden), device)[None, None, None]
        self.length = self.end
        if self.evidence is not None and length <= s.query_tokens:  # the forwards `attend` takes evidence from
            self.evidence.queries += length

    def _reading_plan(self, ws: int, length: int) -> tuple[int, int, int, bool, bool]:
        """How a forward of `length` tokens whose window starts at ws reads what lies before the window: sinks, far
        tokens before the window, far tokens per query, whether all its queries share one selection, and whether
        each query (or block of query_block) selects for itself."""
        s = self.settings
        n_sinks = min(s.sinks, ws)
        n_far = ws - n_sinks
        # Far tokens per query: all of them while they fit in topk; past that topk, or short_topk in a short forward.
        short = length <= s.query_tokens
        far_topk = s.short_topk() if short and n_far > s.topk else s.topk
        # Queries in blocks of query_block rows, one far selection each: the whole forward is one block when
        # everything fits, nothing is selected (topk 0) or the caller asked for one shared selection.
        one_block = n_far <= far_topk or not far_topk or self.shared_selection
        return n_sinks, n_far, far_topk, one_block, not one_block and short

    def asks(self, length: int) -> bool:
        """Whether a forward of `length` tokens after those held is a question that `Session.prefill` reads twice
        (`question_pools`, module docstring): two tokens or more, starting at a pool boundary (the cache truncates
        there only), each selecting for itself, and not a re-read of the last question's tail (after a truncation
        that kept the question: the same tokens, read again from a pool boundary)."""
        s = self.settings
        rereads = self.question_pools is not None and self.length < self.question_end  # the question's own tail
        return bool(s.question_pools or s.question_matches) and length >= 2 and self.length % s.kpool == 0 and \
            not rereads and self._reading_plan(self._window_start(self.length), length)[-1]

    def read_question(self, forward: Callable[[], torch.Tensor], tokens: Sequence[int] | None = None,
                      held: int = 0, question_from: int | None = None) -> torch.Tensor:
        """Read a question (see `asks`) twice; `forward()` runs the model over its tokens and returns the logits;
        `tokens`, the prompt's ids (those held, then the question's), adds the pools holding the question's rarest
        wording (`matching_pools`) ahead of those its queries score best. `held`: how many of them the cache held
        before the call that reads the question (the document, as far as the cache can tell: the recent window's
        places are matched up to there, not among the tokens read with the question, its own words among them).
        `question_from`: where in `tokens` the question's own words begin, when the caller knows (a frame is taken
        from them only, `matching_pools`).

        The first read finds the question's pools and takes the evidence: where the question looks of itself (in
        the second read every token's selection holds the kept pools, which would draw its attention to them
        whatever it asks). It calls no on_select hook, and the cache forgets its tokens afterwards. The second read
        (its logits returned) and the short forwards after it keep those pools (`keep_question_pools`) until a
        truncation cuts the question or a long forward (more document, a next message) is read."""
        start, hook = self.length, self.on_select
        self.on_select, self.scouting_question, self.scouted = None, True, None
        try:
            forward()
            end = self.length
        finally:
            self.scouting_question, self.on_select = False, hook
            self.truncate(start)
        scores, s, pools, hidden = self.scouted, self.settings, None, None
        if scores is not None:  # per pool scored: from the first after the sinks to the window's start
            first = self.n_sinks // s.kpool
            order, n = scores.argsort(descending=True, stable=True), len(scores)
            matched = shunned = order[:0]
            if tokens is not None and s.question_matches:
                # The window's places are matched too, though read whole: a look-alike there is passed over only
                # when the place it looks like is found, wherever that lies.
                document_end = max((first + n) * s.kpool, min(start, held))
                document = torch.tensor(tokens[first * s.kpool: document_end])
                question = torch.tensor(tokens[start:end])
                frame_from = None if question_from is None else min(max(question_from - start, 0), end - start)
                found = matching_pools(document, question, s.kpool, s.question_matches, s.match_repeat_share,
                                       uncounted_from=n, frame_from=frame_from, words=self.words)
                matched, look_alikes, strays, framed = (m.to(order.device) for m in found)
                n_held = len(document) // s.kpool
                kept = question_pools(matched, n_held)

                def unread(places: torch.Tensor) -> torch.Tensor:  # their spans, but for those of places taken
                    spans = question_pools(places, n_held)
                    return spans[~torch.isin(spans, kept)]

                # A passed-over place's span is not read, though the question scores it (a look-alike's words do).
                # In the recent window a look-alike's span, or another entry's of a taken place's template, is not
                # attended either (its value is the answer's likeliest wrong copy: at 128K, 200 needles in one
                # document, answers copied the window's), but a stray's is: the window is what the answer reads on
                # from, and a pair met by chance there names no wrong answer.
                shunned = unread(torch.cat([look_alikes, strays, framed]))
                shunned = shunned[shunned < n]
                hidden = unread(torch.cat([look_alikes, framed]))
                hidden = hidden[hidden >= n]
                offsets = torch.arange(s.kpool, device=order.device)
                hidden = ((hidden + first)[:, None] * s.kpool + offsets).flatten()
                matched = matched[matched < n]
                order = order[~torch.isin(order, shunned)]
            # Matched places first: those beyond a short forward's far tokens are cut, and the places a match does
            # not find (a look-alike passed over, a question naming nothing) go to the scored pools, with their span:
            # 4-token pieces of scattered places were what answers copied garbled words from (fwe).
            budget = s.short_topk() // s.kpool
            pools = question_pools(torch.cat([matched, order[: s.question_pools]]), n)
            pools = pools[~torch.isin(pools, shunned)][:budget]
            # The rest of a short forward's far tokens (spans that overlap leave some): the pools the question scores
            # best after those, not each query's own choice (every far token beside the kept ones dilutes them, the
            # more so the longer the document: at 128K the queries' own choices took the answer off the needles).
            more = order[~torch.isin(order, pools)][: max(0, budget - len(pools))]
            pools = torch.cat([pools, more]) + first
        self.question_pools, self.question_start, self.question_end = pools, start, end
        self.question_hidden = hidden if hidden is not None and len(hidden) else None
        self.scouted, evidence, self.evidence = None, self.evidence, None
        try:
            return forward()
        finally:
            self.evidence = evidence

    def _select(self, layer: int, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Positions of the sinks and the far tokens each query block attends to: (n_blocks, N), ascending."""
        s = self.settings
        source = self.sources[layer]
        if source != layer:
            return self.selections[source]
        T = q.shape[1]
        n_blocks = -(-T // self.query_block)
        if self.n_far <= self.far_topk or not self.far_topk:  # everything fits, or nothing is to be selected
            return self.fixed_positions.expand(n_blocks, -1)
        first_pool, end_pool = self.n_sinks // s.kpool, self.ws // s.kpool
        indexer, index = (self.indexer, self.index) if self.per_query or self.segment_indexer is None else \
            (self.segment_indexer, self.segment_index)
        pooled = self.scored_pools(index, indexer, layer, first_pool, end_pool)
        index_q, weights = indexer.queries(layer, x, q)
        if self.per_query:
            scores = indexer.score(layer, index_q, weights, pooled)[0]  # (T, P)
            if s.cumulative_scores:
                scores = self.layer_scores = scores if self.layer_scores is None else self.layer_scores + scores
            if self.scouting_question:  # the last layer to score has the sum over all of them
                self.scouted = scores.max(dim=0).values
            elif self.question_pools is not None:
                scores = keep_question_pools(scores, self.question_pools - first_pool)
            if self.query_block > 1:  # blocks of queries share the sum of their scores
                scores = F.pad(scores, (0, 0, 0, -T % self.query_block)).view(n_blocks, -1, scores.shape[1]).sum(1)
            pools = scores.topk(self.far_topk // s.kpool, dim=-1, sorted=False).indices  # sorted below
        else:
            pools = self._block_pools(layer, indexer, index_q, weights, pooled)
        far = ((pools.sort(dim=-1).values + first_pool)[..., None] * s.kpool + self.pool_offsets).flatten(-2)
        return torch.cat([self.fixed_positions.expand(n_blocks, -1), far], dim=-1)

    def _block_pools(self, layer: int, indexer: Indexer, index_q: torch.Tensor, weights: torch.Tensor,
                     pooled: torch.Tensor) -> torch.Tensor:
        """The pools (n_blocks, topk // kpool) each block of a long forward shares, indexed into `pooled`.

        Scoring every query of a block would cost more than the attention it saves, and the block's mean query
        blurs the per-head softmax that lets a sharp head count (8K perplexity against dense: +2.1% from the mean
        query, +1.2% from every query's scores summed, +1.6% from these 32 of 2,048). So a block's selection sums the
        scores of `segment_queries` evenly spaced queries of it (its last one included), over the
        `segment_candidates` pools its mean query scores best when there are more pools than that: the cost per
        block then stays the same however long the history."""
        s, T, P = self.settings, index_q.shape[1], pooled.shape[1]
        starts = torch.arange(0, T, self.query_block, device=index_q.device)
        sizes = (T - starts).clamp(max=self.query_block)
        steps = torch.arange(min(s.segment_queries, self.query_block), device=index_q.device)
        # From each block's last query back to its first (a short last block repeats some): (n_blocks, m).
        picks = starts[:, None] + sizes[:, None] - 1 - (sizes[:, None] - 1) * steps // max(len(steps) - 1, 1)
        candidates = None
        if P > s.segment_candidates:
            mean_q, mean_weights = (torch.stack([t[0, b : b + self.query_block].mean(dim=0)
                                                 for b in starts.tolist()])[None] for t in (index_q, weights))
            mean_scores = indexer.score(layer, mean_q, mean_weights, pooled)[0]  # (n_blocks, P)
            candidates = mean_scores.topk(s.segment_candidates, dim=-1, sorted=False).indices
            pooled = pooled[0][candidates]  # (n_blocks, C, key_dim)
        else:
            pooled = pooled.expand(len(starts), -1, -1)
        scores = indexer.score(layer, index_q[0][picks], weights[0][picks], pooled).sum(dim=1)
        pools = scores.topk(self.far_topk // s.kpool, dim=-1, sorted=False).indices
        return pools if candidates is None else candidates.gather(-1, pools)

    def scored_pools(self, index: PooledIndexCache, indexer: Indexer, layer: int, first_pool: int,
                     end_pool: int) -> torch.Tensor:
        """The pooled keys [first_pool, end_pool) of `index` for `indexer` to score: as stored where it reads them
        so (`reads_stored_pools`), else in the compute dtype, which its matmuls then run in. The engine computes in
        fp32 on a CPU without native bf16, and there a bf16 matmul is emulated: one query against 8,208 bf16 pools
        took 3.19 ms, 0.48 ms with the keys widened first (AVX2 EPYC, one thread)."""
        pooled = index.pooled(self.index_slots[layer])[:, first_pool:end_pool]
        return pooled if indexer.reads_stored_pools else pooled.to(self.dtype)

    def attend(self, layer: int, qk: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention over the far part (sinks + selected, per query block) and the recent window, computed
        separately and merged by their log-sum-exps (no copy of the window per block)."""
        if qk.shape[0] != 1:
            raise ValueError("the IndexPool cache runs one sequence at a time")
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        T, group = qk.shape[1], H // KV
        q, k = qk[:, :, :H], qk[:, :, H:]  # un-rotated
        if layer in self.index_slots:
            for index, indexer in zip(self.indexes, (self.indexer, self.segment_indexer)):
                index.append(self.index_slots[layer], *indexer.keys(layer, x, k))
        self.store.write(layer, self.start, k[0], v[0])
        qk_rot = apply_rope(qk, self.cos, self.sin).to(self.dtype)[0]  # q and k heads rotated in one go
        q_rot = qk_rot[:, :H]  # (T, H, D)
        slots = slice(self.start - self.recent_start, self.end - self.recent_start)
        self.recent_k[layer, :, slots] = qk_rot[:, H:].transpose(0, 1)
        self.recent_v[layer, :, slots] = v[0].transpose(0, 1)

        far = self._select(layer, x, q)
        self.selections[layer] = far
        if self.on_select is not None:
            self.on_select(layer, self.positions, far)
        evidence = self.evidence is not None and T <= self.settings.query_tokens
        # Evidence needs each part's log-sum-exp, a window mask the window apart: the torch path.
        if self.backend == "triton" and not evidence and self.window_mask is None:
            return self._sparse_attention(layer, q_rot, far).view(1, T, H * D)
        n_blocks, block = far.shape[0], self.query_block
        # Each part is (output, log-sum-exp) in row order (KV, T * group): the query rows of each KV head.
        parts = []
        q_rows = q_rot.view(T, KV, group, D).transpose(0, 1).reshape(1, KV, T * group, D)
        window_end = self.start if T > 1 else self.end  # a single query sees itself too: no mask needed
        if window_end > self.ws:  # the recent window before this forward, seen whole by every query
            window = slice(self.ws - self.recent_start, window_end - self.recent_start)
            parts.append(attention_with_lse(q_rows, self.recent_k[None, layer, :, window],
                                            self.recent_v[None, layer, :, window], mask=self.window_mask))
        if T > 1:
            # The forward's own tokens, causally: per query head (keys repeated over the group) so that the
            # kernel's causal mode skips the hidden half instead of adding a mask to every logit.
            own_k = qk_rot[:, H:].transpose(0, 1).repeat_interleave(group, dim=0)
            own_v = v[0].transpose(0, 1).repeat_interleave(group, dim=0)
            own_out, own_lse = attention_with_lse(q_rot.transpose(0, 1)[None], own_k[None], own_v[None], causal=True)
            parts.append((own_out.view(KV, group, T, D).transpose(1, 2).reshape(1, KV, T * group, D),
                          own_lse.view(KV, group, T).transpose(1, 2).reshape(1, KV, T * group)))
        if far.shape[1]:
            # Far part: one batch entry per query block, the block's query rows per KV head.
            q_blocks = F.pad(q_rot, (0, 0, 0, 0, 0, n_blocks * block - T)).view(n_blocks, block, KV, group, D)
            q_blocks = q_blocks.transpose(1, 2).reshape(n_blocks, KV, block * group, D)
            far_out, far_lse, far_probs = far_attention(self.store, layer, q_blocks, far, self.far_rope_fp32,
                                                        (self.far_cos, self.far_sin_signed), with_probs=evidence)
            parts.append((far_out.reshape(n_blocks, KV, block * group, D).transpose(0, 1).reshape(1, KV, -1, D)[:, :, : T * group],
                          far_lse.transpose(0, 1).reshape(1, KV, -1)[:, :, : T * group]))
        if evidence:
            self._add_evidence(layer, parts, q_rows, window_end, far, (far_probs, far_lse) if far.shape[1] else None)
        out = merge_attention(parts)
        return out.view(KV, T, group, D).transpose(0, 1).reshape(1, T, H * D)

    def _sparse_attention(self, layer: int, q_rot: torch.Tensor, far: torch.Tensor) -> torch.Tensor:
        """`attend`'s far part, window and own tokens as one kernel call: the window buffer from ws to the forward's
        end, each query seeing it up to itself."""
        from indexpool.kernels import sparse_attention

        store, window = self.store, slice(self.ws - self.recent_start, self.end - self.recent_start)
        scales = (store.k_scale[layer], store.v_scale[layer]) if store.quantized else (None, None)
        return sparse_attention(q_rot, store.k[layer], store.v[layer], far, *self.far_rope,
                                self.recent_k[layer, :, window], self.recent_v[layer, :, window], self.start - self.ws,
                                query_block=self.query_block, k_scale=scales[0], v_scale=scales[1])

    def _add_evidence(self, layer, parts, q_rows, window_end, far, far_part) -> None:
        """Each attended token's attention probability against the whole forward's log-sum-exp (short forwards
        only: a question, an answer token): the far part's from its probabilities within that part (`attend`'s
        far_part: probabilities and log-sum-exp), the window's from its logits recomputed (products in the cache's
        dtype, fp32 after: converting every key to fp32 first doubled a question's reading time)."""
        KV, D = self.n_kv_heads, self.head_dim
        lse = torch.stack([part_lse for _, part_lse in parts]).logsumexp(dim=0)[0]  # (KV, rows)
        # Keys from end - local_band on are in every query's local band (masked below): not computed at all. In a
        # document many windows long (local band = window) that is all the window but a pool's worth.
        limit = min(window_end, self.end - self.evidence.local_band)
        if limit > self.ws:
            keys = self.recent_k[layer, :, self.ws - self.recent_start : limit - self.recent_start]
            # keys @ q^T reads the window's keys where they lie; q @ keys^T copied them into a transposed layout.
            logits = (keys @ q_rows[0].transpose(-1, -2)).transpose(-1, -2).float() * D**-0.5  # (KV, rows, W)
            positions = torch.arange(self.ws, limit, device=logits.device)
            query_positions = self.positions.repeat_interleave(self.n_heads // KV)
            local = positions[None, :] > query_positions[:, None] - self.evidence.local_band
            if self.window_mask is not None:  # look-alikes left out: no attention to them
                local |= self.window_mask[0, 0, :, : limit - self.ws] < 0
            mass = (logits - lse[..., None]).exp().masked_fill_(local, 0).sum(dim=(0, 1))
            self.evidence.add(positions, mass)
        if far_part is not None:
            probs, part_lse = far_part
            n_blocks, rows = probs.shape[0], probs.shape[2]
            band = self.evidence.local_band
            if band and far.numel() and int(far.max()) > self.start - band:  # a band reaching past the window
                block_rows = torch.arange(rows, device=far.device) // (self.n_heads // KV)
                row_positions = self.start + torch.arange(n_blocks, device=far.device)[:, None] * self.query_block \
                    + block_rows  # (n_blocks, rows); padded rows lie past the end and add nothing anyway
                probs = probs.masked_fill((far[:, None, :] > row_positions[..., None] - band)[:, None], 0)
            # The forward's rows in block order; padded rows get +inf, so they add nothing.
            lse_blocks = F.pad(lse, (0, n_blocks * rows - lse.shape[1]), value=float("inf"))
            lse_blocks = lse_blocks.view(KV, n_blocks, rows).transpose(0, 1)
            self.evidence.add(far.flatten(), gathered_key_mass(probs, part_lse, lse_blocks).flatten())


def far_attention(store: HistoryStore, layer: int, q: torch.Tensor, far: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor], rotation: tuple[torch.Tensor, torch.Tensor],
                  mask: torch.Tensor | None = None, with_probs: bool = False):
    """Attention of query rows q (B, KV, R, D) over the far tokens `far` (B, N) of the history store, their keys
    rotated to where they are placed: (output, fp32 log-sum-exp (B, KV, R), and with with_probs each row's
    probabilities (B, KV, R, N) for the evidence, else None). The C kernel reads the selected K/V where they lie and
    rotates the keys itself (rope: fp32 cos and signed sin, (N, D) or (B, N, D)); else they are gathered and rotated
    in the cache dtype (rotation: cos and signed sin broadcastable to the gathered (B, N, KV, D)). mask: additive
    (B, 1, 1, N), or None."""
    native = None
    if not store.quantized:  # q in the store's dtype (an fp32 model's bf16 store), read as a bf16 model reads it
        k_store, v_store = store.heads(layer)
        native = native_attention(q.to(k_store.dtype), k_store, v_store, mask, return_lse=True, index=far, rope=rope,
                                  return_probs=with_probs)
    if native is not None:
        out = native[0].to(q.dtype)
        return (out, *native[1:]) if with_probs else (out, native[1], None)
    far_k, far_v = store.gather(layer, far)  # (B, N, KV, D)
    # In place on the freshly gathered keys: several times faster than out-of-place bf16 ops here.
    far_k = far_k.roll(q.shape[-1] // 2, -1).mul_(rotation[1]).addcmul_(far_k, rotation[0])
    if not with_probs:
        return (*attention_with_lse(q, far_k.transpose(1, 2), far_v.transpose(1, 2), mask=mask), None)
    logits = gathered_key_logits(q, far_k)  # needed for the evidence too: computed once, for both
    if mask is not None:
        logits = logits + mask.reshape(mask.shape[0], -1, 1)
    out, lse = attention_from_logits(logits, far_v)
    return out, lse, key_probabilities(logits, lse)


def gathered_key_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Scaled fp32 logits (B, N, KV * R) of query rows q (B, KV, R, D), R rows per KV head, against keys (B, N, KV, D)
    as gathered (rotated): column h * R + r is row r of KV head h. One matmul against block-diagonal queries (each
    row's query in its KV head's slice, zeros elsewhere), so the keys are read in their gathered layout instead of
    being copied into a per-head one."""
    B, KV, R, D = q.shape
    blocks = torch.eye(KV, dtype=q.dtype, device=q.device).view(1, KV, 1, KV, 1)
    q_blocks = (q[:, :, :, None, :] * blocks).reshape(B, KV * R, KV * D)
    return torch.bmm(keys.reshape(B, keys.shape[1], KV * D), q_blocks.transpose(1, 2)).float() * D**-0.5


def attention_from_logits(logits: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, KV, R, D) in the values' dtype and fp32 log-sum-exp (B, KV, R) from `gathered_key_logits`
    and the values (B, N, KV, D) as gathered. Where the logits are wanted anyway (evidence), this replaces the flash
    kernel: a question of 33 tokens at 34K, 2,112 keys each, took 25 ms a layer against 34 ms for flash plus the
    logits (fp32, AVX2, one thread). The probabilities meet every KV head's values in one matmul; the blocks where
    a row meets another head's values are computed and dropped (three KV heads: cheaper than three matmuls)."""
    B, N, KV, D = values.shape
    lse = logits.logsumexp(dim=1)  # (B, KV * R)
    probs = (logits - lse[:, None]).exp_().to(values.dtype)
    full = torch.bmm(probs.transpose(1, 2), values.reshape(B, N, KV * D))  # (B, KV * R, KV * D)
    out = full.view(B, KV, -1, KV, D).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # (B, KV, R, D)
    return out, lse.view(B, KV, -1)


def key_probabilities(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Each query row's attention probabilities (B, KV, R, N) from `gathered_key_logits`' logits (B, N, KV * R) and
    their log-sum-exp (B, KV, R): the layout the C decode kernel gives them in (`native_attention`)."""
    B, N = logits.shape[:2]
    return (logits - lse.reshape(B, 1, -1)).exp().transpose(1, 2).reshape(*lse.shape, N)


def gathered_key_mass(probs: torch.Tensor, part_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention probability of each gathered key, summed over the query rows: probs (B, KV, R, N) within their
    part of the attention, whose log-sum-exp is part_lse (B, KV, R); lse (B, KV, R) of the rows' whole attention.
    Returns (B, N) fp32."""
    B, KV, R, N = probs.shape
    weights = (part_lse - lse).exp().reshape(B, 1, KV * R)
    return torch.bmm(weights, probs.reshape(B, KV * R, N))[:, 0]


class AttentionEvidence:
    """Where queries look inside a span [start, end) of earlier tokens: the attention probability each token of the
    span gets, summed over the query rows (heads) of short forwards (a question, the tokens of an answer) and over
    layers. Exact for what the queries attend to (sinks, the selected far tokens, the recent window); a token not
    selected gets nothing, since the model never saw it."""

    def __init__(self, start: int, end: int, local_band: int = 0):
        self.start, self.end = start, end
        self.local_band = local_band  # keys this close before a query are local context, not evidence
        self.queries = 0  # query tokens whose attention was added
        self._mass = torch.zeros(max(0, end - start))
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def beyond(self, baseline: AttentionEvidence) -> torch.Tensor:
        """Per token, the mass above what `baseline` (the same span, other queries: a question about nothing in
        particular) gave it per query, times this evidence's queries; never below 0. Some tokens (many a " the")
        draw attention whatever is asked, and far more of it than the tokens a question is about: measured against
        a neutral question, they cancel (benchmarks/grounding.py at 30K: the first cited part held the fact 4/10
        times on the plain mass, 10/10 beyond a baseline)."""
        if (baseline.start, baseline.end) != (self.start, self.end) or not baseline.queries:
            raise ValueError("the baseline must cover the same span and hold some queries")
        return (self.mass - baseline.mass * (self.queries / baseline.queries)).clamp_min_(0)

    def add(self, positions: torch.Tensor, mass: torch.Tensor) -> None:
        """Kept as given and summed in batches (when `mass` is read, or every PENDING_ADDS adds, which bounds the
        memory held): a masked scatter per add cost a decode step ~1 ms per layer."""
        self._pending.append((positions.reshape(-1), mass.reshape(-1).float()))
        if len(self._pending) >= self.PENDING_ADDS:
            self._flush()

    PENDING_ADDS = 256

    @property
    def mass(self) -> torch.Tensor:
        """(end - start,) fp32: the attention probability summed on each token of the span."""
        self._flush()
        return self._mass

    def _flush(self) -> None:
        if self._pending:
            positions = torch.cat([p.to(self._mass.device) for p, _ in self._pending])
            mass = torch.cat([m.to(self._mass.device) for _, m in self._pending])
            self._pending.clear()
            inside = (positions >= self.start) & (positions < self.end)
            self._mass.index_add_(0, positions[inside] - self.start, mass[inside])

    def span_mass(self, start: int, end: int, mass: torch.Tensor | None = None) -> float:
        """The mass of the tokens [start, end) (of `mass` when given: per token of the span, e.g. `beyond`'s)."""
        mass = self.mass if mass is None else mass
        return float(mass[max(0, start - self.start) : max(0, end - self.start)].sum())
