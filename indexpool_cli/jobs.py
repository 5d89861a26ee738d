"""The jobs (ask, summarize, complete inside a file) over a `Backend`: the local engine (local.py) or an
OpenAI-compatible server (remote.py). A job takes an ingested Document and its options, makes the requests, and
returns `JobResult`s; it imports nothing of the command line (app.py parses options, calls a job and renders what
it returns) and leaves how a document is read to the backend.

What both backends share lives here, once:
- the requests (`ask_request`, `summary_request`) and the messages around them (`request_messages`);
- documents longer than one pass can read: `answer_in_sections` answers sections that fit, then their answers
  together, in more levels while those do not fit;
- sources: `rank_sources` ranks the parts an answer rests on from the question's words and, where the backend kept
  it, the attention evidence of the model's reading (the local engine's IndexPool); without evidence, from the
  answer's own wording;
- the result cache (`ResultCache`): a reproducible request (greedy or seeded) on the same document and backend is
  answered from it, where the backend says its results are worth keeping (a server's).

Errors are the engine's and the jobs' own exceptions (`InputError`, `SettingsError`, `ContextTooLong`, a backend's
`RemoteError`); the command line maps them to exit codes in one place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from indexpool.model.errors import InputError, SettingsError
from indexpool.model.tensor_cache import (bytes_checksum, delete_files, is_cache_directory, make_cache_directory,
                                          remove_orphaned_temporaries, write_atomically)
from .ingest import Document, Part
from .retrieval import LexicalIndex, combined

DOCUMENT_MARK = "\x00DOCUMENT\x00"  # where the document goes in the rendered chat template
QUOTE_MARK = "\x00QUOTE\x00"  # where an ask request takes the quoted lines (left out where nothing is quoted)
ASK_QUESTION = "Question: "
MAX_SOURCES = 3
SOURCE_SHARE = 0.5  # a part is cited when its score is at least this share of the best part's
SUMMARY_LENGTHS = {  # what the request asks for, and the new tokens it may take
    "short": ("in three sentences", 160),
    "medium": ("in one paragraph of about 150 words", 320),
    "long": ("in about 400 words, section by section", 720),
}
SUMMARY_STRATEGIES = ("auto", "single", "hierarchical")
ANSWER_MODES = ("auto", "extract", "generate")
SECTION_SUMMARY_TOKENS = 200  # most new tokens of a section's answer in `answer_in_sections`

OnResult = Callable[[int, "JobResult"], None]  # (request index, its result), in request order
OnText = Callable[[int, str], None]  # (request index, a piece of its text) as it is written


class ContextTooLong(InputError):
    """A request does not fit the backend's context (exit code 3); `limit` is that context when known. `results`
    holds what completed before the failure (None where a request failed)."""

    def __init__(self, message: str, limit: int | None = None):
        super().__init__(message)
        self.limit = limit
        self.results: list[JobResult | None] = []


@dataclass
class JobResult:
    text: str
    sources: list[dict] = field(default_factory=list)
    prompt_tokens: int = 0
    document_tokens: int = 0
    new_tokens: int = 0
    cached: bool = False  # the document was restored from the document cache, or the result from the result cache
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

    @classmethod
    def from_json(cls, data: dict) -> JobResult:
        tokens, timings = data["tokens"], data["timings"]
        return cls(data["text"], sources=data["sources"], prompt_tokens=tokens["prompt"],
                   document_tokens=tokens["document"], new_tokens=tokens["new"],
                   read_seconds=timings["read_seconds"], answer_seconds=timings["answer_seconds"],
                   stop_reason=data["stop_reason"], notes=data["notes"], quotes=data.get("quotes", []))


class Backend(Protocol):
    """What a job needs of a model. Token counts are the backend's own (a server may only estimate them)."""

    @property
    def name(self) -> str:
        """The model, as results name it."""

    def identity(self) -> dict:
        """What, besides a request and its document, decides the result: the result cache's key."""

    def keeps_results(self) -> bool:
        """Whether results go to the result cache: reproducible (greedy or seeded) and worth keeping."""

    def extracts(self) -> bool:
        """What --answer/--summary auto means here: True to extract from the document, False to generate."""

    def count_tokens(self, text: str) -> int:
        """Tokens of a piece of text (an estimate where the backend cannot count)."""

    def document_tokens(self, document: Document) -> int:
        """Tokens of a whole document, as exactly as the backend can count them."""

    def fits(self, document: Document, request: str, max_new_tokens: int) -> bool:
        """Whether the document, the request and the answer fit the model's own context."""

    def reads_whole(self, document: Document, request: str, max_new_tokens: int) -> bool:
        """Whether one pass can read the document for the request (the local engine's IndexPool reads more than
        the model's own context)."""

    def section_budget(self, request: str, max_new_tokens: int) -> int:
        """Most tokens of a section that one pass reads with `request`; raises ContextTooLong where too few fit
        for sections to help."""

    def context_note(self, document_tokens: int) -> str:
        """The context a document of `document_tokens` was measured against, for a result's notes."""

    def answer(self, document: Document, requests: list[str], max_new_tokens: int, extract: bool,
               on_result: OnResult, on_text: OnText | None = None) -> list[JobResult]:
        """Each request on the document, read in one pass: on_result(i, result) in request order, on_text(i, piece)
        as a result's text is written (where the backend streams). `extract`: answer ask requests with the
        document's own passage where one is found."""

    def answer_each(self, documents: list[Document], request: str, max_new_tokens: int,
                    what: str) -> list[JobResult]:
        """The request on each of several documents (sections, inputs), as many at once as the backend can; `what`
        names them in progress messages."""


