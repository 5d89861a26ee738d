"""Question answering on real documents: does `ask` cite the right place and answer with the fact, against plain
retrieval, on manuals, a codebase and a log that no one here wrote?

The documents and their questions are in benchmarks/data/doc_qa_*.json (the documents come from the system:
benchmarks/doc_qa_documents.py; `--install` apt-installs the Debian documentation packages that hold the PDFs). Each
question has its ground-truth location (page, line range, file and line range) and accepted answer strings. In one
run, per document:

- ours: `indexpool ask DOC -Q q1 -Q q2 ... --json` as a user runs it (default settings, greedy), cold (an empty
  document cache: the document is read), then one question again on the cached document;
- BM25: the parts (pages, line ranges, files' chunks) ranked by Okapi BM25 on the question's plain words, as the
  citation;
- retrieve-then-read: the same model answering from the top BM25 parts placed in its own context (dense attention,
  RTR_PARTS parts, at most RTR_TOKENS tokens), with the same request.

Scores: the first cited source is a right location; a right location among the first 3; the answer holds the fact
(one of the accepted strings, case and spacing aside), for ours as it answers by default and with `--answer
generate`. Times: the cold `ask` with all the document's questions, and a later question on the cached document.
With --summaries (or --summaries-only), each document's summary (`indexpool summarize`: by default the extracted
outline, and with `--summary generate`) against a summary of its first FIRST_TOKENS tokens: the share of the
document's top-level sections (`sections` in the data file, each with keywords) that it mentions.

    .venv/bin/python -m benchmarks.doc_qa --install --summaries   # every document (about 40 minutes on 2 cores)
    .venv/bin/python -m benchmarks.doc_qa --docs libidn2 -v       # one document, every question shown
    .venv/bin/python -m benchmarks.doc_qa --summaries-only -v     # the summaries alone (about 12 minutes)
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine_description, run_indexpool
from benchmarks.doc_qa_documents import DocumentMissing, data_files, documents_folder, load_set, materialize
from indexpool.ingest import Part

RTR_PARTS = 4  # parts retrieve-then-read places in the model's context
RTR_TOKENS = 6144  # at most, within the model's 8K context with the request and the answer
MAX_NEW_TOKENS = 100
FIRST_TOKENS = 7168  # the summary baseline reads this many of the document's first tokens (8K with the request)
_PLAIN_WORD = re.compile(r"\w+")


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def answer_holds(answer: str, accepted: list[str]) -> bool:
    """Whether the answer contains one of the accepted strings, case and runs of white space aside."""
    said = normalize(answer)
    return any(normalize(a) in said for a in accepted)


def location_matches(location: dict, source: str, where: dict) -> bool:
    """Whether a cited part (its `location` and `source` as in ask's --json) is at a ground-truth place: the same
    page, or overlapping lines (in the same file, when the place names one: the source ends with it)."""
    if "page" in where:
        return location.get("page") == where["page"]
    if "lines" in where and "lines" in location:
        if "file" in where and not (source == where["file"] or source.endswith("/" + where["file"])):
            return False
        (a, b), (c, d) = location["lines"], where["lines"]
        return a <= d and c <= b
    if "message" in where:
        return location.get("message") == where["message"]
    return False


def source_scores(sources: list[dict], places: list[dict]) -> tuple[bool, bool]:
    """(the first source is at one of the places, one of the first three is)."""
    hits = [any(location_matches(s.get("location", {}), s.get("source", ""), w) for w in places) for s in sources[:3]]
    return bool(hits[:1] and hits[0]), any(hits)


def bm25_ranking(parts, question: str) -> list[int]:
    """Part indices by plain Okapi BM25 (lowercased words, nothing else), best first."""
    from indexpool.retrieval import BM25

    bm25 = BM25([_PLAIN_WORD.findall(p.text.lower()) for p in parts])
    scores = bm25.scores(_PLAIN_WORD.findall(question.lower()))
    return sorted(range(len(parts)), key=lambda i: -scores[i])


def run_ask(path: str, questions: list[str], cache_dir: str, threads: int | None,
            *options: str) -> tuple[list[dict], float]:
    """`indexpool ask` as a user runs it: the results (one JSON object per question) and the wall time."""
    out, seconds = run_indexpool("ask", path, *[a for q in questions for a in ("-Q", q)], "--json", "--quiet",
                                 "--cache-dir", cache_dir, "-n", str(MAX_NEW_TOKENS), *options, threads=threads)
    return [json.loads(line) for line in out.splitlines() if line.strip()], seconds


class RetrieveThenRead:
    """The same model answering from the top BM25 parts in its own (dense) context."""

    def __init__(self):
        from indexpool.model.runtime import load_engine

        self.loaded = load_engine(None)

    def answer(self, document, ranking: list[int], question: str) -> str:
        from indexpool.ingest import Document
        from indexpool.jobs import ask_request, plain_request

        tok = self.loaded.tokenizer
        chosen, size = [], 0
        for i in ranking[:RTR_PARTS]:
            n = len(tok.encode(document.parts[i].text))
            if chosen and size + n > RTR_TOKENS:
                break
            chosen.append(document.parts[i])
            size += n
        return self.dense(Document(chosen, [], []), plain_request(ask_request(question)), MAX_NEW_TOKENS)

    def dense(self, document, request: str, max_new_tokens: int) -> str:
        """The model's greedy answer to `request` on `document` in its own context (dense attention)."""
        from indexpool.jobs import request_messages
        from indexpool.local import DocumentTokens, HeldDocument, document_prompt, run_request
        from indexpool.model.generate import Sampler, SamplingParams, Session

        tok = self.loaded.tokenizer
        prompt = document_prompt(tok, DocumentTokens.encode(tok, document), request_messages(request))
        session = Session(self.loaded.model, min(self.loaded.config.context_length, len(prompt.ids) + max_new_tokens))
        result = run_request(HeldDocument(session, tok, document), prompt, Sampler(SamplingParams(temperature=0)),
                             min(max_new_tokens, session.max_length - len(prompt.ids)), with_sources=False)
        return result.text


def coverage(summary: str, sections: list[dict]) -> list[bool]:
    """Whether the summary mentions each section: one of its keywords, case aside."""
    said = normalize(summary)
    return [any(normalize(k) in said for k in section["keywords"]) for section in sections]


def run_summarize(path: str, threads: int | None, *options: str) -> tuple[str, float]:
    """`indexpool summarize` as a user runs it (default length and strategy, and `options`): the summary and the
    wall time."""
    out, seconds = run_indexpool("summarize", path, "--json", "--quiet", "--no-cache", *options, threads=threads)
    return json.loads(out.splitlines()[-1])["text"], seconds


def summarize_first_tokens(reader: RetrieveThenRead, document, budget: int) -> str:
    """The baseline summary: the same request on the document's first `budget` tokens only (dense)."""
    from indexpool.ingest import Document
    from indexpool.jobs import SUMMARY_LENGTHS, summary_request

    tok = reader.loaded.tokenizer
    new_tokens = SUMMARY_LENGTHS["medium"][1]
    kept, size = [], 0
    for part in document.parts:
        ids = tok.encode(part.text)
        if size + len(ids) > budget:
            rest = budget - size
            if rest > 0:
                kept.append(Part(tok.decode(ids[:rest]), part.source, part.cite))
            break
        kept.append(part)
        size += len(ids)
    return reader.dense(Document(kept, [], []), summary_request("medium", None), new_tokens)


def evaluate(doc_set: dict, workdir: Path, reader: RetrieveThenRead, args) -> dict:
    from indexpool.ingest import load_document

    path = materialize(doc_set["document"], workdir, install=args.install)
    document = load_document([str(path)])
    questions = [] if args.summaries_only else doc_set["questions"]
    texts = [q["question"] for q in questions]
    cache_dir = tempfile.mkdtemp(prefix="doc_qa_cache_", dir=workdir)
    ours, generated, cold_seconds, cached_seconds = [], [], 0.0, 0.0
    if texts:
        ours, cold_seconds = run_ask(str(path), texts, cache_dir, args.threads)
        _, cached_seconds = run_ask(str(path), texts[:1], cache_dir, args.threads)
        generated, _ = run_ask(str(path), texts, cache_dir, args.threads, "--answer", "generate")
    rows = []
    for q, result, written in zip(questions, ours, generated):
        ranking = bm25_ranking(document.parts, q["question"])
        bm25_sources = [{"location": document.parts[i].location(), "source": document.parts[i].source}
                        for i in ranking[:3]]
        t0 = time.perf_counter()
        rtr_answer = reader.answer(document, ranking, q["question"])
        row = {"id": q["id"], "type": q.get("type", ""),
               "ours_first": source_scores(result["sources"], q["where"])[0],
               "ours_top3": source_scores(result["sources"], q["where"])[1],
               "ours_answer": answer_holds(result["text"], q["answers"]),
               "generated_answer": answer_holds(written["text"], q["answers"]),
               "bm25_first": source_scores(bm25_sources, q["where"])[0],
               "bm25_top3": source_scores(bm25_sources, q["where"])[1],
               "rtr_answer": answer_holds(rtr_answer, q["answers"]),
               "rtr_seconds": time.perf_counter() - t0,
               "ours_text": result["text"], "generated_text": written["text"], "rtr_text": rtr_answer,
               "ours_cites": [s["cite"] for s in result["sources"]], "quotes": [x["cite"] for x in result["quotes"]]}
        rows.append(row)
        if args.verbose:
            mark = lambda ok: "OK" if ok else "--"  # noqa: E731
            print(f"  {q['id']:18} cite {mark(row['ours_first'])}/{mark(row['bm25_first'])} answer "
                  f"{mark(row['ours_answer'])}/{mark(row['generated_answer'])}/{mark(row['rtr_answer'])}  "
                  f"{q['question'][:60]!r}\n      ours: {result['text'].strip()[:90]!r} "
                  f"[{'; '.join(row['ours_cites'])}]\n      generated: {written['text'].strip()[:90]!r}\n"
                  f"      rtr:  {rtr_answer.strip()[:90]!r}  want {q['answers'][:2]} at {q['where']}", flush=True)
    tokens = ours[0]["tokens"]["document"] if ours else 0
    result = {"name": doc_set["name"], "kind": doc_set["kind"], "tokens": tokens, "questions": len(rows),
              "cold_seconds": cold_seconds, "cached_seconds": cached_seconds, "rows": rows}
    if (args.summaries or args.summaries_only) and doc_set.get("sections"):
        summary, seconds = run_summarize(str(path), args.threads)
        written, written_seconds = run_summarize(str(path), args.threads, "--summary", "generate")
        first = summarize_first_tokens(reader, document, FIRST_TOKENS)
        result["summary"] = {"ours": coverage(summary, doc_set["sections"]),
                             "generated": coverage(written, doc_set["sections"]),
                             "first_tokens": coverage(first, doc_set["sections"]), "seconds": seconds,
                             "generated_seconds": written_seconds, "ours_text": summary, "generated_text": written,
                             "first_tokens_text": first}
        if args.verbose:
            print(f"  summary ({seconds:.1f} s):\n{summary}\n  --summary generate ({written_seconds:.0f} s): "
                  f"{written.strip()[:300]!r}\n  first {FIRST_TOKENS} tokens: {first.strip()[:300]!r}", flush=True)
    return result


COLUMNS = [("ours_first", "first source: ours"), ("bm25_first", "BM25"), ("ours_top3", "top 3: ours"),
           ("bm25_top3", "BM25"), ("ours_answer", "answer: ours"), ("generated_answer", "ours, --answer generate"),
           ("rtr_answer", "retrieve-then-read")]


def report(results: list[dict]) -> None:
    header = f"| document | kind | tokens | q | {' | '.join(label for _, label in COLUMNS)} | cold ask | cached q |"
    print("\n" + header + "\n" + "|---" * (header.count("|") - 1) + "|")
    totals = {key: 0 for key, _ in COLUMNS}
    count = 0
    for r in results:
        n = r["questions"]
        if not n:
            continue
        cells = []
        for key, _ in COLUMNS:
            hits = sum(row[key] for row in r["rows"])
            totals[key] += hits
            cells.append(f"{hits}/{n}")
        count += n
        print(f"| {r['name']} | {r['kind']} | {r['tokens']:,} | {n} | {' | '.join(cells)} | {r['cold_seconds']:.0f} s "
              f"| {r['cached_seconds']:.1f} s |")
    if count:
        cells = [f"{totals[key]}/{count} ({100 * totals[key] / count:.0f}%)" for key, _ in COLUMNS]
        print(f"| all | | | {count} | {' | '.join(cells)} | | |")


def report_summaries(results: list[dict]) -> None:
    rows = [r for r in results if "summary" in r]
    if not rows:
        return
    print(f"\n| document | sections | summarize (default: extract) | summarize --summary generate | first "
          f"{FIRST_TOKENS} tokens only | summarize time | --summary generate time |\n|---|---|---|---|---|---|---|")
    total, hits = 0, {"ours": 0, "generated": 0, "first_tokens": 0}
    for r in rows:
        summary = r["summary"]
        n = len(summary["ours"])
        total += n
        cells = []
        for key in hits:
            hits[key] += sum(summary[key])
            cells.append(f"{sum(summary[key])}/{n}")
        print(f"| {r['name']} | {n} | {' | '.join(cells)} | {summary['seconds']:.1f} s | "
              f"{summary['generated_seconds']:.0f} s |")
    cells = [f"{h}/{total} ({100 * h / total:.0f}%)" for h in hits.values()]
    print(f"| all | {total} | {' | '.join(cells)} | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="", help="comma-separated names (benchmarks/data/doc_qa_NAME.json)")
    parser.add_argument("--install", action="store_true", help="apt-get install the documents' Debian packages")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--save", type=Path, default=None, help="write every result as JSON to this file")
    parser.add_argument("--summaries", action="store_true",
                        help="also summarize each document, against a summary of its first 8K tokens only")
    parser.add_argument("--summaries-only", action="store_true", help="only the summaries (no questions)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every question's answers and sources")
    args = parser.parse_args()

    from indexpool.model.runtime import set_threads

    set_threads(args.threads)
    names = [n for n in args.docs.split(",") if n] or [load_set(str(p))["name"] for p in data_files()]
    print(machine_description())
    print(f"documents: {', '.join(names)}")
    reader = RetrieveThenRead()
    results = []
    with documents_folder() as folder:
        for name in names:
            doc_set = load_set(name)
            print(f"\n{name}: {doc_set['about']}", flush=True)
            try:
                results.append(evaluate(doc_set, folder, reader, args))
            except DocumentMissing as e:
                print(f"  skipped: {e}")
                continue
            r = results[-1]
            if r["questions"]:
                print(f"  {r['tokens']:,} tokens; cold ask with {r['questions']} questions {r['cold_seconds']:.0f} s, "
                      f"a later question {r['cached_seconds']:.1f} s", flush=True)
    report(results)
    report_summaries(results)
    if args.save:
        args.save.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
