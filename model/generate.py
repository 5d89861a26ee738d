"""The generation loop: segmented prefill, then one token at a time with sampling, stopping on stop tokens."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Sequence

import torch

from .errors import ModelOutputError
from .indexers import Indexer, TrainingFreeIndexer
from .indexpool_branches import IndexPoolBranches, max_branch_tokens
from .indexpool_cache import AttentionEvidence, IndexPoolCache, IndexPoolConfig
from .llama import BatchKVCache, KVCache, Transformer


@dataclass
class SamplingParams:
    temperature: float = 0.7  # 0 means greedy
    top_k: int = 40  # 0 disables
    top_p: float = 0.95  # 1 disables
    seed: int | None = None


class Sampler:
    """Picks the next token from fp32 logits (B, V); reproducible under a seed."""

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        if params.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < params.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if params.top_k < 0:
            raise ValueError("top_k must be >= 0")
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.temperature == 0:
            picked = logits.argmax(dim=-1)
            _check_finite(logits.gather(-1, picked[..., None]))  # argmax ranks NaN first: one value tells
            return picked
        # With top_k the draw is among the k best tokens only, the temperature applied to them alone (the ranking
        # is the same): softmax, sort and draw over a 128K vocabulary took 10 ms a token, a fifth of a 1B model's
        # step on a CPU, and an operation over the whole vocabulary leaves torch's threads spinning, which slowed
        # the next step's C threads (`kernels/cpu_decode.c`)
        candidates = None  # the vocabulary ids of `logits`' columns, when they are a ranked subset
        if 0 < p.top_k < logits.shape[-1]:
            logits, candidates = torch.topk(logits, p.top_k, dim=-1)
        best = logits.amax(dim=-1, keepdim=True)
        _check_finite(best)
        logits = (logits - best) / p.temperature  # the best at 0: a tiny temperature cannot overflow to inf - inf
        if p.top_p < 1:
            if candidates is None:
                logits, candidates = torch.sort(logits, dim=-1, descending=True)
            probs = logits.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
            logits = logits.masked_fill((probs.cumsum(dim=-1) - probs) >= p.top_p, float("-inf"))
        drawn = torch.multinomial(logits.softmax(dim=-1), 1, generator=self.generator)
        return (drawn if candidates is None else candidates.gather(-1, drawn)).squeeze(-1)


def _check_finite(best: torch.Tensor) -> None:
    """ModelOutputError unless every row's best logit is a finite number (max and argmax both rank NaN first)."""
    if not bool(torch.isfinite(best).all()):
        raise ModelOutputError("the model computed logits that are not numbers (NaN or inf): its weights hold such "
                               "values, or the dtype overflows; try --dtype fp32, or another copy of the model")


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""  # "stop_token", "max_new_tokens", "context_full" (or a job's "extracted": no generation)
    drafted: int = 0  # speculative decoding (`SpeculativeSession`): drafts checked, and kept
    accepted: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0


class SpeculativeSession:
    """`Session.generate` for one prompt, greedy, with the model's MTP layer drafting a token that the next forward
    checks (`glm5_next.speculative_tokens`): the same tokens as greedy decoding, in fewer forwards when the drafts
    are right. What `complete --speculative` runs; it keeps nothing between calls."""

    def __init__(self, model):
        if getattr(model, "mtp", None) is None:
            raise ValueError("the model has no MTP layer to draft with")
        self.model = model

    def generate(self, prompt: list[int], sampler: Sampler, max_new_tokens: int,
                 stop_ids: frozenset[int] | set[int] = frozenset(), stats: GenerationStats | None = None,
                 on_prefill_progress: Callable[[int, int], None] | None = None) -> Iterator[int]:
        from .glm5_next import SpeculativeStats, speculative_tokens

        if sampler.params.temperature != 0:
            raise ValueError("speculative decoding is greedy: it needs temperature 0")
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens, drafts = len(prompt), SpeculativeStats()
        t0 = time.perf_counter()
        stats.stop_reason = "max_new_tokens"
        for token in speculative_tokens(self.model, prompt, max_new_tokens, drafts,
                                        on_prefill_progress=on_prefill_progress):
            if not stats.prefill_seconds:  # the first token comes with the prompt's read
                stats.prefill_seconds, t0 = time.perf_counter() - t0, time.perf_counter()
            stats.drafted, stats.accepted = drafts.drafted, drafts.accepted
            if token in stop_ids:
                stats.stop_reason = "stop_token"
                break
            stats.new_tokens += 1
            yield token
        stats.decode_seconds = time.perf_counter() - t0


