"""RULER-style long-context tasks, generated here; IndexPool, dense attention and a window-only reader in one run.

The task kinds follow NVIDIA's RULER (Hsieh et al., 2024); the generator and the wording are our own, and nothing is
downloaded. Needles and assignments hide in natural prose (`common.natural_haystack`: Python's documentation, then
the system's license texts; repeated past its end), never in repeated filler lines.

    niah_single      one needle "One of the special magic numbers for KEY is: VALUE." (KEY two words, VALUE seven
                     digits); the value is asked for
    niah_multikey    that needle among 3 distractor needles whose keys share a word with the asked one
    niah_multivalue  4 needles for the asked key, each with its own value: all 4 are asked for
    niah_multiquery  4 needles with 4 keys, all asked for at once
    vt               variable tracking: a chain "VAR A = 12345", then 1 to 4 hops "VAR B = VAR A", among 2 decoy
                     chains; every variable that holds the value is asked for
    cwe              common words: a numbered list of words, 10 of them 30 times each and the others 3 times (more
                     where our vocabulary runs short, the 10 staying 3 times as frequent): the 10 most common
    fwe              frequent words: coded words drawn from a Zipf law (exponent 2): the 3 most frequent

A length counts every token the model reads (chat template, instruction, document, question, the answer's start) in
the model's tokenizer: each prompt has between 99% and 100% of it. Each answer is scored as RULER scores these tasks:
the share of the expected strings found in it (case-insensitive; all-style recall), averaged over the samples.
Samples are seeded by (seed, task, length, index): more samples keep the first ones.

Readers, in one run: `dense` (only where a prompt and its answer fit the model's own context), `indexpool` (the
default settings and indexer, as `SessionOptions()` gives them) and `window` (`IndexPoolConfig(topk=0)`: the attention
sinks and the recent window only, no retrieval, as StreamingLLM). Samples share their haystack's start (as RULER's
do) and are read in the order of their token ids, so a session re-reads a prompt only from where it leaves the one
before (IndexPool's segments, and so its selections, then start elsewhere: scores can move a little with the order).
A prompt is read as `indexpool ask` reads a document and a question: the chat template's start, the instruction and
the document first, then the question with the answer's start, which IndexPool reads as a question (twice: its
first read finds the pools it keeps, from the question's tokens only).

    .venv/bin/python -m benchmarks.ruler --lengths 4096,16384 --samples 5
    .venv/bin/python -m benchmarks.ruler --lengths 32768,131072 --readers indexpool,window --json ruler.json
    .venv/bin/python -m benchmarks.ruler --haystack haystack.txt --lengths 32768 --tasks niah_single --topk 4096

`--shared-document` (the needle tasks and vt) plants every sample's needles or chains in one document and asks each
sample's question of it: the document is read once for all of them, which is what makes 10 samples at 1M one read of
1M tokens; each question then has the other samples' needles or chains besides its own (harder than a sample alone).
`--haystack FILE` draws the samples from that text (save `common.natural_haystack()` to a file to draw the same
ones on another machine); `--topk` sets IndexPool's far tokens per query, `--query-topk` those of the question's
and the answer's queries, `--question-pools` and `--question-matches` the question's pools kept for them (its best
scored, and the places holding its rarest wording); `--json` is rewritten after every
row. `--baselines` reads nothing: it scores the cwe and fwe samples with answers no model gives (`word_baselines`:
the recent window's most frequent words, words drawn at random from the document), what counting or chance scores.

Prints the machine, then one row per (task, length, reader): score, samples, seconds per sample and the tokens a
sample read (what its prompt did not share with the one before); then each reader's average over the tasks per
length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import statistics
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from benchmarks.common import chat_frame, greedy_answer, long_read_progress, machine_description, natural_haystack
from indexpool.model.generate import Session, common_prefix
from indexpool.model.indexpool_cache import IndexPoolConfig
from indexpool.model.runtime import load_engine, set_threads
from indexpool.model.tensor_cache import write_atomically
from indexpool.model.sessions import SessionOptions, default_indexer, describe_indexers, segment_indexer

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
NIAH_TASKS = TASKS[:4]
PLANTED_TASKS = TASKS[:5]  # the tasks that plant lines in prose: their samples can share one document
READERS = ("dense", "indexpool", "window")
TOLERANCE = 0.01  # a prompt has between (1 - TOLERANCE) * length and length tokens
MAX_NEW_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "niah_multiquery": 48, "vt": 40,
                  "cwe": 64, "fwe": 32}  # the answer with room to spare: each digit is a token of its own

# Needle keys are adjective-noun pairs (RULER draws words too); none of these is a suffix of another, so the key
# "red-ox" could never hide inside "tired-ox".
ADJECTIVES = ("amber bold brisk calm clever crisp dusty eager faint fierce gentle golden hollow humble icy jolly keen "
              "lively lucky mellow misty noble pale proud quiet rapid rustic shiny silent sleek smoky snowy solid "
              "stormy sunny swift tidy vivid wild witty").split()
NOUNS = ("anchor badger beacon canyon castle cedar comet copper dolphin ember falcon forest galaxy garden harbor "
         "island jungle kettle lantern meadow mirror needle oasis orchid otter pebble pepper pigeon planet quartz "
         "raven ribbon saddle salmon shadow spider summit tiger tunnel valley violin walrus willow").split()
NIAH_INTRO = ("Some special magic numbers are hidden in the text below. Read it carefully and remember them: you will "
              "be asked about them at the end.\n\n")
VT_INTRO = ("The text below hides variable assignments, lines of the form VAR NAME = VALUE. Keep track of them: you "
            "will be asked which variables end up holding a value.\n\n")
COMMON_WORDS, COMMON_TIMES, RARE_TIMES = 10, 30, 3
CODED_WORDS, CODED_LETTERS, ZIPF_EXPONENT, FREQUENT_WORDS = 1000, 6, 2.0, 3
FREQUENT_MARGIN = 1.2  # the 3rd most frequent coded word occurs at least this many times as often as the 4th


@dataclass
class Sample:
    task: str
    length: int
    instruction: str  # the user's message is instruction + document + question
    document: str
    question: str
    answer_start: str  # the assistant's answer begins with it (the model continues it)
    answers: list[str]  # what the answer must name, all of it
    prompt: list[int] = field(repr=False)  # token ids: chat template, instruction, document, question, answer start
    document_end: int = field(repr=False)  # prompt[:document_end]: the chat template's start, instruction, document
    number: int = 0  # the sample's number among the task's (its seed's last part)


@dataclass
class Plan:
    """A sample of a task that plants lines in prose (a needle task, vt) before its document is written: what it
    plants where, and what it asks."""
    task: str
    intro: str
    inserts: list[tuple[float, str]]  # (depth in [0, 1), text), planted in this order
    names: set[str]  # its keys, values and variables: no other sample in a shared document may plant one of them
    question: str
    answer_start: str
    answers: list[str]


def recall_all(answer: str, expected: list[str]) -> float:
    """RULER's all-style string match for one answer: the share of the expected strings that occur in it,
    case-insensitive."""
    text = answer.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


WORD_TASKS = ("cwe", "fwe")  # the tasks whose answer is counted, not found: word_baselines scores them


def document_words(task: str, text: str, cut: bool = False) -> list[str]:
    """A cwe list's entries or a fwe text's coded words, in order; with `cut` (text a piece of the document), not the
    line or word text starts in."""
    if task == "cwe":  # a cut line is whole or fails the pattern, but for its number's first digits
        return re.findall(r"^\d+\. (\S+)$", text, re.M)
    return text.split()[1:] if cut else text.split()


def word_baselines(sample: Sample, tokenizer, window: int, draws: int = 200) -> dict[str, float]:
    """Scores of answers no model gives, for cwe and fwe: `window count`, the asked number of words most frequent in
    the document's part of the prompt's last `window` tokens (the recent window a reader attends as it answers: what
    it could name by counting there alone); `random words`, as many words drawn at random from the whole document
    by occurrence (what copying gives by chance, averaged over `draws` answers); `entries`, the share of the
    document's words that are answers (not a score)."""
    asked = len(sample.answers)
    recent = tokenizer.decode(sample.prompt[max(0, len(sample.prompt) - window):sample.document_end])
    counted = [word for word, _ in Counter(document_words(sample.task, recent, cut=True)).most_common(asked)]
    words = document_words(sample.task, sample.document)
    rng = random.Random(sample.document)
    chance = statistics.mean(recall_all(" ".join(rng.choices(words, k=asked)), sample.answers) for _ in range(draws))
    answers = set(sample.answers)
    return {"window count": 100 * recall_all(" ".join(counted), sample.answers), "random words": 100 * chance,
            "entries": 100 * sum(word in answers for word in words) / len(words)}


