"""Document ingestion: files, folders and stdin turned into text with location markers that answers can cite.

`load_document` reads each input with the reader its format needs (PDF, EPUB, HTML, plain text, chat log, a
codebase folder) and returns the parts in reading order. Every part starts with a short marker the model sees
(`[Page 12]`, `[notes.txt lines 10-48]`, `=== src/app.py ===` plus numbered lines, `[2026-03-01 10:22] Maria:`) and
carries the cite an answer should give. The readers are imported when first needed: pypdf and pathspec cost start-up
time that a plain text input does not need.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from dataclasses import dataclass
from typing import BinaryIO, Sequence

FORMATS = ("auto", "text", "markdown", "rst", "html", "epub", "pdf", "chat", "code")

# What each group of unsupported extensions is, and what the user can do instead.
_UNSUPPORTED = {
    "export it as PDF or text": (".doc", ".docx", ".odt", ".rtf", ".xls", ".xlsx", ".ods", ".ppt", ".pptx", ".odp",
                                 ".pages", ".numbers", ".key"),
    "extract its text first (no OCR here)": (".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp",
                                             ".heic", ".ico"),
    "transcribe it to text first": (".mp3", ".wav", ".flac", ".ogg", ".m4a", ".aac", ".mp4", ".mkv", ".mov", ".avi",
                                    ".webm"),
    "unpack it and pass the folder": (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".7z", ".rar", ".zst"),
}
_UNSUPPORTED_HINT = {ext: hint for hint, exts in _UNSUPPORTED.items() for ext in exts}
_HTML_EXTENSIONS = (".html", ".htm", ".xhtml")
# Text inputs whose content may be a chat log (JSON, JSONL or a plain log), so the chat reader is tried on them.
# Not .log: a server log's "2026-03-01 10:22:01 INFO app: started" would pass for a chat line.
_CHAT_CANDIDATE_EXTENSIONS = (".json", ".jsonl", ".ndjson", ".txt", "")


class IngestError(Exception):
    """An input cannot be read: the one-line message says what is wrong and what to do. Exit code 3 (bad input)."""

    exit_code = 3


@dataclass(frozen=True)
class IngestOptions:
    pages: str | None = None  # PDF page ranges, 1-based inclusive: "10-40", "3", "1-5,9", "10-" (to the end)
    password: str | None = None  # PDF password, tried after the empty one
    max_file_bytes: int = 1_000_000  # per file inside a folder (and its .gitignore files); bigger files are skipped
    max_total_bytes: int = 50_000_000  # a whole folder, or what an EPUB unpacks to; no file is added beyond it
    max_input_bytes: int = 200_000_000  # one file or stdin given as an input; a bigger one is refused
    include_hidden: bool = False  # dot files and folders inside a folder
    format: str = "auto"  # one of FORMATS: forces the reader (stdin has no extension to go by)


@dataclass(frozen=True)
class Part:
    """One citable piece of the document, in reading order."""

    text: str  # what the model reads, marker included; ends with "\n"
    source: str  # display path as the user gave it ("book.pdf", "src/app.py" inside a folder, "-" for stdin)
    cite: str  # what an answer cites: "book.pdf p. 12", "src/app.py:120-158", "notes.txt:10-48"
    # Where it is, for a script checking a citation (`location`): a PDF's page, a text's or a file's 1-based
    # inclusive line range, a chat log's message number, an EPUB's chapter.
    page: int | None = None
    lines: tuple[int, int] | None = None
    message: int | None = None
    chapter: int | None = None

    def location(self) -> dict:
        """The part's place in its source: {"page": 12}, {"lines": [10, 48]}, {"message": 3} or {"chapter": 2}."""
        where = {"page": self.page, "lines": list(self.lines) if self.lines else None, "message": self.message,
                 "chapter": self.chapter}
        return {key: value for key, value in where.items() if value is not None}


@dataclass
class Document:
    parts: list[Part]
    skipped: list[tuple[str, str]]  # (path, reason) for what a folder walk left out
    notes: list[str]  # what the user should know: pages without text, limits reached, options ignored
    name: str = ""  # the inputs as the user gave them ("book.pdf", "notes/ a.txt"), for messages and cache listings

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.parts)


