"""Lexical retrieval (indexpool_cli/retrieval.py) and how `ask` uses it with the attention evidence (local.py): the
passages quoted to the model, the sources cited first, their structured locations and texts."""

from __future__ import annotations

import torch

from indexpool.ingest import Document, Part
from indexpool.jobs import ask_request, request_messages
from indexpool.local import QUOTE_PASSAGES, DocumentTokens, document_prompt, passage_quote, with_quote
from indexpool.retrieval import BM25, LexicalIndex, navigational, terms
from indexpool.model.indexpool_cache import AttentionEvidence


def test_terms_split_identifiers_and_drop_stop_words():
    assert terms("What does idn2_lookup_u8 return?") == ["idn2_lookup_u8", "idn2", "lookup", "u8", "return"]
    assert terms("HTTPConnection.getresponse _MAXLINE") == ["httpconnection.getresponse", "http", "connection",
                                                           "getrespons", "_maxline", "maxlin"]
    assert terms("configured configures configure") == ["configur"] * 3
    assert terms("utf8 cookies") == ["utf8", "cooki"]


def test_bm25_ranks_the_part_with_the_rare_word_first():
    parts = [terms("the cat sat on the mat"), terms("a dog and a cat"), terms("the retry policy is set in config")]
    scores = BM25(parts).scores(terms("where is the retry policy?"))
    assert scores[2] > 0 and scores[0] == scores[1] == 0
    assert BM25([]).scores(["x"]) == []


TOC = "Table of Contents\n" + "".join(f"{i} Chapter {i} . . . . . . . . {i * 3}\n" for i in range(1, 12))
INDEX = "Index\n" + "".join(f"idn2_function_{i} {i + 4}\n" for i in range(10))
PROSE = "\n".join(f"Paragraph {i} explains how the library converts names, with a few words more." for i in range(10))


def test_tables_of_contents_and_indexes_are_navigational():
    assert navigational(TOC) and navigational(INDEX)
    assert not navigational(PROSE) and not navigational("1\n2\n3")  # too short to tell


def test_a_navigational_part_scores_below_the_page_that_states_the_fact():
    content = "idn2_function_3 converts a label to Punycode.\n" + PROSE
    index = LexicalIndex([INDEX, content], [(0, line) for line in INDEX.splitlines()] +
                         [(1, line) for line in content.splitlines()])
    scores = index.part_scores("what does idn2_function_3 do?")
    assert scores[1] > scores[0] > 0
    passages = index.passage_scores("idn2_function_3 Punycode")
    best = index.passages[max(range(len(passages)), key=passages.__getitem__)]
    assert best.part == 1 and best.first_line == len(INDEX.splitlines())  # the passage holding the fact


# --- `ask`'s use of it, on the default model's tokenizer ---

PAGES = [
    "[Page 1]\nThe harbour office opens at six.\nShips unload grain at the north pier.\n",
    "[Page 2]\nThe lighthouse keeper is Ilse Morrow.\nShe keeps the lamp lit.\n",
    "[Page 3]\nThe ferry to Kelp Island leaves from pier 12.\nTickets cost 4 crowns.\n",
    "[Page 4]\nThe ferry to Rook Island leaves from pier 40.\nTickets cost 9 crowns.\n",
]


def prompt_for(tokenizer, question: str):
    document = Document([Part(text, "book.pdf", f"book.pdf p. {i}", page=i) for i, text in enumerate(PAGES, 1)], [], [])
    tokens = DocumentTokens.encode(tokenizer, document)
    return document, document_prompt(tokenizer, tokens, request_messages(ask_request(question)))


def flat_evidence(prompt, on_part: int | None = None) -> tuple[AttentionEvidence, AttentionEvidence]:
    """An even baseline, and evidence that exceeds it on one part's tokens only (none: nowhere)."""
    evidence = AttentionEvidence(prompt.doc_start, prompt.doc_end)
    baseline = AttentionEvidence(prompt.doc_start, prompt.doc_end)
    n = prompt.doc_end - prompt.doc_start
    for e in (evidence, baseline):
        e.add(torch.arange(prompt.doc_start, prompt.doc_end), torch.full((n,), 0.01))
        e.queries = 1
    if on_part is not None:
        start, end = prompt.part_spans[on_part]
        evidence.add(torch.arange(start, end), torch.full((end - start,), 0.05))
    return evidence, baseline


def sources_of(tokenizer, document, prompt, evidence, baseline, answer: str, quote) -> list[dict]:
    """The sources a result on the local engine cites (`local.job_result`, with `jobs.rank_sources`)."""
    from indexpool.local import HeldDocument, job_result
    from indexpool.model.generate import GenerationStats

    held = HeldDocument(None, tokenizer, document, baseline=baseline)
    return job_result(held, prompt, answer, GenerationStats(), 0.0, evidence, quote).sources