class Haystack:
    """The natural prose needles hide in, in pieces: sentences, and lines of a long piece (a table, a code listing),
    so that a prompt can be cut to within 1% of even 4K tokens and a needle always lands between two pieces."""

    MAX_PIECE_CHARS = 160  # about 40 tokens

    def __init__(self, text: str | None = None):
        self.text = natural_haystack() if text is None else text
        pieces = []
        for piece in re.split(r"(?<=[.!?]\s)|(?<=\n\n)", self.text):
            pieces += [piece] if len(piece) <= self.MAX_PIECE_CHARS else re.split(r"(?<=\n)", piece)
        self.pieces = [piece for piece in pieces if piece]

    def prose(self, n: int, inserts: dict[int, list[str]]) -> str:
        """The first n pieces (repeated past the end), inserts[i] standing before piece i (i == n: after the last)."""
        parts = []
        for i in range(n + 1):
            parts += inserts.get(i, [])
            if i < n:
                parts.append(self.pieces[i % len(self.pieces)])
        return "".join(parts)

    @cached_property
    def words(self) -> list[str]:
        """The common-words vocabulary, sorted: the prose's plain words of 4 to 10 lower-case letters (no part of a
        name, a call or a contraction) that occur twice or more (no fragment of a one-off oddity), less those inside
        another of them ("claim" in "disclaim"), which naming the other would score."""
        counts = Counter(re.findall(r"(?<![\w.'(-])[a-z]{4,10}(?![\w'(-])", self.text))
        words = sorted(word for word, n in counts.items() if n >= 2)
        joined = " ".join(words)
        return [word for word in words if joined.count(word) == 1]

    def absent(self, text: str) -> bool:
        return text not in self.text


