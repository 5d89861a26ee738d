"""Hostile inputs: devices, pipes and endless streams, zip bombs, absurd page ranges, deep nesting, chat exports
and model files of the wrong shape. Each is refused (or skipped, or read) within bounded time and memory, with a
one-line IngestError or ModelLoadError that says what is wrong and what to do; never another exception."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from gguf import GGUFValueType
from safetensors.torch import save

from benchmarks.fuzz import hf_directory, memory_ceiling, tiny_gguf_bytes, tiny_hf_config, time_limit
from doc_fixtures import chatgpt_export, write_epub
from indexpool.ingest import IngestError, IngestOptions, load_document
from indexpool.model.errors import ModelLoadError
from indexpool.model.loader import load_model

CHAPTERS = [("ch1.xhtml", "<h1>Start</h1><p>It began.</p>"), ("ch2.xhtml", "<p>The end.</p>")]


@pytest.fixture(autouse=True)
def bounded(tmp_path, monkeypatch):
    """A regression fails here instead of hanging on a pipe or taking the machine's memory; inputs are named
    relative to the working directory, as a user types them."""
    monkeypatch.chdir(tmp_path)
    with memory_ceiling(1 << 30), time_limit(60):
        yield


def expect_error(paths, message, options=IngestOptions(), stdin=None):
    with pytest.raises(IngestError) as caught:
        load_document(paths, options, stdin=stdin)
    assert str(caught.value) == message


def expect_load_error(path, message):
    with pytest.raises(ModelLoadError) as caught:
        load_model(path, torch.float32)
    assert str(caught.value) == message


# --- inputs that are not regular files ---

def test_devices_pipes_and_sockets_given_as_inputs_are_refused(tmp_path):
    os.mkfifo("pipe.txt")
    server = socket.socket(socket.AF_UNIX)
    server.bind("socket.txt")
    os.symlink("/dev/zero", "zeros.txt")
    advice = "not a regular file: give a file or a folder (or redirect it to stdin and give '-')"
    try:
        expect_error(["/dev/zero"], f"/dev/zero is a character device, {advice}")
        expect_error(["zeros.txt"], f"zeros.txt is a character device, {advice}")
        expect_error(["pipe.txt"], f"pipe.txt is a named pipe, {advice}")  # no writer: opening it would wait
        expect_error(["socket.txt"], f"socket.txt is a socket, {advice}")
    finally:
        server.close()


def test_stdin_is_read_up_to_the_input_limit():
    options = IngestOptions(max_input_bytes=100)
    assert load_document(["-"], options, stdin=io.BytesIO(b"x" * 99 + b"\n")).text == f"[stdin line 1]\n{'x' * 99}\n"
    too_much = "stdin holds over 100 bytes, the most one input may: split it into smaller files and give those"
    expect_error(["-"], too_much, options, stdin=io.BytesIO(b"x" * 101))
    with open("/dev/zero", "rb") as endless:  # `indexpool ask - < /dev/zero`
        expect_error(["-"], too_much, options, stdin=endless)


def test_a_file_over_the_input_limit_is_refused_before_it_is_read(tmp_path):
    Path("big.txt").write_bytes(b"word " * 1000)
    Path("sparse.txt").touch()
    os.truncate("sparse.txt", 1 << 40)  # a terabyte that takes no disk: read, it would take the memory
    expect_error(["big.txt"], "big.txt holds over 4 KB, the most one input may: split it into smaller files",
                 IngestOptions(max_input_bytes=4000))
    expect_error(["sparse.txt"], "sparse.txt holds over 200 MB, the most one input may: split it into smaller files")


def test_a_folder_walk_skips_pipes_and_reads_no_gitignore_that_is_not_a_regular_file(tmp_path):
    for name in ("fifo_ignore", "zero_ignore", "big_ignore"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kept.py").write_text("x = 1\n")
        (tmp_path / name / "debug.log").write_text("ignored only when .gitignore is read\n")
    os.mkfifo("fifo_ignore/.gitignore")
    os.mkfifo("fifo_ignore/pipe.py")
    os.symlink("/dev/zero", "zero_ignore/.gitignore")
    Path("big_ignore/.gitignore").write_text("*.log\n" * 100)
    document = load_document(["fifo_ignore"])
    assert [part.source for part in document.parts] == ["debug.log", "kept.py"]
    assert ("pipe.py", "not a regular file (a named pipe)") in document.skipped
    assert document.notes == ["fifo_ignore: .gitignore is a named pipe, not a regular file: its rules are not applied"]
    # git does not follow a symlinked .gitignore either; followed, this one would never end.
    assert load_document(["zero_ignore"]).notes == [
        "zero_ignore: .gitignore is a symlink, not a regular file: its rules are not applied"]
    document = load_document(["big_ignore"], IngestOptions(max_file_bytes=500))
    assert document.notes == ["big_ignore: .gitignore is over 500 bytes: its rules are not applied"]
    assert [part.source for part in document.parts] == ["debug.log", "kept.py"]
    Path("big_ignore/.gitignore").write_text("*.log\n")
    assert [part.source for part in load_document(["big_ignore"]).parts] == ["kept.py"]


def test_gitignore_rules_that_are_invalid_or_backtrack_without_end_are_left_out(tmp_path):
    """Found by the fuzzer: a lone "!" made pathspec raise; "*" x 400 + ".log" (or "*a*a*a*a*a") took minutes per
    file name, as each wildcard multiplies the regex's backtracking by the name's length."""
    Path("repo").mkdir()
    Path("repo/.gitignore").write_text("!\n" + "*" * 400 + ".log\n*a*a*a*a*a.txt\ngen/***/out\n\\*\\*\\*x\n")
    for name in ("app.log", "a" * 200 + ".txt", "gen/1/2/out", "***x", "kept.py"):
        Path("repo", name).parent.mkdir(parents=True, exist_ok=True)
        Path("repo", name).write_text("text\n")
    document = load_document(["repo"])
    # A run of stars is one wildcard, as git reads it ("***" alone in a segment is "**").
    assert {path for path, reason in document.skipped if reason.startswith("ignored")} == {
        "app.log", "gen/1/2/out", "***x"}
    assert sorted(part.source for part in document.parts) == ["a" * 200 + ".txt", "kept.py"]
    assert document.notes == ["repo: .gitignore: 2 rule(s) left out (not valid, or over 2 wildcards in one path "
                              "segment)"]


def test_gitignore_bracket_that_compiles_to_a_bad_regex_is_left_out(tmp_path):
    """Found by the fuzzer: pathspec turned "[a-[]" into a regex that re cannot compile (re.error)."""
    Path("repo").mkdir()
    Path("repo/.gitignore").write_text("*.log\n[a-[]x\n")
    Path("repo/a.log").write_text("log\n")
    Path("repo/a.py").write_text("x = 1\n")
    document = load_document(["repo"])
    assert [part.source for part in document.parts] == ["a.py"]
    assert document.notes == ["repo: .gitignore: 1 rule(s) left out (not valid, or over 2 wildcards in one path "
                              "segment)"]


def test_ignore_rules_of_a_folder_are_bounded(tmp_path, monkeypatch):
    from indexpool.ingest import code

    monkeypatch.setattr(code, "MAX_IGNORE_RULES", 3)
    Path("repo/sub").mkdir(parents=True)
    Path("repo/.gitignore").write_text("*.log\n*.tmp\n")
    Path("repo/sub/.gitignore").write_text("*.txt\n*.md\n")
    for name in ("a.log", "sub/b.txt", "sub/c.py"):
        Path("repo", name).write_text("text\n")
    document = load_document(["repo"])
    assert [part.source for part in document.parts] == ["sub/b.txt", "sub/c.py"]
    assert document.notes == ["repo: sub/.gitignore would take the folder's ignore rules over 3: its rules are not "
                              "applied"]


def test_folders_nested_deeper_than_the_limit_are_skipped_and_never_overflow_the_stack(tmp_path):
    from indexpool.ingest.code import MAX_FOLDER_DEPTH

    # Made and removed one level at a time: pathlib, os.makedirs and shutil.rmtree all recurse per level.
    folders = ["deep"]
    for _ in range(sys.getrecursionlimit() + 100):
        folders.append(os.path.join(folders[-1], "d"))
    for folder in folders:
        os.mkdir(folder)
    Path(folders[-1], "bottom.py").write_text("print('bottom')\n")
    Path(folders[MAX_FOLDER_DEPTH], "last.py").write_text("print('last')\n")
    try:
        document = load_document(["deep"])
    finally:
        os.remove(Path(folders[-1], "bottom.py"))
        os.remove(Path(folders[MAX_FOLDER_DEPTH], "last.py"))
        for folder in reversed(folders):
            os.rmdir(folder)
    assert [part.source for part in document.parts] == ["d/" * MAX_FOLDER_DEPTH + "last.py"]
    assert document.skipped == [("d/" * (MAX_FOLDER_DEPTH + 1), f"too deep (over {MAX_FOLDER_DEPTH} folders down)")]


# --- EPUB archives ---

def _rewrite_member(source: Path, target: Path, member: str, text: str | None = None, **info_changes) -> Path:
    """`source` with one member's text replaced, or its zip entry's fields (compress_type, flag_bits...) changed."""
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == member and text is not None:
                data = text.encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED if info.filename != "mimetype" else None)
    if info_changes:
        _patch_entry(target, member, **info_changes)
    return target


def _patch_entry(path: Path, member: str, compress_type: int | None = None, flag_bits: int | None = None,
                 file_size: int | None = None) -> None:
    """Overwrite fields of `member`'s local header and central directory entry, as a hostile archive would."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    # (signature, offset of the flags, of the method, of the uncompressed size, of the name length, header length)
    for signature, flags_at, method_at, size_at, name_len_at, header in ((b"PK\x03\x04", 6, 8, 22, 26, 30),
                                                                        (b"PK\x01\x02", 8, 10, 24, 28, 46)):
        start = 0
        while (start := data.find(signature, start)) >= 0:
            length = struct.unpack_from("<H", data, start + name_len_at)[0]
            if data[start + header:start + header + length] == name:
                if compress_type is not None:
                    struct.pack_into("<H", data, start + method_at, compress_type)
                if flag_bits is not None:
                    struct.pack_into("<H", data, start + flags_at, flag_bits)
                if file_size is not None:
                    struct.pack_into("<I", data, start + size_at, file_size)
            start += 4
    path.write_bytes(bytes(data))


