"""`ask`'s quote: the lines a question's reading looked at most beyond the neutral question's, found on synthetic
evidence over a document of known lines (the default model's tokenizer), and put in the prompt's place for it."""

from __future__ import annotations

import pytest
import torch

from indexpool.ingest import Document, Part
from indexpool.jobs import ask_request, plain_request, request_messages
from indexpool.local import (QUOTE_CLOSE, QUOTE_OPEN, QUOTE_TOKENS, DocumentTokens, document_prompt, evidence_quote, with_quote)
from indexpool.model.indexpool_cache import AttentionEvidence

LINES = [f"Line {i}: the {word} of the harbour is described here in a few plain words." for i, word in
         enumerate(["bell", "crane", "light", "wall", "gate", "boat", "rope", "dock", "tide", "flag"])]


@pytest.fixture(scope="module")
def prompt(default_tokenizer):
    document = Document([Part("\n".join(LINES) + "\n", "harbour.txt", "harbour.txt:1-10")], [], [])
    tokens = DocumentTokens.encode(default_tokenizer, document)
    return document, document_prompt(default_tokenizer, tokens, request_messages(ask_request("What is the bell?")))


def line_tokens(tokenizer, prompt, index: int) -> range:
    """The prompt positions of LINES[index]'s tokens (its line break included)."""
    start = prompt.doc_start + sum(len(tokenizer.encode(line + "\n")) for line in LINES[:index])
    return range(start, start + len(tokenizer.encode(LINES[index] + "\n")))


def evidence_on(prompt, weights: dict[int, float], tokenizer) -> tuple[AttentionEvidence, AttentionEvidence]:
    """Evidence with `weight` on every token of each given line, and an even baseline that it exceeds there only."""
    evidence = AttentionEvidence(prompt.doc_start, prompt.doc_end)
    baseline = AttentionEvidence(prompt.doc_start, prompt.doc_end)
    n = prompt.doc_end - prompt.doc_start
    baseline.add(torch.arange(prompt.doc_start, prompt.doc_end), torch.full((n,), 0.01))
    baseline.queries = evidence.queries = 1
    evidence.add(torch.arange(prompt.doc_start, prompt.doc_end), torch.full((n,), 0.01))
    for index, weight in weights.items():
        positions = torch.tensor(list(line_tokens(tokenizer, prompt, index)))
        evidence.add(positions, torch.full((len(positions),), weight))
    return evidence, baseline


def test_the_request_with_and_without_its_quote(default_tokenizer, prompt):
    """The place for a quote changes no token of the request: the prompt is the plain request's, split."""
    _, with_place = prompt
    tokens = DocumentTokens([], [])
    plain = document_prompt(default_tokenizer, tokens, request_messages(plain_request(ask_request("What is the bell?"))))
    placed = document_prompt(default_tokenizer, tokens, request_messages(ask_request("What is the bell?")))
    assert placed.ids == plain.ids and plain.quote_at is None
    assert default_tokenizer.decode(placed.ids[: placed.quote_at]).endswith("Question: What is the bell?\n")
    assert with_place.max_tokens > len(with_place.ids) + QUOTE_TOKENS


def test_the_line_with_the_most_evidence_is_quoted_in_its_place(default_tokenizer, prompt):
    document, prompt = prompt
    evidence, baseline = evidence_on(prompt, {6: 0.05, 2: 0.02}, default_tokenizer)
    quote = evidence_quote(default_tokenizer, prompt, evidence, baseline)
    [passage] = quote.passages
    assert passage.text == LINES[6]
    assert passage.start == line_tokens(default_tokenizer, prompt, 6).start
    ids = with_quote(default_tokenizer, prompt, quote)
    opening = default_tokenizer.encode(QUOTE_OPEN)
    assert ids[: prompt.quote_at] == prompt.ids[: prompt.quote_at]
    assert ids[len(ids) - (len(prompt.ids) - prompt.quote_at):] == prompt.ids[prompt.quote_at:]
    quoted = default_tokenizer.decode(ids[prompt.quote_at : len(ids) - (len(prompt.ids) - prompt.quote_at)])
    # The quote, then the question again, next to the answer.
    assert quoted == f"{QUOTE_OPEN}{LINES[6]}{QUOTE_CLOSE}Question: What is the bell?\n"
    assert ids[prompt.quote_at:][: len(opening)] == opening


def test_neighbouring_lines_with_half_the_evidence_join_the_quote(default_tokenizer, prompt):
    _, prompt = prompt
    joined = evidence_quote(default_tokenizer, prompt, *evidence_on(prompt, {4: 0.05, 5: 0.03, 7: 0.02},
                                                                      default_tokenizer))
    assert joined.passages[0].text == f"{LINES[4]}\n{LINES[5]}"  # line 7 is not next to the quoted lines
    alone = evidence_quote(default_tokenizer, prompt, *evidence_on(prompt, {4: 0.05, 5: 0.02}, default_tokenizer))
    assert alone.passages[0].text == LINES[4]


def test_a_quote_is_at_most_quote_tokens_around_the_evidence(default_tokenizer):
    long_line = " ".join(f"word{i}" for i in range(200)) + " the secret is 77 " + " ".join(f"w{i}" for i in range(200))
    document = Document([Part(long_line + "\n", "long.txt", "long.txt:1")], [], [])
    tokens = DocumentTokens.encode(default_tokenizer, document)
    prompt = document_prompt(default_tokenizer, tokens, request_messages(ask_request("What is the secret?")))
    evidence = AttentionEvidence(prompt.doc_start, prompt.doc_end)
    baseline = AttentionEvidence(prompt.doc_start, prompt.doc_end)
    evidence.queries = baseline.queries = 1
    secret = prompt.doc_start + len(default_tokenizer.encode(long_line.split(" the secret")[0])) + 2
    evidence.add(torch.arange(secret - 3, secret + 3), torch.ones(6))
    quote = evidence_quote(default_tokenizer, prompt, evidence, baseline)
    [passage] = quote.passages
    assert len(passage.tokens) <= QUOTE_TOKENS and "the secret is 77" in passage.text


def test_nothing_is_quoted_when_nothing_stands_out(default_tokenizer, prompt):
    _, prompt = prompt
    evidence, baseline = evidence_on(prompt, {}, default_tokenizer)
    assert evidence_quote(default_tokenizer, prompt, evidence, baseline) is None
    # Two lines far apart with about the same evidence: neither stands out (less than QUOTE_MIN_RATIO times)
    assert evidence_quote(default_tokenizer, prompt, *evidence_on(prompt, {1: 0.05, 8: 0.03}, default_tokenizer)) is None
    assert evidence_quote(default_tokenizer, prompt, *evidence_on(prompt, {1: 0.05, 8: 0.02},
                                                                     default_tokenizer)).passages[0].text == LINES[1]
    assert with_quote(default_tokenizer, prompt, None) == prompt.ids
