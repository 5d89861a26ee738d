"""Document ingestion: PDFs, text formats, EPUB, codebases, chat logs and bad input, on inputs built in tmp_path."""

from __future__ import annotations

import io
import json
import shutil

import pytest

from doc_fixtures import (chatgpt_export, encrypted_pdf_bytes, git_ignored, make_repository, numbered_source,
                          pdf_bytes, write_epub, write_json)
from indexpool.ingest import Document, IngestError, IngestOptions, Part, load_document

BOOK_PAGES = [["Alpha   beta  gamma", "hyphen-", "ated word  "], None, ["Page (three)"], ["Last page"]]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Inputs are named relative to the working directory, as a user types them."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def expect_error(paths, message, options=IngestOptions(), stdin=None):
    with pytest.raises(IngestError) as caught:
        load_document(paths, options, stdin=stdin)
    assert str(caught.value) == message
    assert caught.value.exit_code == 3


def cites(document: Document) -> list[str]:
    return [part.cite for part in document.parts]


# --- PDF ---

def test_pdf_one_part_per_page_with_markers_and_blank_page_noted(workdir):
    (workdir / "book.pdf").write_bytes(pdf_bytes(BOOK_PAGES))
    document = load_document(["book.pdf"])
    assert document.parts == [
        Part("[Page 1]\nAlpha beta gamma\nhyphen-\nated word\n", "book.pdf", "book.pdf p. 1", page=1),
        Part("[Page 3]\nPage (three)\n", "book.pdf", "book.pdf p. 3", page=3),
        Part("[Page 4]\nLast page\n", "book.pdf", "book.pdf p. 4", page=4),
    ]
    assert document.notes == ["book.pdf: page 2 has no text (scanned?)"]
    assert document.skipped == []
    assert document.text == "".join(part.text for part in document.parts)


@pytest.mark.parametrize("pages, expected_pages, expected_notes", [
    ("3-4", [3, 4], []),
    ("1,4", [1, 4], []),
    ("4, 1-1", [1, 4], []),
    ("2-", [3, 4], ["book.pdf: page 2 has no text (scanned?)"]),
])
def test_pdf_page_ranges(workdir, pages, expected_pages, expected_notes):
    (workdir / "book.pdf").write_bytes(pdf_bytes(BOOK_PAGES))
    document = load_document(["book.pdf"], IngestOptions(pages=pages))
    assert cites(document) == [f"book.pdf p. {page}" for page in expected_pages]
    assert document.notes == expected_notes


@pytest.mark.parametrize("pages", ["0", "3-1", "a", "1-2-3", "", "1,,2", "-4", "1-" + "9" * 19,
                                   pytest.param("9" * 5000, id="5000 digits")])
def test_pdf_bad_page_range_syntax(workdir, pages):
    (workdir / "book.pdf").write_bytes(pdf_bytes(BOOK_PAGES))
    expect_error(["book.pdf"], f"bad page range {pages!r}: use e.g. 10-40, 3, 1-5,9 or 10- (pages count from 1)",
                 IngestOptions(pages=pages))


@pytest.mark.parametrize("pages", ["5", "1,7", "6-", "9999999999999-"])
def test_pdf_page_range_starting_past_the_end_names_the_page_count(workdir, pages):
    (workdir / "book.pdf").write_bytes(pdf_bytes(BOOK_PAGES))
    expect_error(["book.pdf"], f"book.pdf has 4 pages: --pages {pages} is out of range", IngestOptions(pages=pages))


@pytest.mark.parametrize("pages, expected_pages", [("3-9", [3, 4]), ("1-9999999999999", [1, 3, 4]),
                                                   ("4-999999999999999999,1", [1, 4])])
def test_pdf_page_range_running_past_the_end_is_read_to_the_last_page_with_a_note(workdir, pages, expected_pages):
    (workdir / "book.pdf").write_bytes(pdf_bytes(BOOK_PAGES))
    document = load_document(["book.pdf"], IngestOptions(pages=pages))
    assert cites(document) == [f"book.pdf p. {page}" for page in expected_pages]
    first, last = pages.split(",")[0].split("-")
    assert document.notes[0] == f"book.pdf has 4 pages: --pages {first}-{last} read to page 4"


