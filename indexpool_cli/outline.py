"""Extractive outlines: a document's top-level sections, each with the sentence from it that best represents it.

`summarize --summary extract` (what `auto` gives models under 1B parameters) shows one where the model's own
summary would say nothing: the default 135M model's summaries of real manuals named 2% of their top-level sections
(benchmarks/doc_qa.py --summaries, docs/benchmarks.md).

Sections come from the document's own structure, the highest level of it that has at least two sections:
1. file and chapter markers (a folder's `=== path ===`, an EPUB's `[Chapter 3: title]`),
2. Markdown headings (`#` to `######` at a line's start after a blank line, outside code blocks; the HTML reader
   writes `<h1>`-`<h6>` so),
3. numbered headings (`2 Library Functions`, `2.3 Locale Functions`) whose numbers run in sequence (a table of
   contents' lines, in a navigational part, never count),
4. the entries of a table of contents (a navigational part in the document's first third: titles followed by
   page numbers), each found as a line of its own after it, in the contents' order (unnumbered chapters),
5. underlined headings (reStructuredText, setext), ranked by the order their underline characters first appear,
6. log entries (a Debian changelog's `package (version) ...; urgency=`, `commit <hash>`, an mbox `From ` line),
7. in code, top-level definitions (`class`, `def`, `function`, ...).
A document with none of these (a chat log among them) is cut into equal runs of its parts. When there are more sections than the outline
has items, consecutive sections share an item. Text before the first section (a title page, a table of contents,
a site's navigation; at most a third of the document, or that level of headings is not its structure) is left out.

Each item's sentence is the one whose terms are most particular to its section (term frequency in the section
times the inverse frequency across sections, over the square root of the sentence's term count), the first
sentences of a section weighted up (a section usually says what it is about first), those opening with a word
that points back ("It", "Thus") weighted down, and a sentence the document repeats (boilerplate) divided by the
times it does. A code item gives its best
comment or docstring sentence and its top-level definitions.
"""

from __future__ import annotations

import math
import os
import re
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

from .ingest import Document
from .retrieval import navigational, terms

# Items in an outline, and sentences per item, for each summary length.
OUTLINE_ITEMS = {"short": 5, "medium": 12, "long": 24}
OUTLINE_SENTENCES = {"short": 1, "medium": 1, "long": 2}
LEADING_SENTENCES = 2  # a section's first sentences ...
LEADING_WEIGHT = 1.5  # ... have their score multiplied by this
# A sentence opening with a word that points back ("It provides ...", "Thus, ...") needs the one before it.
DANGLING_STARTS = frozenset("it its this that these those they them thus hence so also however then there such "
                            "here he she both otherwise instead".split())
DANGLING_WEIGHT = 0.5
SENTENCE_WORDS = (6, 45)  # a candidate sentence's fewest and most words
CODE_SENTENCE_WORDS = 3  # a docstring's or comment's fewest ("JSON token scanner.")
MIN_WORD_SHARE = 0.6  # of a candidate sentence's words that are plain words (code, grammar and tables are not prose)
MAX_SYMBOL_SHARE = 0.04  # of its characters that are brackets, operators or table rules ("f([in] int x)", "a | b")
MAX_PREAMBLE = 1 / 3  # of a document's lines before its first top-level section, at most (a title page, a TOC)
MAX_TITLE_CHARS = 160  # of an item's title joining several sections' titles
MAX_DEFINITIONS = 8  # names a code item lists
FOCUS_WEIGHT = 2.0  # a sentence's score is multiplied by 1 + this x the share of the focus's terms it holds

