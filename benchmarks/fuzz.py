"""Fuzzing the input readers and the model loaders with hypothesis.

The property: for arbitrary or mutated bytes, a reader returns a Document or raises IngestError (the model loader:
a loaded model or ModelLoadError), with a one-line message, never another exception, within bounded time and
memory. Each target starts from small valid samples built here (a PDF, an EPUB, an HTML page, chat logs, plain
text, a .gitignore in a folder, a tiny GGUF model, a tiny Hugging Face directory's config.json and safetensors
file); hypothesis mutates them (bytes changed, inserted, deleted, repeated, cut; integers written over them: counts,
lengths and sizes of every width; pieces of the format inserted) or gives arbitrary bytes, and the chat logs and
config.json also get JSON values of any shape.

    .venv/bin/python -m benchmarks.fuzz --minutes 10
    .venv/bin/python -m benchmarks.fuzz --minutes 2 --target gguf --target epub

Prints, per target, the examples run, the slowest one, the largest traced memory peak, and each finding (the error,
on an input shrunk by hypothesis, saved under --out to make a regression test of). tests/test_fuzz.py runs a short
derandomized pass of the same property on every target.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import signal
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from indexpool.ingest import IngestError, IngestOptions, load_document
from indexpool.model.errors import ModelLoadError
from tests.doc_fixtures import chatgpt_export, encrypted_pdf_bytes, pdf_bytes, write_epub

SECONDS_PER_EXAMPLE = 10.0  # far above any reader's time on inputs this small: over it is a hang or a blow-up
TRACED_BYTES_PER_EXAMPLE = 256 << 20  # Python allocations (bytes, lists, numpy arrays) of one example, at the peak
CEILING_BYTES = 4 << 30  # address space allowed above the process's at the start: an allocation past it fails


class Finding(Exception):
    """An input on which a target broke the property: the message says how."""


class Hang(BaseException):
    """Raised by `time_limit`: a BaseException, so that no reader's `except Exception` makes it its own error."""


@dataclass
class Target:
    name: str
    error: type[Exception]  # the one error the target may raise
    seeds: Callable[[Path], list[bytes]]  # valid samples, built in a scratch folder
    run: Callable[[bytes, Path], object]  # reads `data` (files go under the scratch folder)
    pieces: tuple[bytes, ...] = ()  # pieces of the format that mutations insert
    text_numbers: bool = False  # integers written as digits (text formats) rather than binary
    shapes: st.SearchStrategy[bytes] | None = None  # structured inputs, beside the mutated and arbitrary ones


# ---------------------------------------------------------------------------------------------- the targets

def _read_stdin(format: str) -> Callable[[bytes, Path], object]:
    def run(data: bytes, scratch: Path):
        return load_document(["-"], IngestOptions(format=format), stdin=io.BytesIO(data))

    return run


def _epub_seeds(scratch: Path) -> list[bytes]:
    chapters = [("ch1.xhtml", "<h1>Start</h1><p>It began &amp; went on.</p>"), ("ch2.xhtml", "<p>The end.</p>")]
    return [write_epub(scratch / "book.epub", chapters).read_bytes(),
            write_epub(scratch / "drm.epub", chapters, encrypted=True).read_bytes()]


HTML_SEED = ("<!DOCTYPE html><html><head><title>Page</title><style>p{}</style><script>x = '<p>';</script></head>"
             "<body><h1>Main &amp; title</h1><p>First <b>para</b>graph.</p><ul><li>one</li><li>two</li></ul>"
             "<table><tr><td>a</td><td>b</td></tr></table><pre>  keep\n  this</pre><div>x<br>y</div></body></html>")
CHAT_MESSAGES = [{"role": "user", "name": "Maria", "content": "Hi there", "timestamp": "2026-03-01T10:22:33+01:00"},
                 {"role": "assistant", "created_at": 1772360580, "content": [{"type": "text", "text": "Hello"}]},
                 {"sender": "Bob", "text": "no time given"}]
PLAIN_LOG = "2026-03-01 10:22 - Maria: Are we on?\nnoon is fine\n2026-03-01 10:25 - Bob: Yes: see you.\n"


def _chat_seeds(scratch: Path) -> list[bytes]:
    return [json.dumps(CHAT_MESSAGES).encode(), "\n".join(json.dumps(m) for m in CHAT_MESSAGES).encode(),
            json.dumps({"messages": CHAT_MESSAGES}).encode(), json.dumps(chatgpt_export()).encode(),
            PLAIN_LOG.encode()]


