"""Our tiktoken-based tokenizer against transformers' tokenizer for the default model (see conftest.py)."""

import copy
import json
import re
import time
from pathlib import Path

import pytest
from mixed_corpus import MISSING_BYTE_CHARS, MISSING_BYTE_PLANES, build_mixed_corpus
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from indexpool.model.errors import ModelLoadError
from indexpool.model.tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN, Tokenizer

MISSING_BYTE_FINDER = re.compile(f"[{MISSING_BYTE_CHARS}{chr(MISSING_BYTE_PLANES[0])}-{chr(MISSING_BYTE_PLANES[1])}]")

EDGE_CASES = [
    "a  1", "a 1", "x\t\t2", " 3", "  42  ", "1,234.5e-6", "٣٤ ²½ Ⅻ ①", "it's DON'T I'M we'll",
    "\x04", "ab\x04cd", "..\x04..", "\x04ab\x04", "\U00040000", "x\U00040000y", " \U00080000 ", "!!\U000bffff!!",
    "1\x132", "  \x1d  ", "😀\x06😀", "  \n\n  x", "\r\n\r\n", "\u3000\xa0x", "",
]


def reference_ids(reference, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in reference.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def first_mismatch(texts, ours, theirs) -> str:
    text, a, b = next((t, a, b) for t, a, b in zip(texts, ours, theirs) if a != b)
    return f"first in {text[:200]!r}: ours {a[:40]} vs reference {b[:40]}"


@pytest.fixture(scope="module")
def mixed_corpus() -> list[str]:
    return build_mixed_corpus()


def test_build_from_gguf_metadata(default_gguf_metadata):
    start = time.perf_counter()
    tokenizer = Tokenizer.from_gguf_metadata(default_gguf_metadata)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"building the tokenizer took {elapsed:.2f} s"
    assert tokenizer.vocab_size == 49152
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.add_bos) == (1, 2, False)
    assert tokenizer.stop_ids == {0, 2}  # <|im_end|> (EOS, end of turn) and <|endoftext|>
    assert tokenizer.chat_template == default_gguf_metadata["tokenizer.chat_template"]


def test_corpus_parity(default_tokenizer, reference_tokenizer, mixed_corpus):
    assert sum(len(text.encode("utf-8")) for text in mixed_corpus) >= 1_000_000
    assert any(MISSING_BYTE_FINDER.search(text) for text in mixed_corpus)
    assert any("a  1" in text for text in mixed_corpus)

    ours = [default_tokenizer.encode(text) for text in mixed_corpus]
    theirs = reference_ids(reference_tokenizer, mixed_corpus)
    mismatched_ids = sum(sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(ours, theirs))
    mismatched_docs = sum(x != y for x, y in zip(ours, theirs))
    assert mismatched_ids == 0, (
        f"{mismatched_ids} mismatching ids in {mismatched_docs} of {len(mixed_corpus)} documents; "
        + first_mismatch(mixed_corpus, ours, theirs)
    )


def test_edge_case_parity(default_tokenizer, reference_tokenizer):
    ours = [default_tokenizer.encode(text) for text in EDGE_CASES]
    assert ours == reference_ids(reference_tokenizer, EDGE_CASES)


def test_digits_split_one_by_one(default_tokenizer):
    def pieces(text):
        return [default_tokenizer.decode([i]) for i in default_tokenizer.encode(text)]

    assert pieces("a  1") == ["a", "  ", "1"]
    assert pieces("x 2024") == ["x", " ", "2", "0", "2", "4"]


def test_ordinary_text_stays_on_tiktokens_fast_path(default_tokenizer, mixed_corpus):
    fast_only = copy.copy(default_tokenizer)
    fast_only._encode_without_missing_bytes = None  # calling it would fail
    texts = [text for text in mixed_corpus[:50] if not MISSING_BYTE_FINDER.search(text)]
    assert [fast_only.encode(text) for text in texts] == [default_tokenizer.encode(text) for text in texts]
    assert fast_only.encode("<|im_start|>user\nhi", allow_special=True)[0] == 1


def test_bytes_without_a_token_are_dropped(default_tokenizer):
    assert default_tokenizer.encode("\x04ab\x04") == default_tokenizer.encode("ab")
    assert default_tokenizer.encode("\x04") == []
    # U+40000 is F1 80 80 80: the lead byte has no token, the continuation bytes do.
    ids = default_tokenizer.encode("\U00040000")
    assert [default_tokenizer.encoding.decode_single_token_bytes(i) for i in ids] == [b"\x80"] * 3


