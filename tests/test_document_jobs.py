"""`ask`, `summarize`, `complete --file` and `cache` as a user runs them, on inputs built here: a text file with a
planted fact, a generated PDF, a small folder, stdin; the document cache (reuse, a damaged entry, list, clear); and
every kind of bad input with its one-line error and exit code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from doc_fixtures import encrypted_pdf_bytes, pdf_bytes, write_planted_report
from test_cli import assert_error, cli_env, indexpool, ok

FACT = "The access code of the glass tower is 41729."
QUESTION = "What is the access code of the glass tower?"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """About 1,500 tokens of prose with the fact in the middle."""
    return write_planted_report(tmp_path_factory.mktemp("docs"), FACT, topics=6, lines=160)


@pytest.fixture(scope="module")
def short_report(tmp_path_factory) -> Path:
    """About 650 tokens, the fact in the middle: for the tests that need no longer document (each read costs)."""
    return write_planted_report(tmp_path_factory.mktemp("short-docs"), FACT, topics=6, lines=70)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("doc-cache")


@pytest.fixture(scope="module")
def first_and_second_ask(report, cache_dir):
    args = ("ask", str(report), QUESTION, "--json", "--quiet", "--cache-dir", str(cache_dir), "-n", "24")
    first = json.loads(ok(indexpool(*args)))
    second = json.loads(ok(indexpool(*args)))
    return first, second


def test_ask_answers_from_the_document_and_cites_the_fact_line(first_and_second_ask, report):
    first, _ = first_and_second_ask
    # The default model's answer is extracted (--answer auto): the passage the question points to, cited.
    assert "41729" in first["text"] and FACT in first["text"] and first["stop_reason"] == "extracted"
    assert first["tokens"]["document"] > 1000 and first["tokens"]["new"] == 0
    assert first["sources"], first
    fact_line = report.read_text().splitlines().index(FACT) + 1
    start, end = map(int, first["sources"][0]["cite"].rsplit(":", 1)[1].split("-"))
    assert start <= fact_line <= end, first["sources"]
    # The question's words and reading found the fact's lines, which were quoted to the model before it answered,
    # and the source gives them with its structured location.
    quoted = first["quotes"][0]
    assert FACT in quoted["text"] and quoted["cite"] == first["sources"][0]["cite"]
    assert first["sources"][0]["location"] == quoted["location"] == {"lines": [start, end]}
    assert FACT in first["sources"][0]["text"] and first["sources"][0]["source"] == str(report)


def test_ask_with_a_generated_answer(report, cache_dir):
    out = json.loads(ok(indexpool("ask", str(report), QUESTION, "--answer", "generate", "--json", "--quiet",
                                  "--cache-dir", str(cache_dir), "-n", "24")))
    assert out["tokens"]["new"] >= 1 and out["stop_reason"] != "extracted"
    assert FACT in out["quotes"][0]["text"]  # quoted to the model before it wrote its answer
    assert "41729" in out["text"]


def test_ask_without_the_quote(short_report):
    out = json.loads(ok(indexpool("ask", str(short_report), QUESTION, "--no-quote", "--json", "--quiet", "--no-cache",
                                  "-n", "8")))
    assert out["quotes"] == [] and out["sources"]
    assert out["request"] == f"Question: {QUESTION}\nAnswer in one short sentence, with the exact words of the document above."


def test_second_ask_restores_the_document_from_the_cache(first_and_second_ask):
    first, second = first_and_second_ask
    assert not first["cached"] and second["cached"]
    assert second["text"] == first["text"]  # the restored state is the state: greedy answers match
    assert second["sources"] == first["sources"]


def test_cache_list_and_clear(first_and_second_ask, cache_dir):
    listed = [json.loads(line) for line in ok(indexpool("cache", "list", "--json", "--cache-dir", str(cache_dir))).splitlines()]
    # The read document, and the neutral question's evidence its sources are ranked against.
    assert sorted(e["description"].endswith("evidence baseline") for e in listed) == [False, True]
    assert all("report.txt" in e["description"] and e["bytes"] > 0 for e in listed)
    ok(indexpool("cache", "clear", "--cache-dir", str(cache_dir)))
    assert ok(indexpool("cache", "list", "--json", "--cache-dir", str(cache_dir))) == ""


def test_a_damaged_cache_entry_is_rebuilt_with_a_warning(report, tmp_path):
    args = ("ask", str(report), QUESTION, "--json", "--cache-dir", str(tmp_path), "-n", "8")
    first = json.loads(ok(indexpool(*args)))
    entry = max(tmp_path.glob("*.safetensors"), key=lambda p: p.stat().st_size)  # the document, not its baseline
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # truncated
    proc = indexpool(*args)
    again = json.loads(ok(proc))
    assert "unusable" in proc.stderr.decode() and not again["cached"]
    assert again["text"] == first["text"]
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # rebuilt, beside the baseline


def test_several_questions_read_the_document_once(short_report, tmp_path):
    out = ok(indexpool("ask", str(short_report), QUESTION, "-Q", "What is the glass tower?", "--json", "--quiet",
                       "--no-cache", "-n", "8"))
    results = [json.loads(line) for line in out.splitlines()]
    assert [q in r["request"] for r, q in zip(results, (QUESTION, "What is the glass tower?"))] == [True, True]
    assert results[1]["timings"]["read_seconds"] < results[0]["timings"]["read_seconds"]


def test_questions_answered_as_one_batch_match_one_by_one(short_report, tmp_path):
    """Several questions decode as branches of the held document; each answer and its sources are those the
    question gets asked alone. In fp32: in bf16 the batch's kernels round differently from one question's (other
    matmul shapes, bf16 weights for more than four rows), which can flip a near-tied greedy choice. The file is
    named from its own folder: the prompt holds its name, and pytest's numbered temporary folders would make the
    prompt differ from run to run (two sources' shares can be that close). The shares (given to 4 decimals) agree to
    1.5e-4: an answer cut at -n counts the same queries both ways (when the forward of its last token counted too
    alone, they differed by up to 0.0022). The batch reads the document; the questions alone restore it from the
    document cache (the state it saved)."""
    questions = [QUESTION, "What is the glass tower?", "What does the pass statement do?"]
    args = ("--json", "--quiet", "--cache-dir", str(tmp_path), "-n", "16", "--dtype", "fp32", "--answer", "generate")
    folder, name = short_report.parent, short_report.name
    out = ok(indexpool("ask", name, questions[0], "-Q", questions[1], "-Q", questions[2], *args, cwd=folder))
    batched = [json.loads(line) for line in out.splitlines()]
    alone = [json.loads(ok(indexpool("ask", name, q, *args, cwd=folder))) for q in questions]
    assert all(r["cached"] for r in alone)
    assert [r["text"] for r in batched] == [r["text"] for r in alone]
    assert [[s["cite"] for s in r["sources"]] for r in batched] == [[s["cite"] for s in r["sources"]] for r in alone]
    assert "41729" in batched[0]["text"]
    assert any(r["tokens"]["new"] == 16 for r in alone), "no answer was cut at -n: the check below needs one"
    for b, a in zip(batched, alone):
        assert [s["share"] for s in b["sources"]] == pytest.approx([s["share"] for s in a["sources"]], abs=1.5e-4)


def test_ask_reads_stdin(short_report):
    out = ok(indexpool("ask", "-", QUESTION, "--quiet", "--no-cache", "-n", "24", stdin=short_report.read_bytes()))
    assert "41729" in out
    assert "Sources: stdin:" in out


def test_summarize_a_pdf_cites_pages(tmp_path):
    pages = [[f"Page {n} is about the harbour of town {n}.", "Ships arrive every morning."] for n in range(1, 4)]
    path = tmp_path / "harbours.pdf"
    path.write_bytes(pdf_bytes(pages))
    result = json.loads(ok(indexpool("summarize", str(path), "--length", "short", "--json", "--quiet", "--no-cache",
                                     "-n", "30", "--summary", "generate")))
    assert result["text"].strip() and result["tokens"]["new"] >= 1
    assert result["sources"] and all(s["cite"].startswith(f"{path} p. ") for s in result["sources"])


def test_summarize_gives_the_default_model_an_outline_citing_each_section(tmp_path):
    """The default model (under 1B parameters) gets an extracted outline (`--summary auto`): one line per
    top-level section with its title, its citation and its sentence; --json gives each as a source."""
    path = tmp_path / "glimmer.md"
    path.write_text("# Glimmer\n\nGlimmer renders vector maps from tile archives on the command line.\n\n"
                    "## Installing\n\nInstall the glimmer package with the package manager of your system.\n\n"
                    "## Options\n\nThe --zoom option picks the zoom level of every rendered tile.\n")
    result = json.loads(ok(indexpool("summarize", str(path), "--json", "--quiet", "--no-cache")))
    assert result["stop_reason"] == "extracted" and result["tokens"]["new"] == 0
    assert [s["title"] for s in result["sources"]] == ["Glimmer", "Installing", "Options"]
    assert all("lines" in s["location"] for s in result["sources"]) and "--zoom" in result["sources"][2]["text"]
    lines = ok(indexpool("summarize", str(path), "--quiet", "--no-cache")).splitlines()
    assert lines[2].startswith(f"- Options ({path}:") and lines[2].endswith("zoom level of every rendered tile.")
    assert len(lines) == 3  # the items cite their sources: no "Sources:" line


def test_ask_a_pdf_extracts_and_cites_the_page_with_its_location(tmp_path):
    """A short PDF (its words decide: a document this short has no neutral question's baseline): the answer is the
    passage of the page that holds the fact, cited with its page as a structured location and the passage's text."""
    pages = [["The harbour office opens at six.", "Ships unload grain at the north pier."],
             ["The lighthouse keeper is Ilse Morrow.", "She keeps the lamp lit all night."],
             ["The ferry to Kelp Island leaves from pier 12.", "Tickets cost four crowns."]]
    path = tmp_path / "harbour.pdf"
    path.write_bytes(pdf_bytes(pages))
    result = json.loads(ok(indexpool("ask", str(path), "Who is the lighthouse keeper?", "--json", "--quiet",
                                     "--no-cache")))
    assert "Ilse Morrow" in result["text"] and result["stop_reason"] == "extracted"
    first = result["sources"][0]
    assert first["location"] == {"page": 2} and first["cite"] == f"{path} p. 2" and first["source"] == str(path)
    assert "Ilse Morrow" in first["text"] and result["quotes"][0]["location"] == {"page": 2}


def write_notes(directory: Path) -> list[Path]:
    """Three short notes on different subjects, each well inside the model's context."""
    subjects = [("harbour", "Ships arrive every morning and leave at dusk."),
                ("orchard", "The apple trees are pruned in late winter."),
                ("library", "Books are returned to the front desk before noon.")]
    paths = []
    for name, line in subjects:
        path = directory / f"{name}.txt"
        path.write_text("\n".join(f"Note {i} about the {name}: {line}" for i in range(1, 9)) + "\n")
        paths.append(path)
    return paths


def test_summarize_several_inputs_gives_each_its_summary_decoded_as_one_batch(tmp_path):
    """Each input gets its own summary, in order, labelled with its path; those that fit the model's context are
    decoded as one dense batch, and in fp32 each is the summary the input gets alone (one pass, dense attention
    as IndexPool gives it while everything fits). fp32 throughout: `--decode-weights off` also keeps the K/V cache
    fp32 (a bf16 one rounds the last-bit differences of a batch's sums to neighbouring values)."""
    paths = [str(p) for p in write_notes(tmp_path)]
    args = ("--length", "short", "--json", "--quiet", "--no-cache", "-n", "20", "--dtype", "fp32",
            "--decode-weights", "off", "--summary", "generate")
    results = [json.loads(line) for line in ok(indexpool("summarize", *paths, *args)).splitlines()]
    assert [r["path"] for r in results] == paths
    alone = [json.loads(ok(indexpool("summarize", path, *args))) for path in paths]
    assert [r["text"] for r in results] == [r["text"] for r in alone]
    for result, path in zip(results, paths):
        assert result["tokens"]["new"] >= 1 and any("decoded in a batch" in note for note in result["notes"])
        assert all(source["source"] == path for source in result["sources"])  # each cites its own input
    text = ok(indexpool("summarize", *paths, "--length", "short", "--quiet", "--no-cache", "--summary", "extract"))
    assert [line for line in text.splitlines() if line.startswith("==> ")] == [f"==> {p} <==" for p in paths]


def test_summarize_together_reads_several_inputs_as_one_document(tmp_path):
    paths = [str(p) for p in write_notes(tmp_path)]
    out = ok(indexpool("summarize", *paths, "--together", "--length", "short", "--json", "--quiet", "--no-cache",
                       "-n", "8", "--summary", "generate"))
    (result,) = [json.loads(line) for line in out.splitlines()]
    assert "path" not in result and result["tokens"]["document"] > 3 * 60


def test_complete_inside_a_file_of_a_folder(tmp_path):
    (tmp_path / "util.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "app.py").write_text("from util import double\n\n\ndef main():\n    print(double(21))\n")
    proc = indexpool("complete", str(tmp_path), "--file", "app.py", "--line", "4", "--json", "--quiet",
                     "--temperature", "0", "-n", "6")
    result = json.loads(ok(proc))
    assert result["prompt_tokens"] > 20 and result["new_tokens"] >= 1
    line = assert_error(indexpool("complete", str(tmp_path), "--file", "missing.py", "--quiet"), 3)
    assert "missing.py" in line


def bad_input(kind: str, d: Path) -> Path:
    """Build one kind of unusable input in d."""
    if kind == "missing":
        return d / "nowhere.txt"
    if kind == "directory":
        (d / "nothing").mkdir()
        (d / "nothing" / "x.bin").write_bytes(b"\x00" * 64)
        return d / "nothing"
    name, data = {"empty": ("empty.txt", b""), "binary": ("blob.txt", b"\x00\x01\x02" * 500),
                  "docx": ("letter.docx", b"PK\x03\x04"),
                  "encrypted": ("locked.pdf", encrypted_pdf_bytes([["secret"]], "pw", "AES-256"))}[kind]
    (d / name).write_bytes(data)
    return d / name


@pytest.mark.parametrize("kind, expected", [("missing", "no such file"), ("empty", "empty"), ("binary", "binary"),
                                            ("docx", "not supported"), ("encrypted", "--password"),
                                            ("directory", "nothing")])
def test_bad_inputs_give_one_line_and_exit_3(tmp_path, kind, expected):
    line = assert_error(indexpool("ask", str(bad_input(kind, tmp_path)), "what?", "--quiet", "--no-cache"), 3)
    assert expected in line, line


def test_usage_errors_exit_2(report):
    for args in (["ask", str(report)], ["ask", str(report), " "], ["summarize", str(report), "--length", "huge"],
                 ["ask", str(report), "q", "--answer", "bogus"], ["summarize", str(report), "--summary", "bogus"],
                 ["complete", "text", "--line", "3"]):
        assert_error(indexpool(*args, "--quiet"), 2)


def test_an_input_beyond_the_memory_budget_is_refused(report):
    proc = indexpool("ask", str(report), QUESTION, "--quiet", "--no-cache",
                     env=cli_env(INDEXPOOL_MEMORY_LIMIT="1000000"))
    line = assert_error(proc, 3)
    assert "GiB" in line and "--offload-dir" in line


def test_defaults_from_the_config_file_and_the_environment(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('temperature = 0\n\n[complete]\nmax_new_tokens = 3\n')
    result = json.loads(ok(indexpool("complete", "--json", "--quiet", "Once upon a time",
                                     env=cli_env(INDEXPOOL_CONFIG=str(config)))))
    assert result["new_tokens"] <= 3
    result = json.loads(ok(indexpool("complete", "--json", "--quiet", "Once upon a time",
                                     env=cli_env(INDEXPOOL_CONFIG=str(config), INDEXPOOL_COMPLETE_MAX_NEW_TOKENS="1"))))
    assert result["new_tokens"] == 1  # the environment beats the file
    config.write_text('[complete]\njson = true\nmax_new_tokens = 2\n')  # an option's own name: --json's parameter is json_out
    assert json.loads(ok(indexpool("complete", "--quiet", "Once", env=cli_env(INDEXPOOL_CONFIG=str(config)))))["new_tokens"] <= 2
    config.write_text('[complete]\nmax_new_tokenz = 3\n')
    proc = indexpool("complete", "hello", env=cli_env(INDEXPOOL_CONFIG=str(config)))
    line = assert_error(proc, 2)
    assert "max_new_tokenz" in line
    config.write_text('[complete]\nmax_new_tokens = "lots"\n')  # a bad value says where it was given
    line = assert_error(indexpool("complete", "hello", env=cli_env(INDEXPOOL_CONFIG=str(config))), 2)
    assert f"(from the config file {config})" in line, line
    line = assert_error(indexpool("complete", "hello", env=cli_env(INDEXPOOL_COMPLETE_MAX_NEW_TOKENS="lots")), 2)
    assert "(from the environment variable INDEXPOOL_COMPLETE_MAX_NEW_TOKENS)" in line, line
    line = assert_error(indexpool("complete", "hello", env=cli_env(INDEXPOOL_THREADS="two")), 2)
    assert "(from the environment variable INDEXPOOL_THREADS)" in line, line
    for named, says in ((tmp_path / "missing.toml", "not found"), (tmp_path, "not a regular file")):
        line = assert_error(indexpool("complete", "hello", env=cli_env(INDEXPOOL_CONFIG=str(named))), 2)
        assert f"config file {named}: {says}" in line


def test_chat_about_a_document_reads_it_once(short_report):
    turns = f"{QUESTION}\nAnd what is the glass tower?\nThank you.\n".encode()
    out = ok(indexpool("chat", str(short_report), "--json", "--quiet", "--no-cache", "--temperature", "0", "-n", "16",
                       stdin=turns))
    replies = [json.loads(line) for line in out.splitlines()]
    assert len(replies) == 3
    document_tokens = replies[0]["tokens"]["document"]
    assert document_tokens > 500
    assert "41729" in replies[0]["text"] and replies[0]["sources"]
    # The document was read before the first message; each turn feeds only its own message (and the last reply).
    assert all(r["fed_tokens"] < 60 for r in replies), [r["fed_tokens"] for r in replies]
    assert replies[2]["tokens"]["prompt"] > replies[1]["tokens"]["prompt"] > replies[0]["tokens"]["prompt"]


def test_hierarchical_summary_summarizes_sections_then_cites_them(report):
    result = json.loads(ok(indexpool("summarize", str(report), "--strategy", "hierarchical", "--section-tokens", "400",
                                     "--json", "--quiet", "-n", "24", "--summary", "generate")))
    assert result["text"].strip() and result["tokens"]["document"] > 1000
    (note,) = [n for n in result["notes"] if n.startswith("hierarchical")]
    assert int(note.split()[1]) >= 3  # sections of at most 400 tokens
    assert result["sources"] and all(" to " in s["cite"] or s["cite"].startswith(str(report)) for s in result["sources"])
