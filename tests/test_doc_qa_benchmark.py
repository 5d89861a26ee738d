"""The document-QA benchmark's scoring (benchmarks/doc_qa.py) on small fixtures, and its question sets
(benchmarks/data/doc_qa_*.json) well formed: every question with a place to find it and answers to accept."""

from __future__ import annotations

import pytest

from benchmarks.doc_qa import answer_holds, bm25_ranking, coverage, location_matches, source_scores
from benchmarks.doc_qa_documents import data_files, load_set
from indexpool.ingest import Part


def test_an_answer_holds_the_fact_whatever_its_case_and_spacing():
    assert answer_holds("It returns  IDN2_OK\non success.", ["idn2_ok"])
    assert answer_holds("The limit is 65,536 bytes.", ["65536", "65,536"])
    assert not answer_holds("It returns an error.", ["IDN2_OK", "0x0"])
    assert not answer_holds("", ["x"])


@pytest.mark.parametrize("location, source, where, expected", [
    ({"page": 7}, "a.pdf", {"page": 7}, True),
    ({"page": 8}, "a.pdf", {"page": 7}, False),
    ({"lines": [10, 48]}, "notes.txt", {"lines": [48, 50]}, True),  # overlapping at one line
    ({"lines": [10, 47]}, "notes.txt", {"lines": [48, 50]}, False),
    ({"lines": [1, 60]}, "/tmp/x/http/client.py", {"file": "client.py", "lines": [5, 6]}, True),
    ({"lines": [1, 60]}, "/tmp/x/http/server.py", {"file": "client.py", "lines": [5, 6]}, False),
    ({"lines": [1, 60]}, "/tmp/x/http/myclient.py", {"file": "client.py", "lines": [5, 6]}, False),
    ({"message": 3}, "chat.json", {"message": 3}, True),
    ({}, "a.pdf", {"page": 1}, False),
])
def test_a_cited_location_matches_the_ground_truth(location, source, where, expected):
    assert location_matches(location, source, where) is expected


def test_first_and_top_three_sources():
    cited = [{"location": {"page": p}, "source": "a.pdf"} for p in (3, 9, 5, 7)]
    assert source_scores(cited, [{"page": 3}]) == (True, True)
    assert source_scores(cited, [{"page": 5}]) == (False, True)
    assert source_scores(cited, [{"page": 7}]) == (False, False)  # fourth: beyond the top 3
    assert source_scores(cited, [{"page": 1}, {"page": 9}]) == (False, True)  # a question on two places
    assert source_scores([], [{"page": 1}]) == (False, False)


def test_bm25_baseline_ranks_by_the_question_s_words():
    parts = [Part("[Page 1]\nThe harbour opens at six.\n", "a.pdf", "a.pdf p. 1", page=1),
             Part("[Page 2]\nThe ferry leaves from pier twelve.\n", "a.pdf", "a.pdf p. 2", page=2)]
    assert bm25_ranking(parts, "Which pier does the ferry leave from?")[0] == 1


def test_summary_coverage_counts_sections_by_their_keywords():
    sections = [{"title": "Cookies", "keywords": ["cookiejar", "morsel"]}, {"title": "Server", "keywords": ["cgi"]}]
    assert coverage("It parses a Morsel.", sections) == [True, False]


def test_the_question_sets_are_complete():
    sets = [load_set(str(path)) for path in data_files()]
    assert len(sets) >= 6 and sum(s["kind"] == "pdf" for s in sets) >= 2
    assert {"pdf", "code", "log"} <= {s["kind"] for s in sets} and {"html", "text"} & {s["kind"] for s in sets}
    for doc_set in sets:
        questions = doc_set["questions"]
        assert len(questions) >= 10, doc_set["name"]
        assert len({q["id"] for q in questions}) == len(questions)
        assert {q["type"] for q in questions} == {"lookup", "which-part", "two-places"}, doc_set["name"]
        for q in questions:
            assert q["question"].strip() and q["answers"] and all(a.strip() for a in q["answers"]), q["id"]
            assert q["where"] and all({"page"} == set(w) or "lines" in w for w in q["where"]), q["id"]
            assert (len(q["where"]) == 2) == (q["type"] == "two-places"), q["id"]
        assert 5 <= len(doc_set["sections"]) <= 12 and all(s["keywords"] for s in doc_set["sections"])