GITIGNORE_SEED = b"*.log\nbuild/\n!keep.log\n# comment\n/src/**/gen_*.py\n[Dd]ebug?/\n\\#hash\n"


def _read_folder_with_gitignore(data: bytes, scratch: Path):
    repo = scratch / "repo"
    if not repo.exists():
        for rel in ("a.py", "keep.log", "debug.log", "build/out.txt", "src/x/gen_a.py", "src/x/b.py", "Debug1/c.txt"):
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            (repo / rel).write_text(f"# {rel}\n")
    (repo / ".gitignore").write_bytes(data)
    return load_document([str(repo)])


# A tiny llama model: vocabulary of 8 byte-level tokens, one layer, hidden size 8, two heads of 4, one K/V head.
TINY = dict(vocab=8, dim=8, heads=2, kv_heads=1, head_dim=4, ffn=16, layers=1, context=64)
TOKENS = ["a", "b", "c", "d", "e", "Ġ", "ab", "Ġa"]


def _tiny_tensors() -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of the tiny model's weights."""
    t = TINY
    q, kv = t["heads"] * t["head_dim"], t["kv_heads"] * t["head_dim"]
    shapes = {"model.embed_tokens.weight": (t["vocab"], t["dim"]), "model.norm.weight": (t["dim"],),
              "lm_head.weight": (t["vocab"], t["dim"])}
    for i in range(t["layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in (
            ("input_layernorm.weight", (t["dim"],)), ("post_attention_layernorm.weight", (t["dim"],)),
            ("self_attn.q_proj.weight", (q, t["dim"])), ("self_attn.k_proj.weight", (kv, t["dim"])),
            ("self_attn.v_proj.weight", (kv, t["dim"])), ("self_attn.o_proj.weight", (t["dim"], q)),
            ("mlp.gate_proj.weight", (t["ffn"], t["dim"])), ("mlp.up_proj.weight", (t["ffn"], t["dim"])),
            ("mlp.down_proj.weight", (t["dim"], t["ffn"])))})
    return shapes


def tiny_gguf_metadata() -> dict[str, tuple[object, object]]:
    """The tiny GGUF model's metadata: key -> (value, GGUFValueType), the architecture apart."""
    from gguf import GGUFValueType as T

    t = TINY
    sizes = {"block_count": t["layers"], "context_length": t["context"], "embedding_length": t["dim"],
             "feed_forward_length": t["ffn"], "attention.head_count": t["heads"],
             "attention.head_count_kv": t["kv_heads"], "attention.key_length": t["head_dim"], "vocab_size": t["vocab"]}
    return {**{f"llama.{key}": (value, T.UINT32) for key, value in sizes.items()},
            "llama.rope.freq_base": (10000.0, T.FLOAT32), "llama.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32),
            "tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.pre": ("default", T.STRING),
            "tokenizer.ggml.tokens": (TOKENS, T.ARRAY), "tokenizer.ggml.token_type": ([1] * len(TOKENS), T.ARRAY),
            "tokenizer.ggml.merges": (["a b", "Ġ a"], T.ARRAY), "tokenizer.ggml.bos_token_id": (0, T.UINT32),
            "tokenizer.ggml.eos_token_id": (1, T.UINT32),
            "tokenizer.chat_template": ("{% for m in messages %}{{ m.content }}{% endfor %}", T.STRING)}