def load_document(paths: Sequence[str], options: IngestOptions = IngestOptions(),
                  stdin: BinaryIO | None = None) -> Document:
    """Read `paths` in order ("-" is stdin: `stdin`, or sys.stdin.buffer) into one Document. Raises IngestError."""
    if options.format not in FORMATS:
        raise IngestError(f"unknown format {options.format!r}: use one of {', '.join(FORMATS)}")
    if not paths:
        raise IngestError("no input: give a file, a folder, or '-' for stdin")
    if list(paths).count("-") > 1:
        raise IngestError("'-' (stdin) is given more than once: stdin can be read only once")
    if options.pages is not None:
        from .pdf import parse_page_ranges

        parse_page_ranges(options.pages)  # bad syntax fails before any input is read

    document = Document(parts=[], skipped=[], notes=[], name=", ".join(paths))
    for path in paths:
        if path == "-":
            try:
                data = read_at_most(stdin if stdin is not None else sys.stdin.buffer, options.max_input_bytes)
            except OverLimit:
                raise IngestError(f"stdin holds over {size_text(options.max_input_bytes)}, the most one input may: "
                                  f"split it into smaller files and give those") from None
            if not data.strip():
                raise IngestError("stdin is empty: pipe a document in, or give a file path")
            name = "stdin"
            kind, parts = _read_input(data, name, "-", "", options, document.notes)
        elif os.path.isdir(path):
            if options.format not in ("auto", "code"):
                raise IngestError(f"{os.path.normpath(path)} is a folder: --format {options.format} reads a file; "
                                  f"use --format auto or code")
            from .code import read_folder

            prefix = os.path.normpath(path) + "/" if len(paths) > 1 else ""
            document.parts += read_folder(path, prefix, options, document.skipped, document.notes)
            continue
        else:
            source = os.path.normpath(path)
            name = printable(source)  # as messages and citations show it: a control character in it escaped
            extension = os.path.splitext(source)[1].lower()
            if options.format == "auto" and extension in _UNSUPPORTED_HINT:
                raise IngestError(f"{name}: {extension} files are not supported: {_UNSUPPORTED_HINT[extension]}")
            data = _read_file(path, name, options.max_input_bytes)
            kind, parts = _read_input(data, name, source, extension, options, document.notes)
        if len(paths) > 1 and kind in ("pdf", "epub", "chat"):
            # Their markers do not name the file (text and code ones do): with several inputs, say which begins.
            parts[0] = dataclasses.replace(parts[0], text=f"=== {name} ===\n{parts[0].text}")
        document.parts += parts
    return document


class NotRegularFile(Exception):
    """A path that is a device, a named pipe, a socket or a folder; args[0] says which ("a named pipe")."""


class OverLimit(Exception):
    """A file that holds more bytes than the limit; args[0] is its size as far as known (at least limit + 1)."""


_SPECIAL_FILES = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                  (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
                  (stat.S_ISLNK, "a symlink"))


def _check_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise NotRegularFile(next((kind for test, kind in _SPECIAL_FILES if test(mode)), "an unknown kind of file"))