def test_pdf_with_no_text_at_all_asks_for_ocr(workdir):
    (workdir / "scan.pdf").write_bytes(pdf_bytes([None, None]))
    expect_error(["scan.pdf"], "scan.pdf has no text layer (scanned?): OCR it first, e.g. with ocrmypdf")
    (workdir / "book.pdf").write_bytes(pdf_bytes(BOOK_PAGES))
    expect_error(["book.pdf"], "book.pdf has no text layer (scanned?): OCR it first, e.g. with ocrmypdf",
                 IngestOptions(pages="2"))


def test_pdf_encrypted_with_an_empty_user_password_opens_without_asking(workdir):
    (workdir / "locked.pdf").write_bytes(encrypted_pdf_bytes([["Owner only"]], user_password="", algorithm="RC4-128"))
    assert load_document(["locked.pdf"]).parts == [Part("[Page 1]\nOwner only\n", "locked.pdf", "locked.pdf p. 1", page=1)]


def test_pdf_encrypted_with_a_user_password(workdir):
    data = encrypted_pdf_bytes([["Top secret"], ["More"]], user_password="s3cret", algorithm="AES-256")
    (workdir / "secret.pdf").write_bytes(data)
    expect_error(["secret.pdf"], "secret.pdf is encrypted: pass --password")
    expect_error(["secret.pdf"], "secret.pdf: wrong password (--password)", IngestOptions(password="guess"))
    document = load_document(["secret.pdf"], IngestOptions(password="s3cret"))
    assert document.text == "[Page 1]\nTop secret\n[Page 2]\nMore\n"


def test_pdf_that_is_not_a_pdf(workdir):
    (workdir / "broken.pdf").write_bytes(b"%PDF-1.4\nnot really a PDF\n")
    with pytest.raises(IngestError) as caught:
        load_document(["broken.pdf"])
    message = str(caught.value)
    assert message.startswith("broken.pdf is not a readable PDF (") and message.endswith("): repair or re-export it")
    assert "\n" not in message and caught.value.exit_code == 3
    (workdir / "notes.pdf").write_text("Plain notes, named as a PDF.\n")  # no PDF header at all: said so
    expect_error(["notes.pdf"], "notes.pdf is not a PDF (no PDF header): give --format text (or another --format) "
                                "to read it as what it is")
    assert "Plain notes, named as a PDF." in load_document(["notes.pdf"], IngestOptions(format="text")).text


def test_pdf_from_stdin_is_recognised_by_its_content():
    document = load_document(["-"], stdin=io.BytesIO(pdf_bytes([["From a pipe"]])))
    assert document.parts == [Part("[Page 1]\nFrom a pipe\n", "-", "stdin p. 1", page=1)]


# --- plain text, Markdown, HTML, encodings ---

def test_text_parts_end_at_paragraph_breaks_near_40_lines(workdir):
    text = numbered_source(150, blank_every=7)  # blank lines 7, 14, 21, ...
    (workdir / "notes.txt").write_text(text)
    document = load_document(["notes.txt"])
    # Each part ends at the blank line closest to 40 lines in (42, 84, 126), that blank line not included.
    assert cites(document) == ["notes.txt:1-41", "notes.txt:43-83", "notes.txt:85-125", "notes.txt:127-150"]
    lines = text.split("\n")
    for part, (first, last) in zip(document.parts, [(1, 41), (43, 83), (85, 125), (127, 150)]):
        assert part.text == f"[notes.txt lines {first}-{last}]\n" + "\n".join(lines[first - 1:last]) + "\n"
        assert part.source == "notes.txt"


def test_text_without_paragraph_breaks_is_cut_at_40_lines(workdir):
    (workdir / "flat.txt").write_text(numbered_source(100) + "one more\n")
    document = load_document(["flat.txt"])
    assert cites(document) == ["flat.txt:1-40", "flat.txt:41-80", "flat.txt:81-101"]
    assert document.parts[2].text.endswith("line 100\none more\n")


def test_text_single_line_marker_and_cite(workdir):
    (workdir / "one.txt").write_text("\n\n  just this  \n\n")
    assert load_document(["one.txt"]).parts == [Part("[one.txt line 3]\n  just this\n", "one.txt", "one.txt:3", lines=(3, 3))]


def test_markdown_is_kept_as_written(workdir):
    markdown = "# Title\n\nSome *emphasis* and `code`.\n\n## Section\n\n- item\n"
    (workdir / "README.md").write_text(markdown)
    assert load_document(["README.md"]).text == "[README.md lines 1-7]\n" + markdown


