"""The local engine as a jobs `Backend` (`LocalBackend`): a document is read into the model's own context once
(IndexPool where it is longer than the model's), kept in the document cache, and every request on it is appended
to it; chat turns (`Conversation`) and raw continuation (`LocalBackend.complete`) run on the same engine.

Sources come from what the model attended to and, for a question, from its words: while the question and the
answer are read and written, the attention probability of every token it attends to (sinks aside: the selected far
tokens and the recent window) is summed over heads and layers (`AttentionEvidence`), and counted beyond what a
neutral question's reading gives it (`evidence_baseline`: some tokens draw attention whatever is asked); the
parts of the passages quoted come first (`jobs.rank_sources`).

A question is answered in two steps where the document is long enough to have sources: the question is read (its
attention evidence), then the passages its words, its reading and the model's likelihood of it point to are found
(`passage_quote`, with the lexical index of indexpool_cli/retrieval.py). The answer is either the best passage
itself (`extract_answer`, what `--answer auto` gives a small model: the default model wrote answers holding the
fact far less often than the passage held it) or written by the model after the passages are quoted to it
(`run_request`, `run_batch`). On real manuals, a codebase and a log (benchmarks/doc_qa.py) attention alone cited
an index page listing every name; the question's words find the place, the reading and the model tell apart the
places the words score alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable

import torch

from indexpool.model import sessions
from indexpool.model.indexpool_cache import AttentionEvidence, IndexPoolCache
from indexpool.model.llama import KVCache
from indexpool.model.sessions import SessionOptions
from indexpool.model.tensor_cache import TensorCache, cache_key
from .ingest import Document
from .jobs import (ASK_QUESTION, DOCUMENT_MARK, QUOTE_MARK, JobResult, InOrder, OnResult, OnText, ask_request,
                   rank_sources, request_messages)
from .retrieval import ATTENTION_WEIGHT, LexicalIndex, Passage, combined


QUOTE_TOKENS = 96  # most document tokens quoted from attention evidence alone (`evidence_quote`)
# A question whose words the document holds is answered from passages found by its words and its reading together
# (`passage_quote`): at most QUOTE_PASSAGES of them, PASSAGE_TOKENS each.
QUOTE_PASSAGES = 2
PASSAGE_TOKENS = 128
# A passage's score: its words and reading (`retrieval.combined`) and, for the RERANK_CANDIDATES best by their words,
# this weight times the model's likelihood of the question after it (scaled from the least to the most likely
# candidate: `question_likelihoods`).
MODEL_WEIGHT = 0.25
RERANK_CANDIDATES = 6
RERANK_CONTEXT_TOKENS = 200  # of a candidate passage, before the question
QUOTE_LINE_SHARE = 0.5  # lines next to the best one join the quote when their evidence is this share of its
# A quote only when the best line holds this many times the evidence of the best line elsewhere: planted facts at
# 30K stood 3.4-17x above the next line (all right), code questions on a folder 1.0-1.3x (all wrong lines).
QUOTE_MIN_RATIO = 2.0
QUOTE_OPEN, QUOTE_CLOSE = 'From the document: "', '"\n'  # the quote's frame (measured against two others)
EVIDENCE_LOCAL_BAND = 256  # tokens before a query whose attention is local context, not evidence
EVIDENCE_MIN_DOCUMENT = 1024  # shorter documents: every token may be evidence


@dataclass
class DocumentIndex:
    """A document's lines as tokens and as text, with the lexical index over its parts and passages."""

    lexical: LexicalIndex
    line_spans: list[tuple[int, int]]  # token range of each line of `lexical.lines`, within the document's ids

    def passage_span(self, passage: Passage) -> tuple[int, int]:
        return self.line_spans[passage.first_line][0], self.line_spans[passage.last_line - 1][1]


@dataclass
class DocumentTokens:
    """A document encoded part by part, without special tokens (text in it can never act as a control token)."""

    ids: list[int]
    part_spans: list[tuple[int, int]]  # token range of each part within ids
    _index: DocumentIndex | None = field(default=None, repr=False, compare=False)

    @classmethod
    def encode(cls, tokenizer, document: Document) -> DocumentTokens:
        ids, spans = [], []
        for part in document.parts:
            start = len(ids)
            ids += tokenizer.encode(part.text)
            spans.append((start, len(ids)))
        return cls(ids, spans)

    def index(self, tokenizer) -> DocumentIndex:
        """Lines split at the tokens holding a line break (a part ends a line too), indexed once."""
        if self._index is None:
            breaks = tokenizer.line_break_ids
            lines, line_spans = [], []
            for part, (start, end) in enumerate(self.part_spans):
                first = start
                for position in range(start, end):
                    if self.ids[position] in breaks or position == end - 1:
                        lines.append((part, tokenizer.decode(self.ids[first : position + 1])))
                        line_spans.append((first, position + 1))
                        first = position + 1
            texts = [""] * len(self.part_spans)
            for part, text in lines:
                texts[part] += text
            self._index = DocumentIndex(LexicalIndex(texts, lines), line_spans)
        return self._index


@dataclass
class DocumentPrompt:
    ids: list[int]
    doc_start: int  # token range of the document inside ids
    doc_end: int
    part_spans: list[tuple[int, int]]  # token range of each part
    reusable: int  # leading tokens every request on this document shares (cached)
    quote_at: int | None = None  # where quoted lines go in ids (the request had QUOTE_MARK), else None
    document: DocumentTokens | None = None  # the document's tokens (and its lexical index)
    question: str | None = None  # an ask request's question: its words find the passages quoted
    question_again: list[int] = field(default_factory=list)  # the question's tokens, repeated after a quote

    @property
    def max_tokens(self) -> int:
        """Tokens the prompt can grow to: its own, and a quote's (`with_quote`)."""
        if self.quote_at is None:
            return len(self.ids)
        return (len(self.ids) + max(QUOTE_TOKENS, QUOTE_PASSAGES * PASSAGE_TOKENS)
                + QUOTE_PASSAGES * QUOTE_FRAME_TOKENS + len(self.question_again))


