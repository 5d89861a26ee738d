"""The jobs layer (indexpool_cli/jobs.py) over a fake backend: no model, no server, no command line. What the jobs
decide is visible: which requests go to the backend and in what order, when a document is read in sections and how
the levels stack, the result cache, the sources ranked without attention evidence, and the usage errors."""

from __future__ import annotations

import pytest

from indexpool import jobs
from indexpool.ingest import Document, Part, load_document
from indexpool.jobs import ContextTooLong, JobResult, ResultCache, rank_sources, request_question
from indexpool.model.errors import SettingsError
from indexpool.retrieval import LexicalIndex

FACT = "The access code of the glass tower is 41729."
QUESTION = "What is the access code of the glass tower?"


class FakeBackend:
    """A backend in plain Python. Tokens are words; one pass holds `context` words (None: any). A question's answer
    is the document's line sharing the most words with it; any other request's answer is the document's first line
    (a section's "summary"). `refuses_above`: like a server that does not report its context, a pass longer than
    this is refused with the limit named, which the backend then knows."""

    name = "fake"

    def __init__(self, context: int | None = None, extracts: bool = False, keeps: bool = False,
                 refuses_above: int | None = None):
        self.context = context
        self._extracts = extracts
        self.keeps = keeps
        self.refuses_above = refuses_above
        self.calls: list[tuple[str, str, str]] = []  # (method, document text, request)

    def identity(self) -> dict:
        return {"backend": "fake"}

    def keeps_results(self) -> bool:
        return self.keeps

    def extracts(self) -> bool:
        return self._extracts

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def document_tokens(self, document: Document) -> int:
        return self.count_tokens(document.text)

    def fits(self, document: Document, request: str, max_new_tokens: int) -> bool:
        needed = self.document_tokens(document) + self.count_tokens(request) + max_new_tokens
        return self.context is None or needed <= self.context

    reads_whole = fits

    def section_budget(self, request: str, max_new_tokens: int) -> int:
        budget = self.context - self.count_tokens(request) - max_new_tokens
        if budget < 2 * max_new_tokens:
            raise ContextTooLong(f"a context of {self.context} words is too small for sections", self.context)
        return budget

    def context_note(self, document_tokens: int) -> str:
        return f"{document_tokens} words against a context of {self.context}"

    def reply(self, document: Document, request: str) -> str:
        lines = [line for line in document.text.splitlines() if line.strip() and not line.startswith("[")]
        question = request_question(request)
        if question is None or not lines:
            return lines[0] if lines else ""
        asked = {word.strip("?.").lower() for word in question.split()}
        return max(lines, key=lambda line: len(asked & {w.strip("?.").lower() for w in line.split()}))

    def answer(self, document, requests, max_new_tokens, extract, on_result, on_text=None):
        needed = self.document_tokens(document)
        if self.refuses_above is not None and needed > self.refuses_above:
            self.context = self.refuses_above
            error = ContextTooLong("the request is longer than the context", self.refuses_above)
            error.results = [None] * len(requests)
            raise error
        index = LexicalIndex.of_parts([part.text for part in document.parts])
        results = []
        for i, request in enumerate(requests):
            self.calls.append(("answer", document.text, request))
            text = self.reply(document, request)
            if on_text:
                for word in text.split(" "):
                    on_text(i, word + " ")
            result = JobResult(text, document_tokens=needed, stop_reason="extracted" if extract else "stop_token")
            result.sources = rank_sources(document, index, request_question(request), text)
            on_result(i, result)
            results.append(result)
        return results

    def answer_each(self, documents, request, max_new_tokens, what):
        for document in documents:
            self.calls.append(("each", document.text, request))
        return [JobResult(self.reply(document, request)) for document in documents]


def report(lines: int = 60, fact_at: int = 41) -> Document:
    """A text document of numbered lines, one part per 5 lines, the fact on line `fact_at`."""
    text = [FACT if n == fact_at else f"Line {n} tells of harbour number {n} and its ships." for n in range(1, lines + 1)]
    parts = [Part("\n".join(text[i : i + 5]) + "\n", "report.txt", f"report.txt:{i + 1}-{i + 5}", lines=(i + 1, i + 5))
             for i in range(0, lines, 5)]
    return Document(parts, [], [], name="report.txt")


def test_ask_reads_the_whole_document_in_one_pass_and_cites_the_fact():
    backend, seen, streamed = FakeBackend(), [], []
    results = jobs.ask(backend, report(), [QUESTION, "Which harbour has number 7?"], 20,
                       on_result=lambda i, r: seen.append(i), on_text=lambda i, piece: streamed.append(i))
    assert seen == [0, 1] and sorted(set(streamed)) == [0, 1]
    assert results[0].text == FACT and results[0].sources[0]["cite"] == "report.txt:41-45"
    assert FACT in results[0].sources[0]["text"] and results[0].sources[0]["location"] == {"lines": [41, 45]}
    assert "harbour number 7 " in results[1].text
    assert [call[0] for call in backend.calls] == ["answer", "answer"]  # one pass each, no sections
    assert all(call[1] == report().text for call in backend.calls)


