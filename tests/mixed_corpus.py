"""A deterministic corpus of over 1 MB of mixed text for tokenizer parity tests, built from local files plus
generated parts aimed at the tokenizer's edge cases (digits, whitespace, contractions, scripts across the Unicode
planes, and the characters whose bytes the default model's vocabulary lacks)."""

from __future__ import annotations

import random
import sysconfig
import unicodedata
from pathlib import Path

import pydoc_data.topics

MIN_CORPUS_BYTES = 1_100_000
CHUNK_CHARS = 4096  # the reference tokenizer is fast on documents of a few KB

# The characters whose UTF-8 bytes the default model (SmolLM2) has no single-byte token for: six control characters
# and everything led by 0xF1/0xF2 (U+40000-U+BFFFF). 0xC0, 0xC1, 0xF5-0xFF never occur in valid UTF-8.
MISSING_BYTE_CHARS = "\x04\x06\x13\x14\x16\x1d"
MISSING_BYTE_PLANES = (0x40000, 0xBFFFF)

STDLIB_FILES = (
    "argparse.py", "difflib.py", "textwrap.py", "string.py", "json/decoder.py", "email/_header_value_parser.py",
    "locale.py", "calendar.py", "datetime.py", "encodings/punycode.py", "test/test_unicode.py",
)

# Blocks to draw "words" from: (first, last) code points, across the BMP and the supplementary planes.
SCRIPT_RANGES = (
    (0x00C0, 0x024F),  # Latin-1 supplement and extended letters
    (0x0370, 0x03FF),  # Greek
    (0x0400, 0x04FF),  # Cyrillic
    (0x0531, 0x0587),  # Armenian
    (0x05D0, 0x05EA),  # Hebrew
    (0x0620, 0x064A),  # Arabic
    (0x0900, 0x097F),  # Devanagari (letters, signs and digits)
    (0x0E01, 0x0E5B),  # Thai
    (0x10A0, 0x10FF),  # Georgian
    (0x3041, 0x3096),  # Hiragana
    (0x30A1, 0x30FA),  # Katakana
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7A3),  # Hangul syllables
    (0xE000, 0xF8FF),  # private use
    (0xFF01, 0xFF5E),  # fullwidth forms
    (0x10000, 0x1005D),  # Linear B
    (0x1D400, 0x1D7FF),  # mathematical alphanumerics
    (0x1F300, 0x1F64F),  # pictographs and emoticons
    (0x1F900, 0x1F9FF),  # supplemental symbols and pictographs
    (0x20000, 0x2A6DF),  # CJK extension B (plane 2)
    (0x30000, 0x3134A),  # CJK extension G (plane 3)
    (0xE0020, 0xE007F),  # tags (plane 14)
    (0xF0000, 0xF00FF),  # supplementary private use A (plane 15)
    (0x100000, 0x1000FF),  # supplementary private use B (plane 16)
)

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs!",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Voix ambiguë d'un cœur qui, au zéphyr, préfère les jattes de kiwis.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Τάχιστη αλώπηξ βαφής ψημένη γη, δρασκελίζει υπέρ νωθρού κυνός.",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ",
    "我能吞下玻璃而不伤身体。敏捷的棕色狐狸跳过了懒狗。",
    "다람쥐 헌 쳇바퀴에 타고파. 키스의 고유조건은 입술끼리 만나야 하고",
    "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ومغلف بجلد أزرق",
    "דג סקרן שט בים מאוכזב ולפתע מצא חברה",
    "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम",
    "เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน",
    "Emoji: 😀 😃 😄 👍🏽 👨‍👩‍👧‍👦 🇺🇸 🇯🇵 🏳️‍🌈 1️⃣ #️⃣ ❤️ ✨ 🧑🏿‍🚀",
    "Math: 𝐀𝐁𝐂 𝑥² + 𝑦² = 𝑧², ∀x∈ℝ, ∑ᵢ aᵢ ≤ ∞, √2 ≈ 1.414, ∮ E·dA = Q/ε₀",
    "Combining: e\u0301 a\u0300 n\u0303 o\u0308\u0304 Z\u0336\u0317a\u0315\u0353l\u0327g\u0361o\u0489 \u1100\u1161\u11a8",
)

CONTRACTIONS = (
    "don't", "I'm", "we'll", "they've", "she'd", "you're", "it's", "can't", "won't", "shouldn't've", "y'all",
    "DON'T", "I'M", "WE'LL", "THEY'VE", "SHE'D", "YOU'RE", "IT'S", "It'S", "rock'n'roll", "'sup", "''", "'''",
    "it’s", "don’t", "O'Neill", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "l'homme", "dell'arte", "'90s",
)

SPACES = (
    " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t ",
    "\xa0", "\u3000", "\u2028", "\x0b", "\x0c", "\x85", "\u2009",
)

# Where to put a character with a missing byte: inside words, punctuation runs (merged across the dropped byte by the
# reference), digits, whitespace, emoji; "{}" stands for the character.
MISSING_BYTE_CONTEXTS = (
    "ab{}cd", "..{}..", "!!{}!!", " {}x", "1{}2", "  {}  ", "{}{}", "{}", "--{}->", "é{}中", "😀{}😀", "'{}s", " {}\n",
)