def test_round_trip(default_tokenizer, mixed_corpus):
    texts = [text for text in mixed_corpus if not MISSING_BYTE_FINDER.search(text)]
    failures = [text for text in texts if default_tokenizer.decode(default_tokenizer.encode(text)) != text]
    assert not failures, f"{len(failures)} of {len(texts)} documents do not round trip, e.g. {failures[0][:200]!r}"


def test_lone_surrogates_become_replacement_characters(default_tokenizer):
    for text in ("a\ud800b", "\udfff", "x\ud83d", "\ud800\x04 1"):
        expected = default_tokenizer.encode(text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))
        assert default_tokenizer.encode(text) == expected
        assert default_tokenizer.encode(text, allow_special=True) == expected
    assert default_tokenizer.decode(default_tokenizer.encode("a\ud800b")) == "a\ufffdb"


def test_word_ids_take_a_word_at_a_lines_start_and_within_it_for_one(default_tokenizer):
    words = default_tokenizer.word_ids
    assert len(words) == default_tokenizer.vocab_size
    [spaced], [bare] = default_tokenizer.encode(" One"), default_tokenizer.encode("One")
    assert spaced != bare and words[spaced] == words[bare] == bare
    [space] = default_tokenizer.encode(" ")  # nothing after the space: a word of its own
    assert words[space] == space
    end_of_turn = default_tokenizer.encode("<|im_end|>", allow_special=True)[0]
    assert words[end_of_turn] == end_of_turn
    changed = [i for i, word in enumerate(words) if word != i]
    assert changed and all(default_tokenizer.decode([i]) == " " + default_tokenizer.decode([words[i]])
                           for i in changed)


def test_stream_decoder_yields_only_whole_characters(default_tokenizer):
    text = "Hi 😀👍🏽 中文字符 \U00020000\U0002a6d6 👨‍👩‍👧 naïve é\u0301 🇯🇵 end"
    ids = default_tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters are split across tokens
    decoder = default_tokenizer.stream_decoder()
    outputs = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert all("\ufffd" not in piece for piece in outputs)
    assert "".join(outputs) == default_tokenizer.decode(ids) == text
    assert "" in outputs  # some tokens held back a partial character


def test_stream_decoder_skips_control_tokens(default_tokenizer):
    ids = default_tokenizer.encode("<|im_start|>assistant\nHello 😀<|im_end|>", allow_special=True)
    decoder = default_tokenizer.stream_decoder()
    assert "".join(decoder.push(i) for i in ids) + decoder.flush() == "assistant\nHello 😀"


def test_special_tokens(default_tokenizer, reference_tokenizer):
    plain = default_tokenizer.encode("<|im_end|>")
    assert len(plain) > 1 and 2 not in plain
    assert default_tokenizer.decode(plain) == "<|im_end|>"
    assert default_tokenizer.encode("<|im_end|>", allow_special=True) == [2]
    assert 2 in default_tokenizer.stop_ids
    # With allow_special, text matches transformers, which always splits special tokens out.
    texts = [
        "<|im_start|>user\nhi 12<|im_end|>\n<|im_start|>assistant\n",
        "a<|endoftext|>b<|im_end|><|im_end|>",
        "<|im_start|>x\x04y\U00040000<|im_end|> \x06<|im_start|>",
        "no specials here",
    ]
    assert [default_tokenizer.encode(t, allow_special=True) for t in texts] == reference_ids(reference_tokenizer, texts)


def test_encode_chat_adds_bos_once(default_gguf_metadata):
    messages = [{"role": "user", "content": "Hi"}]
    with_bos = Tokenizer.from_gguf_metadata({**default_gguf_metadata, "tokenizer.ggml.add_bos_token": True})
    ids = with_bos.encode_chat(messages)
    assert ids[0] == 1 and ids[1] != 1  # the render already starts with <|im_start|>, the BOS token
    other_bos = Tokenizer.from_gguf_metadata(
        {**default_gguf_metadata, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 0}
    )
    assert other_bos.encode_chat(messages) == [0] + with_bos.encode_chat(messages)


# ---- from_hf_dir ----


def split_then_byte_level(pattern: str) -> dict:
    """tokenizer.json's form of a regex pre-tokenizer (Llama 3, Qwen2): Split on the regex, then bytes to characters."""
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {"type": "Sequence", "pretokenizers": [split, byte_level]}


# Variants of the saved smollm tokenizer.json: section -> replacement.
HF_VARIANTS = {
    "nfc": ("normalizer", {"type": "NFC"}),
    "llama3-split": ("pre_tokenizer", split_then_byte_level(LLAMA3_PATTERN)),
    "qwen2-split": ("pre_tokenizer", split_then_byte_level(QWEN2_PATTERN)),
}


