"""Lexical retrieval over a document's parts and passages: which pages, line ranges or messages a question's words
point to. `ask` combines it with the attention evidence of the model's own reading (local.py): the words find the
place in manuals, codebases and logs full of look-alike names, where attention alone cited an index page; the
attention tells apart places the words score alike.

Terms are lowercased words, with identifiers also split at underscores, dots and case changes (`idn2_lookup_u8`
gives `idn2_lookup_u8`, `idn2`, `lookup`, `u8`; `getaddrinfo` stays whole), English stop words left out and a light
suffix stripping (`configured` and `configure` meet). Scores are Okapi BM25. Navigational parts (a table of
contents, an index: most lines end in page numbers) list every name and state nothing: their scores are scaled
down.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

BM25_K1 = 1.2
BM25_B = 0.75
NAVIGATIONAL_WEIGHT = 0.2  # a navigational part's share of its lexical score
NAVIGATIONAL_MIN_LINES = 6
NAVIGATIONAL_SHARE = 0.5  # of its non-empty lines ending in a page number or a dotted leader
# A place's score: its lexical score plus this weight times its attention evidence, each scaled to the best place's
# (`combined`). The words find the place; the reading tells apart places the words score alike. On the
# real-document set (benchmarks/doc_qa.py) the words alone put a passage holding the answer first for 51 of 72
# questions, attention alone 14, words, attention and the model's likelihood of the question together 53 (its part
# the right first source: 61, 22 and 66; benchmarks/passage_choice.py, docs/benchmarks.md).
ATTENTION_WEIGHT = 0.1

_WORD = re.compile(r"[A-Za-z0-9_]+(?:[.:][A-Za-z0-9_]+)*")
_SUBWORD = re.compile(r"[A-Z]+(?![a-z])[0-9]*|[A-Z]?[a-z]+[0-9]*|[0-9]+")
_PAGE_REFERENCE = re.compile(r"(?:\.\s*){3,}\s*[0-9ivxlc]+\s*$|\s[0-9]{1,4}(?:,\s*[0-9]{1,4})*\s*$", re.IGNORECASE)
STOP_WORDS = frozenset("""a about above after again against all also am an and any are as at be because been before
being below between both but by can could did do does doing down during each few for from further had has have having
he her here hers him his how i if in into is it its itself just me more most my no nor not now of off on once only or
other our out over own same she should so some such than that the their them then there these they this those
through to too under until up very was we were what when where which while who whom why will with would you your
yours tell give show find explain describe say said use used using""".split())


def stem(word: str) -> str:
    """A light suffix stripping (plural, -ing, -ed, -ly, a final e), enough for a question's word to meet the
    text's: "configured", "configures" and "configure" all give "configur"."""
    if word.isalpha():
        for suffix in ("ing", "ed", "es", "ly", "s", "e"):
            if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
                return word[: len(word) - len(suffix)]
    return word


def terms(text: str) -> list[str]:
    """The terms of a text, in order (an identifier's parts follow it)."""
    out = []
    for match in _WORD.finditer(text):
        word = match.group()
        lower = word.lower()
        pieces = [p.lower() for chunk in re.split(r"[_.:]+", word) for p in _SUBWORD.findall(chunk)]
        if lower not in STOP_WORDS:
            out.append(stem(lower))
        if pieces != [lower]:
            out += [stem(p) for p in pieces if p not in STOP_WORDS and len(p) > 1]
    return out


def navigational(text: str) -> bool:
    """Whether a part is a table of contents or an index: most of its lines end in page numbers."""
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < NAVIGATIONAL_MIN_LINES:
        return False
    return sum(bool(_PAGE_REFERENCE.search(line)) for line in lines) >= NAVIGATIONAL_SHARE * len(lines)


class BM25:
    """Okapi BM25 over a fixed collection of term lists."""

    def __init__(self, collection: list[list[str]]):
        self.counts = [Counter(doc) for doc in collection]
        self.lengths = [len(doc) for doc in collection]
        self.mean_length = sum(self.lengths) / max(1, len(collection))
        frequency = Counter(term for counts in self.counts for term in counts)
        n = len(collection)
        self.idf = {term: math.log(1 + (n - df + 0.5) / (df + 0.5)) for term, df in frequency.items()}

    def scores(self, query: list[str]) -> list[float]:
        wanted = [term for term in dict.fromkeys(query) if term in self.idf]
        out = []
        for counts, length in zip(self.counts, self.lengths):
            norm = BM25_K1 * (1 - BM25_B + BM25_B * length / max(1.0, self.mean_length))
            score = 0.0
            for term in wanted:
                tf = counts.get(term, 0)
                if tf:
                    score += self.idf[term] * tf * (BM25_K1 + 1) / (tf + norm)
            out.append(score)
        return out


def combined(lexical: list[float], attention: list[float], attention_weight: float = ATTENTION_WEIGHT) -> list[float]:
    """Lexical scores plus `attention_weight` times attention evidence, each scaled to its best."""

    def scaled(values: list[float]) -> list[float]:
        best = max(values, default=0.0)
        return [v / best for v in values] if best > 0 else [0.0] * len(values)

    return [a + attention_weight * b for a, b in zip(scaled(lexical), scaled(attention))]


@dataclass
class Passage:
    part: int  # index of its part in the document
    first_line: int  # line range [first_line, last_line) in `LexicalIndex.lines`
    last_line: int


class LexicalIndex:
    """BM25 over a document's parts (what is cited) and its passages (windows of a few lines inside a part: what is
    quoted). `lines[i]` is (part index, text) in document order."""

    PASSAGE_LINES = 6  # lines a passage spans
    PASSAGE_STRIDE = 3  # lines between the starts of two passages of a part

    def __init__(self, part_texts: list[str], lines: list[tuple[int, str]]):
        self.lines = lines
        self.navigational = [navigational(text) for text in part_texts]
        self.parts = BM25([terms(text) for text in part_texts])
        by_part: dict[int, list[int]] = {}
        for i, (part, text) in enumerate(lines):
            if text.strip():
                by_part.setdefault(part, []).append(i)
        self.passages: list[Passage] = []
        for part, indices in by_part.items():
            first = indices[0]
            last = indices[-1] + 1
            start = first
            while True:
                end = min(last, start + self.PASSAGE_LINES)
                self.passages.append(Passage(part, start, end))
                if end >= last:
                    break
                start += self.PASSAGE_STRIDE
        self.passage_bm25 = BM25([terms("\n".join(text for _, text in lines[p.first_line : p.last_line]))
                                  for p in self.passages])

    @classmethod
    def of_parts(cls, part_texts: list[str]) -> "LexicalIndex":
        """The index of parts given as text, split at their line breaks."""
        lines = [(i, line) for i, text in enumerate(part_texts) for line in text.splitlines(keepends=True)]
        return cls(part_texts, lines)

    def part_scores(self, text: str) -> list[float]:
        """Each part's BM25 score for `text`'s terms, navigational parts scaled down."""
        return [score * (NAVIGATIONAL_WEIGHT if nav else 1.0)
                for score, nav in zip(self.parts.scores(terms(text)), self.navigational)]

    def passage_scores(self, text: str) -> list[float]:
        """Each passage's BM25 score for `text`'s terms, those in navigational parts scaled down."""
        return [score * (NAVIGATIONAL_WEIGHT if self.navigational[p.part] else 1.0)
                for score, p in zip(self.passage_bm25.scores(terms(text)), self.passages)]
