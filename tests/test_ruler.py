"""benchmarks/ruler.py's task generator and scoring (no model runs): seeded samples, within 1% of their length in the
default model's tokenizer, with the answers where each task needs them and distractors that never give them."""

import argparse
import re
from collections import Counter

import pytest

from benchmarks import ruler
from benchmarks.ruler import (ADJECTIVES, NIAH_TASKS, NOUNS, TASKS, Generator, Haystack, document_words, draw,
                              recall_all, word_baselines)

NEEDLE = re.compile(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d+)\. ")
ASSIGNMENT = re.compile(r"^VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d{5})$", re.M)


@pytest.fixture(scope="module")
def generator(default_tokenizer):
    return Generator(default_tokenizer)


def needles(sample) -> list[tuple[str, str]]:
    return NEEDLE.findall(sample.document)


def resolved_assignments(document: str) -> dict[str, str]:
    """Each variable's value, the assignments resolved in reading order; each variable must be assigned once, after
    the one it copies (a KeyError: used before it is defined)."""
    holds: dict[str, str] = {}
    for name, source, copied in ASSIGNMENT.findall(document):
        assert name not in holds
        holds[name] = holds[copied] if copied else source
    return holds


def test_samples_are_seeded(generator):
    for task in TASKS:
        first = generator.samples(task, 4096, 2, seed=7)
        again = generator.samples(task, 4096, 1, seed=7)  # more samples keep the first ones
        assert (first[0].prompt, first[0].answers) == (again[0].prompt, again[0].answers)
        assert first[0].prompt != generator.samples(task, 4096, 1, seed=8)[0].prompt
        assert first[0].answers != first[1].answers
        later, = generator.samples(task, 4096, 1, seed=7, first=1)  # a run that adds samples draws the next ones
        assert (later.prompt, later.answers) == (first[1].prompt, first[1].answers)


@pytest.mark.parametrize("length", [4096, 16384])
def test_prompts_are_the_chat_template_within_1_percent_of_the_length(generator, default_tokenizer, length):
    for task in TASKS:
        for sample in generator.samples(task, length, 2, seed=1):
            user = sample.instruction + sample.document + sample.question
            text = default_tokenizer.render_chat([{"role": "user", "content": user}]) + sample.answer_start
            assert sample.prompt == default_tokenizer.encode(text, allow_special=True)
            # The document ends where the question starts (a token across the two is left to the question).
            before, after = (default_tokenizer.decode(ids) for ids in (sample.prompt[: sample.document_end],
                                                                        sample.prompt[sample.document_end:]))
            assert before + after == text and sample.question in after and after.endswith(sample.answer_start)
            assert 0 <= len(after) - len(text) + text.index(sample.question) < 16
            assert 0.99 * length <= len(sample.prompt) <= length, (task, len(sample.prompt))


def test_a_length_too_short_for_the_task_is_refused(generator):
    with pytest.raises(ValueError, match="too short"):
        generator.samples("cwe", 1024, 1, seed=0)  # the common words alone take more
    run = argparse.Namespace(samples=1, seed=0, first_sample=0, shared_document=False)
    with pytest.raises(SystemExit, match=r"^ruler.py: error: a length of 1024 tokens is too short .*--lengths$"):
        draw(generator, "cwe", 1024, run)  # the command line's one-line error, not a traceback


def test_needles_hide_in_the_natural_prose(generator):
    """Take the needles out and what is left is the haystack's own text, from its start."""
    for task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
        for sample in generator.samples(task, 16384, 2, seed=2):
            prose = NEEDLE.sub("", sample.document)
            assert len(prose) > 40000 and generator.haystack.text.startswith(prose)


def test_a_given_haystack_is_the_prose_samples_draw(default_tokenizer, generator):
    """`--haystack FILE`: the same samples on a machine whose Python documentation and licenses differ."""
    text = "A river bends past the old mill. Its water turns the wheel slowly. " * 2000
    own = Generator(default_tokenizer, Haystack(text))
    sample, = own.samples("niah_single", 4096, 1, seed=4)
    assert text.startswith(NEEDLE.sub("", sample.document))
    again, = Generator(default_tokenizer, Haystack(generator.haystack.text)).samples("niah_single", 4096, 1, seed=4)
    assert again.prompt == generator.samples("niah_single", 4096, 1, seed=4)[0].prompt