_MARKER = re.compile(r"^(?:=== (?P<file>.+) ===|\[Chapter \d+: (?P<chapter>.+)\])$")
_READER_MARKER = re.compile(r"^\[[^\]\n]{1,200}\]$")  # a page's or a text's first line: "[Page 3]", "[a.txt lines 1-40]"
_CODE_LINE = re.compile(r"^\s*\d+\|[ ]?")
_MARKDOWN = re.compile(r"^(#{1,6})\s+(\S.*?)\s*#*$")
_CONTENTS_ENTRY = re.compile(r"^(?P<title>.*?\S)(?:\s*(?:\.\s*){2,}|\s+)(?:[0-9]{1,4}|[ivxlc]{1,6})$", re.IGNORECASE)
_FENCE = re.compile(r"^\s{0,3}(?:```|~~~)")
_NUMBERED = re.compile(r"^(\d{1,2}(?:\.\d{1,2})*)\.?\s+([A-Z][^\n]{1,70})$")
_UNDERLINE = re.compile(r"^([=\-~*^+#])\1{2,}$")
_LOG_ENTRY = re.compile(r"^(?:(?P<deb>\S+ \([^)\s]+\)) [^;]*; *urgency=|(?P<git>commit [0-9a-f]{7})[0-9a-f]*\b|"
                        r"From \S+ )")
_DEFINITION = re.compile(r"^(?:export\s+|pub\s+|public\s+|async\s+)*(?:class|def|function|func|fn|struct|interface|"
                         r"enum|trait|impl|module|type)\s+([A-Za-z_][A-Za-z0-9_]*)")