UNICODE_DIGITS = "0123456789٠١٢٣٤٥٦٧٨٩۰۱۲۳०१२३४५৬৭๑๒๓０１２３²³¹⁴½¾⅓ⅠⅡⅫⅿ①②⑳〇𝟎𝟏𝟚𝟡"


def _files_text() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
    documents += [(stdlib / name).read_text(encoding="utf-8") for name in STDLIB_FILES if (stdlib / name).is_file()]
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        files = [p for p in sorted(licenses.iterdir()) if p.is_file() and not p.is_symlink()]  # links repeat texts
        documents += [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return documents


def _assigned_char(rng: random.Random, first: int, last: int) -> str:
    # Only characters assigned in Python's (older) Unicode data, so that every tokenizer's Unicode tables agree.
    while True:
        char = chr(rng.randint(first, last))
        if unicodedata.category(char) != "Cn":
            return char


def _unicode_words(rng: random.Random, count: int) -> str:
    words = []
    for _ in range(count):
        first, last = rng.choice(SCRIPT_RANGES)
        word = "".join(_assigned_char(rng, first, last) for _ in range(rng.randint(1, 8)))
        if rng.random() < 0.15:
            word += "".join(chr(rng.randint(0x0300, 0x036F)) for _ in range(rng.randint(1, 3)))  # combining marks
        words.append(word)
        words.append(rng.choice(SPACES) if rng.random() < 0.2 else " ")
    return "".join(words)


def _number(rng: random.Random) -> str:
    n = rng.randint(0, 10 ** rng.randint(1, 12))
    small = [rng.randint(0, 255) for _ in range(4)]
    forms = (
        str(n), f"{n:,}", f"{n / 7:.{rng.randint(1, 6)}f}", f"{n:e}", f"0x{n:X}", f"-{n}", f"+{n}", f"{n}%",
        f"${n:,}.{small[0] % 100:02d}", f"€{n}", f"{small[0] % 31 + 1}/{small[1] % 12 + 1}/{1900 + small[2]}",
        f"{1900 + small[0]}-{small[1] % 12 + 1:02d}-{small[2] % 28 + 1:02d}T{small[3] % 24:02d}:{small[0] % 60:02d}",
        f"v{small[0] % 10}.{small[1] % 20}.{small[2]}", ".".join(map(str, small)),
        f"+1 ({200 + small[0]}) {200 + small[1]}-{1000 + n % 9000}", f"{small[0] % 99 + 1}th", f"{n}px",
        "".join(rng.choice(UNICODE_DIGITS) for _ in range(rng.randint(1, 6))), f"x{small[0] % 10}", f"abc{n}def",
    )
    return rng.choice(forms)


def _numbers_text(rng: random.Random, count: int) -> str:
    parts = []
    for _ in range(count):
        # Whitespace right before a digit is where the `smollm` split differs from plain GPT-2 ('a  1').
        before = rng.choice(("", " ", "  ", "   ", "\t", "\n", " \n ", "\u3000", "a  ", "x\t\t", "word ", "(", "#", "'"))
        parts.append(before + _number(rng) + rng.choice((" ", "  ", ", ", ".", "\n", "", ";", " and ")))
    return "".join(parts)


def _whitespace_text(rng: random.Random, count: int) -> str:
    parts = []
    for _ in range(count):
        run = "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 6))) * rng.randint(1, 4)
        parts.append(run + rng.choice(("word", "x", "7", "42", "!", "...", "é", "中", "😀", "", "'s", "-")))
    return "".join(parts)


def _contractions_text(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(CONTRACTIONS) + rng.choice((" ", "  ", ", ", ". ", "\n", "!", "'")) for _ in range(count))


def _missing_bytes_text(rng: random.Random, count: int) -> str:
    """Snippets with the characters whose bytes have no token, in words, punctuation, digits and whitespace."""
    parts = []
    for _ in range(count):
        if rng.random() < 0.5:
            missing = rng.choice(MISSING_BYTE_CHARS)
        else:
            missing = chr(rng.randint(*MISSING_BYTE_PLANES))
        template = rng.choice(MISSING_BYTE_CONTEXTS)
        parts.append(template.replace("{}", missing) + rng.choice((" ", "", "\n", "word ")))
    return "".join(parts)


def _chunks(text: str) -> list[str]:
    """Split at line ends into pieces of about CHUNK_CHARS."""
    chunks, current = [], []
    size = 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= CHUNK_CHARS:
            chunks.append("".join(current))
            current, size = [], 0
    if current:
        chunks.append("".join(current))
    return chunks


def build_mixed_corpus() -> list[str]:
    """The corpus as a list of documents of a few KB each; the same on every call."""
    rng = random.Random(20240601)
    documents = _files_text()
    documents += [" ".join(rng.choice(SENTENCES) for _ in range(40)) for _ in range(40)]
    documents += [_numbers_text(rng, 1500) for _ in range(10)]
    documents += [_unicode_words(rng, 800) for _ in range(20)]
    documents += [_whitespace_text(rng, 800) for _ in range(10)]
    documents += [_contractions_text(rng, 1500) for _ in range(5)]
    documents += [_missing_bytes_text(rng, 300) for _ in range(10)]
    corpus = [chunk for document in documents for chunk in _chunks(document)]
    while sum(len(chunk.encode("utf-8")) for chunk in corpus) < MIN_CORPUS_BYTES:
        corpus += _chunks(_unicode_words(rng, 800) + _numbers_text(rng, 500))
    return corpus