# -- requests -------------------------------------------------------------------------------------------------------


def request_messages(request: str, system: str | None = None) -> list[dict]:
    """One user turn: the document, then the request."""
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": f"{DOCUMENT_MARK}\n{request}"}]


def ask_request(question: str) -> str:
    """A question, with a place for the quote (QUOTE_MARK: see `plain_request`)."""
    return f"{ASK_QUESTION}{question}\n{QUOTE_MARK}Answer in one short sentence, with the exact words of the document above."


def plain_request(request: str) -> str:
    """A request as a user or a server sees it: without the place for a quote."""
    return request.replace(QUOTE_MARK, "")


def request_question(request: str) -> str | None:
    """The question of an ask request (`ask_request`), else None."""
    if ASK_QUESTION not in request:
        return None
    return plain_request(request).split(ASK_QUESTION, 1)[1].split("\n", 1)[0].strip() or None


def summary_request(length: str, focus: str | None) -> str:
    how = SUMMARY_LENGTHS[length][0]
    about = f", focusing on {focus}" if focus else ""
    return f"Summarize the document above {how}{about}."


def choice(value: str, allowed: tuple[str, ...] | dict, option: str) -> str:
    """`value` when it is one of `allowed`, else a usage error naming the option."""
    if value not in allowed:
        raise SettingsError(f"{option} must be one of {', '.join(allowed)}, not {value!r}")
    return value


# -- sources --------------------------------------------------------------------------------------------------------


def rank_sources(document: Document, index: LexicalIndex, question: str | None, answer: str,
                 attention: list[float] | None = None, quoted: list[tuple[int, str]] = ()) -> list[dict]:
    """The parts an answer rests on, at most MAX_SOURCES: first the parts of the passages quoted to the model
    (`quoted`: (part, text), in the order quoted: what it was given to answer from), then the parts with the best
    scores, each at least SOURCE_SHARE of the best. A part's score: the question's words in it (`index`), with the
    attention evidence of the model's reading (`attention`, per part, where the backend kept it: `combined`); a
    backend without evidence leaves only the answer's wording as a trace of what it drew on, so the answer's words
    count too. Each source gives its part's location and its passage that was quoted, else its lines that best
    match the question and the answer (where there are words to match)."""
    words = "\n".join(text for text in (question, answer if attention is None else None) if text)
    lexical = index.part_scores(words) if words else None
    if attention is None:
        scores = lexical or [0.0] * len(document.parts)
    else:
        scores = combined(lexical, attention) if question else attention
    total = sum(scores)
    if not total:
        return []
    ranked = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    best = scores[ranked[0]]
    order = list(dict.fromkeys([part for part, _ in quoted] + [i for i in ranked if scores[i] >= SOURCE_SHARE * best]))
    matching = index.passage_scores(f"{question or ''}\n{answer}") if words else []
    sources = []
    for i in order[:MAX_SOURCES]:
        part = document.parts[i]
        source = {"cite": part.cite, "source": part.source, "share": round(scores[i] / total, 4),
                  "location": part.location()}
        if words:
            source["text"] = next((text for quoted_part, text in quoted if quoted_part == i), None) \
                or cited_passage(index, i, matching)
        sources.append(source)
    return sources