@pytest.fixture(scope="module")
def saved_reference_dirs(reference_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """The reference saved with save_pretrained, as transformers' GGUF loader builds it (plain ByteLevel) and with
    the smollm pre-tokenizer; plus edited copies of the latter (HF_VARIANTS)."""
    plain = copy.deepcopy(reference_tokenizer)
    plain.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    dirs = {"plain": tmp_path_factory.mktemp("hf_plain"), "smollm": tmp_path_factory.mktemp("hf_smollm")}
    plain.save_pretrained(dirs["plain"])
    reference_tokenizer.save_pretrained(dirs["smollm"])

    for variant, (section, value) in HF_VARIANTS.items():
        dirs[variant] = tmp_path_factory.mktemp(f"hf_{variant}")
        for file in dirs["smollm"].iterdir():
            (dirs[variant] / file.name).write_bytes(file.read_bytes())
        spec = json.loads((dirs[variant] / "tokenizer.json").read_text(encoding="utf-8"))
        spec[section] = value
        (dirs[variant] / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return dirs


@pytest.mark.parametrize("variant", ["plain", "smollm", *HF_VARIANTS])
def test_from_hf_dir_matches_transformers(saved_reference_dirs, mixed_corpus, variant):
    directory = saved_reference_dirs[variant]
    ours = Tokenizer.from_hf_dir(directory)
    reference = AutoTokenizer.from_pretrained(directory)
    sample = mixed_corpus[::8] + EDGE_CASES + ["e\u0301 cafe\u0301 \u1100\u1161\u11a8 \u212b \u0041\u030a"]
    ours_ids = [ours.encode(text) for text in sample]
    theirs = reference_ids(reference, sample)
    assert ours_ids == theirs, first_mismatch(sample, ours_ids, theirs)
    assert (ours.bos_id, ours.eos_id, ours.add_bos, ours.vocab_size) == (1, 2, False, 49152)
    assert ours.stop_ids == {0, 2}
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(("pre", "variant"), [("llama-bpe", "llama3-split"), ("qwen2", "qwen2-split"), ("gpt-2", "plain")])
def test_gguf_pre_tokenizer_names(default_gguf_metadata, saved_reference_dirs, mixed_corpus, pre, variant):
    """Other GGUF pre-tokenizer names give their regex, checked with this vocabulary against transformers."""
    ours = Tokenizer.from_gguf_metadata({**default_gguf_metadata, "tokenizer.ggml.pre": pre})
    reference = AutoTokenizer.from_pretrained(saved_reference_dirs[variant])
    sample = mixed_corpus[::8] + EDGE_CASES
    ours_ids = [ours.encode(text) for text in sample]
    theirs = reference_ids(reference, sample)
    assert ours_ids == theirs, first_mismatch(sample, ours_ids, theirs)


def test_from_hf_dir_smollm_equals_gguf(saved_reference_dirs, default_tokenizer, mixed_corpus):
    ours = Tokenizer.from_hf_dir(saved_reference_dirs["smollm"])
    sample = mixed_corpus[::4]
    assert [ours.encode(t) for t in sample] == [default_tokenizer.encode(t) for t in sample]


# ---- unsupported tokenizers ----


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"tokenizer.ggml.model": "llama"}, "llama"),
        ({"tokenizer.ggml.model": "bert"}, "bert"),
        ({"tokenizer.ggml.pre": "falcon"}, "falcon"),
        ({"tokenizer.ggml.pre": "no-such-pre"}, "no-such-pre"),
    ],
)
def test_unsupported_gguf_tokenizer(default_gguf_metadata, changes, name):
    with pytest.raises(ModelLoadError, match=re.escape(f"'{name}'")):
        Tokenizer.from_gguf_metadata({**default_gguf_metadata, **changes})


@pytest.mark.parametrize(
    ("section", "value", "name"),
    [
        ("model", {"type": "Unigram", "vocab": []}, "Unigram"),
        ("model", {"type": "WordPiece", "vocab": {}}, "WordPiece"),
        ("pre_tokenizer", {"type": "Metaspace", "replacement": "▁"}, "Metaspace"),
        ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, {"type": "ByteLevel"}]}, "Whitespace"),
        ("normalizer", {"type": "Lowercase"}, "Lowercase"),
    ],
)
def test_unsupported_hf_tokenizer(saved_reference_dirs, tmp_path, section, value, name):
    spec = json.loads((saved_reference_dirs["plain"] / "tokenizer.json").read_text(encoding="utf-8"))
    spec[section] = value
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ModelLoadError, match=name):
        Tokenizer.from_hf_dir(tmp_path)