def document_prompt(tokenizer, document: DocumentTokens, messages: list[dict], kpool: int = 4) -> DocumentPrompt:
    """The chat template around `messages`, one of which holds DOCUMENT_MARK where the document goes (and may hold
    QUOTE_MARK after it, where `with_quote` puts quoted lines)."""
    head, tail = tokenizer.render_chat(messages).split(DOCUMENT_MARK)
    ids = tokenizer.encode(head, allow_special=True)
    if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
        ids.insert(0, tokenizer.bos_id)
    doc_start = len(ids)
    spans = [(doc_start + start, doc_start + end) for start, end in document.part_spans]
    ids += document.ids
    doc_end = len(ids)
    quote_at = question = None
    if QUOTE_MARK in tail:
        before, tail = tail.split(QUOTE_MARK)
        ids += tokenizer.encode(before, allow_special=True)
        quote_at = len(ids)
        if ASK_QUESTION in before:
            question = before.rsplit(ASK_QUESTION, 1)[1].strip()
    ids += tokenizer.encode(tail, allow_special=True)
    again = tokenizer.encode(f"{ASK_QUESTION}{question}\n") if question else []
    return DocumentPrompt(ids, doc_start, doc_end, spans, reusable=doc_end - doc_end % kpool, quote_at=quote_at,
                          document=document, question=question, question_again=again)


QUOTE_FRAME_TOKENS = 16  # room for the quote's frame (QUOTE_OPEN, QUOTE_CLOSE) in `DocumentPrompt.max_tokens`


@dataclass
class QuotedPassage:
    tokens: list[int]  # document tokens quoted
    start: int  # position of the first in the prompt
    text: str


@dataclass
class Quote:
    passages: list[QuotedPassage]  # in the order they are quoted, the most likely first