def cited_passage(index: LexicalIndex, part: int, scores: list[float]) -> str:
    """Part `part`'s passage with the best of `scores` (every passage's lexical score; its first when none
    scores)."""
    own = [i for i, p in enumerate(index.passages) if p.part == part]
    if not own:
        return ""
    best = index.passages[max(own, key=lambda i: scores[i])]
    return "".join(text for _, text in index.lines[best.first_line : best.last_line]).strip()


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


# -- the result cache -----------------------------------------------------------------------------------------------


def cache_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


class ResultCache:
    """Results of reproducible requests, one file each (`<key>.json`: a line with the XXH3-128 checksum of the
    rest, then the result's JSON), written atomically into a tagged cache directory; a file that fails its
    checksum or does not parse counts as absent and is removed."""

    def __init__(self, directory):
        self.directory = Path(directory)

    def key(self, backend: Backend, document: Document, **request) -> str:
        """The key of a request (its fields) on `document` with `backend`."""
        return cache_key({**backend.identity(), **request,
                          "document": hashlib.sha256(document.text.encode()).hexdigest()})

    def get(self, key: str) -> JobResult | None:
        path = self.directory / f"{key}.json"
        try:
            checksum, _, payload = path.read_bytes().partition(b"\n")
            if checksum.decode("ascii", "replace") != bytes_checksum(payload):
                raise ValueError("checksum mismatch")
            result = JobResult.from_json(json.loads(payload))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            path.unlink(missing_ok=True)
            return None
        result.cached = True
        result.notes.append("from the result cache: the same model, document, request and sampling (--no-cache "
                            "asks again)")
        return result

    def put(self, key: str, result: JobResult) -> None:
        payload = json.dumps(result.to_json()).encode()
        try:
            make_cache_directory(self.directory)
            write_atomically(self.directory / f"{key}.json", bytes_checksum(payload).encode() + b"\n" + payload)
        except OSError:  # no room or no permission: the result was shown, only not kept
            pass

    def clear(self) -> int:
        """Delete the kept results (and orphaned temporary files); returns the bytes freed."""
        kept = [path for path in self.directory.glob("*.json") if re.fullmatch(r"[0-9a-f]{32}\.json", path.name)] \
            if is_cache_directory(self.directory) else []
        return remove_orphaned_temporaries(self.directory) + delete_files(kept)


class InOrder:
    """Results passed on in request order, each as soon as it and those before it are there."""

    def __init__(self, count: int, on_result: OnResult | None):
        self.results: list[JobResult | None] = [None] * count
        self.on_result = on_result
        self.passed = 0

    def put(self, i: int, result: JobResult) -> None:
        self.results[i] = result
        while self.passed < len(self.results) and self.results[self.passed] is not None:
            if self.on_result:
                self.on_result(self.passed, self.results[self.passed])
            self.passed += 1


def recall(results: ResultCache | None, backend: Backend, order: InOrder,
           asked: list[tuple[Document, dict]]) -> tuple[list[int], Callable[[int, JobResult], None]]:
    """The result cache's part in a job of several requests (each a document and the fields that make the
    request): the kept results are passed on to `order` at once; returns the indexes still to answer, and the
    function that passes on (and keeps) each of their results."""
    keys = [results.key(backend, document, **fields) for document, fields in asked] \
        if results is not None and backend.keeps_results() else None
    pending = []
    for i in range(len(asked)):
        kept = results.get(keys[i]) if keys else None
        if kept is None:
            pending.append(i)
        else:
            order.put(i, kept)

    def done(i: int, result: JobResult) -> None:
        if keys:
            results.put(keys[i], result)
        order.put(i, result)

    return pending, done


# -- the jobs -------------------------------------------------------------------------------------------------------


