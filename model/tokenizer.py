"""The tokenizer: byte-level BPE run by tiktoken, built from GGUF metadata or a Hugging Face tokenizer.json, and the
model's Jinja chat template rendered the way transformers renders it.

tiktoken merges by rank. These vocabularies number tokens in the order their merges were learned, so a token's id
is its rank and the merge list is not needed (the parity tests check this against transformers).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import resource
import sys
import time
import unicodedata
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
import regex
import tiktoken
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from .errors import InputError, ModelLoadError

# Pre-tokenizer regexes, as HF tokenizer.json files and llama.cpp's llama-vocab.cpp define them.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# HF's Sequence[Digits(individual_digits=True), ByteLevel]: every numeric char is a piece of its own and GPT-2's regex
# runs inside the stretches between them. A digit ends a stretch as the end of text does, so whitespace right before
# a digit is a whole piece ('a  1' -> 'a', '  ', '1'): hence `(?![^\s\p{N}])` where GPT-2 has `(?!\S)`.
SMOLLM_PATTERN = r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF `tokenizer.ggml.pre` names (with llama.cpp's aliases) -> regex.
GGUF_PRE_TOKENIZER_PATTERNS = {
    "smollm": SMOLLM_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
    "qwen2": QWEN2_PATTERN,
    "deepseek-r1-qwen": QWEN2_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "default": GPT2_PATTERN,
}

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4

# Tokens that end a turn in the chat formats we know; generation stops on any of them that the vocabulary has.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>")

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


BYTE_LEVEL_CHARS = frozenset(_byte_to_unicode().values())
# str.translate table turning a byte-level token string into latin-1 characters, i.e. into its bytes.
_BYTE_LEVEL_TO_LATIN1 = {ord(char): byte for byte, char in _byte_to_unicode().items()}


def _byte_level_ranks(token_ids: dict[str, int], source: str) -> dict[bytes, int]:
    """Byte-level token strings -> tiktoken's {bytes: rank}, with rank = id."""
    unknown = set("".join(token_ids)) - BYTE_LEVEL_CHARS
    if unknown:
        char = min(unknown)
        raise ModelLoadError(f"{source}: the vocabulary is not byte-level BPE (it has character U+{ord(char):04X})")
    return {text.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1"): token_id for text, token_id in token_ids.items()}


def _code_points_led_by(lead_byte: int) -> tuple[int, int] | None:
    """The code point range whose UTF-8 form starts with `lead_byte`; None if no valid UTF-8 starts with it."""
    # (lead bytes, payload bits of the lead byte, bits carried by the continuation bytes, lowest non-overlong code point)
    for first, last, payload_mask, shift, floor in (
        (0xC2, 0xDF, 0x1F, 6, 0x80),
        (0xE0, 0xEF, 0x0F, 12, 0x800),
        (0xF0, 0xF4, 0x07, 18, 0x10000),
    ):
        if first <= lead_byte <= last:
            base = (lead_byte & payload_mask) << shift
            return max(base, floor), min(base + (1 << shift) - 1, 0x10FFFF)
    return None


def _compile_missing_byte_finder(missing_bytes: set[int]) -> re.Pattern | None:
    """A regex finding the characters whose UTF-8 form contains a byte the vocabulary has no token for."""
    if any(0x80 <= b <= 0xBF for b in missing_bytes):
        return re.compile(r"[^\x00-\x7f]")  # a continuation byte can be in any non-ASCII character
    ranges = [(b, b) for b in missing_bytes if b < 0x80]
    ranges += [r for r in map(_code_points_led_by, missing_bytes) if r is not None]
    if not ranges:
        return None
    return re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in sorted(ranges)) + "]")