class Session:
    """A model with its cache and the tokens the cache holds, so later prompts that extend earlier ones
    (a chat's next turn, another question on the same document) only prefill what is new.

    attention=None gives dense attention over a plain KV cache (up to the model's context); an IndexPoolConfig
    gives IndexPool sparse attention (`model/indexpool_cache.py`) with the given indexer (default: training-free);
    `words`, the tokenizer's `word_ids`, lets it tell a template's entries apart from a document's recurring words.
    """

    def __init__(self, model: Transformer, max_length: int, segment: int = 512,
                 attention: IndexPoolConfig | None = None, indexer: Indexer | None = None,
                 segment_indexer: Indexer | None = None, words: Sequence[int] | None = None):
        self.model = model
        self.device = model.device
        self.tokens: list[int] = []
        self.last_fed_tokens = 0
        self.cache: KVCache | IndexPoolCache
        if attention is None:
            self.cache = model.new_cache(max_length)
            self.segment, self.query_tokens = segment, 0
        else:
            indexer = indexer or TrainingFreeIndexer(model.config, attention.kpool, self.device,
                                                     distances=attention.far_distances())
            self.cache = IndexPoolCache(model.config, attention, indexer, max_length, model.dtype, self.device,
                                        segment_indexer)
            if words is not None:
                self.cache.words = torch.tensor(words)  # matching runs on the CPU
            # The prompt's last tokens (where a question is) get their own forward, so they select per query.
            self.segment, self.query_tokens = attention.segment, attention.query_tokens

    @property
    def max_length(self) -> int:
        return self.cache.max_length

    def export_state(self) -> dict[str, torch.Tensor]:
        """The cache's state for the tokens held (views), to save and `restore` later."""
        return self.cache.export_state(len(self.tokens))

    def restore(self, tokens: list[int], state: dict[str, torch.Tensor]) -> None:
        """Hold `tokens` again from a state `export_state` gave for them; ValueError if it does not fit."""
        if len(tokens) > self.max_length:
            raise ValueError(f"the saved state holds {len(tokens)} tokens; this session holds {self.max_length}")
        self.cache.import_state(state)
        self.tokens = list(tokens)

    def reading(self, evidence: AttentionEvidence | None = None, shared_selection: bool = False,
                on_select: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None):
        """How the forwards of a call read (`IndexPoolCache.reading`); nothing to set on a dense cache."""
        if isinstance(self.cache, IndexPoolCache):
            return self.cache.reading(evidence, shared_selection, on_select)
        return nullcontext()

    @torch.inference_mode()
    def prefill(self, prompt: list[int], on_progress: Callable[[int, int], None] | None = None,
                query_tail: bool = True, evidence: AttentionEvidence | None = None,
                on_select: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                question_from: int | None = None) -> torch.Tensor:
        """Make the cache hold exactly `prompt`, reusing the longest common prefix; returns the last logits (1, V).

        Tokens are fed in segments, so no T x T score matrix is ever built. With IndexPool the prompt's last
        `query_tokens` tokens (where a question is) choose their far tokens one by one; query_tail=False skips
        that for a prompt that is only a document (faster; a question appended later gets it); they are read twice
        when they ask (`IndexPoolCache.asks`: the first read finds the question's pools). IndexPool:
        `evidence` learns where the short forwards look (a question: its first read), `on_select` sees every
        layer's selection (a question: its second read's). `question_from`: where the prompt's question begins after
        its document, when the caller knows (the tokens read twice may begin inside the document's last tokens):
        a frame repeated around many keys is taken from the question's own words only (`matching_pools`)."""
        with self.reading(evidence, on_select=on_select):
            return self._prefill(prompt, on_progress, query_tail, question_from)

    def _prefill(self, prompt: list[int], on_progress: Callable[[int, int], None] | None,
                 query_tail: bool, question_from: int | None = None) -> torch.Tensor:
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) > self.max_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; the context holds {self.max_length}")
        keep = self.cache.truncate(common_prefix(self.tokens, prompt[:-1]))  # at least one token is fed: its logits
        self.last_fed_tokens = len(prompt) - keep  # what this call read (the rest was held already)
        new = torch.tensor([prompt[keep:]], device=self.device)
        total, logits = new.shape[1], None
        body = max(0, total - self.query_tokens) if query_tail else total
        asks = getattr(self.cache, "asks", None) if body < total else None  # IndexPool caches read a question twice
        if asks:
            body = self.question_start(len(prompt), keep) - keep
        bounds = list(range(0, body, self.segment)) + [body, total]
        for s, e in zip(bounds, bounds[1:]):
            if e > s:
                forward = partial(self.model, new[:, s:e], keep + s, self.cache)
                # A question is read twice: first for its pools (`IndexPoolCache.read_question`).
                logits = self.cache.read_question(forward, prompt, keep, question_from) \
                    if asks and s == body and asks(e - s) else forward()
                if on_progress:
                    on_progress(e, total)
        self.tokens = list(prompt)
        return logits[:, -1]

    def question_start(self, prompt_length: int, held: int = 0) -> int:
        """Where an IndexPool session reads a prompt's question from (twice, when it asks): its last `query_tokens`
        tokens, none of the `held` ones, from a pool boundary, where the cache can truncate the question's first
        read."""
        start = max(held, prompt_length - self.query_tokens)
        return min(prompt_length, start + -start % self.cache.settings.kpool)

    @torch.inference_mode()
    def read_shared(self, prompt: list[int], evidence: AttentionEvidence | None = None,
                    on_select: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Hold `prompt` but its last token, the new tokens sharing one far selection (IndexPool: for tokens whose
        far context matters little, such as a quote of lines the recent window holds; per-query selection costs
        each query a gather of topk keys per layer). The `prefill` or `generate` of `prompt` that follows reads
        the last token, which selects for itself as the tokens after it will."""
        if isinstance(self.cache, IndexPoolCache) and len(prompt) - common_prefix(self.tokens, prompt) > 1:
            with self.reading(evidence, shared_selection=True, on_select=on_select):
                self._prefill(prompt[:-1], None, True)

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        sampler: Sampler,
        max_new_tokens: int,
        stop_ids: frozenset[int] | set[int] = frozenset(),
        stats: GenerationStats | None = None,
        on_prefill_progress: Callable[[int, int], None] | None = None,
        evidence: AttentionEvidence | None = None,
        question_from: int | None = None,
    ) -> Iterator[int]:
        """Yield new token ids one by one. Stop tokens end generation and are neither yielded nor cached.
        IndexPool: `evidence` learns where the prompt's reading and the new tokens look; `question_from`, where its
        question begins (`prefill`)."""
        stats = stats if stats is not None else GenerationStats()
        stats.prompt_tokens = len(prompt)
        t0 = time.perf_counter()
        logits = self.prefill(prompt, on_prefill_progress, evidence=evidence, question_from=question_from)
        token = sampler(logits)
        stats.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats.stop_reason = "max_new_tokens"
        for _ in range(max_new_tokens):
            token_id = int(token)
            if token_id in stop_ids:
                stats.stop_reason = "stop_token"
                break
            stats.new_tokens += 1
            yield token_id
            if len(self.tokens) >= self.max_length:
                stats.stop_reason = "context_full"
                break
            # The last token allowed is fed too, so that the session holds it for a next turn; its attention picks
            # no token of this answer, so it adds no evidence (`generate_branches` stops before it).
            with self.reading(evidence if stats.new_tokens < max_new_tokens else None):
                logits = self.model(token.view(1, 1), len(self.tokens), self.cache)[:, -1]
            self.tokens.append(token_id)
            token = sampler(logits)
        stats.decode_seconds = time.perf_counter() - t0

    def can_batch(self) -> bool:
        """Whether `generate_batch` can run here: a dense session of the llama family."""
        return isinstance(self.cache, KVCache)

    @torch.inference_mode()
    def generate_batch(self, prompts: list[list[int]], sampler: Sampler, max_new_tokens: int,
                       stop_ids: frozenset[int] | set[int] = frozenset()) -> list[tuple[list[int], GenerationStats]]:
        """Continue several independent prompts, decoding them as one batch (`BatchKVCache`; see `can_batch`).
        Each prompt is read alone by this session's cache (reusing what it holds, as `prefill` does) and its K/V
        copied into its own row; then every step feeds all unfinished rows together. A row stops where `generate`
        would stop it alone (a stop token, max_new_tokens, the session's context full). The session holds the last
        prompt afterwards. Returns each prompt's new tokens and stats (decode seconds are the batch's)."""
        if not self.can_batch():
            raise ValueError("only a dense session decodes independent prompts as one batch")
        if not prompts:
            return []
        capacity = min(self.max_length, max(len(p) for p in prompts) + max_new_tokens)
        batch = self.model.new_cache(capacity, len(prompts), BatchKVCache)
        stats, first_logits = [GenerationStats(prompt_tokens=len(p)) for p in prompts], []
        for b, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            first_logits.append(self.prefill(prompt))
            batch.take_row(b, self.cache, len(prompt))
            stats[b].prefill_seconds = time.perf_counter() - t0

        def forward(kept: list[int], live: list[int], fed: torch.Tensor) -> torch.Tensor:
            if len(kept) < batch.rows:
                batch.keep(kept)
            return self.model(fed, 0, batch)[:, -1]

        new = self._decode_together(torch.cat(first_logits), sampler, max_new_tokens, stop_ids, stats, forward,
                                    fits=lambda b, n: len(prompts[b]) + n <= self.max_length)
        return list(zip(new, stats))

    def _branch_point(self, prompts: list[list[int]]) -> int:
        """How many held tokens every prompt starts with (each keeps at least one token of its own), down to a
        pool boundary."""
        n = min(common_prefix(self.tokens, prompt[:-1]) for prompt in prompts)
        return n - n % self.cache.settings.kpool if isinstance(self.cache, IndexPoolCache) else n

    def can_branch(self, prompts: list[list[int]], max_new_tokens: int) -> bool:
        """Whether `generate_branches` can run these prompts as one batch: an IndexPool session holding tokens
        they all start with, and room for each branch's own tokens (`max_branch_tokens`; max_new_tokens counts
        every token a branch may add to its prompt)."""
        if not isinstance(self.cache, IndexPoolCache) or not prompts:
            return False
        n = self._branch_point(prompts)
        return n > 0 and max(len(p) for p in prompts) - n + max_new_tokens <= max_branch_tokens(self.cache)

    @torch.inference_mode()
    def generate_branches(self, prompts: list[list[int]], sampler: Sampler, max_new_tokens: int,
                          stop_ids: frozenset[int] | set[int] = frozenset(),
                          evidence: list[AttentionEvidence | None] | None = None,
                          then_read: Callable[[int], list[int]] | None = None,
                          more_tokens: int = 0,
                          question_from: int | None = None) -> list[tuple[list[int], GenerationStats]]:
        """Continue several prompts that start with tokens held (questions on a held document), decoding them as
        one batch (`model/indexpool_branches.py`); see `can_branch`. Each prompt's own tokens are read one prompt
        at a time (each question selects for itself), and then `then_read(b)`'s tokens (at most `more_tokens`:
        what the reading of prompt b found, quoted; read by `read_shared`); then every step feeds all
        unfinished branches together. `question_from`: where every prompt's question begins (`prefill`).
        The session holds the shared tokens again afterwards. Returns each prompt's new tokens and stats (decode
        seconds are the batch's)."""
        if not self.can_branch(prompts, max_new_tokens + more_tokens):
            raise ValueError("these prompts cannot be decoded as branches of the tokens held")
        shared = self.tokens[: self.cache.truncate(self._branch_point(prompts))]
        self.tokens = shared
        capacity = max(len(p) for p in prompts) - len(shared) + max_new_tokens + more_tokens
        branches = IndexPoolBranches(self.cache, len(prompts), capacity)
        evidence = evidence or [None] * len(prompts)
        stats, first_logits = [GenerationStats(prompt_tokens=len(p)) for p in prompts], []
        for b, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            logits = self.prefill(prompt, evidence=evidence[b], question_from=question_from)
            more = then_read(b) if then_read else []
            if len(more) > more_tokens:
                raise ValueError(f"then_read gave {len(more)} tokens, more than more_tokens ({more_tokens})")
            if more:
                self.read_shared(prompt + more, evidence[b])
                logits = self.prefill(prompt + more, evidence=evidence[b])
                stats[b].prompt_tokens += len(more)
            first_logits.append(logits)
            branches.take_branch(b)
            self.tokens = list(shared)
            stats[b].prefill_seconds = time.perf_counter() - t0
        branches.evidence = evidence

        def forward(kept: list[int], live: list[int], fed: torch.Tensor) -> torch.Tensor:
            branches.live = torch.tensor(live)
            return self.model(fed, 0, branches)[:, -1]

        new = self._decode_together(torch.cat(first_logits), sampler, max_new_tokens, stop_ids, stats, forward,
                                    fits=lambda b, n: True)  # can_branch made room for every branch
        return list(zip(new, stats))

    def _decode_together(self, logits: torch.Tensor, sampler: Sampler, max_new_tokens: int, stop_ids,
                         stats: list[GenerationStats], forward, fits) -> list[list[int]]:
        """The decode loop of a batch of rows, from their first logits (rows, V): each step samples every live
        row's token, drops the rows that stopped (a stop token, `fits(row, new tokens)` False: the context is
        full) and feeds the rest: `forward(kept rows of the last step, live rows, tokens (live, 1))` returns their
        logits. Fills `stats` (decode seconds are the batch's); returns each row's new tokens."""
        new: list[list[int]] = [[] for _ in stats]
        token = sampler(logits)
        live = list(range(len(stats)))  # the row of stats each fed row is
        t0 = time.perf_counter()
        for step in range(max_new_tokens):
            kept = []
            for row, (b, token_id) in enumerate(zip(live, token.tolist())):
                if token_id in stop_ids:
                    stats[b].stop_reason = "stop_token"
                    continue
                new[b].append(token_id)
                if fits(b, len(new[b])):
                    kept.append(row)
                else:
                    stats[b].stop_reason = "context_full"
            if not kept or step == max_new_tokens - 1:
                break
            live, token = [live[row] for row in kept], token[kept]
            token = sampler(forward(kept, live, token.view(-1, 1)))
        seconds = time.perf_counter() - t0
        for b, row_stats in enumerate(stats):
            row_stats.new_tokens = len(new[b])
            row_stats.stop_reason = row_stats.stop_reason or "max_new_tokens"
            row_stats.decode_seconds = seconds
        return new