def ask(backend: Backend, document: Document, questions: list[str], max_new_tokens: int = 200,
        answer: str = "auto", quote: bool = True, on_result: OnResult | None = None, on_text: OnText | None = None,
        results: ResultCache | None = None) -> list[JobResult]:
    """Answer questions about a document. answer: extract (the document's passage the question points to), generate
    (the model writes it, from the document and the passages quoted to it) or auto (the backend's choice); quote:
    read the question first and quote the passages it points to before the answer is written (the local engine)."""
    if not questions or any(not q.strip() for q in questions):
        raise SettingsError("a question is empty" if questions else "give a question")
    extract = choice(answer, ANSWER_MODES, "--answer") == "extract" or (answer == "auto" and quote and backend.extracts())
    requests = [ask_request(q) if quote else plain_request(ask_request(q)) for q in questions]
    return answer_requests(backend, document, requests, max_new_tokens, extract, on_result, on_text, results)


def answer_requests(backend: Backend, document: Document, requests: list[str], max_new_tokens: int,
                    extract: bool = False, on_result: OnResult | None = None, on_text: OnText | None = None,
                    results: ResultCache | None = None, label: str = "Answer from") -> list[JobResult]:
    """The requests on one document: from the result cache where kept, else read in one pass where the backend
    can (`Backend.answer`), else in sections (`answer_in_sections`, each section's result labelled `label` and its
    span). A backend that learns its context from a refusal (a server) answers the refused requests in sections."""
    order = InOrder(len(requests), on_result)
    asked = [(document, {"request": r, "max_new_tokens": max_new_tokens, "extract": extract}) for r in requests]
    pending, done = recall(results, backend, order, asked)
    whole = [i for i in pending if backend.reads_whole(document, requests[i], max_new_tokens)]
    apart = [i for i in pending if i not in whole]
    if whole:
        try:
            backend.answer(document, [requests[i] for i in whole], max_new_tokens, extract,
                           lambda j, result: done(whole[j], result),
                           on_text and (lambda j, piece: on_text(whole[j], piece)))
        except ContextTooLong as e:
            if e.limit is None:
                raise
            apart += [whole[j] for j, result in enumerate(e.results) if result is None]
    for i in sorted(apart):  # each section answers the request itself, at the same length
        done(i, answer_in_sections(backend, document, requests[i], max_new_tokens, plain_request(requests[i]),
                                   max_new_tokens, label, on_text=on_text and (lambda piece, i=i: on_text(i, piece))))
    return order.results  # type: ignore[return-value]  (every request has its result)


def summarize(backend: Backend, documents: list[Document], length: str = "medium", focus: str | None = None,
              max_new_tokens: int | None = None, strategy: str = "auto", section_tokens: int | None = None,
              summary: str = "auto", on_result: OnResult | None = None, on_text: OnText | None = None,
              results: ResultCache | None = None) -> list[JobResult]:
    """A summary of each document. summary: extract (its outline: `outline_summary`), generate (the model writes
    it) or auto (the backend's choice). strategy: single (one pass over the whole text), hierarchical (sections
    that fit the model's context, then their summaries: `answer_in_sections`) or auto (single when the document
    fits the model's own context). Several documents that fit are summarized together (`Backend.answer_each`)."""
    request = summary_request(choice(length, SUMMARY_LENGTHS, "--length"), focus)
    choice(strategy, SUMMARY_STRATEGIES, "--strategy")
    budget = max_new_tokens or SUMMARY_LENGTHS[length][1]
    order = InOrder(len(documents), on_result)
    if choice(summary, ANSWER_MODES, "--summary") == "extract" or (summary == "auto" and backend.extracts()):
        for i, document in enumerate(documents):  # no model needed: given --summary extract, none is loaded
            order.put(i, outline_summary(document, length, focus))
        return order.results  # type: ignore[return-value]
    fields = {"request": request, "max_new_tokens": budget, "strategy": strategy, "section_tokens": section_tokens}
    pending, done = recall(results, backend, order, [(document, fields) for document in documents])
    fits = {i: backend.fits(documents[i], request, budget) for i in pending}
    single = {i for i in pending if strategy == "single" or (strategy == "auto" and fits[i])}
    together = [i for i in pending if i in single and fits[i]]
    if len(together) >= 2:  # several inputs that fit: as many at once as the backend can
        answers = backend.answer_each([documents[i] for i in together], request, budget, "inputs")
        for i, result in zip(together, answers):
            done(i, result)
    for i in pending:
        text = on_text and (lambda piece, i=i: on_text(i, piece))
        if len(together) >= 2 and i in together:
            continue
        if i in single:
            (result,) = answer_requests(backend, documents[i], [request], budget, label="Summary of",
                                        on_text=text and (lambda _, piece, text=text: text(piece)))
        else:
            result = answer_in_sections(backend, documents[i], request, budget, summary_request("short", focus),
                                        min(budget, SECTION_SUMMARY_TOKENS), "Summary of", section_tokens, text)
        done(i, result)
    return order.results  # type: ignore[return-value]