def test_a_document_longer_than_one_pass_is_answered_in_sections_then_together():
    backend = FakeBackend(context=150)
    document = report()
    (result,) = jobs.ask(backend, document, [QUESTION], 10)
    assert result.text == FACT
    sections = [call for call in backend.calls if call[0] == "each"]
    budget = backend.section_budget(jobs.plain_request(jobs.ask_request(QUESTION)), 10)
    assert len(sections) >= 2 and all(backend.count_tokens(text) <= budget for _, text, _ in sections)
    assert "".join(text for _, text, _ in sections[: len(sections)]).count("Line ") >= 59  # every line in a section
    final = backend.calls[-1]
    assert final[0] == "answer" and final[1].startswith("[Answer from report.txt:1-5")  # the sections' answers
    assert result.sources[0]["cite"].startswith("report.txt:") and " to " in result.sources[0]["cite"]
    note = result.notes[0]
    assert note.startswith(f"hierarchical: {sum(1 for c in sections if c[1] in document.text)} sections")
    assert result.document_tokens == backend.document_tokens(document)


def test_answers_that_do_not_fit_one_pass_are_combined_in_more_levels():
    backend = FakeBackend(context=90)
    (result,) = jobs.ask(backend, report(lines=120, fact_at=97), [QUESTION], 5)
    assert result.text == FACT
    levels = int(result.notes[0].split("together (")[1].split(" level")[0])
    assert levels >= 2
    second_level = [c for c in backend.calls if c[0] == "each" and c[1].startswith("[Answer from")]
    assert second_level  # the first level's answers were themselves answered in sections


def test_a_refusal_that_names_the_context_sends_the_request_to_sections():
    backend = FakeBackend(refuses_above=200)
    (result,) = jobs.ask(backend, report(), [QUESTION], 10)
    assert result.text == FACT and result.notes[0].startswith("hierarchical:")
    assert backend.context == 200


def test_a_context_too_small_for_sections_is_an_input_error():
    with pytest.raises(ContextTooLong, match="too small"):
        jobs.ask(FakeBackend(context=40), report(), [QUESTION], 15)


def test_reproducible_results_are_kept_and_found_again(tmp_path):
    backend, cache = FakeBackend(keeps=True), ResultCache(tmp_path)
    first = jobs.ask(backend, report(), [QUESTION], 20, results=cache)[0]
    again = jobs.ask(backend, report(), [QUESTION], 20, results=cache)[0]
    assert len(backend.calls) == 1 and not first.cached and again.cached and again.text == first.text
    assert again.sources == first.sources and any(n.startswith("from the result cache") for n in again.notes)
    jobs.ask(backend, report(fact_at=12), [QUESTION], 20, results=cache)  # another document: asked
    jobs.ask(backend, report(), [QUESTION], 21, results=cache)  # another length: asked
    assert len(backend.calls) == 3
    local = FakeBackend(keeps=False)  # a backend whose results are not worth keeping is always asked
    jobs.ask(local, report(), [QUESTION], 20, results=cache), jobs.ask(local, report(), [QUESTION], 20, results=cache)
    assert len(local.calls) == 2


def test_summaries_of_several_documents_in_order_the_fitting_ones_together():
    backend, seen = FakeBackend(context=200), []
    short = [report(lines=10, fact_at=2), report(lines=15, fact_at=3)]
    long = report(lines=60)
    results = jobs.summarize(backend, [short[0], long, short[1]], "short", max_new_tokens=20, summary="generate",
                             on_result=lambda i, r: seen.append(i))
    assert seen == [0, 1, 2] and all(r.text.startswith("Line 1 ") for r in results)
    together = [c for c in backend.calls if c[0] == "each" and c[1] in (short[0].text, short[1].text)]
    assert len(together) == 2  # the two that fit, as one call
    assert results[1].notes[0].startswith("hierarchical:")  # the long one, in sections
    section_request = jobs.summary_request("short", None)
    assert all(c[2] == section_request for c in backend.calls if c[0] == "each")


def test_an_extracted_summary_asks_the_backend_nothing(tmp_path):
    path = tmp_path / "g.md"
    path.write_text("# Glimmer\n\nGlimmer renders vector maps from tile archives on the command line.\n\n"
                    "## Installing\n\nInstall the glimmer package with the package manager of your system.\n\n"
                    "## Options\n\nThe --zoom option picks the zoom level of every rendered tile.\n")
    document = load_document([str(path)])
    backend = FakeBackend(extracts=True)
    (result,) = jobs.summarize(backend, [document])
    assert result.stop_reason == "extracted" and result.cites_inline and backend.calls == []
    assert [s["title"] for s in result.sources] == ["Glimmer", "Installing", "Options"]


def test_bad_job_options_are_usage_errors():
    backend = FakeBackend()
    for call in (lambda: jobs.summarize(backend, [report()], length="huge"),
                 lambda: jobs.summarize(backend, [report()], strategy="sideways"),
                 lambda: jobs.summarize(backend, [report()], summary="poem"),
                 lambda: jobs.ask(backend, report(), [" "]),
                 lambda: jobs.ask(backend, report(), [QUESTION], answer="guess")):
        with pytest.raises(SettingsError):
            call()
    assert backend.calls == []


def test_two_inputs_of_which_one_fits_each_get_their_summary():
    backend = FakeBackend(context=200)
    results = jobs.summarize(backend, [report(lines=10, fact_at=2), report(lines=60)], "short", max_new_tokens=20,
                             summary="generate")
    assert [r.text.startswith("Line 1 ") for r in results] == [True, True]
    assert not results[0].notes and results[1].notes[0].startswith("hierarchical:")