class Generator:
    """Samples of every task for one tokenizer (their lengths are measured with it) and one haystack."""

    def __init__(self, tokenizer, haystack: Haystack | None = None):
        self.tokenizer = tokenizer
        self.haystack = haystack or Haystack()
        pre, post = chat_frame(tokenizer)
        self._head = tokenizer.encode(pre, allow_special=True)
        self._post = post

    def samples(self, task: str, length: int, count: int, seed: int, first: int = 0,
                shared: bool = False) -> list[Sample]:
        """Samples number first .. first + count - 1 of the task, length and seed (each drawn on its own).
        `shared` (the needle tasks and vt): one document holds every sample's needles or chains, each sample asking
        its own question of it; a sample whose keys, values or variables another already has is passed over for the
        next number."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
        if shared and task not in PLANTED_TASKS:
            raise ValueError(f"one shared document holds the samples of {', '.join(PLANTED_TASKS)} only, not {task}'s")
        build = getattr(self, f"_{task}")
        if task not in PLANTED_TASKS:
            return [dataclasses.replace(build(self._rng(seed, task, length, i), length), number=i)
                    for i in range(first, first + count)]
        if not shared:
            return [self._planted_document(length, [build(self._rng(seed, task, length, i))], [i])[0]
                    for i in range(first, first + count)]
        planted, numbers, taken = [], [], set()
        i = first
        while len(planted) < count:
            if i - first >= 10 * count + 100:
                raise RuntimeError(f"only {len(planted)} of {count} {task} samples plant no key, value or variable "
                                   f"another one plants: ask for fewer --samples")
            plan = build(self._rng(seed, task, length, i))
            if not plan.names & taken:
                planted.append(plan)
                numbers.append(i)
                taken |= plan.names
            i += 1
        return self._planted_document(length, planted, numbers)

    @staticmethod
    def _rng(seed: int, task: str, length: int, number: int) -> random.Random:
        return random.Random(f"{seed}:{task}:{length}:{number}")

    def _sample(self, task, length, intro, document, question, answer_start, answers) -> Sample:
        user = self._head + self.tokenizer.encode(intro + document + question)
        prompt = user + self.tokenizer.encode(self._post + answer_start, allow_special=True)
        asked = self.tokenizer.encode(question)
        document_end = len(user) - len(asked)
        if user[document_end:] != asked:  # a token straddles the document's end: the document is what lies before it
            document_end = common_prefix(prompt, self._head + self.tokenizer.encode(intro + document))
        return Sample(task, length, intro, document, question, answer_start, list(answers), prompt, document_end)

    def _fit(self, build, length: int) -> Sample:
        """build(size) for the size whose prompt has between (1 - TOLERANCE) * length and length tokens; size is how
        much of the document's filler there is, and the tokens grow with it about linearly."""
        fixed = len(build(0).prompt)
        goal = length * (1 - TOLERANCE / 2)
        if fixed > goal:
            raise ValueError(f"a length of {length} tokens is too short for this task (it needs {fixed} and more)")
        size = max(1, round((goal - fixed) / 8))
        tried = {}
        for _ in range(30):
            sample = tried[size] = build(size)
            n = len(sample.prompt)
            if length * (1 - TOLERANCE) <= n <= length:
                return sample
            step = round((goal - n) * size / max(n - fixed, 1))  # at the tokens per unit measured so far
            size = max(1, size + (step or (1 if n < goal else -1)))
            if size in tried:  # circling: one piece straddles the interval; step by one from here
                size = size + 1 if len(tried[size].prompt) < goal else size - 1
        raise RuntimeError(f"could not fit a {build.__qualname__} sample to {length} tokens (a piece of the prose "
                           f"longer than the 1% a length allows lies where it ends): try another --seed or length")

    # --- needles in a haystack ---

    def _keys(self, rng: random.Random, count: int) -> list[str]:
        keys = set()
        while len(keys) < count:
            keys.add(f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}")
        return rng.sample(sorted(keys), count)

    def _numbers(self, rng: random.Random, count: int, digits: int) -> list[str]:
        """Distinct numbers of `digits` digits, none in the haystack (so each occurs exactly where it is put)."""
        numbers: list[str] = []
        while len(numbers) < count:
            number = str(rng.randrange(10 ** (digits - 1), 10**digits))
            if number not in numbers and self.haystack.absent(number):
                numbers.append(number)
        return numbers

    @staticmethod
    def needle(key: str, value: str) -> str:
        return f"One of the special magic numbers for {key} is: {value}. "

    def _niah(self, rng: random.Random, task: str, needles: list[tuple[str, str]], asked: list[str],
              answers: list[str]) -> Plan:
        """`needles` (key, value) at random depths of the prose, `asked` keys asked for, `answers` expected."""
        depths = sorted(rng.random() for _ in needles)
        order = rng.sample(needles, len(needles))
        keys = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + " and " + asked[-1]
        if len(answers) == 1:
            question = f"\n\nWhat is the special magic number for {keys} mentioned in the text above?"
            answer_start = f"The special magic number for {keys} mentioned in the text is"
        else:
            every = " all" if len(asked) == 1 else ""  # several values for one key
            question = f"\n\nWhat are{every} the special magic numbers for {keys} mentioned in the text above?"
            answer_start = f"The special magic numbers for {keys} mentioned in the text are"
        return Plan(task, NIAH_INTRO, [(depth, self.needle(key, value)) for depth, (key, value) in zip(depths, order)],
                    {name for needle in needles for name in needle}, question, answer_start, answers)

    def _planted_document(self, length: int, plans: list[Plan], numbers: list[int]) -> list[Sample]:
        """One document holding every plan's inserts, and a sample for each plan's question of it (numbered as
        `numbers` say). Fitted with the longest question, so that every prompt is within the length."""

        def build(size: int, plan: Plan) -> Sample:
            inserts: dict[int, list[str]] = {}
            for each in plans:
                for depth, text in each.inserts:
                    inserts.setdefault(round(depth * size), []).append(text)
            return self._sample(plan.task, length, plan.intro, self.haystack.prose(size, inserts), plan.question,
                                plan.answer_start, plan.answers)

        longest = max(plans, key=lambda plan: len(build(0, plan).prompt))
        fitted = self._fit(lambda size: build(size, longest), length)
        return [dataclasses.replace(fitted if plan is longest else self._sample(
            plan.task, length, plan.intro, fitted.document, plan.question, plan.answer_start, plan.answers),
            number=number) for plan, number in zip(plans, numbers)]

    def _niah_single(self, rng):
        key, = self._keys(rng, 1)
        value, = self._numbers(rng, 1, 7)
        return self._niah(rng, "niah_single", [(key, value)], [key], [value])

    def _niah_multikey(self, rng):
        """Three distractors whose keys look like the asked one: each keeps one of its two words."""
        key, = self._keys(rng, 1)
        adjective, noun = key.split("-")
        distractors: set[str] = set()
        while len(distractors) < 3:
            other = f"{adjective}-{rng.choice(NOUNS)}" if rng.random() < 0.5 else f"{rng.choice(ADJECTIVES)}-{noun}"
            if other != key:
                distractors.add(other)
        values = self._numbers(rng, 4, 7)
        needles = list(zip([key, *sorted(distractors)], values))
        return self._niah(rng, "niah_multikey", needles, [key], values[:1])

    def _niah_multivalue(self, rng):
        key, = self._keys(rng, 1)
        values = self._numbers(rng, 4, 7)
        return self._niah(rng, "niah_multivalue", [(key, v) for v in values], [key], values)

    def _niah_multiquery(self, rng):
        keys, values = self._keys(rng, 4), self._numbers(rng, 4, 7)
        return self._niah(rng, "niah_multiquery", list(zip(keys, values)), keys, values)

    # --- variable tracking ---

    def _names(self, rng: random.Random, count: int) -> list[str]:
        names: list[str] = []
        while len(names) < count:
            name = "".join(rng.choices(string.ascii_uppercase, k=5))
            if name not in names and "VAR" not in name and self.haystack.absent(name):
                names.append(name)
        return names

    def _vt(self, rng):
        """The asked chain and 2 decoys, each a value and 1 to 4 hops; each chain's lines in order at random depths."""
        hops = [rng.randint(1, 4) for _ in range(3)]
        values = self._numbers(rng, 3, 5)
        names = self._names(rng, sum(hops) + 3)
        chains, lines = [], []
        for n_hops, value in zip(hops, values):
            chain, names = names[: n_hops + 1], names[n_hops + 1 :]
            chains.append(chain)
            lines.append([f"VAR {chain[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(chain, chain[1:])])
        placed = [(depth, line) for chain_lines in lines
                  for depth, line in zip(sorted(rng.random() for _ in chain_lines), chain_lines)]
        placed.sort()
        answers = chains[0]
        question = f"\n\nWhich variables hold the value {values[0]}, directly or through other variables?"
        answer_start = f"{len(answers)} variables hold the value {values[0]}. They are:"
        return Plan("vt", VT_INTRO, [(depth, f"\n{line}\n") for depth, line in placed],
                    {name for chain in chains for name in chain} | set(values), question, answer_start, answers)

    # --- common and frequent words ---

    def _cwe(self, rng, length):
        """size: how many list entries the other words take. Each of them occurs RARE_TIMES times while the
        vocabulary lasts, more after; the common words stay 3 times as frequent."""
        words = rng.sample(self.haystack.words, len(self.haystack.words))
        common, others = words[:COMMON_WORDS], words[COMMON_WORDS:]
        shuffle_seed = rng.random()
        question = f"\n\nWhat are the {COMMON_WORDS} most common words in the list above?"
        answer_start = f"The {COMMON_WORDS} most common words in the list are:"

        def build(size: int) -> Sample:
            distinct = min(len(others), math.ceil(size / RARE_TIMES))
            times = max(RARE_TIMES, math.ceil(size / max(distinct, 1)))
            entries = [w for w in others[:distinct] for _ in range(times)][:size]
            entries += common * max(COMMON_TIMES, 3 * times)
            random.Random(shuffle_seed).shuffle(entries)
            document = "".join(f"{i}. {word}\n" for i, word in enumerate(entries, 1))
            return self._sample("cwe", length, "Below is a numbered list of words. Some of them occur far more often "
                                "than the others.\n\n", document, question, answer_start, common)

        return self._fit(build, length)

    def _fwe(self, rng, length):
        """size: how many coded words the text holds, drawn one by one from a Zipf law over CODED_WORDS of them (so
        a shorter text is a prefix of a longer one); the answer is the text's own 3 most frequent words, which a
        sample must show by a margin over the 4th (else it is drawn again)."""
        for _ in range(100):
            vocabulary: set[str] = set()
            while len(vocabulary) < CODED_WORDS:
                vocabulary.add("".join(rng.choices(string.ascii_lowercase, k=CODED_LETTERS)))
            ranked = rng.sample(sorted(vocabulary), CODED_WORDS)
            weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(CODED_WORDS)]
            stream_seed = rng.random()

            def build(size: int) -> Sample:
                drawn = random.Random(stream_seed).choices(ranked, weights=weights, k=size)
                counts = Counter(drawn).most_common(FREQUENT_WORDS)
                return self._sample("fwe", length, "Below is a coded text. Keep count of how often each coded word "
                                    "occurs.\n\n", " ".join(drawn), "\n\nWhich are the 3 most frequent coded words in "
                                    "the text above?", "The 3 most frequent coded words are:", [w for w, _ in counts])

            sample = self._fit(build, length)
            counts = Counter(sample.document.split()).most_common(FREQUENT_WORDS + 1)
            if len(counts) > FREQUENT_WORDS and counts[-2][1] >= FREQUENT_MARGIN * counts[-1][1]:
                return sample
        raise RuntimeError("no coded text with a clear 3 most frequent words")


# --- reading ---


def open_reader(reader: str, loaded, capacity: int, indexer, for_segments, settings: IndexPoolConfig) -> Session:
    if reader == "dense":
        return Session(loaded.model, capacity)
    if reader == "indexpool":
        return Session(loaded.model, capacity, attention=settings, indexer=indexer, segment_indexer=for_segments,
                       words=loaded.tokenizer.word_ids)
    # The window reader selects nothing: the segment indexer (hybrid) would only compute keys nobody reads.
    return Session(loaded.model, capacity, attention=IndexPoolConfig(topk=0), indexer=indexer)


# What `--question-variants` may set (short forwards only), and each setting's type.
QUESTION_SETTINGS = {"question_pools": int, "question_matches": int, "query_topk": int, "match_repeat_share": float}


def question_variants(text: str) -> list[dict[str, float]]:
    """'question_pools=0,query_topk=1024;match_repeat_share=0.5' -> [{...}, {...}] (argparse type)."""
    variants = []
    for group in text.split(";"):
        settings = {}
        for item in group.split(","):
            name, _, value = (part.strip() for part in item.partition("="))
            try:
                settings[name] = QUESTION_SETTINGS[name](value)
            except (KeyError, ValueError):
                raise argparse.ArgumentTypeError(f"{item!r}: expected NAME=NUMBER with NAME one of "
                                                 f"{', '.join(QUESTION_SETTINGS)}") from None
            if settings[name] < 0:
                raise argparse.ArgumentTypeError(f"{item!r}: a setting is 0 or more")
        variants.append(settings)
    return variants


def variant_name(settings: dict[str, float]) -> str:
    return "indexpool[" + ",".join(f"{k}={v}" for k, v in settings.items()) + "]"


def answer_under(session: Session, sample: Sample, settings: IndexPoolConfig | None, max_new_tokens: int, stop_ids,
                 label: str, progress: bool = False):
    """`greedy_answer` as `indexpool ask` reads: the document first (only what the session does not hold of it
    already), then the question, which `Session.prefill` reads as a question (twice, with IndexPool). `settings`
    (None: the session's own) are those of the question and the answer: they differ from the session's in what
    short forwards do only (the indexer's query turned for their query_topk). Returns the answer's token ids,
    its GenerationStats and the tokens read (document and question)."""
    cache, prompt, end = session.cache, sample.prompt, sample.document_end
    document_read = 0
    if session.tokens[:end] != prompt[:end]:
        held = common_prefix(session.tokens, prompt[:end])
        reading = long_read_progress(label, end - held) if progress else None
        session.prefill(prompt[:end], reading, query_tail=False)
        document_read = session.last_fed_tokens
    session.tokens = session.tokens[: cache.truncate(end)]
    saved = getattr(cache, "settings", None)
    if settings is not None:
        cache.settings = settings
        cache.indexer.read_at(settings.far_distances())
    try:
        out, stats, fed = greedy_answer(session, prompt, max_new_tokens, label, stop_ids=stop_ids, question_from=end)
        return out, stats, document_read + fed
    finally:
        if settings is not None:
            cache.settings = saved
            cache.indexer.read_at(saved.far_distances())


def draw(generator: Generator, task: str, length: int, args) -> list[Sample]:
    """The run's samples of a task and length; a length too short for the task ends the run with a one-line error."""
    try:
        return generator.samples(task, length, args.samples, args.seed, args.first_sample, args.shared_document)
    except ValueError as error:
        raise SystemExit(f"ruler.py: error: {error}: choose a longer --lengths") from None
    except RuntimeError as error:
        raise SystemExit(f"ruler.py: error: {error}") from None


def print_word_baselines(args, generator: Generator, window: int) -> None:
    print(f"recent window {window} tokens, seed {args.seed}, samples {args.first_sample}.."
          f"{args.first_sample + args.samples - 1}; scores in %, entries: the answers' share of the document's words")
    print(f"{'task':<16} {'length':>7} {'window count':>12} {'random words':>12} {'entries':>7} {'samples':>7}")
    for length in args.lengths:
        for task in (t for t in args.tasks if t in WORD_TASKS):
            samples = draw(generator, task, length, args)
            found = [word_baselines(sample, generator.tokenizer, window) for sample in samples]
            mean = {name: statistics.mean(f[name] for f in found) for name in found[0]}
            print(f"{task:<16} {length:>7} {mean['window count']:>12.1f} {mean['random words']:>12.1f} "
                  f"{mean['entries']:>7.1f} {len(found):>7}", flush=True)


def run(args) -> None:
    set_threads(args.threads)
    machine = machine_description()
    print(machine, flush=True)
    loaded = load_engine(args.model, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    settings = SessionOptions().indexpool
    haystack = Haystack(Path(args.haystack).read_text() if args.haystack else None)
    generator = Generator(tokenizer, haystack)
    if args.baselines:  # no reader: no indexer to build
        print_word_baselines(args, generator, settings.window)
        return
    asked = {name: value for name, value in (("topk", args.topk), ("query_topk", args.query_topk),
                                             ("question_pools", args.question_pools),
                                             ("question_matches", args.question_matches)) if value is not None}
    options = SessionOptions(indexpool=dataclasses.replace(settings, **asked))
    indexer, for_segments = default_indexer(options, loaded), segment_indexer(options, loaded)
    context = loaded.config.context_length
    topk, query_topk = options.indexpool.topk, options.indexpool.short_topk()
    question_pools, question_matches = options.indexpool.question_pools, options.indexpool.question_matches
    repeat_share = options.indexpool.match_repeat_share
    print(f"model {loaded.name} ({context} context), indexer {describe_indexers(indexer, for_segments)}, "
          f"topk {topk}, query topk {query_topk}, question pools {question_pools}, question matches {question_matches} "
          f"(look-alikes under {repeat_share} of a match passed over), "
          f"threads {torch.get_num_threads()}, seed {args.seed}", flush=True)
    print(f"{'task':<16} {'length':>7} {'reader':>9} {'score':>6} {'samples':>7} {'s/sample':>8} {'read/sample':>11}",
          flush=True)
    rows, averages = [], []

    def save() -> None:
        report = {"machine": machine, "model": loaded.name, "context": context,
                  "indexer": describe_indexers(indexer, for_segments), "seed": args.seed,
                  "first_sample": args.first_sample, "shared_document": args.shared_document,
                  "topk": topk, "query_topk": query_topk, "question_pools": question_pools, "question_matches": question_matches,
                  "match_repeat_share": repeat_share,
                  "max_new_tokens": MAX_NEW_TOKENS, "rows": rows, "averages": averages}
        write_atomically(Path(args.json), json.dumps(report, indent=1).encode())

    for length in args.lengths:
        t0 = time.perf_counter()
        samples = {task: draw(generator, task, length, args) for task in args.tasks}
        if args.verbose:
            print(f"  generated {length}-token samples in {time.perf_counter() - t0:.1f} s", flush=True)
        longest = max(len(s.prompt) + MAX_NEW_TOKENS[s.task] for task in samples.values() for s in task)
        for reader in args.readers:
            variants = [(reader, None)]
            if reader == "indexpool" and args.question_variants:
                variants += [(variant_name(v), dataclasses.replace(options.indexpool, **v)) for v in args.question_variants]
            if reader == "dense" and longest > context:
                print(f"{'(all)':<16} {length:>7} {reader:>9}   skipped: the prompts exceed the model's "
                      f"{context}-token context", flush=True)
                continue
            session = open_reader(reader, loaded, longest, indexer, for_segments, options.indexpool)
            scores: dict[str, list[float]] = {name: [] for name, _ in variants}
            for task in args.tasks:
                details = {name: [] for name, _ in variants}
                seconds, read = {name: [] for name, _ in variants}, {name: [] for name, _ in variants}
                for sample in sorted(samples[task], key=lambda s: s.prompt):  # in the order of their token ids
                    i = sample.number
                    for name, settings in variants:
                        t0 = time.perf_counter()
                        label = f"{task} {length}:{name}"
                        out, _, fed = answer_under(session, sample, settings, MAX_NEW_TOKENS[task],
                                                   tokenizer.stop_ids, label, progress=args.verbose)
                        seconds[name].append(time.perf_counter() - t0)
                        read[name].append(fed)
                        answer = tokenizer.decode(out)
                        details[name].append({"sample": i, "answers": sample.answers, "answer": answer,
                                              "score": recall_all(answer, sample.answers)})
                        if args.verbose:
                            print(f"  {task} {length} {name} #{i}: {sample.answers} -> {answer!r} "
                                  f"({details[name][-1]['score']:.2f}, {seconds[name][-1]:.1f} s, {fed} tokens "
                                  f"read)", flush=True)
                for name, _ in variants:
                    score = 100 * statistics.mean(d["score"] for d in details[name])
                    scores[name].append(score)
                    row = {"task": task, "length": length, "reader": name, "score": score,
                           "samples": len(details[name]), "seconds_per_sample": statistics.mean(seconds[name]),
                           "read_per_sample": statistics.mean(read[name]), "details": details[name]}
                    rows.append(row)
                    print(f"{task:<16} {length:>7} {name:>9} {score:>6.1f} {len(details[name]):>7} "
                          f"{row['seconds_per_sample']:>8.1f} {row['read_per_sample']:>11.0f}", flush=True)
                if args.json:  # after every task: a run stopped part way keeps what it measured
                    save()
            for name, _ in variants:
                averages.append({"length": length, "reader": name, "score": statistics.mean(scores[name]),
                                 "tasks": len(scores[name])})
            del session
    print("\naverage over the tasks")
    print(f"{'length':>7} {'reader':>9} {'score':>6} {'tasks':>5}")
    for a in averages:
        print(f"{a['length']:>7} {a['reader']:>9} {a['score']:>6.1f} {a['tasks']:>5}")
    if args.json:
        save()


def choices(allowed):
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",")]
        unknown = [item for item in items if item not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)} not among {', '.join(allowed)}")
        return items

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[4096, 16384, 32768, 131072],
                        help="prompt lengths in tokens (the model's tokenizer), comma-separated")
    parser.add_argument("--samples", type=int, default=50, help="samples per task and length")
    parser.add_argument("--tasks", type=choices(TASKS), default=list(TASKS))
    parser.add_argument("--readers", type=choices(READERS), default=list(READERS),
                        help="dense runs only where the prompts fit the model's context")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first-sample", type=int, default=0, metavar="N",
                        help="draw the samples numbered from N on: a run that adds samples to an earlier one with "
                             "the same seed (the scores of both are then combined by hand)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", metavar="PATH", help="also write the rows (each sample's answer too) as JSON")
    parser.add_argument("--verbose", action="store_true", help="each sample's answer and time")
    parser.add_argument("--topk", type=int, default=None,
                        help=f"far tokens IndexPool selects per query (default: the engine's, {IndexPoolConfig.topk})")
    parser.add_argument("--query-topk", type=int, default=None,
                        help="far tokens per query of the question and the answer (default: the engine's, "
                             f"{IndexPoolConfig.query_topk})")
    parser.add_argument("--question-pools", type=int, default=None,
                        help="the question's best pools kept for it and its answer (default: the engine's, "
                             f"{IndexPoolConfig.question_pools}; 0 with --question-matches 0: the question read once)")
    parser.add_argument("--question-matches", type=int, default=None,
                        help="the places holding the question's rarest token pairs kept for it and its answer "
                             f"(default: the engine's, {IndexPoolConfig.question_matches})")
    parser.add_argument("--question-variants", metavar="SETTINGS", type=question_variants,
                        help="IndexPool also reads each question and its answer under these settings, the rest of "
                             "the prompt read once for all: ';'-separated groups of NAME=NUMBER, NAME one of "
                             f"{', '.join(QUESTION_SETTINGS)} (e.g. 'question_pools=0,query_topk=1024'); a row each")
    parser.add_argument("--shared-document", action="store_true",
                        help=f"{', '.join(PLANTED_TASKS)}: one document holds every sample's needles or chains and "
                             "each sample asks its own question of it, so the document is read once (what makes 10 "
                             "samples at 1M one read); each question meets the other samples' needles or chains too")
    parser.add_argument("--haystack", metavar="FILE",
                        help="the prose needles hide in, as UTF-8 text (default: Python's documentation, then the "
                             "system's license texts, which differ between machines: save them to a file to draw the "
                             "same samples elsewhere)")
    parser.add_argument("--baselines", action="store_true",
                        help="no reader: score cwe and fwe samples with answers no model gives (word_baselines: the "
                             "recent window's most frequent words, words drawn at random) and print those")
    args = parser.parse_args()
    if args.first_sample < 0 or args.samples < 1:
        parser.error("--first-sample must be >= 0 and --samples >= 1")
    if args.shared_document and set(args.tasks) - set(PLANTED_TASKS):
        parser.error(f"--shared-document takes these tasks only: {', '.join(PLANTED_TASKS)}")
    if args.baselines and not set(args.tasks) & set(WORD_TASKS):
        parser.error(f"--baselines scores {' and '.join(WORD_TASKS)} only: name one of them in --tasks")
    run(args)


if __name__ == "__main__":
    main()