@pytest.mark.parametrize("data, expected", [
    (b"\xef\xbb\xbfna\xc3\xafve\n", "naïve"),  # UTF-8 with a BOM
    ("héllo wörld\n".encode("utf-16"), "héllo wörld"),  # UTF-16 with a BOM (it holds NUL bytes)
    ("café ‘quoted’\n".encode("cp1252"), "café ‘quoted’"),  # legacy single-byte text
])
def test_text_encodings(workdir, data, expected):
    (workdir / "enc.txt").write_bytes(data)
    assert load_document(["enc.txt"]).text == f"[enc.txt line 1]\n{expected}\n"


def test_html_is_reduced_to_its_visible_text(workdir):
    (workdir / "page.html").write_text(
        "<!DOCTYPE html><html><head><title>Page</title><style>p{color:red}</style>"
        '<script>var x = "<p>hidden</p>";</script></head>\n<body><h1>Main &amp; title</h1><p>First   paragraph\n'
        "spans lines.</p><ul><li>one</li><li>two &lt;b&gt;</li></ul><table><tr><td>a</td><td>b</td></tr>"
        "<tr><td>c</td></tr></table><pre>  keep\n    indent</pre><div>x<br>y</div></body></html>")
    document = load_document(["page.html"])
    expected = ("# Main & title\n\nFirst paragraph spans lines.\n\n- one\n- two <b>\n\na | b\nc\n\n  keep\n    indent\n"
                "\nx\ny\n")
    # Line numbers count lines of the extracted text; headings keep their level as Markdown's "#".
    assert document.parts == [Part("[page.html lines 1-15]\n" + expected, "page.html", "page.html:1-15", lines=(1, 15))]


def test_stdin_text_and_html():
    document = load_document(["-"], stdin=io.BytesIO(b"first\nsecond\n"))
    assert document.parts == [Part("[stdin lines 1-2]\nfirst\nsecond\n", "-", "stdin:1-2", lines=(1, 2))]
    html = load_document(["-"], stdin=io.BytesIO(b"<!doctype html><p>Hi <b>there</b></p>"))
    assert html.text == "[stdin line 1]\nHi there\n"


def test_forced_format_code_frames_stdin_with_numbered_lines():
    document = load_document(["-"], IngestOptions(format="code"), stdin=io.BytesIO(b"x = 1\n\ny = 2\n"))
    assert document.parts == [Part("=== stdin ===\n1| x = 1\n2|\n3| y = 2\n", "-", "stdin:1-3", lines=(1, 3))]


# --- EPUB ---

def test_epub_chapters_in_spine_order_with_titles(workdir):
    write_epub(workdir / "book.epub", [("ch1.xhtml", "<h1>The Start</h1><p>It began.</p>"),
                                       ("ch2.xhtml", "<p>No heading here.</p>"),
                                       ("ch3.xhtml", "<section><h2>Third</h2><p>Ends &amp; done.</p></section>")])
    document = load_document(["book.epub"])
    # The cover (an image only) takes no chapter number; without h1/h2 the <title> names the chapter.
    assert document.parts == [
        Part("[Chapter 1: The Start]\n# The Start\n\nIt began.\n", "book.epub", "book.epub ch. 1", chapter=1),
        Part("[Chapter 2: Book]\nNo heading here.\n", "book.epub", "book.epub ch. 2", chapter=2),
        Part("[Chapter 3: Third]\n## Third\n\nEnds & done.\n", "book.epub", "book.epub ch. 3", chapter=3),
    ]


def test_epub_with_drm_or_not_a_zip(workdir):
    write_epub(workdir / "drm.epub", [("ch1.xhtml", "<p>scrambled</p>")], encrypted=True)
    expect_error(["drm.epub"], "drm.epub is DRM-protected: only EPUBs without DRM can be read")
    (workdir / "fake.epub").write_text("plain text")
    expect_error(["fake.epub"], "fake.epub is not a valid EPUB (not a zip archive)")


# --- codebases ---

@pytest.fixture
def repository(workdir):
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the fixture repository is made with `git init`")
    (workdir / "outside.txt").write_text("OUTSIDE SECRET\n")
    (workdir / "repo").mkdir()
    return make_repository(workdir / "repo", workdir / "outside.txt")