def test_niah_single_and_multikey_answers_occur_once_and_distractors_never_give_them(generator):
    for sample in generator.samples("niah_single", 4096, 5, seed=3):
        (key, value), = needles(sample)
        assert sample.answers == [value] and len(value) == 7 and sample.document.count(value) == 1
        assert key in sample.question and key in sample.answer_start
    for sample in generator.samples("niah_multikey", 16384, 5, seed=3):
        found = needles(sample)
        asked = re.search(r"for ([a-z]+-[a-z]+) mentioned", sample.question).group(1)
        assert len(found) == 4 and [value for key, value in found if key == asked] == sample.answers
        assert sample.document.count(sample.answers[0]) == 1 and sample.document.count(asked) == 1
        for key, value in found:
            if key != asked:  # a look-alike: one word of the asked key kept, never the whole key or its value
                assert value != sample.answers[0] and len(set(key.split("-")) & set(asked.split("-"))) == 1
                assert key.split("-")[0] in ADJECTIVES and key.split("-")[1] in NOUNS


def test_multivalue_and_multiquery_ask_for_every_value(generator):
    for sample in generator.samples("niah_multivalue", 4096, 5, seed=4):
        found = needles(sample)
        assert len({key for key, _ in found}) == 1 and f"for {found[0][0]} mentioned" in sample.question
        assert sorted(value for _, value in found) == sorted(sample.answers) and len(set(sample.answers)) == 4
        assert all(sample.document.count(value) == 1 for value in sample.answers)
    for sample in generator.samples("niah_multiquery", 4096, 5, seed=4):
        values = dict(needles(sample))
        asked = re.findall(r"[a-z]+-[a-z]+", sample.question)
        assert len(asked) == len(values) == 4 and set(asked) == set(values)
        assert sample.answers == [values[key] for key in asked]
        assert all(sample.document.count(value) == 1 for value in sample.answers)


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_a_shared_document_holds_every_samples_needles_once_and_each_asks_its_own(generator, task):
    alone = generator.samples(task, 16384, 6, seed=5, first=2)
    shared = generator.samples(task, 16384, 6, seed=5, first=2, shared=True)
    document = shared[0].document
    planted = needles(shared[0])
    assert all(sample.document == document for sample in shared)
    assert len({tuple(sample.answers) for sample in shared}) == 6
    keys = [key for key, _ in planted]
    for sample in shared:
        assert 0.99 * 16384 <= len(sample.prompt) <= 16384, len(sample.prompt)
        assert all(document.count(value) == 1 for value in sample.answers)
        # Numbered as drawn alone, with what that sample plants alone: its needles, its question, its answers.
        own, = [each for each in alone if each.number == sample.number] or [None]
        if own is not None:
            assert (own.question, own.answers) == (sample.question, sample.answers)
            assert set(needles(own)) <= set(planted)
            for key in {key for key, _ in needles(own)}:  # no other sample plants a key of its own
                assert keys.count(key) == [k for k, _ in needles(own)].count(key)
    assert len(planted) == 6 * len(needles(alone[0]))
    assert [sample.number for sample in shared][:1] == [2] and len({s.number for s in shared}) == 6


def test_a_shared_document_passes_over_a_sample_whose_key_another_has(generator):
    """niah_single's keys are two words of 1,720 pairs, drawn before anything else: with seed 4 samples 8 and 1 or
    another before it share one, and sample 8 is passed over for number 9."""
    alone = generator.samples("niah_single", 4096, 10, seed=4)
    keys = [needles(sample)[0][0] for sample in alone]
    clash = next(i for i, key in enumerate(keys) if key in keys[:i])
    shared = generator.samples("niah_single", 4096, 9, seed=4, shared=True)
    assert [sample.number for sample in shared] == [i for i in range(10) if i != clash]
    assert sorted(key for key, _ in needles(shared[0])) == sorted(keys[:clash] + keys[clash + 1:])


def test_a_shared_document_is_refused_for_the_word_tasks_and_for_more_samples_than_keys(generator, monkeypatch):
    for task in ("cwe", "fwe"):
        with pytest.raises(ValueError, match=f"not {task}'s"):
            generator.samples(task, 4096, 2, seed=0, shared=True)
    # 3 x 3 words: 9 keys (the 1,720 of the full lists take some 17,000 draws to run out)
    monkeypatch.setattr(ruler, "ADJECTIVES", ADJECTIVES[:3])
    monkeypatch.setattr(ruler, "NOUNS", NOUNS[:3])
    run = argparse.Namespace(samples=10, seed=0, first_sample=0, shared_document=True)
    with pytest.raises(SystemExit, match=r"^ruler.py: error: only 9 of 10 niah_single samples .* fewer --samples$"):
        draw(generator, "niah_single", 16384, run)


