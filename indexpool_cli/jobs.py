"""The document jobs (ask, summarize, complete) over an ingested Document: the prompt around the document, the
document cache, generation, and the sources an answer rests on.

Every job reads the document first (or restores it from the document cache), then appends its request: the
document's tokens come before anything a request changes, so the cached state serves every later question.
Sources come from what the model attended to and, for a question, from its words: while the question and the
answer are read and written, the attention probability of every token it attends to (sinks aside: the selected far
tokens and the recent window) is summed over heads and layers (`AttentionEvidence`), and counted beyond what a
neutral question's reading gives it (`evidence_baseline`: some tokens draw attention whatever is asked); the
parts of the passages quoted come first (`rank_sources`).

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

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from indexpool.model.errors import SettingsError
from indexpool.model.indexpool_cache import AttentionEvidence, IndexPoolCache
from indexpool.model.llama import KVCache
from indexpool.model.tensor_cache import TensorCache, cache_key
from .console import InputError
from .ingest import Document, Part
from .retrieval import LexicalIndex, Passage

DOCUMENT_MARK = "\x00DOCUMENT\x00"  # where the document goes in the rendered chat template
QUOTE_MARK = "\x00QUOTE\x00"  # where an ask request takes the quoted lines (left out where nothing is quoted)
QUOTE_TOKENS = 96  # most document tokens quoted from attention evidence alone (`evidence_quote`)
# A question whose words the document holds is answered from passages found by its words and its reading together
# (`passage_quote`): at most QUOTE_PASSAGES of them, PASSAGE_TOKENS each.
QUOTE_PASSAGES = 2
PASSAGE_TOKENS = 128
# A passage's score: its lexical score and its attention evidence, each scaled to the best passage's, and for the
# RERANK_CANDIDATES best by their words the model's likelihood of the question after the passage (scaled from the
# least to the most likely candidate: `question_likelihoods`), with these weights. The words find the place; the
# reading and the model tell apart places the words score alike. On the real-document set (benchmarks/doc_qa.py)
# the words alone put a passage holding the answer first for 51 of 72 questions, attention alone 14, the three
# together 53 (its part the right first source: 61, 22 and 66; benchmarks/passage_choice.py, docs/benchmarks.md).
ATTENTION_WEIGHT = 0.1
MODEL_WEIGHT = 0.25
RERANK_CANDIDATES = 6
RERANK_CONTEXT_TOKENS = 200  # of a candidate passage, before the question
QUOTE_LINE_SHARE = 0.5  # lines next to the best one join the quote when their evidence is this share of its
# A quote only when the best line holds this many times the evidence of the best line elsewhere: planted facts at
# 30K stood 3.4-17x above the next line (all right), code questions on a folder 1.0-1.3x (all wrong lines).
QUOTE_MIN_RATIO = 2.0
QUOTE_OPEN, QUOTE_CLOSE = 'From the document: "', '"\n'  # the quote's frame (measured against two others)
MAX_SOURCES = 3
SOURCE_SHARE = 0.5  # a part is cited when its evidence is at least this share of the best part's
EVIDENCE_LOCAL_BAND = 256  # tokens before a query whose attention is local context, not evidence
EVIDENCE_MIN_DOCUMENT = 1024  # shorter documents: every token may be evidence

SUMMARY_LENGTHS = {  # what the request asks for, and the new tokens it may take
    "short": ("in three sentences", 160),
    "medium": ("in one paragraph of about 150 words", 320),
    "long": ("in about 400 words, section by section", 720),
}


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


def request_messages(request: str, system: str | None = None) -> list[dict]:
    """One user turn: the document, then the request."""
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{DOCUMENT_MARK}\n{request}"}]


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


def combined(lexical: list[float], attention: list[float], attention_weight: float = ATTENTION_WEIGHT) -> list[float]:
    """Lexical scores plus `attention_weight` times attention evidence, each scaled to its best."""

    def scaled(values: list[float]) -> list[float]:
        best = max(values, default=0.0)
        return [v / best for v in values] if best > 0 else [0.0] * len(values)

    return [a + attention_weight * b for a, b in zip(scaled(lexical), scaled(attention))]


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


@dataclass
class JobResult:
    text: str
    sources: list[dict] = field(default_factory=list)
    prompt_tokens: int = 0
    document_tokens: int = 0
    new_tokens: int = 0
    cached: bool = False  # the document was restored from the document cache
    read_seconds: float = 0.0  # reading the document (prefill, or restoring it)
    answer_seconds: float = 0.0  # the request and the generated text
    stop_reason: str = ""
    notes: list[str] = field(default_factory=list)
    quotes: list[dict] = field(default_factory=list)  # the passages quoted to the model before it answered
    cites_inline: bool = False  # the text cites its sources itself (an outline): no "Sources:" line after it

    def to_json(self) -> dict:
        return {"text": self.text, "sources": self.sources, "quotes": self.quotes,
                "tokens": {"prompt": self.prompt_tokens, "document": self.document_tokens, "new": self.new_tokens},
                "cached": self.cached, "stop_reason": self.stop_reason,
                "timings": {"read_seconds": round(self.read_seconds, 3), "answer_seconds": round(self.answer_seconds, 3)},
                "notes": self.notes}


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


def rank_sources(evidence: AttentionEvidence, prompt: DocumentPrompt, document: Document,
                 baseline: AttentionEvidence | None = None, tokenizer=None, answer: str = "",
                 quote: Quote | None = None) -> list[dict]:
    """The parts an answer rests on, at most MAX_SOURCES: first the parts of the passages quoted to the model (in
    the order quoted: what it was given to answer from), then the parts with the most attention evidence of the
    question's and the answer's reading (beyond the baseline's, when given), for an ask request plus the
    question's words (`combined`), each at least SOURCE_SHARE of the best. Each source gives its part's location
    and its passage that was quoted, else its lines that best match the question and the answer."""
    beyond = evidence.beyond(baseline) if baseline is not None else None
    attention = [evidence.span_mass(start, end, beyond) for start, end in prompt.part_spans]
    index = prompt.document.index(tokenizer) if tokenizer and prompt.document is not None and prompt.question else None
    scores = combined(index.lexical.part_scores(prompt.question), attention) if index is not None else attention
    total = sum(scores)
    if not total:
        return []
    quoted = [part_of(prompt, passage.start) for passage in quote.passages] if quote is not None else []
    ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    best = scores[ranked[0]]
    order = list(dict.fromkeys(quoted + [i for i in ranked if scores[i] >= SOURCE_SHARE * best]))
    words = index.lexical.passage_scores(f"{prompt.question}\n{answer}") if index is not None else []
    sources = []
    for i in order[:MAX_SOURCES]:
        part = document.parts[i]
        source = {"cite": part.cite, "source": part.source, "share": round(scores[i] / total, 4),
                  "location": part.location()}
        if index is not None:
            source["text"] = cited_passage(index, i, prompt, quote, words)
        sources.append(source)
    return sources


def part_of(prompt: DocumentPrompt, position: int) -> int:
    """The index of the part holding prompt position `position`."""
    return next(i for i, (start, end) in enumerate(prompt.part_spans) if start <= position < end)


def cited_passage(index: DocumentIndex, part: int, prompt: DocumentPrompt, quote: Quote | None,
                  scores: list[float]) -> str:
    """The text a source shows for part `part`: its passage that was quoted, else its passage with the best of
    `scores` (every passage's lexical score for the question and the answer; its first when none scores)."""
    start, end = prompt.part_spans[part]
    for passage in quote.passages if quote else []:
        if start <= passage.start < end:
            return passage.text
    own = [i for i, p in enumerate(index.lexical.passages) if p.part == part]
    if not own:
        return ""
    best = index.lexical.passages[max(own, key=lambda i: scores[i])]
    return "".join(text for _, text in index.lexical.lines[best.first_line : best.last_line]).strip()


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


def job_result(text: str, stats, prompt: DocumentPrompt, document: Document,
               evidence: AttentionEvidence | None, with_sources: bool, cached: bool, read_seconds: float,
               answer_seconds: float, baseline: AttentionEvidence | None = None,
               quote: Quote | None = None, tokenizer=None) -> JobResult:
    result = JobResult(text, prompt_tokens=stats.prompt_tokens,
                       document_tokens=prompt.doc_end - prompt.doc_start, new_tokens=stats.new_tokens, cached=cached,
                       read_seconds=read_seconds, answer_seconds=answer_seconds, stop_reason=stats.stop_reason)
    for passage in quote.passages if quote is not None else []:
        part = document.parts[part_of(prompt, passage.start)]
        result.quotes.append({"text": passage.text, "cite": part.cite, "location": part.location()})
    if evidence is not None:
        result.sources = rank_sources(evidence, prompt, document, baseline, tokenizer, text, quote)
    elif with_sources:
        result.notes.append("no sources: they come from IndexPool attention (this run used the model's own "
                            "attention; --attention indexpool gives them on llama-family models)")
    return result


def run_request(session, tokenizer, prompt: DocumentPrompt, document: Document, sampler, max_new_tokens: int,
                on_text: Callable[[str], None] | None, cached: bool, read_seconds: float,
                with_sources: bool = True, baseline: AttentionEvidence | None = None) -> JobResult:
    """Append the request to the held document, generate (streaming text to on_text), and collect sources
    (ranked beyond `baseline`, `evidence_baseline`'s, when given). A request with a place for a quote, given a
    baseline, is read in two steps: up to that place, then with the lines its reading pointed at quoted there
    (`Session.read_shared`: the quote sits in the recent window; its far selection matters little)."""
    from indexpool.model.generate import GenerationStats

    evidence = request_evidence(session.cache, prompt) if with_sources else None
    stats = GenerationStats()
    decoder = tokenizer.stream_decoder()
    pieces, quote = [], None
    t0 = time.perf_counter()
    ids = prompt.ids
    if quotes(prompt, evidence):
        session.prefill(prompt.ids[: prompt.quote_at], evidence=evidence)
        quote = passage_quote(tokenizer, prompt, evidence, baseline, session.model)
        ids = with_quote(tokenizer, prompt, quote)
        session.read_shared(ids, evidence)  # `generate` reads the last token
    for token in session.generate(ids, sampler, max_new_tokens, tokenizer.stop_ids, stats, evidence=evidence):
        pieces.append(piece := decoder.push(token))
        if piece and on_text:
            on_text(piece)
    pieces.append(tail := decoder.flush())
    if tail and on_text:
        on_text(tail)
    return job_result("".join(pieces), stats, prompt, document, evidence, with_sources, cached, read_seconds,
                      time.perf_counter() - t0, baseline, quote, tokenizer)


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


def generated_text(tokenizer, tokens: list[int]) -> str:
    """The text of generated tokens as it is streamed (control tokens left out)."""
    decoder = tokenizer.stream_decoder()
    return "".join(decoder.push(token) for token in tokens) + decoder.flush()


def run_batch(session, tokenizer, prompts: list[DocumentPrompt], document: Document, sampler, max_new_tokens: int,
              cached: bool, read_seconds: float, baseline: AttentionEvidence | None = None) -> list[JobResult]:
    """Requests on the held document decoded together as branches (`Session.generate_branches`), each read as
    `run_request` reads it (in two steps where it quotes); answer seconds are each request's reading plus the
    batch's decoding."""
    evidence = [request_evidence(session.cache, p) for p in prompts]
    quoting = [quotes(p, found) for p, found in zip(prompts, evidence)]
    found_quotes: list[Quote | None] = [None] * len(prompts)

    def then_read(b: int) -> list[int]:  # after the first step of a quoting request: the quote and the rest
        prompt = prompts[b]
        if not quoting[b]:
            return []
        found_quotes[b] = passage_quote(tokenizer, prompt, evidence[b], baseline, session.model)
        return with_quote(tokenizer, prompt, found_quotes[b])[prompt.quote_at :]

    heads = [p.ids[: p.quote_at] if q else p.ids for p, q in zip(prompts, quoting)]
    more = max(p.max_tokens - len(h) for p, h in zip(prompts, heads))
    outputs = session.generate_branches(heads, sampler, max_new_tokens, tokenizer.stop_ids, evidence,
                                        then_read, more_tokens=more)
    results = []
    for (tokens, stats), prompt, found, quote in zip(outputs, prompts, evidence, found_quotes):
        results.append(job_result(generated_text(tokenizer, tokens), stats, prompt, document, found, True, cached,
                                  read_seconds, stats.prefill_seconds + stats.decode_seconds, baseline, quote,
                                  tokenizer))
    return results


ANSWER_MODES = ("auto", "extract", "generate")
# auto (--answer, --summary): extract for models below this many parameters. The default model (135M) wrote an
# answer holding the fact for 2 of 12 questions on a real manual with the right passage quoted to it, and the
# passage itself held it for 8; its summaries of real documents named 2% of their top-level sections, the outline
# 89% (benchmarks/doc_qa.py, docs/benchmarks.md).
EXTRACT_MAX_PARAMETERS = 1_000_000_000


def answer_mode(mode: str, model, option: str = "--answer") -> str:
    """--answer or --summary: extract (from the document), generate (the model writes it), or auto."""
    if mode not in ANSWER_MODES:
        raise SettingsError(f"{option} must be one of {', '.join(ANSWER_MODES)}, not {mode!r}")
    if mode != "auto":
        return mode
    return "extract" if sum(p.numel() for p in model.parameters()) < EXTRACT_MAX_PARAMETERS else "generate"


def outline_summary(document: Document, length: str, focus: str | None) -> JobResult:
    """An extractive summary: the document's outline (indexpool_cli/outline.py), each item citing its part."""
    from .outline import outline, outline_text

    t0 = time.perf_counter()
    items = outline(document, length, focus)
    result = JobResult(outline_text(items, document), stop_reason="extracted", cites_inline=True)
    for item in items:
        part = document.parts[item.part]
        result.sources.append({"cite": part.cite, "source": part.source, "title": item.title,
                               "location": part.location(), "text": item.text})
    result.answer_seconds = time.perf_counter() - t0
    if not items:
        result.notes.append("the document has no text to outline")
    return result


def extract_answer(session, tokenizer, prompt: DocumentPrompt, document: Document, cached: bool,
                   read_seconds: float, baseline: AttentionEvidence | None) -> JobResult | None:
    """An extractive answer: the question is read after the held document (its attention evidence), and the
    answer is the passage its words and its reading point to most (`passage_quote`), cited with the others
    quoted. None when the request has no question to quote for or nothing is found (generate instead)."""
    from indexpool.model.generate import GenerationStats

    evidence = request_evidence(session.cache, prompt)
    if not quotes(prompt, evidence):
        return None
    t0 = time.perf_counter()
    session.prefill(prompt.ids[: prompt.quote_at], evidence=evidence)
    quote = passage_quote(tokenizer, prompt, evidence, baseline, session.model)
    session.tokens = session.tokens[: session.cache.truncate(prompt.reusable)]  # the document alone again
    if quote is None:
        return None
    stats = GenerationStats(prompt_tokens=prompt.quote_at, stop_reason="extracted")
    return job_result(quote.passages[0].text, stats, prompt, document, evidence, True, cached, read_seconds,
                      time.perf_counter() - t0, baseline, quote, tokenizer)


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
    session.prefill(probe.ids, evidence=baseline)
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


ASK_QUESTION = "Question: "


def ask_request(question: str) -> str:
    """A question, with a place for the quote (QUOTE_MARK: see `plain_request`)."""
    return f"{ASK_QUESTION}{question}\n{QUOTE_MARK}Answer in one short sentence, with the exact words of the document above."


def plain_request(request: str) -> str:
    """A request as a user or a server sees it: without the place for a quote."""
    return request.replace(QUOTE_MARK, "")


def summary_request(length: str, focus: str | None) -> str:
    how = SUMMARY_LENGTHS[length][0]
    about = f", focusing on {focus}" if focus else ""
    return f"Summarize the document above {how}{about}."


def completion_context(document: Document, file: str, line: int | None) -> str:
    """Raw text for completing `file` (as listed in the folder) after `line`: the folder's other parts first, then
    the file's own lines up to `line`, unnumbered, so that the model continues the code itself."""
    import re

    own = [part for part in document.parts if part.source == file]
    if not own:
        listed = sorted({part.source for part in document.parts})
        raise InputError(f"--file {file} is not among the files read ({len(listed)} files, e.g. "
                         f"{', '.join(listed[:3])}); give its path relative to the folder")
    numbered = re.compile(r"^\s*(\d+)\| ?(.*)$")
    lines = []
    for part in own:
        for text_line in part.text.splitlines():
            match = numbered.match(text_line)
            if match:
                lines.append((int(match.group(1)), match.group(2)))
    if line is not None and line > len(lines):
        raise InputError(f"--line {line} is past the end of {file} ({len(lines)} lines)")
    kept = [text for number, text in lines if line is None or number <= line]
    context = "".join(part.text for part in document.parts if part.source != file)
    return f"{context}=== {file} ===\n" + "\n".join(kept) + "\n"


def split_sections(document: Document, count_tokens: Callable[[str], int], max_tokens: int) -> list[Document]:
    """Consecutive runs of parts of at most `max_tokens` each (a part longer than that is a section of its own),
    for hierarchical summaries: each section is summarized alone, then the summaries together."""
    sections: list[Document] = []
    current: list = []
    size = 0
    for part in document.parts:
        n = count_tokens(part.text)
        if current and size + n > max_tokens:
            sections.append(Document(current, [], []))
            current, size = [], 0
        current.append(part)
        size += n
    if current:
        sections.append(Document(current, [], []))
    return sections


SECTION_RESERVE = 1024  # tokens of a section-summary prompt kept for the template, the request and the summary
SECTION_SUMMARY_TOKENS = 200


def section_prompts(tokenizer, sections: list[Document]) -> list[DocumentPrompt]:
    """Each section's request for a short summary of it."""
    request = request_messages(summary_request("short", None))
    return [document_prompt(tokenizer, DocumentTokens.encode(tokenizer, section), request) for section in sections]


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
            results.append(run_request(session, tokenizer, prompts[first], documents[first], sampler, max_new_tokens,
                                       None, False, 0.0, with_sources=False))
            continue
        outputs = session.generate_batch([prompts[i].ids for i in rows], sampler, max_new_tokens, tokenizer.stop_ids)
        for i, (tokens, stats) in zip(rows, outputs):
            results.append(job_result(generated_text(tokenizer, tokens), stats, prompts[i], documents[i], None, False,
                                      False, stats.prefill_seconds, stats.decode_seconds))
    return results


def summarize_sections(session, tokenizer, sections: list[Document], prompts: list[DocumentPrompt], sampler,
                       batch: int, on_section: Callable[[range, int], None] | None = None) -> list[str]:
    """Each section's short summary from its prompt (`section_prompts`), `batch` sections decoded together
    (`generate_each`). on_section(the batch's sections, total) before each batch."""
    results = generate_each(session, tokenizer, prompts, sections, sampler, SECTION_SUMMARY_TOKENS, batch, on_section)
    return [result.text.strip() for result in results]


def summarize_hierarchical(loaded, document: Document, final_request: str, max_new_tokens: int, sampler,
                           section_tokens: int | None, open_dense, open_final, on_text: Callable[[str], None] | None = None,
                           on_section: Callable[[range, int], None] | None = None) -> JobResult:
    """Summaries of sections that each fit the model's context (dense attention), decoded in batches as large as
    memory allows (`section_batch_size`), then a summary of those summaries, which cites the sections.
    `open_dense(needed)` / `open_final(needed)` open the sessions; on_section(the batch's sections, total) before
    each batch."""
    from indexpool.model.sessions import available_memory_bytes

    tok = loaded.tokenizer
    budget = min(section_tokens or loaded.config.context_length, loaded.config.context_length - SECTION_RESERVE)
    counted = []  # tokens of each part, as split_sections counts them

    def count(text: str) -> int:
        counted.append(len(tok.encode(text)))
        return counted[-1]

    sections = split_sections(document, count, budget)
    t0 = time.perf_counter()
    prompts = section_prompts(tok, sections)
    section_session = open_dense(loaded.config.context_length)
    batch = section_batch_size(section_session, [len(p.ids) for p in prompts], SECTION_SUMMARY_TOKENS,
                               available_memory_bytes())
    section_summaries = summarize_sections(section_session, tok, sections, prompts, sampler, batch, on_section)
    summary_parts = []
    for section, summary in zip(sections, section_summaries):
        first, last = section.parts[0].cite, section.parts[-1].cite
        cite = first if first == last else f"{first} to {last}"
        summary_parts.append(Part(f"[{cite}]\n{summary}\n\n", section.parts[0].source, cite))
    summaries = Document(summary_parts, [], [])
    tokens = DocumentTokens.encode(tok, summaries)
    prompt = document_prompt(tok, tokens, request_messages(final_request))
    final_session = open_final(len(prompt.ids) + max_new_tokens)
    final_session.prefill(prompt.ids[: prompt.reusable], query_tail=False)
    read_seconds = time.perf_counter() - t0
    result = run_request(final_session, tok, prompt, summaries, sampler, max_new_tokens, on_text, False, read_seconds)
    result.document_tokens = sum(counted)
    result.notes.append(f"hierarchical: {len(sections)} sections summarized, then their summaries")
    return result