def test_epub_zip_bomb_is_refused_by_its_declared_size(tmp_path):
    book = write_epub(tmp_path / "book.epub", CHAPTERS)
    # 5 MB of one letter packs into about 5 KB.
    bomb = _rewrite_member(book, tmp_path / "bomb.epub", "OEBPS/text/ch1.xhtml", "<p>" + "a" * 5_000_000 + "</p>")
    assert bomb.stat().st_size < 20_000
    message = "bomb.epub unpacks to over 1 MB of text, more than a book holds (a zip bomb?): not read"
    expect_error(["bomb.epub"], message, IngestOptions(max_total_bytes=1_000_000))
    assert load_document(["bomb.epub"]).parts[0].text.startswith("[Chapter 1]\naaaa")  # within the 50 MB default


def test_epub_unpacked_bytes_are_counted_over_all_members_as_read(tmp_path):
    book = write_epub(tmp_path / "book.epub", CHAPTERS)
    chapter = "<p>" + "b" * 600_000 + "</p>"
    two = _rewrite_member(book, tmp_path / "mid.epub", "OEBPS/text/ch1.xhtml", chapter)
    two = _rewrite_member(two, tmp_path / "two.epub", "OEBPS/text/ch2.xhtml", chapter)
    # Each chapter alone is under the limit: the second one read passes it.
    expect_error(["two.epub"], "two.epub unpacks to over 1 MB of text, more than a book holds (a zip bomb?): not read",
                 IngestOptions(max_total_bytes=1_000_000))