def test_variable_tracking_chains_resolve_to_the_answers(generator):
    """Resolved in reading order (each variable defined once, after the one it copies), the variables holding the
    asked value are exactly the answers: 2 to 5 (1 to 4 hops); the decoy chains hold other values."""
    hops = set()
    for sample in generator.samples("vt", 4096, 12, seed=5):
        holds = resolved_assignments(sample.document)
        value = re.search(r"value (\d{5})", sample.question).group(1)
        assert sorted(n for n, v in holds.items() if v == value) == sorted(sample.answers)
        assert sample.document.count(value) == 1 and f"{len(sample.answers)} variables" in sample.answer_start
        decoys = Counter(v for v in holds.values() if v != value)
        assert len(decoys) == 2 and all(2 <= n <= 5 for n in decoys.values())
        assert all(sample.document.count(f"VAR {name} =") == 1 for name in sample.answers)
        hops.add(len(sample.answers) - 1)
    assert hops == {1, 2, 3, 4}


def test_a_shared_document_holds_every_samples_chains_and_each_asks_its_own(generator):
    """vt's samples in one document: every sample's three chains (each variable assigned once), and each question's
    value held by exactly the variables of that sample's own chain, as when it is drawn alone."""
    alone = generator.samples("vt", 16384, 5, seed=5)
    shared = generator.samples("vt", 16384, 5, seed=5, shared=True)
    document = shared[0].document
    assert all(sample.document == document for sample in shared)
    holds = resolved_assignments(document)
    assert len(set(holds.values())) == 15  # 5 samples, 3 chains each
    for sample in shared:
        assert 0.99 * 16384 <= len(sample.prompt) <= 16384, len(sample.prompt)
        value = re.search(r"value (\d{5})", sample.question).group(1)
        assert sorted(n for n, v in holds.items() if v == value) == sorted(sample.answers)
        assert document.count(value) == 1
        own, = [each for each in alone if each.number == sample.number] or [None]
        if own is not None:
            assert (own.question, own.answers, own.answer_start) == (sample.question, sample.answers,
                                                                     sample.answer_start)
            assert set(ASSIGNMENT.findall(own.document)) <= set(ASSIGNMENT.findall(document))


@pytest.mark.parametrize("length", [4096, 65536])  # 64K: more than the vocabulary's words 3 times each
def test_common_words_are_the_most_common_by_far(generator, length):
    for sample in generator.samples("cwe", length, 2, seed=6):
        lines = sample.document.splitlines()
        assert [line.split(". ")[0] for line in lines] == [str(i) for i in range(1, len(lines) + 1)]
        counts = Counter(line.split(". ")[1] for line in lines)
        assert sorted(w for w, _ in counts.most_common(10)) == sorted(sample.answers)
        rest = [n for w, n in counts.items() if w not in sample.answers]
        assert min(counts[w] for w in sample.answers) >= 30 and min(counts[w] for w in sample.answers) >= 3 * max(rest)
        assert not any(w in other for w in sample.answers for other in counts if other != w)  # no word hides another


def test_frequent_words_are_the_3_most_frequent_by_a_margin(generator):
    for length in (4096, 16384):
        for sample in generator.samples("fwe", length, 4, seed=7):
            counts = Counter(sample.document.split()).most_common()
            assert [w for w, _ in counts[:3]] == sample.answers
            assert counts[2][1] >= 1.2 * counts[3][1] and len(counts) > 20  # a Zipf tail, not just 4 words


def test_recall_all_is_the_share_of_expected_strings_found():
    assert recall_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1
    assert recall_all("The number is 1234567.", ["1234567", "7654321"]) == 0.5
    assert recall_all("They are: ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO", "PQRST"]) == 0.5  # case-insensitive
    assert recall_all("I do not know.", ["1234567"]) == 0