def test_the_question_s_words_choose_the_quoted_passage(default_tokenizer):
    document, prompt = prompt_for(default_tokenizer, "Who is the lighthouse keeper?")
    assert prompt.question == "Who is the lighthouse keeper?"
    quote = passage_quote(default_tokenizer, prompt, *flat_evidence(prompt))
    assert 1 <= len(quote.passages) <= QUOTE_PASSAGES
    assert "Ilse Morrow" in quote.passages[0].text
    ids = with_quote(default_tokenizer, prompt, quote)
    assert "Ilse Morrow" in default_tokenizer.decode(ids[prompt.quote_at :])
    sources = sources_of(default_tokenizer, document, prompt, *flat_evidence(prompt), "Ilse Morrow.", quote)
    assert sources[0]["cite"] == "book.pdf p. 2" and sources[0]["location"] == {"page": 2}
    assert "Ilse Morrow" in sources[0]["text"]


def test_attention_tells_apart_passages_the_words_score_alike(default_tokenizer):
    """Pages 3 and 4 match "ferry leaves from pier" alike; the reading's evidence on page 4 decides."""
    document, prompt = prompt_for(default_tokenizer, "From which pier does the ferry leave?")
    for part, pier in ((2, "pier 12"), (3, "pier 40")):
        evidence, baseline = flat_evidence(prompt, on_part=part)
        quote = passage_quote(default_tokenizer, prompt, evidence, baseline)
        assert pier in quote.passages[0].text
        sources = sources_of(default_tokenizer, document, prompt, evidence, baseline, "", quote)
        assert sources[0]["location"] == {"page": part + 1}


def test_a_question_whose_words_are_nowhere_falls_back_to_the_evidence(default_tokenizer):
    document, prompt = prompt_for(default_tokenizer, "Zyx qwv?")
    assert passage_quote(default_tokenizer, prompt, *flat_evidence(prompt)) is None  # nothing stands out
    quote = passage_quote(default_tokenizer, prompt, *flat_evidence(prompt, on_part=1))
    assert [p.text for p in quote.passages] == ["[Page 2]\nThe lighthouse keeper is Ilse Morrow.\nShe keeps the lamp lit."]


def tiny_loaded_model(tokenizer):
    """A tiny random llama-family model with `tokenizer`, as `load_model` returns one."""
    from pathlib import Path

    from indexpool.model.llama import LlamaConfig, Transformer
    from indexpool.model.loader import LoadedModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn_dim=64, context_length=64, rope_theta=10000.0)
    return LoadedModel(Transformer(config).eval(), tokenizer, config, Path("tiny.gguf"), "tiny", 0, 32.0)


def test_ask_tells_the_session_where_its_question_begins(default_tokenizer, monkeypatch):
    """`ask` reads its request after the document with the document's end as the question's start, so a frame is
    taken from the question's own words only (`matching_pools`), not from the document's last tokens read with it;
    and a session given the tokenizer's words compares frames by them (a tiny random model with the default
    tokenizer, IndexPool settings small enough to select)."""
    from indexpool.local import HeldDocument, run_request
    import indexpool.model.indexpool_cache as indexpool_cache
    from indexpool.model.generate import Sampler, SamplingParams, Session
    from indexpool.model.indexpool_cache import IndexPoolCache, IndexPoolConfig

    document, prompt = prompt_for(default_tokenizer, "Which pier does the ferry to Rook Island leave from?")
    settings = IndexPoolConfig(kpool=4, topk=8, window=8, sinks=4, segment=16, query_tokens=6,
                               segment_candidates=4, kv_storage="full")
    session = Session(tiny_loaded_model(default_tokenizer).model, len(prompt.ids) + 200, attention=settings,
                      words=default_tokenizer.word_ids)
    seen, words_seen = [], []
    read_question, matching_pools = IndexPoolCache.read_question, indexpool_cache.matching_pools

    def spy(cache, forward, tokens=None, held=0, question_from=None):
        seen.append(question_from)
        return read_question(cache, forward, tokens, held, question_from)

    def matching_spy(*args, words=None, **kwargs):
        words_seen.append(words)
        return matching_pools(*args, words=words, **kwargs)

    monkeypatch.setattr(IndexPoolCache, "read_question", spy)
    monkeypatch.setattr(indexpool_cache, "matching_pools", matching_spy)
    run_request(HeldDocument(session, default_tokenizer, document), prompt, Sampler(SamplingParams(temperature=0)), 2)
    assert seen and all(start == prompt.doc_end for start in seen)
    assert words_seen and all(words.tolist() == default_tokenizer.word_ids for words in words_seen)


def test_a_document_jobs_session_has_the_tokenizers_words(default_tokenizer):
    from indexpool.model.indexpool_cache import IndexPoolConfig
    from indexpool.model.sessions import SessionOptions, open_session

    settings = IndexPoolConfig(kpool=4, topk=8, window=8, sinks=4, segment=16, query_tokens=6, segment_candidates=4)
    options = SessionOptions(indexpool=settings, indexer="training-free", prune_index=False)
    session = open_session(tiny_loaded_model(default_tokenizer), options, 1000, auto="indexpool")
    assert session.cache.words.tolist() == default_tokenizer.word_ids