def test_epub_member_declaring_a_smaller_size_than_it_unpacks_to_is_damaged(tmp_path):
    # zipfile stops at the declared size, so the CRC of what it unpacked does not match.
    _rewrite_member(write_epub(tmp_path / "book.epub", CHAPTERS), tmp_path / "liar.epub", "OEBPS/text/ch1.xhtml",
                    "<p>" + "c" * 100_000 + "</p>", file_size=100)
    with pytest.raises(IngestError) as caught:
        load_document(["liar.epub"])
    assert str(caught.value).startswith("liar.epub is not a valid EPUB (damaged archive: Bad CRC-32")
    assert str(caught.value).endswith("): repair or re-export it")


def test_epub_with_deflate64_or_an_encrypted_member(tmp_path):
    book = write_epub(tmp_path / "book.epub", CHAPTERS)
    _rewrite_member(book, tmp_path / "d64.epub", "OEBPS/text/ch1.xhtml", compress_type=9)
    expect_error(["d64.epub"], "d64.epub uses deflate64 compression (OEBPS/text/ch1.xhtml), which cannot be unpacked "
                               "here: re-save it with ordinary zip compression, e.g. with Calibre")
    _rewrite_member(book, tmp_path / "locked.epub", "OEBPS/text/ch1.xhtml", flag_bits=1)
    expect_error(["locked.epub"], "locked.epub is password-protected (OEBPS/text/ch1.xhtml is encrypted): only EPUBs "
                                  "without encryption can be read")