def tiny_gguf_bytes(scratch: Path, changes: dict[str, tuple[object, object] | None] | None = None,
                    arch: str = "llama") -> bytes:
    """The tiny model as a GGUF file, F32 tensors, with the tokenizer metadata the loader reads; `changes` replace
    metadata entries (None: leave the key out)."""
    import gguf
    import numpy as np

    from indexpool.model.loader import GGUF_LAYER_NAMES, HF_LAYER_NAMES

    t = TINY
    path = scratch / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for key, entry in {**tiny_gguf_metadata(), **(changes or {})}.items():
        if entry is not None:
            w.add_key_value(key, *entry)
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    gguf_names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{GGUF_LAYER_NAMES[role]}"
                       for i in range(t["layers"]) for role, hf in HF_LAYER_NAMES.items()})
    rng = np.random.default_rng(0)
    for name, shape in _tiny_tensors().items():
        w.add_tensor(gguf_names[name], rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _load_gguf(data: bytes, scratch: Path):
    import torch

    from indexpool.model.loader import load_model

    path = scratch / "model.gguf"
    path.write_bytes(data)
    return load_model(path, torch.float32)


def tiny_hf_config() -> dict:
    t = TINY
    return {"model_type": "llama", "hidden_size": t["dim"], "intermediate_size": t["ffn"],
            "num_hidden_layers": t["layers"], "num_attention_heads": t["heads"], "num_key_value_heads": t["kv_heads"],
            "head_dim": t["head_dim"], "vocab_size": t["vocab"], "max_position_embeddings": t["context"],
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def tiny_safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(0)
    return save({name: torch.randn(shape, generator=generator) for name, shape in _tiny_tensors().items()})


def hf_directory(scratch: Path, config: bytes | None = None, weights: bytes | None = None) -> Path:
    """The tiny model as a Hugging Face directory, with `config` or `weights` in place of its own."""
    folder = scratch / "hf"
    folder.mkdir(exist_ok=True)
    tokenizer = {"model": {"type": "BPE", "vocab": {token: i for i, token in enumerate(TOKENS)}, "merges": []},
                 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False}, "added_tokens": []}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "config.json").write_bytes(config if config is not None else json.dumps(tiny_hf_config()).encode())
    (folder / "model.safetensors").write_bytes(weights if weights is not None else tiny_safetensors_bytes())
    return folder


def _load_hf(folder: Path):
    import torch

    from indexpool.model.loader import load_model

    return load_model(folder, torch.float32)


# JSON values of any shape, with the keys the chat reader and the config loader look for.
CHAT_KEYS = ("role", "name", "sender", "author", "content", "text", "timestamp", "time", "create_time", "messages",
             "mapping", "message", "parts", "children", "parent", "current_node", "title", "type", "id")
CONFIG_KEYS = tuple(tiny_hf_config()) + (
    "text_config", "rope_scaling", "rope_parameters", "rope_type", "factor", "original_max_position_embeddings",
    "low_freq_factor", "high_freq_factor", "attention_bias", "index_kpool", "linear_attn_config",
    "quantization_config", "weight_block_size", "n_routed_experts", "layer_types", "index_topk")


def json_values(keys: tuple[str, ...]) -> st.SearchStrategy:
    scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12)
               | st.sampled_from(keys + ("llama", "qwen3", "glm5_next", "llama3", "user")))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.sampled_from(keys) | st.text(max_size=6), inner, max_size=5),
                        max_leaves=24)


def _chat_shapes() -> st.SearchStrategy[bytes]:
    messages = st.lists(st.dictionaries(st.sampled_from(CHAT_KEYS), json_values(CHAT_KEYS), max_size=6), max_size=4)
    value = json_values(CHAT_KEYS) | messages | st.builds(lambda m: {"messages": m}, messages)
    return value.map(lambda v: json.dumps(v).encode())


def _config_shapes() -> st.SearchStrategy[bytes]:
    # The tiny config with some values replaced, so that the loader gets past its first checks; or any JSON at all.
    changes = st.dictionaries(st.sampled_from(CONFIG_KEYS), json_values(CONFIG_KEYS), min_size=1, max_size=4)
    changed = changes.map(lambda c: {**tiny_hf_config(), **c})
    return (changed | json_values(CONFIG_KEYS)).map(lambda v: json.dumps(v).encode())


JSON_PIECES = (b"[", b"]", b"{", b"}", b",", b":", b"null", b"true", b'"', b"1e400", b"-1", b"9" * 400, b"NaN",
               b"[" * 3000, b'"mapping":', b'"content":', b'"parts":', b"\n")