def answer_in_sections(backend: Backend, document: Document, request: str, max_new_tokens: int,
                       section_request: str, section_max_new_tokens: int, label: str,
                       section_tokens: int | None = None, on_text: Callable[[str], None] | None = None) -> JobResult:
    """A document read in sections that one pass reads (at most `section_tokens` each, where given): each
    section's answer to `section_request`, headed `label` and the span it covers, then those answers together as
    the parts of a new document, in more levels while they do not fit one pass; `request` on the last level's
    document gives the result, whose sources cite the sections' spans."""
    budget = backend.section_budget(section_request, section_max_new_tokens)
    budget = min(budget, section_tokens) if section_tokens else budget
    t0 = time.perf_counter()
    pieces = Document(fitted_parts(document, backend.count_tokens, budget), [], [])
    sections = split_sections(pieces, backend.count_tokens, budget)
    answers = section_answers(backend, sections, section_request, section_max_new_tokens, label)
    levels, calls = 1, len(sections)
    while not backend.reads_whole(answers, request, max_new_tokens):
        groups = split_sections(answers, backend.count_tokens, budget)
        if len(groups) == len(answers.parts):
            raise ContextTooLong(f"the answers of the document's sections do not fit one pass, even two at a time "
                                 f"(sections of at most {budget:,} tokens); lower --max-new-tokens")
        answers = section_answers(backend, groups, section_request, section_max_new_tokens, label)
        levels, calls = levels + 1, calls + len(groups)
    read_seconds = time.perf_counter() - t0
    (result,) = backend.answer(answers, [request], max_new_tokens, False, lambda i, r: None,
                               on_text and (lambda i, piece: on_text(piece)))
    document_tokens = backend.document_tokens(document)
    result.document_tokens = document_tokens
    result.read_seconds += read_seconds
    result.cached = False
    result.notes.insert(0, f"hierarchical: {len(sections)} sections were answered separately (at most {budget:,} "
                           f"tokens each), then their answers together ({levels} level{'s' if levels > 1 else ''}, "
                           f"{calls + 1} requests); {backend.context_note(document_tokens)}")
    return result


def section_answers(backend: Backend, sections: list[Document], request: str, max_new_tokens: int,
                    label: str) -> Document:
    """Each section's answer, headed `label` and the span it covers, as the parts of the next level's document."""
    answers = backend.answer_each(sections, request, max_new_tokens, "sections")
    parts = []
    for section, answer in zip(sections, answers):
        first, last = section.parts[0].cite, section.parts[-1].cite
        span = first if first == last else f"{first} to {last}"
        parts.append(Part(f"[{label} {span}]\n{answer.text.strip()}\n\n", section.parts[0].source, span))
    return Document(parts, [], [])


def split_sections(document: Document, count_tokens: Callable[[str], int], max_tokens: int) -> list[Document]:
    """Consecutive runs of parts of at most `max_tokens` each (a part longer than that is a section of its own)."""
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


def fitted_parts(document: Document, count_tokens: Callable[[str], int], budget: int) -> list[Part]:
    """The document's parts, a part longer than `budget` tokens cut into pieces that fit (at line ends where there
    are some), each keeping the part's cite."""
    parts = []
    for part in document.parts:
        text = part.text
        while (n := count_tokens(text)) > budget:
            most_chars = max(1, len(text) * budget // n)
            cut = text.rfind("\n", most_chars // 2, most_chars) + 1 or most_chars
            parts.append(dataclasses.replace(part, text=text[:cut]))
            text = text[cut:]
        if text:
            parts.append(dataclasses.replace(part, text=text))
    return parts


def completion_context(document: Document, file: str, line: int | None) -> str:
    """Raw text for completing `file` (as listed in the folder) after `line`: the folder's other parts first, then
    the file's own lines up to `line`, unnumbered, so that the model continues the code itself."""
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
