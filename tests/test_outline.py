"""Extractive outlines (indexpool_cli/outline.py): sections from each kind of structure a document has, the
sentence each item shows, titles of merged sections, and documents with no structure at all."""

from __future__ import annotations

from indexpool.ingest import Document, Part
from indexpool.ingest.code import code_parts
from indexpool.ingest.text import html_to_text, text_parts
from indexpool.outline import common_ends, group_title, outline, outline_text


def text_document(text: str, name: str = "doc.txt") -> Document:
    return Document(text_parts(text, name, name), [], [])


def pdf_document(pages: list[str]) -> Document:
    return Document([Part(f"[Page {n}]\n{text}\n", "m.pdf", f"m.pdf p. {n}", page=n)
                     for n, text in enumerate(pages, start=1)], [], [])


FILLER = "The committee met again to review the schedule for the coming weeks in detail."


def test_numbered_headings_of_a_pdf_manual_skip_its_table_of_contents():
    toc = "Table of Contents\n" + "\n".join(f"{n} {t} . . . . . . . . {n + 2}" for n, t in
                                           enumerate(["Overview", "Installing", "Options", "Errors"], start=1))
    toc += "\n2.1 Packages . . . . . 3\n3.1 Flags . . . . . 4"
    pages = [
        toc,
        "1 Overview\nGlimmer renders vector maps from tile archives on the command line.\n" + FILLER,
        "2 Installing\nInstall the glimmer package with your system's package manager before first use.\n"
        "2.1 Packages\nBinary packages exist for Debian and Fedora.\n" + FILLER,
        "3 Options\nThe --zoom option picks the zoom level of every rendered tile.\n3.1 Flags\n" + FILLER,
        "4 Errors\nA missing tile archive makes glimmer exit with status 3 and a message.\n" + FILLER,
    ]
    document = pdf_document(pages)
    items = outline(document)
    assert [item.title.split(" (")[0] for item in items] == ["1 Overview", "2 Installing", "3 Options", "4 Errors"]
    assert items[1].title == "2 Installing (2.1 Packages)"  # the level below, in the title
    assert "renders vector maps" in items[0].text and items[0].part == 1  # page 2: the TOC page is not cited
    assert "--zoom option" in items[2].text and "status 3" in items[3].text
    text = outline_text(items, document)
    assert text.splitlines()[0].startswith("- 1 Overview (m.pdf p. 2): Glimmer renders")
    assert outline(document, "short")[1].title == "2 Installing"  # short: no subheadings


def test_unnumbered_chapters_are_found_from_the_table_of_contents():
    """A manual whose chapters have no numbers: its contents page names them, each is found where it starts (in
    the contents' order), and a running header repeating a title later is not taken for its start."""
    toc = "Contents\n" + "\n".join(f"{title} . . . . . . . {page}" for title, page in
                                    [("Getting Started", 2), ("Configuring Routes", 3), ("Troubleshooting", 4),
                                     ("Glossary", 5), ("Acknowledgements", 5), ("Index", 6)])
    pages = [
        toc,
        "Getting Started\nOrrery draws planetary routes for small observatories and their visitors.\n" + FILLER,
        "Getting Started\n" + FILLER + "\nConfiguring Routes\nA route file lists the bodies a tour visits in order.",
        "Troubleshooting\nA missing ephemeris file stops the tour with a clear message.\n" + FILLER,
        "Glossary\nAn ephemeris gives the positions of the bodies at given times.\n" + FILLER,
    ]
    items = outline(pdf_document([pages[0]] + [page + f"\n{FILLER}" * 4 for page in pages[1:]]))
    assert [item.title for item in items] == ["Getting Started", "Configuring Routes", "Troubleshooting", "Glossary"]
    assert items[0].part == 1 and "planetary routes" in items[0].text and "route file" in items[1].text


def test_a_numbered_list_item_is_not_a_heading_and_numbers_must_run_in_sequence():
    text = ("1 Basics\nKestrel is a scheduler for batch jobs on small clusters of machines.\n\n"
            "1. The job file is read\nand checked before anything runs on the cluster.\n\n"
            "7 Reasons to upgrade\n" + FILLER + "\n\n2 Queues\nEvery job waits in a queue until a node is free.\n")
    items = outline(text_document(text))
    assert [item.title for item in items] == ["1 Basics", "2 Queues"]


def test_markdown_headings_from_html_and_the_text_under_a_single_title():
    html = ("<html><body><nav><ul><li>Home</li><li>About</li></ul></nav><h1>Tern <a href='#t'>#</a></h1>"
            "<p>Tern is a library for parsing binary logs quickly and safely.</p>"
            "<h2>Reading</h2><p>The reader yields one record per call until the log ends.</p>"
            "<h3>Buffers</h3><p>" + FILLER + "</p>"
            "<h2>Writing</h2><p>The writer appends records and flushes them on close.</p></body></html>")
    text, _ = html_to_text(html)
    assert "# Tern" in text and "## Reading" in text and "### Buffers" in text
    items = outline(text_document(text, "tern.html"))
    assert [item.title for item in items] == ["Tern", "Reading (Buffers)", "Writing"]
    assert "parsing binary logs" in items[0].text and "Home" not in outline_text(items, text_document(text))