def test_codebase_walk_reads_sorted_files_and_reports_everything_skipped(repository):
    document = load_document(["repo"])
    assert cites(document) == ["README.md:1-3", "src/app.py:1-49", "src/app.py:51-70", "src/keep.log:1",
                               "src/util.js:1"]
    assert [part.source for part in document.parts] == ["README.md", "src/app.py", "src/app.py", "src/keep.log",
                                                        "src/util.js"]
    assert document.skipped == [
        (".env", "hidden"),
        (".git/", "git metadata"),
        (".gitignore", "hidden"),
        ("debug.log", "ignored by .gitignore"),
        ("empty.py", "empty"),
        ("node_modules/", "vendored or generated"),
        ("outside_link.txt", "symlink to outside the folder"),
        ("package-lock.json", "lock file"),
        ("secret/", "ignored by .gitignore"),
        ("src/.gitignore", "hidden"),
        ("src/generated.py", "ignored by src/.gitignore"),
        ("tool", "binary"),
        ("util_link.js", "symlink to src/util.js (not followed)"),
    ]
    assert document.notes == []
    assert "OUTSIDE SECRET" not in document.text and "TOKEN" not in document.text


def test_codebase_gitignore_decisions_match_git(repository):
    document = load_document(["repo"])
    ours = {path for path, reason in document.skipped if reason.startswith("ignored by ")}
    assert ours == git_ignored(repository)


def test_codebase_file_framing_and_line_numbers(repository):
    first, second = [part for part in load_document(["repo"]).parts if part.source == "src/app.py"]
    # 70 lines with blank lines 25 and 50: the first part ends at the blank line 50 (not included).
    expected_first = "".join("25|\n" if n == 25 else f"{n}| line {n}\n" for n in range(1, 50))
    assert first.text == "=== src/app.py ===\n" + expected_first
    assert second.text == "".join(f"{n}| line {n}\n" for n in range(51, 71))


def test_codebase_hidden_files_on_request_but_never_git(repository):
    document = load_document(["repo"], IngestOptions(include_hidden=True))
    assert [part.source for part in document.parts] == [".env", ".gitignore", "README.md", "src/.gitignore",
                                                        "src/app.py", "src/app.py", "src/keep.log", "src/util.js"]
    assert (".git/", "git metadata") in document.skipped


def test_codebase_size_limits(repository):
    app_size = (repository / "src" / "app.py").stat().st_size
    document = load_document(["repo"], IngestOptions(max_file_bytes=100))
    assert ("src/app.py", f"too big ({app_size} bytes > 100 bytes per file)") in document.skipped
    assert "src/app.py" not in [part.source for part in document.parts]

    readme_size = (repository / "README.md").stat().st_size
    document = load_document(["repo"], IngestOptions(max_total_bytes=readme_size + 10))
    assert [part.source for part in document.parts] == ["README.md"]
    assert document.skipped[-1] == ("src/app.py", f"total limit reached ({readme_size + 10} bytes): "
                                                  "this and later files not read")
    assert document.notes == [f"repo: stopped at src/app.py: the folder is over {readme_size + 10} bytes "
                              "(max_total_bytes)"]


def test_several_folders_are_named_in_paths(workdir):
    for folder in ("a", "b"):
        (workdir / folder).mkdir()
        (workdir / folder / "x.py").write_text(f"print('{folder}')\n")
    document = load_document(["a", "b"])
    assert document.parts == [Part("=== a/x.py ===\n1| print('a')\n", "a/x.py", "a/x.py:1", lines=(1, 1)),
                              Part("=== b/x.py ===\n1| print('b')\n", "b/x.py", "b/x.py:1", lines=(1, 1))]


def test_single_source_file_is_framed_like_a_codebase_file(workdir):
    (workdir / "script.py").write_text("import os\nprint(os.name)\n")
    assert load_document(["script.py"]).parts == [
        Part("=== script.py ===\n1| import os\n2| print(os.name)\n", "script.py", "script.py:1-2", lines=(1, 2))]


def test_folder_with_nothing_readable(workdir):
    (workdir / "junk").mkdir()
    (workdir / "junk" / "data.bin").write_bytes(b"\0\1\2")
    (workdir / "junk" / "yarn.lock").write_text("lock\n")
    expect_error(["junk"], "junk has no readable text files (1 binary, 1 lock file)")
    (workdir / "void").mkdir()
    expect_error(["void"], "void has no readable text files (it is empty)")


