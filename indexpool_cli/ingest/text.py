"""Plain text, Markdown, reStructuredText, HTML and EPUB; the decoding and line splitting the other readers share."""

from __future__ import annotations

import codecs
import io
import posixpath
import re
import zipfile
from html.parser import HTMLParser
from urllib.parse import unquote
from xml.etree import ElementTree

from . import IngestError, Part, error_text, printable, size_text

_UTF32_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)  # checked before UTF-16: FF FE 00 00 starts with FF FE
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
# A legacy-encoded text has few control characters; random bytes that happen to hold no NUL have many (about 1 in 8).
_MAX_CONTROL_SHARE = 0.02
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f-\x9f]")  # not \t \n \v \f \r or ESC (in logs)


def looks_binary(data: bytes) -> bool:
    """A NUL byte in the first 8 KB, unless a UTF-16/32 byte-order mark explains it."""
    return not data.startswith(_UTF32_BOMS + _UTF16_BOMS) and b"\0" in data[:8192]


def decode_text(data: bytes) -> str | None:
    """UTF-8 (BOM or not), UTF-32/16 with a BOM, then cp1252 or latin-1 for NUL-free bytes that read as text.

    None when the bytes are not text in any of these.
    """
    try:
        if data.startswith(codecs.BOM_UTF8):
            return data.decode("utf-8-sig")
        if data.startswith(_UTF32_BOMS):
            return data.decode("utf-32")
        if data.startswith(_UTF16_BOMS):
            return data.decode("utf-16")
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    if b"\0" in data:
        return None
    try:
        text = data.decode("cp1252")
    except UnicodeDecodeError:  # cp1252 leaves five bytes undefined; latin-1 maps them all
        text = data.decode("latin-1")
    controls = len(_CONTROL_CHARACTERS.findall(text))
    return None if controls > _MAX_CONTROL_SHARE * len(text) else text


def split_lines(text: str) -> list[str]:
    """Lines as an editor counts them (\\n, \\r\\n or \\r), trailing spaces dropped.

    str.splitlines also breaks at form feeds and Unicode separators, which would shift the line numbers.
    """
    return [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]


def line_chunks(lines: list[str], target: int, shortest: int, longest: int) -> list[tuple[int, int]]:
    """(start, end) line ranges, 0-based, end-exclusive; blank lines trimmed at both ends, blank ranges left out.

    A range ends after the blank line closest to `target` lines in, among those `shortest` to `longest` lines in,
    so that paragraphs (or functions) stay whole; with no blank line there it ends at `target`.
    """
    chunks = []
    start = 0
    while start < len(lines):
        if len(lines) - start <= longest:
            end = len(lines)
        else:
            breaks = [i for i in range(start + shortest, start + longest + 1) if not lines[i - 1]]
            end = min(breaks, key=lambda i: abs(i - start - target)) if breaks else start + target
        first, last = start, end
        while first < last and not lines[first]:
            first += 1
        while last > first and not lines[last - 1]:
            last -= 1
        if first < last:
            chunks.append((first, last))
        start = end
    return chunks


def line_span(first: int, last: int) -> str:
    """1-based inclusive lines "10-48", or "10" for one line."""
    return f"{first}-{last}" if last > first else f"{first}"


def text_parts(text: str, name: str, source: str) -> list[Part]:
    """Parts of about 40 lines, cut at paragraph breaks where possible, each led by `[name lines 10-48]`."""
    lines = split_lines(text)
    parts = []
    for start, end in line_chunks(lines, target=40, shortest=20, longest=60):
        span = line_span(start + 1, end)
        label = "lines" if end - start > 1 else "line"
        body = "\n".join(lines[start:end])
        parts.append(Part(f"[{name} {label} {span}]\n{body}\n", source, f"{name}:{span}", lines=(start + 1, end)))
    return parts