TARGETS = {target.name: target for target in (
    Target("pdf", IngestError, lambda scratch: [pdf_bytes([["Alpha beta"], None, ["Page (three)"]]),
                                              encrypted_pdf_bytes([["Secret"]], "", "RC4-128")],
           _read_stdin("pdf"), pieces=(b"<<", b">>", b"[", b"]", b" 0 R", b"obj\n", b"endobj\n", b"stream\n",
                                       b"endstream\n", b"/Count ", b"/Kids [", b"/Length ", b"/Filter /FlateDecode",
                                       b"/Type /Page", b"xref\n", b"trailer\n", b"%%EOF"), text_numbers=True),
    Target("epub", IngestError, _epub_seeds, _read_stdin("epub"),
           pieces=(b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"<!DOCTYPE x [<!ENTITY a 'aaaa'>]>", b"&a;",
                   b"<rootfile full-path='", b"<itemref idref='", b"<p>")),
    Target("html", IngestError, lambda scratch: [HTML_SEED.encode(), HTML_SEED.encode("utf-16")], _read_stdin("html"),
           pieces=(b"<", b">", b"</", b"<pre>", b"<script>", b"<title>", b"<h1>", b"<li>", b"<td>", b"<!--", b"-->",
                   b"<![CDATA[", b"&#", b"&#x110000;", b"<" * 2000, b"<div>" * 2000), text_numbers=True),
    Target("chat", IngestError, _chat_seeds, _read_stdin("auto"), pieces=JSON_PIECES, text_numbers=True,
           shapes=_chat_shapes()),
    Target("text", IngestError, lambda scratch: [b"Plain text.\n\nA second paragraph\r\nwith CRLF.\n",
                                               "caf\u00e9 \u2018quoted\u2019\n".encode("utf-16")],
           _read_stdin("text"), pieces=(b"\0", b"\r", b"\n" * 200, b"\xff\xfe", b"\xef\xbb\xbf"), text_numbers=True),
    Target("gitignore", IngestError, lambda scratch: [GITIGNORE_SEED], _read_folder_with_gitignore,
           pieces=(b"**/", b"!", b"\\", b"[", b"]", b"[!a-", b"*", b"?", b"/", b"\n", b"#", b"**" * 200)),
    Target("gguf", ModelLoadError, lambda scratch: [tiny_gguf_bytes(scratch)], _load_gguf, pieces=(b"GGUF",)),
    Target("config", ModelLoadError, lambda scratch: [json.dumps(tiny_hf_config()).encode()],
           lambda data, scratch: _load_hf(hf_directory(scratch, config=data)), pieces=JSON_PIECES,
           text_numbers=True, shapes=_config_shapes()),
    Target("safetensors", ModelLoadError, lambda scratch: [tiny_safetensors_bytes()],
           lambda data, scratch: _load_hf(hf_directory(scratch, weights=data)),
           pieces=(b'"dtype":"F8_E4M3"', b'"shape":[', b'"data_offsets":[', b"18446744073709551615", b"{", b"}",
                   b"[", b"]", b'"__metadata__":')),
)}


# ------------------------------------------------------------------------------------------- the mutations

NUMBERS = (0, 1, 2, 7, 8, 255, 256, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**32, 2**40, 2**62,
           2**63 - 1, 2**63, 2**64 - 1)


@st.composite
def mutated(draw, target: Target, seeds: list[bytes]) -> bytes:
    """A seed with a few mutations: bytes changed, inserted, deleted, repeated or cut; an integer written over it
    (binary, of width 1 to 8, or as digits); a piece of the format inserted."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(("byte", "number", "insert", "delete", "repeat", "cut", "piece")))
        if op == "byte" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif op == "number":
            number = draw(st.sampled_from(NUMBERS + (len(data),)))
            if target.text_numbers:
                data[pos:pos] = str(number).encode()
            else:
                width = draw(st.sampled_from((1, 2, 4, 8)))
                data[pos:pos + width] = (number % (1 << 8 * width)).to_bytes(width, "little")
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=32))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 64))]
        elif op == "repeat":
            data[pos:pos] = bytes(data[pos:pos + draw(st.integers(1, 64))]) * draw(st.integers(2, 200))
        elif op == "cut":
            del data[pos:]
        elif op == "piece" and target.pieces:
            data[pos:pos] = draw(st.sampled_from(target.pieces))
    return bytes(data)


def inputs(target: Target, seeds: list[bytes]) -> st.SearchStrategy[bytes]:
    strategies = [mutated(target, seeds), st.binary(max_size=512)]
    if target.shapes is not None:
        strategies.append(target.shapes)
    return st.one_of(strategies)


# ------------------------------------------------------------------------------------------ the property

@dataclass
class Measures:
    examples: int = 0
    slowest: float = 0.0
    traced_peak: int = 0
    last_input: bytes = b""  # after a failure: the input hypothesis shrank it to, the last one it runs


def check(target: Target, data: bytes, scratch: Path, measures: Measures | None = None,
          seconds: float = SECONDS_PER_EXAMPLE, traced_bytes: int = TRACED_BYTES_PER_EXAMPLE) -> None:
    """Run `target` on `data`: Finding unless it returns, or raises its error with a one-line message, within
    `seconds` and `traced_bytes` (Python allocations at the peak)."""
    if measures is not None:
        measures.last_input = data
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with time_limit(seconds):
            target.run(data, scratch)
    except target.error as e:
        message = str(e)
        if not message or "\n" in message:
            raise Finding(f"{type(e).__name__} not on one line: {message!r}") from e
    except Hang:
        raise Finding(f"still running after {seconds:g} s") from None
    except Exception as e:
        raise Finding(f"{type(e).__name__}: {e}") from e
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if measures is not None:
            measures.examples += 1
            measures.slowest = max(measures.slowest, elapsed)
            measures.traced_peak = max(measures.traced_peak, peak)
    if peak > traced_bytes:
        raise Finding(f"{peak / 2**20:.0f} MiB allocated (over {traced_bytes / 2**20:.0f} MiB) on "
                      f"{len(data):,} bytes of input")


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Hang raised in the block once `seconds` have passed (Unix, main thread): a hung read fails instead."""
    def alarm(signum, frame):
        raise Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fuzz_property(target: Target, scratch: Path, measures: Measures | None = None, **limits):
    """The property as a hypothesis test of `target` (to be given settings and called)."""
    seeds = target.seeds(scratch)

    @given(inputs(target, seeds))
    def property(data: bytes) -> None:
        check(target, data, scratch, measures, **limits)

    return property