def test_epub_with_too_many_archive_entries_is_refused_before_its_directory_is_read(tmp_path, monkeypatch):
    from indexpool.ingest import text

    monkeypatch.setattr(text, "MAX_EPUB_ENTRIES", 5)
    write_epub(tmp_path / "book.epub", CHAPTERS)  # 7 entries: mimetype, container, package, css, cover, 2 chapters
    expect_error(["book.epub"], "book.epub is not a valid EPUB (over 5 files in its archive)")


def test_epub_member_names_in_messages_are_escaped(tmp_path):
    book = write_epub(tmp_path / "book.epub", CHAPTERS)
    package = zipfile.ZipFile(book).read("OEBPS/content.opf").decode().replace('href="text/ch1.xhtml"',
                                                                                'href="text/ch%0A1.xhtml"')
    _rewrite_member(book, tmp_path / "odd.epub", "OEBPS/content.opf", package)
    expect_error(["odd.epub"], "odd.epub is not a valid EPUB (no OEBPS/text/ch\\n1.xhtml in the archive)")


# --- HTML ---

def test_html_marked_section_python_cannot_parse_is_passed_over(tmp_path):
    """Found by the fuzzer: Python's HTML parser raises AssertionError on "<![" followed by anything but a known
    keyword; a browser reads it as a bogus comment up to its ">"."""
    Path("page.html").write_text("<p>before</p><![\x01DATA[<p>after</p><![CDATA[x]]><p>end</p>")
    assert load_document(["page.html"]).text == "[page.html lines 1-5]\nbefore\n\nafter\n\nend\n"


# --- JSON: deep nesting and chat exports of the wrong shape ---