class _HTMLText(HTMLParser):
    """Visible text of an HTML page: block elements on their own lines, list items as "- ", cells split by " | ",
    headings led by Markdown's "#" to "######" (the document's structure, for outlines)."""

    # <head> itself is not dropped: HTML lets its end tag be omitted, and its text-bearing children are these.
    _DROPPED = {"script", "style", "noscript", "template", "title", "svg"}
    _PARAGRAPHS = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre", "table", "ul", "ol", "dl",
                   "section", "article", "header", "footer", "figure", "hr", "aside", "nav", "main"}
    _HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}
    _LINES = {"div", "li", "tr", "dt", "dd", "caption", "figcaption", "address", "details", "summary", "form",
              "fieldset", "legend", "body", "html"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.pieces: list[str] = []
        self.line_has_text = False
        self.dropped_depth = 0
        self.pre_depth = 0
        self.heading = ""  # the first h1/h2
        self.head_title = ""  # the <title>
        self._title_tag: str | None = None  # the tag whose text is being gathered as heading or title
        self._title_text: list[str] = []

    def _newline(self, blank_line: bool) -> None:
        """End the line: with a blank line after it for paragraphs; for other blocks only when the line has text,
        so nested blocks (<li><p>, <div><div>) do not pile up empty lines."""
        if blank_line:
            self.pieces.append("\n\n")
        elif self.line_has_text:
            self.pieces.append("\n")
        self.line_has_text = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self._DROPPED:
            self.dropped_depth += 1
        if tag == "title" or (tag in ("h1", "h2") and not self.heading):
            self._title_tag, self._title_text = tag, []
        if self.dropped_depth:
            return
        if tag == "br":
            self.pieces.append("\n")
            self.line_has_text = False
        elif tag in self._PARAGRAPHS:
            self._newline(blank_line=True)
        elif tag in self._LINES:
            self._newline(blank_line=False)
        elif tag in ("td", "th") and self.line_has_text:
            self.pieces.append(" | ")
        if tag == "li":
            self.pieces.append("- ")
            self.line_has_text = True
        if tag in self._HEADINGS:
            self.pieces.append("#" * int(tag[1]) + " ")
        if tag == "pre":
            self.pre_depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == self._title_tag:
            title = " ".join("".join(self._title_text).split())[:80]
            if tag == "title":
                self.head_title = self.head_title or title
            else:
                self.heading = self.heading or title
            self._title_tag = None
        if tag in self._DROPPED:
            self.dropped_depth = max(0, self.dropped_depth - 1)
            return
        if self.dropped_depth:
            return
        if tag == "pre":
            self.pre_depth = max(0, self.pre_depth - 1)
        if tag in self._HEADINGS and self.pieces and self.pieces[-1].startswith("#") and not self.pieces[-1].strip("# "):
            self.pieces.pop()  # an empty heading
        if tag in self._PARAGRAPHS:
            self._newline(blank_line=True)
        elif tag in self._LINES:
            self._newline(blank_line=False)

    def parse_marked_section(self, i: int, report: int = 1) -> int:
        """A "<![" section of a keyword Python's parser does not know ("<![x", "<![\\x01") makes it raise
        AssertionError: passed over to its ">" instead, as a browser reads it (a bogus comment)."""
        try:
            return super().parse_marked_section(i, report)
        except AssertionError:
            end = self.rawdata.find(">", i + 3)
            return -1 if end < 0 else end + 1

    def handle_data(self, data: str) -> None:
        if self._title_tag:
            self._title_text.append(data)
        if self.dropped_depth:
            return
        if not self.pre_depth:
            data = re.sub(r"\s+", " ", data)
            if not self.line_has_text:
                data = data.lstrip()
        if data:
            self.pieces.append(data)
            self.line_has_text = not data.endswith("\n")


def html_to_text(html: str) -> tuple[str, str]:
    """The visible text of an HTML or XHTML document, and its title (first h1/h2, else <title>, else "")."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    text = "\n".join(split_lines("".join(parser.pieces)))
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text, parser.heading or parser.head_title


_CONTAINER_NS = "{urn:oasis:names:tc:opendocument:xmlns:container}"
_OPF_NS = "{http://www.idpf.org/2007/opf}"
_XMLENC_NS = "{http://www.w3.org/2001/04/xmlenc#}"
# An EPUB with more archive entries than this is refused before its directory is parsed (each entry costs memory):
# books hold hundreds of files, a few thousand at most.
MAX_EPUB_ENTRIES = 20_000
_UNPACKABLE = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)


def read_epub(data: bytes, name: str, source: str, max_bytes: int) -> list[Part]:
    """One part per spine document with text, in spine order, led by `[Chapter 3: Title]`; cite "book.epub ch. 3".

    Chapters are numbered over the spine documents that have text, so a cover image page takes no number. What is
    unpacked (container, package, chapters) may total `max_bytes`: the sizes the archive declares are checked before
    a member is read, and what is read is counted too, since the declared sizes can lie.
    """
    if data.count(b"PK\x01\x02") > MAX_EPUB_ENTRIES:  # an upper bound on the entries of the central directory
        raise IngestError(f"{name} is not a valid EPUB (over {MAX_EPUB_ENTRIES:,} files in its archive)")
    archive = _Unpacker(data, name, max_bytes)
    try:
        container = ElementTree.fromstring(archive.read("META-INF/container.xml"))
        rootfile = container.find(f".//{_CONTAINER_NS}rootfile")
        if rootfile is None or not rootfile.get("full-path"):
            raise IngestError(f"{name} is not a valid EPUB (no package file in META-INF/container.xml)")
        opf_path = rootfile.get("full-path")
        package = ElementTree.fromstring(archive.read(opf_path))
        encrypted = _encrypted_members(archive)
        manifest = {item.get("id"): item for item in package.iter(f"{_OPF_NS}item")}
        parts = []
        for itemref in package.iter(f"{_OPF_NS}itemref"):
            item = manifest.get(itemref.get("idref"))
            if item is None or item.get("media-type") not in ("application/xhtml+xml", "text/html"):
                continue
            member = posixpath.normpath(posixpath.join(posixpath.dirname(opf_path),
                                                       unquote(item.get("href", "").split("#")[0])))
            if member in encrypted:
                raise IngestError(f"{name} is DRM-protected: only EPUBs without DRM can be read")
            html = decode_text(archive.read(member))
            if html is None:
                raise IngestError(f"{name} is not a valid EPUB ({printable(member)} is not text)")
            text, title = html_to_text(html)
            if not text:
                continue
            chapter = len(parts) + 1
            marker = f"[Chapter {chapter}: {title}]" if title else f"[Chapter {chapter}]"
            parts.append(Part(f"{marker}\n{text}\n", source, f"{name} ch. {chapter}", chapter=chapter))
    except ElementTree.ParseError as e:
        raise IngestError(f"{name} is not a valid EPUB (bad XML: {e})") from None
    if not parts:
        raise IngestError(f"{name} has no text in its chapters (images only?)")
    return parts


class _Unpacker:
    """An EPUB's members, read within a budget of unpacked bytes shared by all of them. zipfile raises many kinds of
    error on a damaged archive (bad headers or CRCs, truncated or corrupt compressed streams): each is an IngestError
    here."""

    def __init__(self, data: bytes, name: str, max_bytes: int):
        self.name, self.max_bytes, self.left = name, max_bytes, max_bytes
        try:
            self.archive = zipfile.ZipFile(io.BytesIO(data))
        except zipfile.BadZipFile:
            raise IngestError(f"{name} is not a valid EPUB (not a zip archive)") from None
        except Exception as e:
            raise self._damaged(e) from None

    def has(self, member: str) -> bool:
        try:
            self.archive.getinfo(member)
        except KeyError:
            return False
        return True

    def read(self, member: str) -> bytes:
        try:
            info = self.archive.getinfo(member)
        except KeyError:
            raise IngestError(f"{self.name} is not a valid EPUB (no {printable(member)} in the archive)") from None
        if info.flag_bits & 0x1:
            raise IngestError(f"{self.name} is password-protected ({printable(member)} is encrypted): only EPUBs "
                              f"without encryption can be read")
        if info.compress_type not in _UNPACKABLE:
            method = zipfile.compressor_names.get(info.compress_type, f"method {info.compress_type}")
            raise IngestError(f"{self.name} uses {method} compression ({printable(member)}), which cannot be "
                              f"unpacked here: re-save it with ordinary zip compression, e.g. with Calibre")
        if info.file_size > self.left:
            raise self._too_big()
        try:
            with self.archive.open(info) as f:
                data = f.read(self.left + 1)
        except Exception as e:
            raise self._damaged(e) from None
        if len(data) > self.left:
            raise self._too_big()
        self.left -= len(data)
        return data

    def _damaged(self, error: Exception) -> IngestError:
        return IngestError(f"{self.name} is not a valid EPUB (damaged archive: {error_text(error)}): repair or "
                           f"re-export it")

    def _too_big(self) -> IngestError:
        return IngestError(f"{self.name} unpacks to over {size_text(self.max_bytes)} of text, more than a book holds "
                           f"(a zip bomb?): not read")


def _encrypted_members(archive: _Unpacker) -> set[str]:
    """Members listed in META-INF/encryption.xml: DRM, or font obfuscation (which touches fonts only)."""
    if not archive.has("META-INF/encryption.xml"):
        return set()
    encryption = ElementTree.fromstring(archive.read("META-INF/encryption.xml"))
    return {unquote(ref.get("URI", "")) for ref in encryption.iter(f"{_XMLENC_NS}CipherReference")}