@contextlib.contextmanager
def memory_ceiling(extra_bytes: int = CEILING_BYTES) -> Iterator[None]:
    """The process's address space limited to what it has now plus `extra_bytes` (Linux), so that an input that
    makes a reader allocate gigabytes fails with MemoryError instead of taking the machine's memory."""
    status = Path("/proc/self/status")
    if not status.exists():
        yield
        return
    vm_kib = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = vm_kib * 1024 + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# ---------------------------------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="fuzzing time, shared by the targets")
    parser.add_argument("--target", action="append", choices=list(TARGETS), help="a target (repeatable; default all)")
    parser.add_argument("--seconds", type=float, default=SECONDS_PER_EXAMPLE, help="time limit of one example")
    parser.add_argument("--out", type=Path, default=None, help="folder for the inputs of findings (default: a new "
                                                                 "temporary folder)")
    args = parser.parse_args()

    from benchmarks.common import machine_description

    print(machine_description())
    names = args.target or list(TARGETS)
    out = args.out or Path(tempfile.mkdtemp(prefix="indexpool-fuzz-"))
    out.mkdir(parents=True, exist_ok=True)
    budget = args.minutes * 60 / len(names)
    print(f"{args.minutes:g} minutes over {len(names)} targets; findings saved under {out}")
    print(f"{'target':<12} {'examples':>9} {'slowest s':>10} {'traced MiB':>11} {'findings':>9}")
    total = 0
    with memory_ceiling(), tempfile.TemporaryDirectory() as tmp:
        for name in names:
            measures, findings = Measures(), {}
            scratch = Path(tmp) / name
            scratch.mkdir()
            run = settings(max_examples=200, deadline=None, database=None, derandomize=False,
                           report_multiple_bugs=False, suppress_health_check=list(HealthCheck))(
                fuzz_property(TARGETS[name], scratch, measures, seconds=args.seconds))
            stop = time.monotonic() + budget
            while time.monotonic() < stop:  # rounds of 200 examples, each from a new random seed
                try:
                    run()
                except Exception as failure:  # a Finding, shrunk; or hypothesis's own report of a flaky one
                    message = " ".join(f"{type(failure).__name__}: {failure}".split())[:300]
                    if message not in findings:
                        path = out / f"{name}-{len(findings) + 1}.bin"
                        path.write_bytes(measures.last_input)
                        findings[message] = f"{message} (input: {path}, {len(measures.last_input):,} bytes)"
            total += len(findings)
            print(f"{name:<12} {measures.examples:>9,} {measures.slowest:>10.2f} "
                  f"{measures.traced_peak / 2**20:>11.1f} {len(findings):>9}", flush=True)
            for finding in findings.values():
                print(f"    {finding}", flush=True)
    print(f"findings: {total}")
    sys.exit(1 if total else 0)


if __name__ == "__main__":
    main()