def test_underlined_headings_rank_by_the_order_their_characters_appear():
    text = ("Ledger Guide\n************\n\nLedger keeps double-entry accounts in plain text files.\n\n"
            "Accounts\n========\n\nAn account is opened by its first posting in a journal.\n\n"
            "Reports\n*******\n\nReports sum the postings of every account over a period.\n\n"
            "Balances\n========\n\n" + FILLER + "\n")
    items = outline(text_document(text))
    assert [item.title for item in items] == ["Ledger Guide (Accounts)", "Reports (Balances)"]


def test_code_files_give_their_docstring_and_definitions():
    files = {
        "pkg/store.py": '"""Key-value storage on disk with atomic writes and a write-ahead log."""\n\n'
                        "class Store:\n    def get(self, key):\n        return None\n\n\n"
                        "def open_store(path):\n    return Store()\n\n\ndef _private():\n    pass\n",
        "pkg/net.py": "# Network transport for replicas, sending batches of log records to peers.\n"
                      "import socket\n\n\nclass Transport:\n    pass\n\n\nclass Peer:\n    pass\n",
    }
    parts = [part for name, text in files.items() for part in code_parts(text, name, name)]
    items = outline(Document(parts, [], []))
    assert [item.title for item in items] == ["pkg/store.py", "pkg/net.py"]
    assert items[0].text == ("Key-value storage on disk with atomic writes and a write-ahead log. "
                             "Defines Store, open_store.")
    assert items[1].text.startswith("Network transport for replicas") and items[1].text.endswith("Defines Transport, Peer.")


def test_log_entries_merged_into_items_keep_every_version_in_the_title():
    entries = "".join(f"tool ({v}-1) unstable; urgency=low\n\n  * Fix bug number {v} in the parser of the tool.\n\n"
                      f" -- Ann <ann@example.org>  Mon, 0{v % 9 + 1} Jan 2020 10:00:00 +0000\n\n"
                      for v in range(30, 0, -1))
    items = outline(text_document(entries, "changelog"), "medium")
    assert len(items) == 12
    assert items[0].title.startswith("tool (30-1, 29-1") and items[0].title.count("tool (") == 1  # said once
    titles = " ".join(item.title for item in items)
    assert all(f"{v}-1" in titles for v in range(1, 31))


def test_a_document_without_headings_is_cut_into_equal_runs_of_parts():
    pages = [f"Page {n} tells of the orchard in season {n}, where the pickers work from dawn." for n in range(1, 21)]
    document = pdf_document(pages)
    items = outline(document, "short")
    assert len(items) == 5
    assert items[0].title == "m.pdf p. 1 to m.pdf p. 4" and items[-1].title == "m.pdf p. 17 to m.pdf p. 20"
    assert sorted(p for item in items for p in item.parts) == list(range(20))


def test_the_sentence_prefers_a_section_s_own_terms_and_not_a_dangling_start():
    text = ("1 Ferries\nIt runs every hour in summer.\nThe Kelp ferry crosses the sound between Arne and Kelp.\n"
            + FILLER + "\n2 Trains\nThe night train to Vossby stops at every station on the coast.\n" + FILLER + "\n")
    items = outline(text_document(text))
    assert items[0].text.startswith("The Kelp ferry") and "Vossby" in items[1].text


def test_focus_picks_the_sentence_about_it():
    body = ("1 Harbour\nThe harbour office opens at six every morning of the year for the fishing crews.\n"
            "Grain ships unload cargo at the north pier.\n\n"
            "2 Town\nThe town hall holds the archive of the harbour since its founding.\n")
    assert "office opens" in outline(text_document(body))[0].text
    assert "Grain ships" in outline(text_document(body), focus="cargo ships")[0].text


def test_titles_of_merged_sections():
    assert common_ends(["make (4.3-1)", "make (4.2.1-2)"]) == ("make (", ")")
    assert common_ends(["dns.getServers()", "dns.lookup(host)"]) == ("", "")  # not inside a name
    assert group_title(["Alpha", "Beta"]) == "Alpha; Beta"
    assert group_title([f"Part {n} of the tale" for n in (1, 2)]) == "Part 1, 2 of the tale"
    long = [f"{word} is a section about a long subject" for word in "abcdefghij"]
    assert group_title(long) == f"{long[0]} ... {long[-1]} (10 sections)"


def test_an_empty_document_has_no_outline():
    assert outline(Document([], [], [])) == []