def read_regular_file(path: str, limit: int, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them.

    Raises NotRegularFile for anything else (a device or a pipe never ends or blocks; follow_symlinks=False also
    refuses a symlink), OverLimit past `limit` (by the file's size, and by what is read: a file can grow, and
    /proc files show size 0), OSError when it cannot be read. The kind is checked before opening, since opening a
    named pipe waits for a writer and opening a device can act on it, and again on what was opened, in case the path
    was replaced in between.
    """
    _check_regular((os.stat if follow_symlinks else os.lstat)(path).st_mode)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    with open(os.open(path, flags), "rb") as f:
        info = os.fstat(f.fileno())
        _check_regular(info.st_mode)
        if info.st_size > limit:
            raise OverLimit(info.st_size)
        return read_at_most(f, limit, info.st_size)


def read_at_most(stream: BinaryIO, limit: int, expected: int = 0) -> bytes:
    """What `stream` holds, at most `limit` bytes: OverLimit at one byte past it (an endless stream is not read to
    its end). Read in pieces of the `expected` size or 1 MB, so that a short input does not allocate the whole
    limit; each piece is one read of the source (`read1`), so a terminal's Ctrl-D ends the input the first time,
    where a buffered `read` of a piece would wait for a second one."""
    read = getattr(stream, "read1", stream.read)
    chunks, total = [], 0
    while chunk := read(min(max(expected - total, 1 << 20), limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise OverLimit(total)
    return b"".join(chunks)


def printable(text: str) -> str:
    """A name read from inside an input (an archive member, a file in a folder), for a one-line message: as it is,
    or with its control characters escaped."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def error_text(error: Exception) -> str:
    """A library's error for a one-line message: whitespace runs (newlines too) made one space, at most 200
    characters; its type when it has no text."""
    return " ".join(str(error).split())[:200] or type(error).__name__


def size_text(n: int) -> str:
    """A byte count for a message: "3.2 GB", "200 MB", "512 bytes"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def _read_file(path: str, name: str, limit: int) -> bytes:
    try:
        data = read_regular_file(path, limit)
    except NotRegularFile as e:
        raise IngestError(f"{name} is {e.args[0]}, not a regular file: give a file or a folder (or redirect it to "
                          f"stdin and give '-')") from None
    except OverLimit:
        raise IngestError(f"{name} holds over {size_text(limit)}, the most one input may: split it into smaller "
                          f"files") from None
    except FileNotFoundError:
        raise IngestError(f"no such file or directory: {name}") from None
    except PermissionError:
        raise IngestError(f"cannot read {name}: permission denied") from None
    except OSError as e:
        raise IngestError(f"cannot read {name}: {e.strerror or e}") from None
    if not data:
        raise IngestError(f"{name} is empty")
    return data


def _read_input(data: bytes, name: str, source: str, extension: str, options: IngestOptions,
                notes: list[str]) -> tuple[str, list[Part]]:
    """The format the input was read as, and its parts."""
    kind = options.format if options.format != "auto" else _sniff(data, name, extension, is_stdin=source == "-")
    if options.pages is not None and kind != "pdf":
        notes.append(f"--pages applies to PDFs only: ignored for {name}")
    if kind == "pdf":
        from .pdf import read_pdf

        return kind, read_pdf(data, name, source, options.pages, options.password, notes)
    if kind == "epub":
        from .text import read_epub

        return kind, read_epub(data, name, source, options.max_total_bytes)

    from .text import decode_text, looks_binary, text_parts

    if looks_binary(data):
        raise IngestError(f"{name} looks binary: give a text, PDF or EPUB file (or convert it to UTF-8 text)")
    text = decode_text(data)
    if text is None:
        raise IngestError(f"{name} cannot be decoded as text: convert it to UTF-8 (e.g. with iconv)")
    if not text.strip():
        raise IngestError(f"{name} is empty (only whitespace)")

    if kind == "html":
        from .text import html_to_text

        # Line numbers in the cites are those of the extracted text, not of the HTML source.
        text, _title = html_to_text(text)
        if not text.strip():
            raise IngestError(f"{name} has no text outside its markup")
        return kind, text_parts(text, name, source)
    if kind == "code":
        from .code import code_parts

        return kind, code_parts(text, name, source)
    if kind == "chat" or (kind == "text" and options.format == "auto" and extension in _CHAT_CANDIDATE_EXTENSIONS):
        from .chat import chat_parts, parse_chat

        messages = parse_chat(text)
        if messages is not None:
            return "chat", chat_parts(messages, name, source)
        if kind == "chat":
            raise IngestError(f"{name} does not look like a chat log (JSON or JSONL messages, a ChatGPT export, "
                              f"or 'date time - name: text' lines): drop --format chat to read it as text")
    return kind, text_parts(text, name, source)


def _sniff(data: bytes, name: str, extension: str, is_stdin: bool) -> str:
    """The reader for an input given with --format auto: by content where it is unmistakable, else by extension."""
    if data.startswith(b"%PDF-"):
        return "pdf"
    if data.startswith(b"PK\x03\x04") and b"application/epub+zip" in data[:100]:
        return "epub"
    if extension in (".pdf", ".epub"):
        return extension[1:]
    if extension in _HTML_EXTENSIONS:
        return "html"
    if extension in (".md", ".markdown"):
        return "markdown"
    if extension in (".rst", ".rest"):
        return "rst"
    if is_stdin:
        head = data[:512].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
        if head.startswith((b"<!doctype html", b"<html")):
            return "html"
        return "text"
    from .code import is_code_file

    return "code" if is_code_file(name) else "text"