def test_question_variants_read_the_rest_of_the_prompt_once():
    """`--question-variants`: each sample's question and answer under several settings, what comes before them read
    once. Every variant must answer as a session that reads the same prompts under its settings alone (a tiny random
    model whose question selects per query and keeps its pools; a second indexer reads the segments, as the hybrid
    default does, so that query_topk, which turns the first one's queries, changes the question's reading only)."""
    from dataclasses import replace

    from benchmarks.common import greedy_answer
    from benchmarks.ruler import Sample, answer_under, question_variants
    from indexpool.model.generate import Session
    from indexpool.model.indexers import TrainingFreeIndexer
    from indexpool.model.indexpool_cache import IndexPoolConfig
    from tests.test_indexpool_cache import CONFIG, SETTINGS, prompts_for, tiny_model

    model, segments = tiny_model(5), TrainingFreeIndexer(CONFIG, 4)
    default = IndexPoolConfig(**SETTINGS | dict(query_topk=8, question_pools=1, kv_storage="full"))
    variants = [default] + [replace(default, **v) for v in question_variants("question_pools=0;query_topk=4")]
    # 150 and 174 tokens: the rest of each prompt is read in segments longer than query_tokens (a short last one
    # would select per query, with the first variant's query_topk).
    first, other = prompts_for(11, [150])[0], prompts_for(12, [174])[0]
    # Each one's "document": what Session.prefill reads before a question of query_tokens (6) at a pool boundary.
    samples = [Sample("niah_single", 200, "", "", "", "", ["1"], prompt, document_end) for prompt, document_end in
               ((first, 144), (first[:130] + other[130:], 168))]  # the second shares the first's start, not its question
    session = Session(model, 200, attention=default, segment_indexer=segments)
    answers = [[answer_under(session, sample, settings, 5, frozenset(), "test") for settings in variants]
               for sample in samples]
    assert session.cache.settings is default
    for v, settings in enumerate(variants):
        alone = Session(model, 200, attention=settings, segment_indexer=segments)
        for sample, answered in zip(samples, answers):  # in the same order: the second reads from where they part
            assert answered[v][0] == greedy_answer(alone, sample.prompt, 5, "test")[0]
    # The first variant read the second sample from the last pool boundary they share; the others its question.
    assert [fed for _, _, fed in answers[1]] == [174 - 128, 174 - 168, 174 - 168]
    with pytest.raises(Exception, match="NAME=NUMBER"):
        question_variants("window=3")


def test_samples_sharing_a_document_read_it_once_and_answer_as_each_alone():
    """What `--shared-document` rests on: questions asked of one document in turn read the document once, and each
    answers as a session that reads its prompt alone (a tiny random model; IndexPool past its 64-token context)."""
    from benchmarks.common import greedy_answer
    from benchmarks.ruler import Sample, answer_under
    from indexpool.model.generate import Session
    from indexpool.model.indexpool_cache import IndexPoolConfig
    from tests.test_indexpool_cache import SETTINGS, prompts_for, tiny_model

    model = tiny_model(5)
    settings = IndexPoolConfig(**SETTINGS | dict(query_topk=8, question_pools=1, kv_storage="full"))
    document = prompts_for(21, [144])[0]
    questions = prompts_for(22, [6, 9, 7])
    samples = [Sample("niah_single", 160, "", "", "", "", ["1"], document + question, 144) for question in questions]
    session = Session(model, 160, attention=settings)
    answers = [answer_under(session, sample, None, 5, frozenset(), "test") for sample in samples]
    assert [fed for _, _, fed in answers] == [144 + 6, 9, 7]  # the document once, then each question
    for sample, (out, _, _) in zip(samples, answers):
        alone = Session(model, 160, attention=settings)
        assert out == greedy_answer(alone, sample.prompt, 5, "test")[0]


def test_document_words_are_the_entries_or_the_coded_words_and_a_cut_start_is_dropped():
    assert document_words("cwe", "1. apple\n2. pear\n") == ["apple", "pear"]
    assert document_words("cwe", "ar\n12. apple\n3. pear\n", cut=True) == ["apple", "pear"]
    assert document_words("fwe", "xyzab qwerty xyzab", cut=True) == ["qwerty", "xyzab"]
    assert document_words("fwe", "xyzab qwerty xyzab") == ["xyzab", "qwerty", "xyzab"]


def test_word_baselines_count_the_recent_window_and_draw_from_the_whole_document(generator, default_tokenizer):
    early, late = ["apple"] * 60 + ["melon"] * 4, ["grape", "lemon", "peach", "plum"] * 15
    document = "".join(f"{i}. {word}\n" for i, word in enumerate(early + late, 1))
    question = "\n\nWhat are the 2 most common words in the list above?"
    sample = generator._sample("cwe", 4096, "Below is a numbered list of words.\n\n", document, question, "They are:",
                               ["apple", "melon"])
    whole = word_baselines(sample, default_tokenizer, window=len(sample.prompt), draws=2000)
    assert whole["window count"] == 50  # apple (60) is first; melon (4) is not second: every late word has 15
    recent = word_baselines(sample, default_tokenizer, window=200)  # the last 200 tokens: late words only
    assert recent["window count"] == 0 and recent["entries"] == whole["entries"] == 100 * 64 / 124
    # two words drawn by occurrence: each answer named with probability 1 - (1 - p)^2, p = 60 or 4 in 124
    expected = 100 * ((1 - (1 - 60 / 124) ** 2) + (1 - (1 - 4 / 124) ** 2)) / 2
    assert abs(whole["random words"] - expected) < 2.0