# --- chat logs ---

JSON_MESSAGES = [
    {"role": "user", "name": "Maria", "content": "Hi there", "timestamp": "2026-03-01T10:22:33+01:00"},
    {"role": "assistant", "created_at": 1772360580,
     "content": [{"type": "text", "text": "Hello"}, {"type": "image_url", "image_url": {"url": "x"}},
                 {"type": "text", "text": "Maria"}]},
    {"sender": "Bob", "text": "no time given"},
    {"author": {"role": "user", "name": "Ana"}, "content": "ms epoch", "time": 1772360640000},
    {"role": "system", "content": ""},
]
JSON_PARTS = [
    ("[2026-03-01 10:22] Maria: Hi there\n", "2026-03-01 10:22 Maria"),
    ("[2026-03-01 10:23] assistant: Hello\nMaria\n", "2026-03-01 10:23 assistant"),
    ("Bob: no time given\n", "#3 Bob"),
    ("[2026-03-01 10:24] Ana: ms epoch\n", "2026-03-01 10:24 Ana"),
]


@pytest.mark.parametrize("file_name, encode", [
    ("chat.json", json.dumps),
    ("chat.jsonl", lambda messages: "\n".join(json.dumps(m) for m in messages) + "\n"),
    ("wrapped.json", lambda messages: json.dumps({"messages": messages})),
])
def test_chat_json_and_jsonl(workdir, file_name, encode):
    (workdir / file_name).write_text(encode(JSON_MESSAGES))
    document = load_document([file_name])
    assert document.parts == [Part(text, file_name, f"{file_name} {where}", message=number)
                              for number, (text, where) in enumerate(JSON_PARTS, start=1)]


def test_chatgpt_export_follows_the_current_branch(workdir):
    write_json(workdir / "conversations.json", chatgpt_export())
    document = load_document(["conversations.json"])
    assert document.parts == [
        Part("=== Trip plan ===\n[2026-03-01 10:22] user: Where should we go?\n", "conversations.json",
             "conversations.json 2026-03-01 10:22 user", message=1),
        Part("[2026-03-01 10:24] assistant: New answer: Lisbon.\n", "conversations.json",
             "conversations.json 2026-03-01 10:24 assistant", message=2),
        Part("=== Recipe ===\nuser: Soup?\n", "conversations.json", "conversations.json #3 user", message=3),
        Part("assistant: Tomato.\n", "conversations.json", "conversations.json #4 assistant", message=4),
    ]
    assert "Rome" not in document.text


def test_chatgpt_export_without_current_node_follows_the_newest_replies(workdir):
    export = chatgpt_export()
    del export[0]["current_node"]
    write_json(workdir / "conversations.json", export[:1])
    document = load_document(["conversations.json"])
    assert [part.text for part in document.parts] == [
        "=== Trip plan ===\n[2026-03-01 10:22] user: Where should we go?\n",
        "[2026-03-01 10:24] assistant: New answer: Lisbon.\n",
    ]


@pytest.mark.parametrize("log, expected", [
    ("2026-03-01 10:22 - Maria: Are we still on?\nI can be there at noon.\n2026-03-01 10:25 - Bob: Yes: see you.\n",
     [("[2026-03-01 10:22] Maria: Are we still on?\nI can be there at noon.\n", "2026-03-01 10:22 Maria"),
      ("[2026-03-01 10:25] Bob: Yes: see you.\n", "2026-03-01 10:25 Bob")]),
    ("[10:22] Maria: hi\n[10:23] Bob: hello\n",
     [("[10:22] Maria: hi\n", "10:22 Maria"), ("[10:23] Bob: hello\n", "10:23 Bob")]),
    ("01/03/2026, 10:22 - Messages are end-to-end encrypted.\n01/03/2026, 10:22 - Maria: Hi\n",
     [("[01/03/2026 10:22] Messages are end-to-end encrypted.\n", "01/03/2026 10:22"),
      ("[01/03/2026 10:22] Maria: Hi\n", "01/03/2026 10:22 Maria")]),
    ("[01/03/26, 10:23:05 PM] Bob: Hello\n[01/03/26, 10:24:00 PM] Maria: Hey\n",
     [("[01/03/26 10:23 PM] Bob: Hello\n", "01/03/26 10:23 PM Bob"),
      ("[01/03/26 10:24 PM] Maria: Hey\n", "01/03/26 10:24 PM Maria")]),
])
def test_chat_plain_logs(workdir, log, expected):
    (workdir / "chat.txt").write_text(log)
    document = load_document(["chat.txt"])
    assert document.parts == [Part(text, "chat.txt", f"chat.txt {where}", message=number)
                              for number, (text, where) in enumerate(expected, start=1)]