def test_deeply_nested_json_is_read_as_text_not_a_recursion_error(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    Path("deep.json").write_text(deep + "\n")
    Path("deep.jsonl").write_text(json.dumps({"role": "user", "content": "hi"}) + "\n" + deep + "\n")
    assert load_document(["deep.json"]).parts[0].cite == "deep.json:1"
    assert load_document(["deep.jsonl"]).parts[0].cite == "deep.jsonl:1-2"
    expect_error(["deep.json"], "deep.json does not look like a chat log (JSON or JSONL messages, a ChatGPT export, "
                                "or 'date time - name: text' lines): drop --format chat to read it as text",
                 IngestOptions(format="chat"))


@pytest.mark.parametrize("value", [
    [1, 2, 3], {"messages": 5}, {"messages": [None]}, [{"role": ["user"], "content": "x"}],
    [{"role": "user", "content": {"parts": {"parts": {"parts": "deep"}}}}],
    [{"role": "user", "content": 5}], [{"role": None, "content": None}],
    pytest.param("[" + "9" * 5000 + "]", id="an integer of 5000 digits"),
])
def test_json_that_is_not_a_chat_of_any_shape_is_read_as_text(tmp_path, value):
    text = value if isinstance(value, str) else json.dumps(value)
    Path("chat.json").write_text(text)
    assert load_document(["chat.json"]).text == f"[chat.json line 1]\n{text}\n"


@pytest.mark.parametrize("export", [
    [{"mapping": [1, 2]}], [{"mapping": None}], [{"mapping": {"a": 5, "b": [1]}}],
    [{"mapping": {"a": {"message": "text", "parent": ["x"], "children": 7}}, "current_node": ["a"]}],
    [{"mapping": {"a": {"message": {"author": "user", "content": 5}, "children": [None, {"x": 1}]}}}],
])
def test_chat_export_of_the_wrong_shape_without_messages_is_one_line_error(tmp_path, export):
    Path("conversations.json").write_text(json.dumps(export))
    expect_error(["conversations.json"], "conversations.json has no messages with text")


def test_chat_export_reads_the_messages_it_can_around_nodes_of_the_wrong_shape(tmp_path):
    export = chatgpt_export()[1:]  # "Recipe": b0 (user) -> b1 (assistant)
    mapping = export[0]["mapping"]
    mapping["junk"] = ["not", "a", "node"]
    mapping["b0"]["children"] = ["b1", None, ["unhashable"], "missing"]
    mapping["b1"]["message"]["author"] = {"role": ["assistant"]}  # no author, but its text is kept
    mapping["b1"]["message"]["create_time"] = 10 ** 400  # no time: too large for a date
    export[0]["title"] = {"not": "a title"}
    export[0]["current_node"] = ["b1"]  # not a node id: the newest replies are followed instead
    Path("conversations.json").write_text(json.dumps(export))
    assert [part.text for part in load_document(["conversations.json"]).parts] == [
        "=== Conversation 1 ===\nuser: Soup?\n", "Tomato.\n"]


def test_message_times_out_of_any_date_range_are_left_out(tmp_path):
    Path("chat.json").write_text('[{"role": "user", "content": "big", "timestamp": ' + "9" * 400 + '},'
                                 '{"role": "user", "content": "inf", "timestamp": 1e400},'
                                 '{"role": "user", "content": "nan", "timestamp": NaN}]')
    assert load_document(["chat.json"]).text == "user: big\nuser: inf\nuser: nan\n"


# --- GGUF headers ---

def gguf_header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def gguf_key(key: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode()


def tensor_info(name: str, dims: list[int], qtype: int = 0, offset: int = 0) -> bytes:
    return (gguf_key(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", qtype, offset))


@pytest.mark.parametrize("data, reason", [
    (gguf_header(2**63, 2**63) + bytes(64),
     "9,223,372,036,854,775,808 metadata entries and 9,223,372,036,854,775,808 tensors do not fit in its 88 bytes"),
    (gguf_header(0, 1) + struct.pack("<Q", 2**62) + bytes(64), "unexpected end of file"),
    (gguf_header(0, 1) + gguf_key("k") + struct.pack("<IIQ", 9, 8, 2**60) + bytes(64),
     "an array of 1,152,921,504,606,846,976 items does not fit in the 64 bytes left"),
    (gguf_header(0, 1) + gguf_key("k") + struct.pack("<IIQ", 9, 0, 2**40) + bytes(64),
     "an array of 1,099,511,627,776 items does not fit in the 64 bytes left"),
    (gguf_header(0, 1) + gguf_key("k") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000
     + struct.pack("<IQ", 0, 0), "metadata arrays nested over 4 deep"),
    (gguf_header(0, 1) + gguf_key("k") + struct.pack("<I", 99) + bytes(16), "unknown metadata value type 99"),
    (gguf_header(1, 0) + gguf_key("t") + struct.pack("<I", 2**31) + bytes(64),
     "tensor 't' has 2147483648 dimensions (at most 4)"),
    # 2^32 x 2^32 elements: 0 in 64-bit arithmetic, which would pass for a tensor of no bytes.
    (gguf_header(1, 0) + tensor_info("t", [2**32, 2**32]) + bytes(64), "tensor 't' runs past the end of the file"),
    (gguf_header(1, 0) + tensor_info("t", [2**40] * 4) + bytes(64), "tensor 't' runs past the end of the file"),
    (gguf_header(1, 0) + tensor_info("t", [4], qtype=77) + bytes(64), "tensor 't' has unknown type 77"),
    (gguf_header(1, 0) + tensor_info("t", [20, 2], qtype=2) + bytes(64),
     "tensor 't' has rows of 20, not whole Q4_0 blocks of 32"),
    (gguf_header(1, 0) + tensor_info("t", [4], offset=3) + bytes(64), "tensor 't' is not aligned to 32 bytes"),
    (gguf_header(2, 0) + tensor_info("t", [1]) + tensor_info("t", [1], offset=32) + bytes(96),
     "tensor 't' is listed twice"),
    (gguf_header(0, 1) + gguf_key("general.alignment") + struct.pack("<II", 4, 0) + bytes(8),
     "general.alignment is 0, not a power of two"),
    (gguf_header(1, 0) + tensor_info("a\nb", [4096]) + bytes(64), "tensor 'a\\nb' runs past the end of the file"),
], ids=lambda value: "" if isinstance(value, bytes) else value[:40])
def test_gguf_header_counts_and_sizes_are_checked_before_anything_is_allocated(tmp_path, data, reason):
    Path("bad.gguf").write_bytes(data)
    expect_load_error("bad.gguf", f"bad.gguf is truncated or corrupt and cannot be read as GGUF ({reason})")


def test_a_model_path_that_is_a_pipe_or_a_device_is_refused(tmp_path):
    os.mkfifo("model.gguf")
    advice = "is not a regular file: give a .gguf file or a Hugging Face model directory"
    expect_load_error("model.gguf", f"model.gguf {advice}")
    expect_load_error("/dev/zero", f"/dev/zero {advice}")


@pytest.mark.parametrize("changes, message", [
    ({"llama.context_length": (2**62, GGUFValueType.UINT64)},
     "'llama.context_length' is 4611686018427387904, not a whole number from 1 to 16,777,216"),
    ({"llama.embedding_length": (2**40, GGUFValueType.UINT64)},
     "'llama.embedding_length' is 1099511627776, not a whole number from 1 to 65,536"),
    ({"llama.attention.head_count": (0, GGUFValueType.UINT32)},
     "'llama.attention.head_count' is 0, not a whole number from 1 to 1,024"),
    ({"llama.block_count": ("two", GGUFValueType.STRING)},
     "'llama.block_count' is 'two', not a whole number from 1 to 1,024"),
    ({"llama.rope.freq_base": (float("nan"), GGUFValueType.FLOAT32)},
     "'llama.rope.freq_base' is nan, not a number above 0"),
    ({"llama.attention.head_count_kv": (3, GGUFValueType.UINT32)},
     "2 attention heads cannot be shared by 3 key/value heads (it must divide them)"),
    ({"llama.attention.key_length": (5, GGUFValueType.UINT32)}, "the head dimension 5 is odd; RoPE rotates pairs"),
    ({"llama.context_length": (2**24, GGUFValueType.UINT32), "llama.attention.key_length": (16, GGUFValueType.UINT32)},
     "a context of 16,777,216 tokens with heads of 16 needs RoPE tables over 134,217,728 entries: is it damaged?"),
    ({"llama.block_count": (1000, GGUFValueType.UINT32)},
     "tensor 'blk.1.attn_norm.weight' is missing; the file is incomplete or not a llama-family model"),
    ({"llama.vocab_size": (4_000_000, GGUFValueType.UINT32)},
     "tensor 'token_embd.weight' has shape (8, 8), but the metadata gives (4000000, 8): the file is damaged"),
    ({"tokenizer.ggml.tokens": None}, "required metadata 'tokenizer.ggml.tokens' is missing"),
    ({"tokenizer.ggml.bos_token_id": ("first", GGUFValueType.STRING)},
     "metadata 'tokenizer.ggml.bos_token_id' is not a token id"),
    ({"tokenizer.ggml.token_type": (["a"] * 8, GGUFValueType.ARRAY)},
     "metadata 'tokenizer.ggml.token_type' is not a list of integers"),
])
def test_gguf_metadata_of_the_wrong_type_or_absurd_sizes_is_one_line_error(tmp_path, changes, message):
    Path("model.gguf").write_bytes(tiny_gguf_bytes(tmp_path, changes))
    expect_load_error("model.gguf", f"model.gguf: {message}")


def test_gguf_architecture_names_are_escaped(tmp_path):
    Path("model.gguf").write_bytes(tiny_gguf_bytes(tmp_path, arch="evil\narch"))
    expect_load_error("model.gguf", "unsupported model architecture 'evil\\narch' in model.gguf "
                                    "(supported: llama, mistral, qwen2, qwen3)")


# --- Hugging Face directories: config.json and safetensors ---

@pytest.mark.parametrize("config, message", [
    ([1, 2], "{config} holds an array, not a JSON object of settings"),
    (None, "{config} holds null, not a JSON object of settings"),
    ({"model_type": ["llama"]}, "unsupported model architecture ['llama'] in {folder} (supported: llama, mistral, "
                                "qwen2, qwen3)"),
    ({"hidden_size": -5}, "{config}: 'hidden_size' is -5, not a whole number from 1 to 65,536"),
    ({"intermediate_size": "16"}, "{config}: 'intermediate_size' is '16', not a whole number from 1 to 1,048,576"),
    ({"num_hidden_layers": [1]}, "{config}: 'num_hidden_layers' is [1], not a whole number from 1 to 1,024"),
    ({"vocab_size": 10**12}, "{config}: 'vocab_size' is 1000000000000, not a whole number from 1 to 4,194,304"),
    ({"max_position_embeddings": 10**15},
     "{config}: 'max_position_embeddings' is 1000000000000000, not a whole number from 1 to 16,777,216"),
    ({"rms_norm_eps": "small"}, "{config}: 'rms_norm_eps' is 'small', not a number 0 or more"),
    ({"rope_scaling": [1]}, "{config}: 'rope_scaling' is [1], not an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "{config}: required metadata 'rope_scaling.original_max_position_embeddings' is missing"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "x", "original_max_position_embeddings": 8}},
     "{config}: 'rope_scaling.factor' is 'x', not a number above 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8,
                       "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     "{config}: rope_scaling's high_freq_factor is not above its low_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn\n"}}, "unsupported RoPE scaling 'yarn\\n' in {config}"),
    # Sizes each within bounds, together a 7B model: not the tiny weights beside it, and never allocated.
    ({"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000},
     "{config} describes a model of 6,738,415,616 weights, more than the 4,024 bytes of its .safetensors files "
     "hold: it does not belong to them"),
])
def test_hf_config_of_the_wrong_shape_is_one_line_error(tmp_path, config, message):
    if isinstance(config, dict):
        config = {**tiny_hf_config(), **config}
    folder = hf_directory(tmp_path, config=json.dumps(config).encode())
    expect_load_error(folder, message.format(config=folder / "config.json", folder=folder))


def test_hf_config_ignores_a_text_config_that_is_not_an_object(tmp_path):
    folder = hf_directory(tmp_path, config=json.dumps({**tiny_hf_config(), "text_config": 5}).encode())
    assert load_model(folder, torch.float32).config.dim == tiny_hf_config()["hidden_size"]


def test_hf_config_that_is_not_json_a_pipe_or_too_large(tmp_path, monkeypatch):
    from indexpool.model import loader

    folder = hf_directory(tmp_path, config=b"[" * 100_000 + b"]" * 100_000)
    expect_load_error(folder, f"{folder / 'config.json'} is not valid JSON: maximum recursion depth exceeded while "
                              f"decoding a JSON array from a unicode string")
    (folder / "config.json").write_text('{"vocab_size": ' + "9" * 5000 + "}")
    with pytest.raises(ModelLoadError, match=r"config.json is not valid JSON: Exceeds the limit \(4300 digits\)"):
        load_model(folder, torch.float32)
    monkeypatch.setattr(loader, "MAX_JSON_BYTES", 100)
    (folder / "config.json").write_text(json.dumps(tiny_hf_config()))
    expect_load_error(folder, f"{folder / 'config.json'} is over 100 bytes: too large for a model's JSON file")
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    expect_load_error(folder, f"{folder / 'config.json'} is not a regular file")


def test_broken_safetensors_and_shard_indexes_are_one_line_errors(tmp_path):
    folder = hf_directory(tmp_path, weights=struct.pack("<Q", 2**40) + b"{}" + bytes(4000))
    expect_load_error(folder, f"cannot read weights {folder / 'model.safetensors'}: Error while deserializing header: "
                              "header too large")
    good = hf_directory(tmp_path)
    index = good / "model.safetensors.index.json"
    for weight_map in ({"model.norm.weight": "../../etc/passwd"}, {"model.norm.weight": 5}, [1]):
        index.write_text(json.dumps({"weight_map": weight_map}))
        expect_load_error(good, f"{index}: 'weight_map' must map tensor names to file names in {good}")
    # A tensor the index places in a shard that does not hold it.
    index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "other.safetensors"}}))
    (good / "other.safetensors").write_bytes(save({"something.else": torch.zeros(1)}))
    with pytest.raises(ModelLoadError) as caught:
        load_model(good, torch.float32)
    assert str(caught.value).startswith(f"cannot read tensor 'model.embed_tokens.weight' from "
                                        f"{good / 'other.safetensors'}: ")
    assert "\n" not in str(caught.value)
    index.unlink()
    (good / "other.safetensors").unlink()
    (good / "model.safetensors").unlink()
    os.mkfifo(good / "model.safetensors")
    (good / "padding.safetensors").write_bytes(bytes(10_000))  # so that the weights' bytes fit the config
    expect_load_error(good, f"cannot read weights {good / 'model.safetensors'}: not a regular file")


@pytest.mark.parametrize("config, message", [
    ({"num_hidden_layers": 10**9}, "'num_hidden_layers' is 1000000000, not a whole number from 1 to 1,024"),
    ({"linear_attn_config": [1]}, "'linear_attn_config' is [1], not an object"),
    ({"hidden_size": "big"}, "'hidden_size' is 'big', not a whole number from 1 to 16,777,216"),
    ({"linear_attn_config": {"num_heads": -1}},
     "'linear_attn_config.num_heads' is -1, not a whole number from 1 to 16,777,216"),
    ({"layer_types": "linear_attention"}, "'layer_types' is 'linear_attention', not a list of names"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' is 'yes', not true or false"),
    ({"num_hidden_layers": 4, "quantization_config": {"weight_block_size": [0, 0]}},
     "'weight_block_size' is [0, 0], not two whole numbers"),
    ({"num_hidden_layers": 4, "quantization_config": [1]}, "'quantization_config' is [1], not an object"),
])
def test_glm5_next_config_of_the_wrong_shape_is_one_line_error(tmp_path, config, message):
    folder = hf_directory(tmp_path, config=json.dumps({"model_type": "glm5_next", "index_kpool": 4,
                                                        **config}).encode())
    expect_load_error(folder, f"{folder / 'config.json'}: {message}")


def test_control_characters_in_file_names_are_escaped_where_shown(tmp_path):
    """A file name holding an escape sequence or a line break is shown escaped (its header, citations, notes of
    files skipped), so it cannot recolour a terminal or split a "Sources:" line; each part keeps the real path as
    its source."""
    red, broken, empty = "\x1b[31mred.txt", "new\nline.txt", "\x07bell.txt"
    (tmp_path / red).write_text("The retry policy is configured in settings.\n")
    (tmp_path / broken).write_text("Other notes.\n")
    (tmp_path / empty).write_text("")
    folder = load_document([str(tmp_path)])
    single = load_document([str(tmp_path / red)])
    parts = folder.parts + single.parts
    assert sorted(part.source for part in folder.parts) == sorted([broken, red])
    assert single.parts[0].source == str(tmp_path / red)
    for part in parts:
        assert part.cite.isprintable() and part.text.split("\n")[0].isprintable()
    assert any("\\x1b[31mred.txt" in part.cite for part in folder.parts)
    assert any("new\\nline.txt" in part.cite for part in folder.parts)
    assert [name for name, _ in folder.skipped] == ["\\x07bell.txt"]