def _replace_lone_surrogates(text: str) -> str:
    # Such text cannot be UTF-8 encoded; like tiktoken, turn each lone surrogate into U+FFFD.
    if _LONE_SURROGATE.search(text):
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class StreamDecoder:
    """Turns generated token ids into text as they arrive, holding back the bytes of an unfinished character."""

    def __init__(self, token_bytes: list[bytes], skipped_ids: frozenset[int]):
        self._token_bytes = token_bytes
        self._skipped_ids = skipped_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if token_id in self._skipped_ids:
            return ""
        return self._utf8.decode(self._token_bytes[token_id])

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """Text <-> token ids for one model, plus its chat format. Build it with `from_gguf_metadata` or `from_hf_dir`."""

    def __init__(
        self,
        *,
        name: str,
        pattern: str,
        mergeable_ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        control_ids: frozenset[int],
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        template_tokens: dict[str, str],
        nfc_normalize: bool = False,
        extra_stop_ids: tuple[int, ...] = (),
    ):
        self.encoding = tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
        )
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self._template_tokens = template_tokens  # bos_token, eos_token, ... as the template sees them
        self._nfc_normalize = nfc_normalize
        # Control tokens are markup (turn markers, BOS/EOS), never text shown to a user.
        self._control_ids = control_ids
        end_of_turn_ids = [special_tokens[t] for t in END_OF_TURN_TOKENS if t in special_tokens]
        self.stop_ids = frozenset([t for t in (eos_id, *extra_stop_ids) if t is not None] + end_of_turn_ids)

        self._token_bytes = [b""] * vocab_size
        for token, token_id in mergeable_ranks.items():
            self._token_bytes[token_id] = token
        for token, token_id in special_tokens.items():
            self._token_bytes[token_id] = token.encode("utf-8")

        # Some vocabularies lack a few single bytes. The reference tokenizer drops such bytes from a piece and merges
        # the rest; tiktoken cannot, so text with them takes a slower path (`_encode_without_missing_bytes`).
        missing_bytes = set(range(256)) - {token[0] for token in mergeable_ranks if len(token) == 1}
        self._missing_bytes = bytes(sorted(missing_bytes))
        self._missing_byte_finder = _compile_missing_byte_finder(missing_bytes)
        self._piece_regex = regex.compile(pattern)
        self._special_ids = special_tokens
        longest_first = sorted(special_tokens, key=len, reverse=True)
        self._special_finder = re.compile("|".join(map(re.escape, longest_first))) if special_tokens else None

    # ---- building ----

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> "Tokenizer":
        """From a GGUF file's `tokenizer.*` metadata (as `read_gguf(...).metadata` gives it)."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(f"tokenizer model '{model}' is not supported; only byte-level BPE ('gpt2') is")
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZER_PATTERNS:
            supported = ", ".join(GGUF_PRE_TOKENIZER_PATTERNS)
            raise ModelLoadError(f"pre-tokenizer '{pre}' is not supported; supported: {supported}")

        tokens = metadata["tokenizer.ggml.tokens"]
        token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        special_types = (GGUF_CONTROL, GGUF_USER_DEFINED)
        special_tokens = {text: i for i, (text, kind) in enumerate(zip(tokens, token_types)) if kind in special_types}
        ordinary = {text: i for i, (text, kind) in enumerate(zip(tokens, token_types)) if kind not in special_types}

        def token_text(key: str) -> str | None:
            token_id = metadata.get(key)
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        template_keys = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        template_tokens = {
            name: text
            for name, key in template_keys.items()
            if (text := token_text(f"tokenizer.ggml.{key}_token_id")) is not None
        }
        return cls(
            name=f"gguf-{pre}",
            pattern=GGUF_PRE_TOKENIZER_PATTERNS[pre],
            mergeable_ranks=_byte_level_ranks(ordinary, "GGUF tokenizer"),
            special_tokens=special_tokens,
            control_ids=frozenset(i for i, kind in enumerate(token_types) if kind == GGUF_CONTROL),
            vocab_size=len(tokens),
            bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
            template_tokens=template_tokens,
            extra_stop_ids=tuple(
                metadata[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if key in metadata
            ),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face model directory: tokenizer.json, plus tokenizer_config.json and chat_template.jinja."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        try:
            spec = json.loads(tokenizer_file.read_text(encoding="utf-8"))
            config_file = path / "tokenizer_config.json"
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.exists() else {}
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot read the tokenizer ({type(e).__name__}: {e})") from None

        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ModelLoadError(
                f"{tokenizer_file}: tokenizer model '{model.get('type')}' is not supported; only byte-level BPE is"
            )
        normalizer = (spec.get("normalizer") or {}).get("type")
        if normalizer not in (None, "NFC"):
            raise ModelLoadError(f"{tokenizer_file}: normalizer '{normalizer}' is not supported")

        # HF matches every added token in text before BPE, special or not, so all of them are tiktoken specials.
        added = spec.get("added_tokens", [])
        special_tokens = {token["content"]: token["id"] for token in added}
        special_ids = set(special_tokens.values())
        ordinary = {text: i for text, i in model["vocab"].items() if i not in special_ids}

        def token_text(name: str) -> str | None:
            value = config.get(name)
            return value.get("content") if isinstance(value, dict) else value  # older configs store an AddedToken dict

        def token_id(name: str) -> int | None:
            text = token_text(name)
            return special_tokens.get(text, model["vocab"].get(text))

        return cls(
            name=f"hf-{path.name}",
            pattern=_pattern_from_hf_pre_tokenizer(spec.get("pre_tokenizer"), tokenizer_file),
            mergeable_ranks=_byte_level_ranks(ordinary, str(tokenizer_file)),
            special_tokens=special_tokens,
            control_ids=frozenset(token["id"] for token in added if token.get("special")),
            vocab_size=max(*model["vocab"].values(), *special_ids) + 1,
            bos_id=token_id("bos_token"),
            eos_id=token_id("eos_token"),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=_hf_chat_template(path, config),
            template_tokens={
                name: text
                for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                if (text := token_text(name)) is not None
            },
            nfc_normalize=normalizer == "NFC",
        )

    # ---- encoding and decoding ----

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; with allow_special, special-token strings in it become their ids, else plain text."""
        text = _replace_lone_surrogates(text)
        if self._nfc_normalize:
            text = unicodedata.normalize("NFC", text)
        if self._missing_byte_finder is None or not self._missing_byte_finder.search(text):
            if allow_special:
                return self.encoding.encode(text, allowed_special="all")
            return self.encoding.encode_ordinary(text)
        if not allow_special or self._special_finder is None:
            return self._encode_without_missing_bytes(text)
        ids: list[int] = []
        start = 0
        for match in self._special_finder.finditer(text):
            ids += self.encode(text[start : match.start()])
            ids.append(self._special_ids[match.group()])
            start = match.end()
        return ids + self.encode(text[start:])

    def _encode_without_missing_bytes(self, text: str) -> list[int]:
        """Split pieces in Python, drop the bytes the vocabulary lacks from each, and BPE the rest with tiktoken."""
        ids: list[int] = []
        for piece in self._piece_regex.findall(text):
            piece_bytes = piece.encode("utf-8").translate(None, self._missing_bytes)
            if piece_bytes:
                ids += self.encoding._encode_single_piece(piece_bytes)
        return ids

    def decode(self, ids) -> str:
        """Text of `ids`, special tokens included; invalid UTF-8 becomes U+FFFD."""
        return b"".join(self._token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    @cached_property
    def line_break_ids(self) -> frozenset[int]:
        """The ids of the tokens whose text holds a line break: where lines end in a sequence of token ids."""
        return frozenset(i for i, token in enumerate(self._token_bytes) if b"\n" in token)

    @cached_property
    def word_ids(self) -> list[int]:
        """Each token id's word: the id of its text without a leading space where the vocabulary holds that text
        (' One' within a line and 'One' at its start are one word), else its own id."""
        ids = {token: i for i, token in enumerate(self._token_bytes) if token and i not in self._control_ids}
        return [ids.get(token[1:], i) if token[:1] == b" " else i for i, token in enumerate(self._token_bytes)]

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self._token_bytes, self._control_ids)

    # ---- chat ----

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        # transformers also passes tools and documents (None when absent); templates test them with `is none`.
        try:
            with _template_limits():
                return _compile_chat_template(self.chat_template).render(
                    messages=messages,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self._template_tokens,
                )
        except jinja2.exceptions.SecurityError as e:
            raise InputError(f"the model's chat template was stopped: {e}") from None
        except jinja2.exceptions.TemplateError as e:
            raise InputError(f"the model's chat template failed: {' '.join(str(e).split())[:300]}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids = self.encode(self.render_chat(messages, add_generation_prompt), allow_special=True)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids


def _pattern_from_hf_pre_tokenizer(pre_tokenizer: dict | None, source: Path) -> str:
    """The single regex equivalent to a tokenizer.json pre-tokenizer, for the byte-level forms in use."""
    is_sequence = pre_tokenizer is not None and pre_tokenizer.get("type") == "Sequence"
    steps = pre_tokenizer.get("pretokenizers", []) if is_sequence else [pre_tokenizer]
    kinds = [step.get("type") if step else None for step in steps]
    byte_level = steps[-1] if kinds[-1:] == ["ByteLevel"] and not steps[-1].get("add_prefix_space") else None
    if byte_level is not None:
        uses_regex = byte_level.get("use_regex", True)
        if len(steps) == 1 and uses_regex:
            return GPT2_PATTERN
        first = steps[0]
        if kinds == ["Digits", "ByteLevel"] and first.get("individual_digits") and uses_regex:
            return SMOLLM_PATTERN
        if (
            kinds == ["Split", "ByteLevel"]
            and not uses_regex
            and "Regex" in first.get("pattern", {})
            and first.get("behavior") == "Isolated"
            and not first.get("invert")
        ):
            return first["pattern"]["Regex"]
    described = str(kinds[0]) if len(kinds) == 1 else "Sequence[" + ", ".join(map(str, kinds)) + "]"
    raise ModelLoadError(f"{source}: pre-tokenizer {described} is not supported; only byte-level BPE forms are")


def _hf_chat_template(path: Path, config: dict) -> str | None:
    # Newer saves put the template in its own file; older ones in tokenizer_config.json, possibly as named variants.
    template_file = path / "chat_template.jinja"
    if template_file.exists():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


# ---- chat templates, compiled like transformers' apply_chat_template ----


class _GenerationTag(Extension):
    """transformers' `{% generation %}` marks assistant text for training masks; rendering just keeps its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_template_error(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# A chat template comes with the model file, so it runs sandboxed and bounded: real templates render in milliseconds
# into a few KB, so these only stop one built to hang or to fill the memory.
TEMPLATE_SECONDS = 5.0
TEMPLATE_MEMORY_BYTES = 1 << 30  # growth of the process's peak memory while rendering
TEMPLATE_SIZE = 1 << 24  # characters (or items) one operation may build; larger counts in arguments are refused
_LARGE_WIDTH = re.compile(r"\d{8,}")  # a field width of 10**7 or more in a format string


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, refusing single operations that would build huge values: repetition, concatenation and powers,
    string formatting with huge widths, calls and filters given huge counts."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator, left, right):
        sized = (str, list, tuple)
        if operator == "*" and isinstance(left, int) and isinstance(right, sized):
            left, right = right, left
        if operator == "*" and isinstance(left, sized) and isinstance(right, int):
            _check_size(len(left) * right)
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            _check_size(len(left) + len(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            _check_size(abs(right) * max(abs(left).bit_length(), 1) // 8)
        elif operator == "%" and isinstance(left, str) and _LARGE_WIDTH.search(left):
            raise SecurityError("a format width too large")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        _check_arguments(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):  # `'{:>9}'.format` looked up in a template
        if isinstance(getattr(value, "__self__", None), str) and _LARGE_WIDTH.search(value.__self__):
            raise SecurityError("a format width too large")
        return super().wrap_str_format(value)


def _check_size(size: int) -> None:
    if size > TEMPLATE_SIZE:
        raise SecurityError(f"an operation would build {size:,} characters or items (at most {TEMPLATE_SIZE:,})")


def _check_arguments(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _check_size(abs(value))


def _bounded_filter(function):
    passed = hasattr(function, "jinja_pass_arg")  # @pass_context and friends: the context comes first

    def run(*args, **kwargs):
        _check_arguments(args[2 if passed else 1:], kwargs)  # not the filtered value itself
        return function(*args, **kwargs)

    if passed:
        run.jinja_pass_arg = function.jinja_pass_arg
    return run


@contextlib.contextmanager
def _template_limits():
    """Stop a render that runs past TEMPLATE_SECONDS or grows the peak memory by TEMPLATE_MEMORY_BYTES: a trace
    function checks both at each line of Python it runs (the template's compiled code and Jinja's runtime)."""
    start, base = time.monotonic(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    def trace(frame, event, arg):
        if time.monotonic() - start > TEMPLATE_SECONDS:
            raise SecurityError(f"it ran over {TEMPLATE_SECONDS:.0f} s")
        if (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024 > TEMPLATE_MEMORY_BYTES:
            raise SecurityError(f"it took over {TEMPLATE_MEMORY_BYTES >> 20} MiB of memory")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


@lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