def test_json_that_is_not_a_chat_is_text(workdir):
    (workdir / "config.json").write_text('{"name": "demo", "version": 1}\n')
    assert load_document(["config.json"]).parts == [
        Part('[config.json line 1]\n{"name": "demo", "version": 1}\n', "config.json", "config.json:1", lines=(1, 1))]
    (workdir / "notes.md").write_text("Just notes.\n")
    expect_error(["notes.md"], "notes.md does not look like a chat log (JSON or JSONL messages, a ChatGPT export, "
                               "or 'date time - name: text' lines): drop --format chat to read it as text",
                 IngestOptions(format="chat"))


# --- several inputs, options, bad input ---

def test_several_inputs_are_concatenated_in_order(workdir):
    (workdir / "book.pdf").write_bytes(pdf_bytes([["Only page"]]))
    (workdir / "notes.txt").write_text("a note\n")
    document = load_document(["book.pdf", "notes.txt", "-"], IngestOptions(pages="1"), stdin=io.BytesIO(b"piped\n"))
    # With several inputs, a PDF's first part names the file (text markers already do).
    assert document.text == "=== book.pdf ===\n[Page 1]\nOnly page\n[notes.txt line 1]\na note\n[stdin line 1]\npiped\n"
    assert cites(document) == ["book.pdf p. 1", "notes.txt:1", "stdin:1"]
    assert [part.source for part in document.parts] == ["book.pdf", "notes.txt", "-"]
    piped_pdf = load_document(["notes.txt", "-"], stdin=io.BytesIO(pdf_bytes([["Piped page"]])))
    assert piped_pdf.parts[1] == Part("=== stdin ===\n[Page 1]\nPiped page\n", "-", "stdin p. 1", page=1)
    assert document.notes == ["--pages applies to PDFs only: ignored for notes.txt",
                              "--pages applies to PDFs only: ignored for stdin"]


def test_bad_input_errors(workdir):
    (workdir / "empty.txt").write_bytes(b"")
    (workdir / "blank.txt").write_text(" \n\t\n")
    (workdir / "report.docx").write_bytes(b"PK\x03\x04")
    (workdir / "photo.png").write_bytes(b"\x89PNG")
    (workdir / "data.txt").write_bytes(b"text\0with NUL")
    (workdir / "noise.txt").write_bytes(bytes(range(1, 32)) * 4 + b"\xff")
    (workdir / "docs").mkdir()
    expect_error(["missing.txt"], "no such file or directory: missing.txt")
    expect_error(["empty.txt"], "empty.txt is empty")
    expect_error(["blank.txt"], "blank.txt is empty (only whitespace)")
    expect_error(["-"], "stdin is empty: pipe a document in, or give a file path", stdin=io.BytesIO(b"\n"))
    expect_error(["report.docx"], "report.docx: .docx files are not supported: export it as PDF or text")
    expect_error(["photo.png"], "photo.png: .png files are not supported: extract its text first (no OCR here)")
    expect_error(["data.txt"], "data.txt looks binary: give a text, PDF or EPUB file (or convert it to UTF-8 text)")
    expect_error(["noise.txt"], "noise.txt cannot be decoded as text: convert it to UTF-8 (e.g. with iconv)")
    expect_error(["docs/"], "docs is a folder: --format pdf reads a file; use --format auto or code",
                 IngestOptions(format="pdf"))
    expect_error(["docs/../empty.txt"], "empty.txt is empty")
    expect_error(["a.txt"], "unknown format 'word': use one of auto, text, markdown, rst, html, epub, pdf, chat, code",
                 IngestOptions(format="word"))
    expect_error(["-", "-"], "'-' (stdin) is given more than once: stdin can be read only once")
    expect_error([], "no input: give a file, a folder, or '-' for stdin")
