"""PDF: one part per page, led by `[Page 12]` (the page's 1-based position in the file); cite "book.pdf p. 12"."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from typing import Iterator

from pypdf import PdfReader
from pypdf.errors import DependencyError

from . import IngestError, Part, error_text


def parse_page_ranges(spec: str) -> list[tuple[int, int | None]]:
    """"10-40", "3", "1-5,9" or "10-" as (first, last) page ranges, 1-based inclusive; last None: to the end."""
    ranges = []
    for piece in spec.split(","):
        # At most 18 digits: no PDF has a quintillion pages, and int() refuses numbers of thousands of digits.
        match = re.fullmatch(r"\s*(\d{1,18})\s*(?:(-)\s*(\d{0,18})\s*)?", piece)
        if not match or int(match[1]) < 1 or (match[3] and int(match[3]) < int(match[1])):
            raise IngestError(f"bad page range {spec!r}: use e.g. 10-40, 3, 1-5,9 or 10- (pages count from 1)")
        first = int(match[1])
        ranges.append((first, None if match[2] and not match[3] else int(match[3] or first)))
    return ranges


def select_pages(spec: str | None, page_count: int, name: str, notes: list[str]) -> list[int]:
    """The 1-based pages to read, in order: all of them, or those of the --pages ranges.

    A range that starts past the last page is an error (that page does not exist); one that starts in the document
    and runs past its end is read to the last page, with a note (as "10-" would be).
    """
    if spec is None:
        return list(range(1, page_count + 1))
    pages: set[int] = set()
    plural = "page" if page_count == 1 else "pages"
    for first, last in parse_page_ranges(spec):
        if first > page_count:
            raise IngestError(f"{name} has {page_count} {plural}: --pages {spec} is out of range")
        if last is not None and last > page_count:
            notes.append(f"{name} has {page_count} {plural}: --pages {first}-{last} read to page {page_count}")
        pages.update(range(first, min(page_count if last is None else last, page_count) + 1))
    return sorted(pages)


def tidy_page_text(text: str) -> str:
    """Runs of spaces collapsed, spaces at line ends dropped, at most one blank line in a row; hyphens left alone."""
    lines = [re.sub(r"[ \t\u00a0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def page_list(pages: list[int]) -> str:
    """[4, 7, 8, 9] -> "4, 7-9"."""
    runs: list[list[int]] = []
    for page in pages:
        if runs and page == runs[-1][1] + 1:
            runs[-1][1] = page
        else:
            runs.append([page, page])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


@contextlib.contextmanager
def _pypdf_quiet() -> Iterator[None]:
    """pypdf logs each repair it makes on a damaged file ("EOF marker not found", "Object 9 0 not defined"): what
    matters reaches the user as the reader's own one-line error or note, so these are not printed."""
    logger = logging.getLogger("pypdf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def read_pdf(data: bytes, name: str, source: str, pages: str | None, password: str | None,
             notes: list[str]) -> list[Part]:
    """Parts for the pages selected by `pages` (--pages syntax, None: all) that have text; those without text go
    to `notes`."""
    with _pypdf_quiet():
        return _read_pdf(data, name, source, pages, password, notes)


def _read_pdf(data: bytes, name: str, source: str, pages: str | None, password: str | None,
              notes: list[str]) -> list[Part]:
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            _decrypt(reader, name, password)
        page_count = len(reader.pages)
    except IngestError:
        raise
    except DependencyError:
        raise IngestError(f"{name} is encrypted with AES: install the 'cryptography' package to read it") from None
    except Exception as e:  # pypdf raises many kinds of error on a malformed file, not only PyPdfError
        if b"%PDF-" not in data[:1024]:  # where a PDF's header may lie: only its name says PDF
            raise IngestError(f"{name} is not a PDF (no PDF header): give --format text (or another --format) to "
                              f"read it as what it is") from None
        raise IngestError(f"{name} is not a readable PDF ({error_text(e)}): repair or re-export it") from None
    parts = []
    without_text = []
    for page in select_pages(pages, page_count, name, notes):
        try:
            text = tidy_page_text(reader.pages[page - 1].extract_text())
        except Exception:  # pypdf raises many kinds of error on a broken content stream: that page has no text
            text = ""
        if text:
            parts.append(Part(f"[Page {page}]\n{text}\n", source, f"{name} p. {page}", page=page))
        else:
            without_text.append(page)
    if not parts:
        raise IngestError(f"{name} has no text layer (scanned?): OCR it first, e.g. with ocrmypdf")
    if without_text:
        label = "page" if len(without_text) == 1 else "pages"
        verb = "has" if len(without_text) == 1 else "have"
        notes.append(f"{name}: {label} {page_list(without_text)} {verb} no text (scanned?)")
    return parts


def _decrypt(reader: PdfReader, name: str, password: str | None) -> None:
    """The empty user password first (many PDFs only restrict printing or copying), then the one given."""
    if reader.decrypt(""):
        return
    if password is None:
        raise IngestError(f"{name} is encrypted: pass --password")
    if not reader.decrypt(password):
        raise IngestError(f"{name}: wrong password (--password)")