def evidence_quote(tokenizer, prompt: DocumentPrompt, evidence: AttentionEvidence,
                   baseline: AttentionEvidence) -> Quote | None:
    """The document's lines a question's reading looked at most beyond the baseline: the best line, with the
    lines next to it that hold at least QUOTE_LINE_SHARE of its evidence (a sentence broken over lines), at most
    QUOTE_TOKENS tokens (centred on the evidence); None when nothing stands out: no evidence beyond the baseline, or
    a line elsewhere (not next to the quote) with more than 1 / QUOTE_MIN_RATIO of the best line's."""
    mass = evidence.beyond(baseline)  # per token of [evidence.start, evidence.end)
    ids = prompt.ids[evidence.start : evidence.end]
    if not ids:
        return None
    breaks = tokenizer.line_break_ids
    ends = torch.tensor([token in breaks for token in ids], dtype=torch.long)
    line = ends.cumsum(0) - ends  # a token that holds the line break ends its line
    scores = torch.zeros(int(line[-1]) + 1).index_add_(0, line, mass)
    best = int(scores.argmax())
    if scores[best] <= 0:
        return None
    first = last = best
    while first > 0 and scores[first - 1] >= QUOTE_LINE_SHARE * scores[best]:
        first -= 1
    while last + 1 < len(scores) and scores[last + 1] >= QUOTE_LINE_SHARE * scores[best]:
        last += 1
    elsewhere = torch.cat([scores[: max(0, first - 1)], scores[last + 2 :]])
    if len(elsewhere) and scores[best] < QUOTE_MIN_RATIO * elsewhere.max():
        return None
    inside = ((line >= first) & (line <= last)).nonzero().flatten()
    a, b = int(inside[0]), int(inside[-1]) + 1
    if b - a > QUOTE_TOKENS:  # QUOTE_TOKENS tokens centred on the evidence
        weights = mass[a:b]
        centre = a + int((weights * torch.arange(b - a)).sum() / weights.sum())
        a = min(max(a, centre - QUOTE_TOKENS // 2), b - QUOTE_TOKENS)
        b = a + QUOTE_TOKENS
    while b > a and not tokenizer.decode(ids[b - 1 : b]).strip():  # the line break and spaces after the text
        b -= 1
    text = tokenizer.decode(ids[a:b]).strip()
    return Quote([QuotedPassage(ids[a:b], evidence.start + a, text)]) if text else None


def passage_quote(tokenizer, prompt: DocumentPrompt, evidence: AttentionEvidence,
                  baseline: AttentionEvidence | None, model=None) -> Quote | None:
    """The passages (a few lines of a part) that the question's words, its reading and the model point to (see
    ATTENTION_WEIGHT; `model` None: words and reading only), among the RERANK_CANDIDATES best by their words: the
    best QUOTE_PASSAGES that do not overlap, PASSAGE_TOKENS each at most, best first. When the question's words are
    nowhere in the document: `evidence_quote`, given a baseline (a document too short for one: None)."""
    index = prompt.document.index(tokenizer) if prompt.document is not None else None
    lexical = index.lexical.passage_scores(prompt.question) if index and prompt.question else []
    if not lexical or max(lexical) <= 0:
        return evidence_quote(tokenizer, prompt, evidence, baseline) if baseline is not None else None
    spans = [index.passage_span(p) for p in index.lexical.passages]
    mass = evidence.beyond(baseline) if baseline is not None else evidence.mass
    attention = passage_attention(mass, evidence.start - prompt.doc_start, spans)
    candidates = [i for i in rerank_candidates(lexical) if lexical[i] > 0]
    likelihood = None
    if model is not None and len(candidates) > 1:
        contexts = [prompt.document.ids[a:b][:RERANK_CONTEXT_TOKENS] for a, b in (spans[i] for i in candidates)]
        likelihood = question_likelihoods(model, tokenizer, contexts, prompt.question)
    chosen: list[Passage] = []
    for i in ranked_passages(lexical, attention, candidates, likelihood):
        if len(chosen) == QUOTE_PASSAGES:
            break
        passage = index.lexical.passages[i]
        if any(p.part == passage.part and p.first_line < passage.last_line and passage.first_line < p.last_line
               for p in chosen):
            continue
        chosen.append(passage)
    quoted = []
    for passage in chosen:
        a, b = index.passage_span(passage)
        ids = prompt.document.ids[a : min(b, a + PASSAGE_TOKENS)]
        while ids and not tokenizer.decode(ids[-1:]).strip():  # the line break and spaces after the text
            ids = ids[:-1]
        text = tokenizer.decode(ids).strip()
        if text:
            quoted.append(QuotedPassage(ids, prompt.doc_start + a, text))
    return Quote(quoted) if quoted else None


@torch.inference_mode()
def question_likelihoods(model, tokenizer, contexts: list[list[int]], question: str) -> list[float]:
    """For each context (a passage's tokens), the mean log-probability the model gives the question's tokens
    after it and a "Question:" line: how well the passage leads to what is asked (query likelihood). Each is one
    short dense forward of its own."""
    from indexpool.model.generate import Session

    asked = tokenizer.encode(" " + question.strip())
    lead = tokenizer.encode("\n\nQuestion:")
    out = []
    for context in contexts:
        ids = context + lead + asked
        session = Session(model, len(ids))
        logits = model(torch.tensor([ids], device=session.device), 0, session.cache, all_logits=True)[0]
        first = len(ids) - len(asked)
        logprobs = torch.log_softmax(logits[first - 1 : len(ids) - 1].float(), dim=-1)
        out.append(float(logprobs.gather(1, torch.tensor(asked, device=logits.device).view(-1, 1)).mean()))
    return out


def passage_attention(mass: torch.Tensor, offset: int, spans: list[tuple[int, int]]) -> list[float]:
    """The evidence mass (per token from document position `offset` on) inside each span of document positions."""
    cumulative = torch.cat([torch.zeros(1), mass.double().cumsum(0)])
    n = len(mass)

    def at(position: int) -> float:
        return float(cumulative[min(max(position - offset, 0), n)])

    return [at(b) - at(a) for a, b in spans]


def rerank_candidates(lexical: list[float]) -> list[int]:
    """The RERANK_CANDIDATES passages with the best lexical scores, best first."""
    return sorted(range(len(lexical)), key=lambda i: -lexical[i])[:RERANK_CANDIDATES]


def ranked_passages(lexical: list[float], attention: list[float], candidates: list[int],
                    likelihood: list[float] | None, attention_weight: float = ATTENTION_WEIGHT,
                    model_weight: float = MODEL_WEIGHT) -> list[int]:
    """The candidates best first by `combined` scores plus `model_weight` times the question's likelihood after
    each (None: not measured), scaled from the least to the most likely candidate."""
    scores = combined(lexical, attention, attention_weight)
    if likelihood is not None:
        low, high = min(likelihood), max(likelihood)
        for i, value in zip(candidates, likelihood):
            scores[i] += model_weight * ((value - low) / (high - low) if high > low else 0.0)
    return sorted(candidates, key=lambda i: -scores[i])


def with_quote(tokenizer, prompt: DocumentPrompt, quote: Quote | None) -> list[int]:
    """The prompt's tokens with the quote in its place (as the prompt is, when there is none): each passage in
    its frame (QUOTE_OPEN, QUOTE_CLOSE), then the question again, next to the answer (a small model answers what
    it read last)."""
    if quote is None or prompt.quote_at is None:
        return prompt.ids
    frame = tokenizer.encode(QUOTE_OPEN), tokenizer.encode(QUOTE_CLOSE)
    quoted = [token for passage in quote.passages for token in frame[0] + passage.tokens + frame[1]]
    return prompt.ids[: prompt.quote_at] + quoted + prompt.question_again + prompt.ids[prompt.quote_at :]


def session_identity(loaded, session, choice) -> dict:
    """What, besides the tokens, decides the state a document leaves in the cache."""
    cache = session.cache
    identity = {"model": loaded.name, "model_bytes": loaded.file_bytes, "dtype": str(loaded.model.dtype)}
    if isinstance(cache, IndexPoolCache):
        settings = cache.settings
        identity.update(attention="indexpool", kpool=settings.kpool, topk=settings.topk, window=settings.window,
                        sinks=settings.sinks, sink_gap=cache.sink_gap, segment=settings.segment,
                        index_dtype=settings.index_dtype,
                        kv_storage=cache.kv_storage, kv_dtype=str(cache.store.k.dtype), indexer=choice.indexer,
                        indexer_kind=type(cache.indexer).__name__,
                        index_dims=cache.indexer.key_dim, indexer_sources=cache.sources)
        if cache.segment_indexer is not None:
            identity["segment_indexer_kind"] = type(cache.segment_indexer).__name__
    else:
        identity.update(attention="dense", segment=session.segment)
        if isinstance(cache, KVCache):  # an fp32 model's cache may be bf16 (`Transformer.cache_dtype`)
            identity["kv_dtype"] = str(cache.k.dtype)
    return identity


def read_document(session, prompt: DocumentPrompt, identity: dict, doc_cache: TensorCache | None,
                  description: str, warn: Callable[[str], None],
                  on_progress: Callable[[int, int], None] | None) -> bool:
    """Make the session hold the document (the prompt's reusable tokens); returns True when restored from cache."""
    prefix = prompt.ids[: prompt.reusable]
    if session.tokens[: len(prefix)] == prefix and len(session.tokens) >= len(prefix):
        return True  # already held: a later question in the same run
    key = cache_key(identity, prefix) if doc_cache else ""
    if doc_cache:
        saved = doc_cache.load(key, warn)
        if saved is not None:
            tokens, state = saved
            try:
                session.restore(tokens, state)
                return True
            except ValueError as e:
                warn(f"document cache entry does not fit ({e}); reading the document again")
    session.prefill(prefix, on_progress, query_tail=False)
    if doc_cache:
        try:
            doc_cache.save(key, prefix, session.export_state(), description)
        except OSError as e:  # a full or read-only disk must not cost the user the answer
            warn(f"could not save the document cache ({e})")
    return False


def part_of(prompt: DocumentPrompt, position: int) -> int:
    """The index of the part holding prompt position `position`."""
    return next(i for i, (start, end) in enumerate(prompt.part_spans) if start <= position < end)


def request_evidence(cache, prompt: DocumentPrompt) -> AttentionEvidence | None:
    """Where a request's queries look inside the document (IndexPool sessions; None otherwise). The sinks and the
    last tokens before a query draw attention whatever is asked: in a document long enough to have other places
    to look, they are not evidence. In one many windows long the whole recent window is left out: its exact,
    unremapped attention outweighs the far tokens' (benchmarks/grounding.py cited the document's last part every
    time)."""
    if not isinstance(cache, IndexPoolCache):
        return None
    n_doc = prompt.doc_end - prompt.doc_start
    if n_doc <= EVIDENCE_MIN_DOCUMENT:
        return AttentionEvidence(prompt.doc_start, prompt.doc_end, 0)
    band = cache.settings.window if n_doc > 4 * cache.settings.window else EVIDENCE_LOCAL_BAND
    return AttentionEvidence(max(prompt.doc_start, cache.settings.sinks), prompt.doc_end, band)


@dataclass
class HeldDocument:
    """A document the session holds: read (or restored from the document cache) once, for every request on it.
    `baseline`: where a neutral question's reading looks (`evidence_baseline`), which sources are ranked beyond."""

    session: object
    tokenizer: object
    document: Document
    cached: bool = False  # restored from the document cache
    read_seconds: float = 0.0
    baseline: AttentionEvidence | None = None


def job_result(held: HeldDocument, prompt: DocumentPrompt, text: str, stats, answer_seconds: float,
               evidence: AttentionEvidence | None, quote: Quote | None = None, with_sources: bool = True) -> JobResult:
    """A request's result: its text and counts, the passages quoted to the model, and its sources ranked from its
    attention evidence (beyond the held document's baseline) and the question's words (`jobs.rank_sources`)."""
    document = held.document
    result = JobResult(text, prompt_tokens=stats.prompt_tokens, document_tokens=prompt.doc_end - prompt.doc_start,
                       new_tokens=stats.new_tokens, cached=held.cached, read_seconds=held.read_seconds,
                       answer_seconds=answer_seconds, stop_reason=stats.stop_reason)
    quoted = [(part_of(prompt, passage.start), passage.text) for passage in quote.passages] if quote else []
    for part, passage in quoted:
        result.quotes.append({"text": passage, "cite": document.parts[part].cite,
                              "location": document.parts[part].location()})
    if evidence is not None:
        beyond = evidence.beyond(held.baseline) if held.baseline is not None else None
        attention = [evidence.span_mass(start, end, beyond) for start, end in prompt.part_spans]
        index = prompt.document.index(held.tokenizer).lexical
        result.sources = rank_sources(document, index, prompt.question, text, attention, quoted)
    elif with_sources:
        result.notes.append("no sources: they come from IndexPool attention (this run used the model's own "
                            "attention; --attention indexpool gives them on llama-family models)")
    return result


def run_request(held: HeldDocument, prompt: DocumentPrompt, sampler, max_new_tokens: int,
                on_text: Callable[[str], None] | None = None, with_sources: bool = True) -> JobResult:
    """Append the request to the held document, generate (streaming text to on_text), and collect sources. A
    request with a place for a quote, on an IndexPool session, is read in two steps: up to that place, then with
    the passages its words and reading point to quoted there (`Session.read_shared`: the quote sits in the recent
    window; its far selection matters little)."""
    from indexpool.model.generate import GenerationStats

    session, tokenizer = held.session, held.tokenizer
    evidence = request_evidence(session.cache, prompt) if with_sources else None
    stats = GenerationStats()
    quote = None
    t0 = time.perf_counter()
    ids = prompt.ids
    if quotes(prompt, evidence):
        session.prefill(prompt.ids[: prompt.quote_at], evidence=evidence, question_from=prompt.doc_end)
        quote = passage_quote(tokenizer, prompt, evidence, held.baseline, session.model)
        ids = with_quote(tokenizer, prompt, quote)
        session.read_shared(ids, evidence)  # `generate` reads the last token
    tokens = session.generate(ids, sampler, max_new_tokens, tokenizer.stop_ids, stats, evidence=evidence,
                              question_from=prompt.doc_end)
    text = generated_text(tokenizer, tokens, on_text)
    return job_result(held, prompt, text, stats, time.perf_counter() - t0, evidence, quote, with_sources)


def quotes(prompt: DocumentPrompt, evidence: AttentionEvidence | None) -> bool:
    """Whether a request is read in two steps, quoting what its first step found (see `run_request`)."""
    return prompt.quote_at is not None and evidence is not None


MAX_BATCH = 16  # requests per batch: each step's cost grows with the batch once the weights are amortised


def requests_that_fit(count: int, bytes_per_request: int, available_bytes: int | None) -> int:
    """`count` requests, at most MAX_BATCH and as many as whose buffers fit in half the memory available; at
    least 1."""
    fits = count if available_bytes is None else available_bytes // 2 // bytes_per_request
    return max(1, min(count, MAX_BATCH, fits))


def batch_size(session, prompts: list[DocumentPrompt], max_new_tokens: int, available_bytes: int | None) -> int:
    """How many requests to decode together: all of them (up to MAX_BATCH) when the session can branch them
    and their buffers fit in half the memory available; 1 (one after another) otherwise."""
    from indexpool.model.indexpool_branches import bytes_per_branch

    ids = [p.ids for p in prompts]
    more = max(p.max_tokens - len(p.ids) for p in prompts)  # a quote's tokens
    if len(prompts) < 2 or not session.can_branch(ids, max_new_tokens + more):
        return 1
    capacity = max(p.max_tokens for p in prompts) - len(session.tokens) + max_new_tokens
    return requests_that_fit(len(prompts), bytes_per_branch(session.cache, capacity), available_bytes)


def section_batch_size(session, prompt_lengths: list[int], max_new_tokens: int, available_bytes: int | None) -> int:
    """How many independent prompts (section summaries) to decode together: all of them (up to MAX_BATCH) when
    the session is dense and their rows of K/V fit in half the memory available; 1 (one after another) otherwise."""
    if len(prompt_lengths) < 2 or not session.can_batch():
        return 1
    model = session.model
    row_tokens = min(session.max_length, max(prompt_lengths) + max_new_tokens)  # `Session.generate_batch`'s rows
    return requests_that_fit(len(prompt_lengths), model.config.kv_bytes_per_token(model.dtype) * row_tokens,
                             available_bytes)


def generated_text(tokenizer, tokens: Iterable[int], on_text: Callable[[str], None] | None = None) -> str:
    """The text of generated tokens as it is streamed to on_text (control tokens left out)."""
    decoder = tokenizer.stream_decoder()
    pieces = []
    for token in tokens:
        pieces.append(piece := decoder.push(token))
        if piece and on_text:
            on_text(piece)
    pieces.append(tail := decoder.flush())
    if tail and on_text:
        on_text(tail)
    return "".join(pieces)


def run_batch(held: HeldDocument, prompts: list[DocumentPrompt], sampler, max_new_tokens: int) -> list[JobResult]:
    """Requests on the held document decoded together as branches (`Session.generate_branches`), each read as
    `run_request` reads it (in two steps where it quotes); answer seconds are each request's reading plus the
    batch's decoding."""
    session, tokenizer = held.session, held.tokenizer
    evidence = [request_evidence(session.cache, p) for p in prompts]
    quoting = [quotes(p, found) for p, found in zip(prompts, evidence)]
    found_quotes: list[Quote | None] = [None] * len(prompts)

    def then_read(b: int) -> list[int]:  # after the first step of a quoting request: the quote and the rest
        prompt = prompts[b]
        if not quoting[b]:
            return []
        found_quotes[b] = passage_quote(tokenizer, prompt, evidence[b], held.baseline, session.model)
        return with_quote(tokenizer, prompt, found_quotes[b])[prompt.quote_at :]

    heads = [p.ids[: p.quote_at] if q else p.ids for p, q in zip(prompts, quoting)]
    more = max(p.max_tokens - len(h) for p, h in zip(prompts, heads))
    outputs = session.generate_branches(heads, sampler, max_new_tokens, tokenizer.stop_ids, evidence,
                                        then_read, more_tokens=more, question_from=prompts[0].doc_end)
    return [job_result(held, prompt, generated_text(tokenizer, tokens), stats,
                       stats.prefill_seconds + stats.decode_seconds, found, quote)
            for (tokens, stats), prompt, found, quote in zip(outputs, prompts, evidence, found_quotes)]


def extract_answer(held: HeldDocument, prompt: DocumentPrompt) -> JobResult | None:
    """An extractive answer: the question is read after the held document (its attention evidence), and the
    answer is the passage its words and its reading point to most (`passage_quote`), cited with the others
    quoted. None when the request has no question to quote for or nothing is found (generate instead)."""
    from indexpool.model.generate import GenerationStats

    session = held.session
    evidence = request_evidence(session.cache, prompt)
    if not quotes(prompt, evidence):
        return None
    t0 = time.perf_counter()
    session.prefill(prompt.ids[: prompt.quote_at], evidence=evidence, question_from=prompt.doc_end)
    quote = passage_quote(held.tokenizer, prompt, evidence, held.baseline, session.model)
    session.tokens = session.tokens[: session.cache.truncate(prompt.reusable)]  # the document alone again
    if quote is None:
        return None
    stats = GenerationStats(prompt_tokens=prompt.quote_at, stop_reason="extracted")
    return job_result(held, prompt, quote.passages[0].text, stats, time.perf_counter() - t0, evidence, quote)


PROBE_QUESTION = "What is this document about?"  # asks about nothing in particular: the sources' baseline


def evidence_baseline(session, tokenizer, document: DocumentTokens, prompt: DocumentPrompt, messages: list[dict],
                      identity: dict, doc_cache: TensorCache | None, description: str,
                      warn: Callable[[str], None]) -> AttentionEvidence | None:
    """Where a neutral question's reading (PROBE_QUESTION, in `messages`' place) looks in the held document: the
    baseline sources are ranked against (`AttentionEvidence.beyond`). IndexPool sessions and documents long
    enough to have sources (None otherwise). Kept in the document cache beside the read document."""
    if not isinstance(session.cache, IndexPoolCache) or prompt.doc_end - prompt.doc_start <= EVIDENCE_MIN_DOCUMENT:
        return None
    probe = document_prompt(tokenizer, document, messages, session.cache.settings.kpool)
    baseline = request_evidence(session.cache, probe)
    key = cache_key({**identity, "evidence_baseline": PROBE_QUESTION}, probe.ids) if doc_cache else ""
    saved = doc_cache.load(key, warn) if doc_cache else None
    if saved is not None and {"mass", "queries"} <= saved[1].keys() and saved[1]["mass"].shape == baseline.mass.shape:
        baseline.mass.copy_(saved[1]["mass"])
        baseline.queries = int(saved[1]["queries"])
        return baseline
    session.prefill(probe.ids, evidence=baseline, question_from=probe.doc_end)
    # Back to the document alone: a question must be read from the same point whether or not the probe ran (the
    # probe's tail shares some template tokens with it, which would otherwise be kept and not counted as queries).
    session.tokens = session.tokens[: session.cache.truncate(prompt.reusable)]
    if doc_cache:
        try:
            doc_cache.save(key, [], {"mass": baseline.mass, "queries": torch.tensor(baseline.queries)},
                           f"{description}: evidence baseline")
        except OSError as e:
            warn(f"could not save the evidence baseline ({e})")
    return baseline if baseline.queries else None


SECTION_RESERVE = 1024  # tokens of a section-summary prompt kept for the template, the request and the summary


def generate_each(session, tokenizer, prompts: list[DocumentPrompt], documents: list[Document], sampler,
                  max_new_tokens: int, batch: int, on_batch: Callable[[range, int], None] | None = None) -> list[JobResult]:
    """Each prompt's own continuation (prompts on different documents: sections, several inputs), `batch` of them
    decoded together (`Session.generate_batch`), or one after another when `batch` is 1 (any session); no
    attention sources. on_batch(the batch's prompts, total) before each batch."""
    results = []
    for first in range(0, len(prompts), batch):
        rows = range(first, min(first + batch, len(prompts)))
        if on_batch:
            on_batch(rows, len(prompts))
        if batch == 1:
            held = HeldDocument(session, tokenizer, documents[first])
            results.append(run_request(held, prompts[first], sampler, max_new_tokens, with_sources=False))
            continue
        outputs = session.generate_batch([prompts[i].ids for i in rows], sampler, max_new_tokens, tokenizer.stop_ids)
        for i, (tokens, stats) in zip(rows, outputs):
            held = HeldDocument(session, tokenizer, documents[i], read_seconds=stats.prefill_seconds)
            results.append(job_result(held, prompts[i], generated_text(tokenizer, tokens), stats, stats.decode_seconds,
                                      None, with_sources=False))
    return results


EXTRACT_MAX_PARAMETERS = 1_000_000_000
# --answer/--summary auto: extract for models below this many parameters. The default model (135M) wrote an
# answer holding the fact for 2 of 12 questions on a real manual with the right passage quoted to it, and the
# passage itself held it for 8; its summaries of real documents named 2% of their top-level sections, the outline
# 89% (benchmarks/doc_qa.py, docs/benchmarks.md).


@dataclass
class Events:
    """What the engine tells the person waiting (the command line shows it on stderr; by default nothing):
    warnings, progress lines, a progress callback while a document is read (`reading(total)` yields
    on_progress(done, total) or None), and the wait while the index pruning is calibrated."""

    warn: Callable[[str], None] = lambda message: None
    progress: Callable[[str], None] = lambda message: None
    reading: Callable[[int], ContextManager] = lambda total: contextlib.nullcontext(None)
    calibrating: Callable[[], ContextManager] | None = None


class LocalBackend:
    """The jobs' `Backend` on the local engine. The model is loaded when first needed (`load()` returns the
    engine's loaded model: `--summary extract` loads none). `options`: dense or IndexPool and its settings;
    `sampler`: how tokens are chosen; `doc_cache`: where read documents are kept (None: not kept)."""

    def __init__(self, load: Callable[[], object], options: SessionOptions, sampler, doc_cache: TensorCache | None = None,
                 events: Events | None = None, system: str | None = None):
        self._load = load
        self._loaded = None
        self.options = options
        self.sampler = sampler
        self.doc_cache = doc_cache
        self.events = events or Events()
        self.system = system
        self._encoded: dict[int, tuple[Document, DocumentTokens]] = {}

    @property
    def loaded(self):
        if self._loaded is None:
            self._loaded = self._load()
        return self._loaded

    @property
    def name(self) -> str | None:
        """The model's name once it is loaded (None before: an extracted outline needs no model)."""
        return self._loaded.name if self._loaded is not None else None

    @property
    def context_length(self) -> int:
        return self.loaded.config.context_length

    def identity(self) -> dict:
        loaded = self.loaded
        return {"backend": "local", "model": loaded.name, "model_bytes": loaded.file_bytes,
                "dtype": str(loaded.model.dtype), "options": repr(self.options), "sampling": repr(self.sampler.params)}

    def keeps_results(self) -> bool:
        return False  # the document cache keeps the read document: a request on it costs only its own tokens

    def extracts(self) -> bool:
        from indexpool.model.gguf_weights import weight_count

        return weight_count(self.loaded.model) < EXTRACT_MAX_PARAMETERS

    def count_tokens(self, text: str) -> int:
        return len(self.loaded.tokenizer.encode(text))

    def encoded(self, document: Document) -> DocumentTokens:
        """The document's tokens, encoded once per document."""
        kept = self._encoded.get(id(document))
        if kept is None or kept[0] is not document:
            kept = self._encoded[id(document)] = (document, DocumentTokens.encode(self.loaded.tokenizer, document))
        return kept[1]

    def document_tokens(self, document: Document) -> int:
        return len(self.encoded(document).ids)

    def fits(self, document: Document, request: str, max_new_tokens: int) -> bool:
        return self.document_tokens(document) <= self.context_length - SECTION_RESERVE

    def reads_whole(self, document: Document, request: str, max_new_tokens: int) -> bool:
        return True  # IndexPool reads past the model's context (a session that cannot says why when opened)

    def section_budget(self, request: str, max_new_tokens: int) -> int:
        return self.context_length - SECTION_RESERVE

    def context_note(self, document_tokens: int) -> str:
        return f"the document's {document_tokens:,} tokens, the model's context {self.context_length:,}"

    def open_session(self, needed_tokens: int | None, auto: str = "fit", options: SessionOptions | None = None):
        return sessions.open_session(self.loaded, options or self.options, needed_tokens, auto,
                                     self.events.calibrating)

    def hold(self, session, document: Document, prompt: DocumentPrompt, probe: list[dict]) -> HeldDocument:
        """Make the session hold the document (restored from the document cache where kept), with the baseline of
        a neutral question (`probe`: the messages of PROBE_QUESTION in the request's place)."""
        tokenizer = self.loaded.tokenizer
        identity = session_identity(self.loaded, session, self.options)
        description = f"{document.name or 'document'} ({prompt.doc_end - prompt.doc_start:,} tokens)"
        t0 = time.perf_counter()
        with self.events.reading(prompt.reusable) as on_progress:
            cached = read_document(session, prompt, identity, self.doc_cache, description, self.events.warn,
                                   on_progress)
        baseline = evidence_baseline(session, tokenizer, prompt.document, prompt, probe, identity, self.doc_cache,
                                     description, self.events.warn)
        return HeldDocument(session, tokenizer, document, cached, time.perf_counter() - t0, baseline)

    def answer(self, document: Document, requests: list[str], max_new_tokens: int, extract: bool,
               on_result: OnResult, on_text: OnText | None = None) -> list[JobResult]:
        """The document is read once (or restored from the document cache), then the requests are answered:
        extracted where `extract` and a passage is found (`extract_answer`), else generated: together, as
        branches of the held document, when the session allows (`batch_size`), else in turn, streamed to
        on_text."""
        from indexpool.model.sessions import available_memory_bytes

        tokenizer = self.loaded.tokenizer
        tokens = self.encoded(document)
        kpool = self.options.indexpool.kpool
        prompts = [document_prompt(tokenizer, tokens, request_messages(r, self.system), kpool) for r in requests]
        session = self.open_session(max(p.max_tokens for p in prompts) + max_new_tokens, auto="indexpool")
        held = self.hold(session, document, prompts[0], request_messages(ask_request(PROBE_QUESTION), self.system))
        order = InOrder(len(prompts), on_result)

        def done(i: int, result: JobResult) -> None:
            if i:  # the document was read (or restored) once, for the first request; later ones found it held
                result.cached, result.read_seconds = True, 0.0
            order.put(i, result)

        pending = []
        for i, prompt in enumerate(prompts):
            result = extract_answer(held, prompt) if extract else None
            if result is None:
                pending.append(i)
            else:
                done(i, result)
        budget = min(max_new_tokens, session.max_length - max(p.max_tokens for p in prompts))
        size = batch_size(session, [prompts[i] for i in pending], budget, available_memory_bytes()) if pending else 1
        for first in range(0, len(pending), size):  # every prompt starts with the document, which the session holds
            rows = pending[first : first + size]
            if size > 1:  # decoded together: each result comes when the batch is done
                self.events.progress(f"answering {len(rows)} requests as one batch")
                for i, result in zip(rows, run_batch(held, [prompts[i] for i in rows], self.sampler, budget)):
                    done(i, result)
                continue
            i = rows[0]
            text = on_text and (lambda piece, i=i: on_text(i, piece))
            done(i, run_request(held, prompts[i], self.sampler, budget, text))
        return order.results  # type: ignore[return-value]

    def answer_each(self, documents: list[Document], request: str, max_new_tokens: int,
                    what: str) -> list[JobResult]:
        """Each document's answer on a dense session, decoded in batches as large as memory allows
        (`section_batch_size`); sources from the answer's wording (a batch keeps no attention evidence). With
        --attention indexpool, inputs are read one by one with IndexPool instead (sources from its evidence)."""
        from indexpool.model.sessions import available_memory_bytes

        if what == "inputs" and self.options.attention == "indexpool":
            return [self.answer(d, [request], max_new_tokens, False, lambda i, r: None)[0] for d in documents]
        tokenizer = self.loaded.tokenizer
        prompts = [document_prompt(tokenizer, self.encoded(d), request_messages(request, self.system))
                   for d in documents]
        session = self.open_session(self.context_length, options=dataclasses.replace(self.options, attention="dense"))
        batch = section_batch_size(session, [len(p.ids) for p in prompts], max_new_tokens, available_memory_bytes())

        def show(rows: range, total: int) -> None:
            which = f"{what} {rows.start + 1}-{rows.stop}" if len(rows) > 1 else f"{what[:-1]} {rows.start + 1}"
            self.events.progress(f"answering {which} of {total}" + (" as one batch" if len(rows) > 1 else ""))

        results = generate_each(session, tokenizer, prompts, documents, self.sampler, max_new_tokens, batch, show)
        for document, result in zip(documents, results):
            index = LexicalIndex.of_parts([part.text for part in document.parts])
            result.sources = rank_sources(document, index, None, result.text)
            result.notes.append("decoded in a batch with other documents: sources are the parts whose wording it "
                                "repeats (a batch keeps no attention evidence)")
        return results

    def complete(self, text: str, max_new_tokens: int, on_text: Callable[[str], None] | None = None,
                 speculative: bool = False):
        """Raw continuation of `text` (no chat template): (the new text, its GenerationStats). speculative:
        glm5_next's MTP drafts checked by the next forward (greedy only)."""
        from indexpool.model.generate import GenerationStats
        from indexpool.model.errors import InputError

        if not text:  # checked before the model loads
            raise InputError("the prompt is empty")
        tokenizer = self.loaded.tokenizer
        ids = ([tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []) + tokenizer.encode(text)
        if speculative:
            session = sessions.speculative_session(self.loaded, self.options, len(ids) + max_new_tokens,
                                                   self.sampler.params.temperature)
        else:
            session = self.open_session(len(ids) + max_new_tokens)
        stats = GenerationStats()
        with self.events.reading(len(ids)) as on_progress:
            tokens = session.generate(ids, self.sampler, max_new_tokens, tokenizer.stop_ids, stats, on_progress)
            first = next(tokens, None)  # the prompt is read (its progress shown) before the first token
        return generated_text(tokenizer, [] if first is None else itertools.chain([first], tokens), on_text), stats


@dataclass
class Reply:
    """One turn of a `Conversation`: the reply's text, its GenerationStats, and (about a document) its result with
    sources; `fed_tokens`: the tokens the turn fed the model (its message and the reply before)."""

    text: str
    stats: object
    result: JobResult | None
    fed_tokens: int


DOCUMENT_CHAT_TOKENS = 65536  # room for a conversation about a document, on top of the document


class Conversation:
    """A chat on the local engine, about a document or none. About a document, it is read once (or restored from
    the document cache) before the first message and every reply cites its sources. With IndexPool a conversation
    grows to 128K tokens; where it outgrows the session, the oldest exchanges are dropped (never the document)."""

    def __init__(self, backend: LocalBackend, document: Document | None = None, system: str | None = None):
        self.backend = backend
        self.document = document
        tokenizer = backend.loaded.tokenizer
        self.base = [{"role": "system", "content": system}] if system else []
        self.held = None
        if document is None:
            self.session = backend.open_session(None)
        else:
            self.base += [{"role": "user", "content": f"{DOCUMENT_MARK}\nThis is the document we will talk about."},
                          {"role": "assistant", "content": "I have read it. What would you like to know?"}]
            prompt = self.encode(self.base)
            self.session = backend.open_session(len(prompt.ids) + DOCUMENT_CHAT_TOKENS, auto="indexpool")
            probe = self.base + [{"role": "user", "content": PROBE_QUESTION}]
            self.held = backend.hold(self.session, document, prompt, probe)
            self.held.cached, self.held.read_seconds = False, 0.0
        self.tokenizer = tokenizer
        self.messages = list(self.base)

    def encode(self, messages: list[dict]):
        tokenizer = self.backend.loaded.tokenizer
        if self.document is None:
            return tokenizer.encode_chat(messages)
        return document_prompt(tokenizer, self.backend.encoded(self.document), messages,
                               self.backend.options.indexpool.kpool)

    def length(self, encoded) -> int:
        return len(encoded if self.document is None else encoded.ids)

    def reset(self) -> None:
        self.messages = list(self.base)

    def say(self, message: str, max_new_tokens: int, on_text: Callable[[str], None] | None = None) -> Reply:
        from indexpool.model.errors import InputError
        from indexpool.model.generate import GenerationStats

        session = self.session
        self.messages.append({"role": "user", "content": message})
        encoded = self.encode(self.messages)
        # Drop the oldest exchanges (never the document) when the conversation no longer fits, keeping room for
        # the reply.
        while self.length(encoded) + max_new_tokens > session.max_length and len(self.messages) > len(self.base) + 1:
            del self.messages[len(self.base) : len(self.base) + 2]
            encoded = self.encode(self.messages)
        if self.length(encoded) >= session.max_length:
            self.messages.pop()
            raise InputError(f"the message has {self.length(encoded)} tokens; the model's context is "
                             f"{session.max_length}")
        budget = min(max_new_tokens, session.max_length - self.length(encoded))
        if self.held is None:
            stats = GenerationStats()
            tokens = session.generate(encoded, self.backend.sampler, budget, self.tokenizer.stop_ids, stats)
            reply = Reply(generated_text(self.tokenizer, tokens, on_text), stats, None, session.last_fed_tokens)
        else:
            result = run_request(self.held, encoded, self.backend.sampler, budget, on_text)
            reply = Reply(result.text, None, result, session.last_fed_tokens)
        self.messages.append({"role": "assistant", "content": reply.text})
        return reply
