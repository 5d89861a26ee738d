"""Inputs for the ingestion tests, built at test time: PDFs, an EPUB, a small git repository, chat logs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import zipfile
from pathlib import Path


def pdf_bytes(pages: list[list[str] | None]) -> bytes:
    """A PDF written by hand: each page shows its lines in Helvetica, one text line each; None is a blank page."""
    page_count = len(pages)
    # Objects: 1 catalog, 2 page tree, 3 font, then for page i: 4 + 2i the page, 5 + 2i its content stream.
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % (4 + 2 * i) for i in range(page_count))
        + b"] /Count %d >>" % page_count,
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, lines in enumerate(pages):
        content = b""
        if lines:
            shown = b" T* ".join(b"(" + _pdf_string(line) + b") Tj" for line in lines)
            content = b"BT /F1 12 Tf 14 TL 72 720 Td " + shown + b" ET"
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * i))
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % number + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % offset for offset in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def _pdf_string(text: str) -> bytes:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1")


def encrypted_pdf_bytes(pages: list[list[str] | None], user_password: str, algorithm: str) -> bytes:
    """`pdf_bytes` encrypted by pypdf; an empty user password opens it without asking (owner password only)."""
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf_bytes(pages))))
    writer.encrypt(user_password=user_password, owner_password="owner secret", algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def write_epub(path: Path, chapters: list[tuple[str, str]], encrypted: bool = False) -> Path:
    """An EPUB 3 whose spine is a cover page with only an image, then `chapters` as (file name, XHTML body), in that
    order; the manifest lists them in reverse, so reading in manifest order would be caught."""
    opf_items = [("cover", "cover.xhtml")] + [(f"c{i}", file) for i, (file, _body) in enumerate(chapters)]
    manifest = "".join(f'<item id="{item_id}" href="text/{file}" media-type="application/xhtml+xml"/>'
                       for item_id, file in reversed(opf_items))
    manifest += '<item id="css" href="style.css" media-type="text/css"/>'
    spine = "".join(f'<itemref idref="{item_id}"/>' for item_id, _file in opf_items)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("mimetype", "application/epub+zip", compress_type=zipfile.ZIP_STORED)
        archive.writestr("META-INF/container.xml",
                         '<?xml version="1.0"?><container version="1.0" '
                         'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles>'
                         '<rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
                         '</rootfiles></container>')
        archive.writestr("OEBPS/content.opf",
                         '<?xml version="1.0"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0">'
                         f'<metadata/><manifest>{manifest}</manifest><spine>{spine}</spine></package>')
        archive.writestr("OEBPS/style.css", "p { margin: 0 }")
        archive.writestr("OEBPS/text/cover.xhtml", _xhtml("Book", '<img src="cover.jpg" alt=""/>'))
        for file, body in chapters:
            archive.writestr(f"OEBPS/text/{file}", _xhtml("Book", body))
        if encrypted:
            archive.writestr("META-INF/encryption.xml",
                             '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
                             'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData>'
                             f'<enc:CipherData><enc:CipherReference URI="OEBPS/text/{chapters[0][0]}"/>'
                             '</enc:CipherData></enc:EncryptedData></encryption>')
    return path


def _xhtml(title: str, body: str) -> str:
    return ('<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml">'
            f"<head><title>{title}</title></head><body>{body}</body></html>")


def numbered_source(count: int, blank_every: int = 0) -> str:
    """`count` lines "line N", with a blank line in place of every `blank_every`-th line (0: none)."""
    return "".join("\n" if blank_every and n % blank_every == 0 else f"line {n}\n" for n in range(1, count + 1))


def make_repository(root: Path, outside_file: Path) -> Path:
    """A small project folder, made a git repository: a .gitignore at the top and one in src/ (with a negation),
    ignored files and folders, a binary, a lock file, node_modules/, a hidden file, an empty file, a file of 70 lines,
    a symlink to `outside_file` and one to a file inside. Needs git."""
    files = {
        ".gitignore": "*.log\nsecret/\n",
        ".env": "TOKEN=hidden\n",
        "README.md": "# Demo\n\nA demo project.\n",
        "debug.log": "ignored by the top .gitignore\n",
        "secret/key.txt": "a folder ignored as a whole\n",
        "package-lock.json": '{"lockfileVersion": 3}\n',
        "node_modules/left-pad/index.js": "module.exports = 1;\n",
        "empty.py": "",
        "src/.gitignore": "generated.py\n!keep.log\n",
        "src/generated.py": "ignored by src/.gitignore\n",
        "src/keep.log": "re-included by the negation in src/.gitignore\n",
        "src/app.py": numbered_source(70, blank_every=25),
        "src/util.js": "export const answer = 42;\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "tool").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    os.symlink(outside_file, root / "outside_link.txt")
    os.symlink(root / "src" / "util.js", root / "util_link.js")
    subprocess.run(["git", "init", "-q", str(root)], check=True, capture_output=True)
    return root


def git_ignored(root: Path) -> set[str]:
    """What git itself says is ignored (folders ignored as a whole as one "name/" entry)."""
    listing = subprocess.run(["git", "-C", str(root), "ls-files", "--others", "--ignored", "--exclude-standard",
                              "--directory"], check=True, capture_output=True, text=True).stdout
    return set(listing.split())


def chatgpt_export() -> list[dict]:
    """A conversations.json with two conversations; the first was edited, so its tree has two branches and
    `current_node` ends the one the user last saw."""
    edited = {
        "title": "Trip plan",
        "current_node": "a2",
        "mapping": {
            "root": {"id": "root", "message": None, "parent": None, "children": ["sys"]},
            "sys": {"id": "sys", "parent": "root", "children": ["u1"],
                    "message": {"author": {"role": "system"}, "content": {"content_type": "text", "parts": [""]},
                                "create_time": None}},
            "u1": {"id": "u1", "parent": "sys", "children": ["a1", "a2"],
                   "message": {"author": {"role": "user"}, "create_time": 1772360520.5,
                               "content": {"content_type": "text", "parts": ["Where should we go?"]}}},
            "a1": {"id": "a1", "parent": "u1", "children": [],
                   "message": {"author": {"role": "assistant"}, "create_time": 1772360580,
                               "content": {"content_type": "text", "parts": ["Old answer: Rome."]}}},
            "a2": {"id": "a2", "parent": "u1", "children": [],
                   "message": {"author": {"role": "assistant"}, "create_time": 1772360640,
                               "content": {"content_type": "text", "parts": ["New answer: Lisbon."]}}},
        },
    }
    second = {
        "title": "Recipe",
        "current_node": "b1",
        "mapping": {
            "b0": {"id": "b0", "parent": None, "children": ["b1"],
                   "message": {"author": {"role": "user"}, "create_time": None,
                               "content": {"content_type": "text", "parts": ["Soup?"]}}},
            "b1": {"id": "b1", "parent": "b0", "children": [],
                   "message": {"author": {"role": "assistant"}, "create_time": None,
                               "content": {"content_type": "text", "parts": ["Tomato."]}}},
        },
    }
    return [edited, second]


def write_json(path: Path, value: object) -> Path:
    path.write_text(json.dumps(value))
    return path


def write_planted_report(directory: Path, fact: str, topics: int, lines: int) -> Path:
    """report.txt: the first `lines` lines of Python's documentation (its first `topics` topics), with `fact` as a
    line of its own in the middle."""
    import pydoc_data.topics

    text = "\n\n".join(list(pydoc_data.topics.topics.values())[:topics]).split("\n")[:lines]
    text.insert(lines // 2, fact)
    path = directory / "report.txt"
    path.write_text("\n".join(text) + "\n")
    return path