_COMMENT = re.compile(r"^(?:#+|//+|/\*+|\*+)\s*")
_DOCSTRING = re.compile(r"^[rRbBuU]?(?:\"\"\"|\'\'\')")
_QUOTES = re.compile(r"^[rRbBuU]?(?=\"\"\"|''')|\"\"\"|'''")  # a docstring's quotes and prefix
_PLAIN_WORD = re.compile(r"^[(\"'“‘]?[A-Za-z][a-z'’-]*[)\"'”’]?[,.;:!?]?$")
_SYMBOLS = frozenset("{}[]()<>=*/\\|;#$@^~`+")
_BULLET = re.compile(r"^\s*(?:[*•‣◦–-]|\d{1,2}[.)])\s")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)]?\s+(?=[A-Z0-9\"'“(\[])")
_PERMALINK = re.compile(r"\s*[#¶§]+$")

# A heading's rank: (kind, level), smaller above. Kinds in the order of the module docstring.
MARKER, MARKDOWN, NUMBERED, CONTENTS, UNDERLINED, LOG_ENTRY, DEFINITION = range(7)


@dataclass
class Line:
    part: int  # index of its part in the document
    text: str  # as the document has it, the reader's markers left out
    code: bool  # a line of source code


@dataclass
class Heading:
    line: int  # index in the outline's lines
    rank: tuple[int, int]
    title: str


@dataclass
class Section:
    titles: list[str]
    first_line: int  # [first_line, last_line) in the outline's lines
    last_line: int
    rank: tuple[int, int] | None = None  # its heading's (one section under one heading)


@dataclass
class OutlineItem:
    title: str
    text: str  # the section's sentences (and, for code, its definitions)
    part: int  # the part the text comes from (what the item cites)
    parts: list[int] = field(default_factory=list)  # every part of the item's sections


def document_lines(document: Document) -> list[Line]:
    """Every line of the document in order, without the readers' first-line markers (a file's or a chapter's marker
    is kept: it is a heading) and without a code line's number."""
    lines = []
    for index, part in enumerate(document.parts):
        raw = part.text.splitlines()
        if raw and _READER_MARKER.match(raw[0]) and not _MARKER.match(raw[0]):
            raw = raw[1:]
        body = [line for line in raw if not _MARKER.match(line)]
        code = bool(body) and sum(bool(_CODE_LINE.match(line)) for line in body) >= 0.8 * len(body)
        for line in raw:
            lines.append(Line(index, _CODE_LINE.sub("", line, count=1) if code else line, code))
    return lines


def headings(lines: list[Line], document: Document) -> list[Heading]:
    """Every heading the document's lines hold (see the module docstring), in order."""
    navigation = {i for i, part in enumerate(document.parts) if navigational(part.text)}
    found: list[Heading] = []
    underline_order: list[str] = []
    numbers: list[int] = []  # the last numbered heading's numbers
    fenced = False  # inside a Markdown code block (``` or ~~~)
    for i, line in enumerate(lines):
        text = line.text.strip()
        if not text:
            continue
        marker = _MARKER.match(text)
        if marker:
            found.append(Heading(i, (MARKER, 0), marker.group("file") or marker.group("chapter")))
            continue
        if line.code:
            definition = _DEFINITION.match(line.text)
            if definition:
                found.append(Heading(i, (DEFINITION, 0), definition.group(1)))
            continue
        if line.part in navigation:
            continue
        fence = _FENCE.match(line.text)
        if fence:
            fenced = not fenced
        if fenced or fence:
            continue
        # Markdown's: at the line's start after a blank line (a "# comment" of code shown in the text is neither)
        after_blank = i == 0 or not lines[i - 1].text.strip() or lines[i - 1].part != line.part  # parts end paragraphs
        markdown = _MARKDOWN.match(line.text) if after_blank else None
        if markdown:
            found.append(Heading(i, (MARKDOWN, len(markdown.group(1))), clean_title(markdown.group(2))))
            continue
        numbered = _NUMBERED.match(line.text.rstrip())  # at the line's start: an indented one is a list's
        if numbered and is_title(numbered.group(2)) and not list_item(numbered, lines, i):
            current = [int(n) for n in numbered.group(1).split(".")]
            if follows(numbers, current):
                numbers = current
                found.append(Heading(i, (NUMBERED, len(current)), f"{numbered.group(1)} {clean_title(numbered.group(2))}"))
                continue
        below = lines[i + 1].text.strip() if i + 1 < len(lines) else ""
        underline = _UNDERLINE.match(below)
        if underline and is_title(text) and len(below) >= 0.9 * len(text) and not line.text[:1].isspace():
            char = underline.group(1)
            if char not in underline_order:
                underline_order.append(char)
            found.append(Heading(i, (UNDERLINED, underline_order.index(char)), clean_title(text)))
            continue
        entry = _LOG_ENTRY.match(line.text)
        if entry:
            found.append(Heading(i, (LOG_ENTRY, 0), entry.group("deb") or entry.group("git") or text[:60]))
    return sorted(found + contents_headings(lines, document, navigation), key=lambda h: h.line)


def list_item(numbered: re.Match, lines: list[Line], i: int) -> bool:
    """Whether numbered line `i` starts a list item ("1. The x is" with its next line indented or going on in
    lower case), not a heading."""
    if numbered.string[len(numbered.group(1)) : len(numbered.group(1)) + 1] != ".":
        return False
    after = next((later.text for later in lines[i + 1 : i + 3] if later.text.strip()), "")
    return after[:1].isspace() or after.strip()[:1].islower()


def contents_headings(lines: list[Line], document: Document, navigation: set[int]) -> list[Heading]:
    """The entries of the document's table of contents (see the module docstring; `navigation`: the parts that
    are navigational), each at the first line after the contents (and after the entry before it) whose text is
    the entry's title: running headers that repeat a title later are not taken."""
    contents = sorted(i for i in navigation if i <= len(document.parts) // 3)
    if not contents:
        return []
    titles = []
    for i in contents:
        for text in document.parts[i].text.splitlines():
            entry = _CONTENTS_ENTRY.match(text.strip())
            if entry and is_title(entry.group("title")):
                titles.append(clean_title(entry.group("title")))
    where: dict[str, list[int]] = {}  # a short line's text, as titles are compared, -> its line numbers
    for i, line in enumerate(lines):
        if line.part > contents[-1] and len(line.text) <= 100:
            where.setdefault(title_key(line.text), []).append(i)
    found, after = [], -1
    for title in titles:
        at = where.get(title_key(title), [])
        k = bisect_left(at, after + 1)
        if k < len(at):
            after = at[k]
            found.append(Heading(after, (CONTENTS, 0), title))
    return found


def title_key(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".:")


def is_title(text: str) -> bool:
    """Whether a line could be a heading: short, not a sentence's end, mostly letters."""
    text = text.strip()
    words = text.split()
    return (0 < len(words) <= 12 and len(text) <= 80 and not text.endswith((".", ",", ";", ":"))
            and sum(c.isalpha() for c in text) >= 0.5 * len(text))


def follows(previous: list[int], current: list[int]) -> bool:
    """Whether heading number `current` comes next after `previous` (2 after 1.4, 1.5 after 1.4, 1.4.1 after 1.4);
    the first numbered heading must be 1 or 1.1 (a "0 Preface" or an appendix are not counted)."""
    if not previous:
        return current in ([1], [1, 1])
    for depth in range(len(previous)):
        if len(current) == depth + 1 and current[:depth] == previous[:depth] and current[depth] == previous[depth] + 1:
            return True
    return len(current) == len(previous) + 1 and current[:-1] == previous and current[-1] == 1


def clean_title(title: str) -> str:
    """A heading without its permalink sign (HTML pages' trailing "#" or "¶") or spare spaces."""
    return " ".join(_PERMALINK.sub("", title).split())


def top_sections(lines: list[Line], found: list[Heading], document: Document, count: int) -> list[Section]:
    """The top-level sections: the highest rank with at least two headings (a file's definitions count only when
    it is the only file) whose first comes early enough (MAX_PREAMBLE), and the text under the last single
    heading above them; else `count` equal runs of parts."""
    ranks = Counter(h.rank for h in found)
    files = ranks.get((MARKER, 0), 0)
    for rank in sorted(ranks):
        if ranks[rank] >= 2 and (rank[0] != DEFINITION or files <= 1):
            chosen = [h for h in found if h.rank == rank]
            above = [h for h in found if h.rank < rank and h.line < chosen[0].line]
            if above:  # a single heading above them (a page's title): its text before the first section
                chosen.insert(0, above[-1])
            if chosen[0].line > MAX_PREAMBLE * len(lines):  # a few headings late in the text: not its structure
                continue
            ends = [h.line for h in chosen[1:]] + [len(lines)]
            return [Section([h.title], h.line, end, h.rank) for h, end in zip(chosen, ends)]
    parts = len(document.parts)
    runs = min(count, parts)
    bounds = [round(k * parts / runs) for k in range(runs + 1)]
    line_parts = [line.part for line in lines]
    sections = []
    for start, end in zip(bounds, bounds[1:]):
        first, last = bisect_left(line_parts, start), bisect_left(line_parts, end)
        if first == last:
            continue
        cites = document.parts[start].cite, document.parts[end - 1].cite
        title = cites[0] if cites[0] == cites[1] else f"{cites[0]} to {cites[1]}"
        sections.append(Section([title], first, last))
    return sections


def merge(sections: list[Section], count: int) -> list[Section]:
    """At most `count` sections: consecutive ones merged into runs of about equal numbers of them."""
    if len(sections) <= count:
        return sections
    bounds = [round(k * len(sections) / count) for k in range(count + 1)]
    return [Section([t for s in sections[a:b] for t in s.titles], sections[a].first_line, sections[b - 1].last_line)
            for a, b in zip(bounds, bounds[1:])]


def group_title(titles: list[str]) -> str:
    """A run of sections' titles: their common start and end said once ("make (3.80-10, 3.80-9)"), all of them
    where they fit in MAX_TITLE_CHARS, else the first and the last."""
    if len(titles) < 2:
        return titles[0] if titles else ""
    start, end = common_ends(titles)
    cores = [t[len(start) : len(t) - len(end)] for t in titles]
    joined = f"{start}{', '.join(cores)}{end}" if start else "; ".join(titles)
    if len(joined) <= MAX_TITLE_CHARS:
        return joined
    return f"{titles[0]} ... {titles[-1]} ({len(titles)} sections)"


def common_ends(titles: list[str]) -> tuple[str, str]:
    """The start and the end all titles share, cut at a space or a bracket (`make (` and `)`, never inside a word
    or a number), and short enough to leave every title a core; none without a shared start."""
    shortest = min(len(t) for t in titles)
    start = os.path.commonprefix(titles)[: shortest - 1]
    while start and start[-1] not in " ([{<":
        start = start[:-1]
    if not start:  # an end alone ("()" of function names) would cut the titles at their brackets
        return "", ""
    room = shortest - len(start) - 1
    end = os.path.commonprefix([t[::-1] for t in titles])[::-1][-room:] if room > 0 else ""
    while end and end[0] not in " )]}>":
        end = end[1:]
    return start, end


def subheadings(section: Section, found: list[Heading], rank: tuple[int, int]) -> list[str]:
    """The titles of the headings one level below `rank` inside a section (the highest rank there)."""
    inside = [h for h in found if section.first_line < h.line < section.last_line and h.rank > rank
              and h.rank[0] != DEFINITION]
    if not inside:
        return []
    top = min(h.rank for h in inside)
    return [h.title for h in inside if h.rank == top]


@dataclass
class Sentence:
    text: str
    part: int
    position: int  # its order in its section


def sentences(lines: list[Line], heading_lines: set[int], fewest_words: int = SENTENCE_WORDS[0]) -> list[Sentence]:
    """The candidate sentences of a run of prose lines: paragraphs (cut at blank lines, headings, list items and
    part boundaries) joined across line ends (a word hyphenated at a line end rejoined), split at sentence ends,
    and kept when they have SENTENCE_WORDS words, mostly plain words and few symbols."""
    out: list[Sentence] = []
    paragraph: list[Line] = []

    def flush() -> None:
        if not paragraph:
            return
        text = ""
        for line in paragraph:
            piece = line.text.strip()
            if text.endswith("-") and piece[:1].islower():
                text = text[:-1] + piece
            else:
                text = f"{text} {piece}" if text else piece
        for sentence in _SENTENCE_END.split(_BULLET.sub("", text)):
            words = sentence.split()
            plain = sum(bool(_PLAIN_WORD.match(word)) for word in words)
            symbols = sum(c in _SYMBOLS for c in sentence)
            if (fewest_words <= len(words) <= SENTENCE_WORDS[1] and plain >= MIN_WORD_SHARE * len(words)
                    and symbols <= MAX_SYMBOL_SHARE * len(sentence)):
                out.append(Sentence(" ".join(words), paragraph[0].part, len(out)))
        paragraph.clear()

    for i, line in enumerate(lines):
        if (not line.text.strip() or i in heading_lines or _BULLET.match(line.text)
                or paragraph and paragraph[-1].part != line.part):
            flush()
        if line.text.strip() and i not in heading_lines:
            paragraph.append(line)
    flush()
    return out


def code_sentences(lines: list[Line]) -> list[Sentence]:
    """A code run's comment and docstring lines, as sentences (`sentences`); its code lines are left out."""
    comments, in_docstring = [], False
    for line in lines:
        text = line.text.strip()
        opens = bool(_DOCSTRING.match(text))
        if in_docstring or opens or _COMMENT.match(text):
            comments.append(Line(line.part, _QUOTES.sub("", _COMMENT.sub("", text)), False))
        else:
            comments.append(Line(line.part, "", False))
        quotes = text.count('"""') + text.count("\'\'\'")
        if in_docstring and quotes or opens and quotes == 1:
            in_docstring = not in_docstring
    return sentences(comments, set(), CODE_SENTENCE_WORDS)


def definitions(lines: list[Line]) -> list[str]:
    """A code run's top-level definitions, classes first, at most MAX_DEFINITIONS, without private names."""
    found = [m for line in lines if line.code and (m := _DEFINITION.match(line.text))]
    names = [m.group(1) for m in found if not m.group(1).startswith("_")]
    classes = [m.group(1) for m in found if m.group(0).split()[-2] in ("class", "struct", "interface", "trait", "enum")]
    ordered = list(dict.fromkeys([n for n in classes if n in names] + names))
    return ordered[:MAX_DEFINITIONS]


def term_weights(sections: list[Section], lines: list[Line]) -> list[dict[str, float]]:
    """Each section's terms weighted by how particular they are to it: (1 + log tf) x log(1 + sections / df)."""
    counts = [Counter(t for line in lines[s.first_line : s.last_line] for t in terms(line.text)) for s in sections]
    df = Counter(t for c in counts for t in c)
    n = len(sections)
    return [{t: (1 + math.log(tf)) * math.log(1 + n / df[t]) for t, tf in c.items()} for c in counts]


def sentence_score(sentence: Sentence, weights: dict[str, float], focus: set[str]) -> float:
    own = set(terms(sentence.text))
    if not own:
        return 0.0
    score = sum(weights.get(t, 0.0) for t in sorted(own)) / math.sqrt(len(own))  # sorted: the same sum every run
    if sentence.position < LEADING_SENTENCES:
        score *= LEADING_WEIGHT
    if sentence.text.split(maxsplit=1)[0].strip(",;:").lower() in DANGLING_STARTS:
        score *= DANGLING_WEIGHT
    if focus:
        score *= 1 + FOCUS_WEIGHT * len(own & focus) / len(focus)
    return score


def outline(document: Document, length: str = "medium", focus: str | None = None) -> list[OutlineItem]:
    """The document's outline for a summary of `length` (OUTLINE_ITEMS, OUTLINE_SENTENCES): its top-level
    sections in order, each with its best sentences in their order in the document."""
    count, per_item = OUTLINE_ITEMS[length], OUTLINE_SENTENCES[length]
    lines = document_lines(document)
    if not lines:
        return []
    found = headings(lines, document)
    sections = merge(top_sections(lines, found, document, count), count)
    weights = term_weights(sections, lines)
    titles = {title_key(h.title) for h in found}
    # Headings, and lines repeating a heading's title (a PDF's running headers), are not sentences.
    heading_lines = {h.line for h in found} | {i for i, line in enumerate(lines) if title_key(line.text) in titles}
    wanted = set(terms(focus)) if focus else set()
    runs = [lines[section.first_line : section.last_line] for section in sections]
    codes = [sum(line.code for line in run) > len(run) / 2 for run in runs]
    candidates = [code_sentences(run) if code else sentences(run, {i - s.first_line for i in heading_lines})
                  for run, code, s in zip(runs, codes, sections)]
    repeats = Counter(s.text for found_here in candidates for s in found_here)  # boilerplate says the same everywhere
    items = []
    for section, weight, run, code, found_here in zip(sections, weights, runs, codes, candidates):
        best = sorted(found_here, key=lambda s: sentence_score(s, weight, wanted) / repeats[s.text],
                      reverse=True)[:per_item]
        best.sort(key=lambda s: s.position)
        text = " ".join(s.text if s.text[-1] in ".!?:;" else f"{s.text}." for s in best)
        if code and (names := [n for n in definitions(run) if n not in section.titles]):
            text = f"{text} Defines {', '.join(names)}.".strip()
        parts = list(dict.fromkeys(line.part for line in run))
        title = group_title(section.titles)
        subs = subheadings(section, found, section.rank) if section.rank and length != "short" else []
        while subs and len(title) + sum(len(t) + 2 for t in subs) > MAX_TITLE_CHARS:
            subs.pop()
        if subs:
            title = f"{title} ({'; '.join(subs)})"
        items.append(OutlineItem(title, text, best[0].part if best else parts[0], parts))
    return items


def outline_text(items: list[OutlineItem], document: Document) -> str:
    """An outline as the summary's text: one line per item, its title, where it is, and its sentences."""
    out = []
    for item in items:
        where = document.parts[item.part].cite
        text = f": {item.text}" if item.text else ""
        out.append(f"- {item.title} ({where}){text}\n")
    return "".join(out)
