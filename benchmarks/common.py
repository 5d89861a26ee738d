"""What the benchmarks share: the natural text they read, timing, peak memory, the installed command, the options
they all take and the line that says what machine the figures come from."""

from __future__ import annotations

import argparse
import glob
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INDEXPOOL = Path(sys.executable).parent / "indexpool"  # the command installed beside this Python (the venv's)
CHARS_PER_TOKEN = 4  # about, in Python's documentation read by the default model's tokenizer
CPU_FLAGS = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"]  # the kernels' paths


def natural_text(tokens: int | None = None) -> str:
    """Natural English: Python's own documentation (`pydoc_data.topics`, about 115K tokens); with `tokens`, about
    that many tokens of it, repeated where more are asked for."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics.values())
    if tokens is None:
        return text
    size = tokens * CHARS_PER_TOKEN
    return (text * (size // len(text) + 1))[:size]


def natural_haystack() -> str:
    """A long natural-English haystack: `natural_text()`, then the system's license texts (about 180K tokens
    together in the default model's tokenizer)."""
    licenses = [Path(p).read_text(errors="replace") for p in sorted(glob.glob("/usr/share/common-licenses/*"))
                if Path(p).is_file()]
    return "\n\n".join([natural_text(), *licenses])


def chat_frame(tokenizer) -> tuple[str, str]:
    """The model's chat template around one user message: its text before the message, and after it up to where
    the assistant's answer starts. A long prompt is built from it as token ids, its parts tokenized apart."""
    pre, post = tokenizer.render_chat([{"role": "user", "content": "\x00"}]).split("\x00")
    return pre, post


def greedy_answer(session, prompt: list[int], max_new_tokens: int, label: str, stop_ids=frozenset(),
                  progress: bool = False, question_from: int | None = None):
    """`session` reads `prompt` (only what follows the prefix it already holds; its question from `question_from`,
    `Session.prefill`) and answers greedily: the answer's token ids, its GenerationStats and how many tokens were
    read. progress: `long_read_progress` lines."""
    from indexpool.model.generate import GenerationStats, Sampler, SamplingParams, common_prefix

    stats = GenerationStats()
    reading = long_read_progress(label, len(prompt) - common_prefix(session.tokens, prompt)) if progress else None
    out = list(session.generate(prompt, Sampler(SamplingParams(temperature=0)), max_new_tokens, stop_ids=stop_ids,
                                stats=stats, on_prefill_progress=reading, question_from=question_from))
    return out, stats, session.last_fed_tokens


def natural_ids(tokenizer, tokens: int) -> list[int]:
    """Exactly `tokens` token ids of `natural_text()`, repeated past its end."""
    ids = tokenizer.encode(natural_text())
    return (ids * (tokens // len(ids) + 1))[:tokens]


def leading_pieces(tokenizer, pieces, tokens: int) -> list[str]:
    """The first pieces of text that together take at most `tokens` tokens."""
    kept, total = [], 0
    for piece in pieces:
        total += len(tokenizer.encode(piece))
        if total > tokens:
            break
        kept.append(piece)
    return kept


def text_document(text: str, name: str):
    """`text` read as `indexpool` reads a plain-text file called `name` (a Document)."""
    from indexpool.ingest import load_document

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(text)
        return load_document([str(path)])


def chapters_document(tokenizer, tokens: int):
    """A document of at most `tokens` tokens: chapters of Python's documentation, each headed "Chapter N: TOPIC",
    read as a plain-text file; and the chapters' topics."""
    import pydoc_data.topics

    topics = [(name, text) for name, text in sorted(pydoc_data.topics.topics.items())
              if name.isalpha() and len(text) > 800]
    chapters = [f"Chapter {i}: {name}\n\n{text.strip()}\n\n" for i, (name, text) in enumerate(topics, 1)]
    kept = leading_pieces(tokenizer, chapters, tokens)
    return text_document("".join(kept), "manual.txt"), [name for name, _ in topics[: len(kept)]]


def median_seconds(run, repeats: int, warmup: int = 0) -> float:
    """The median wall time of `repeats` calls of `run`, after `warmup` calls not timed."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts it in KiB


def long_read_progress(label: str, length: int):
    """A prefill progress callback that prints a line on stderr per sixteenth of a read of 128K tokens or more:
    tokens, rate and peak RSS as it goes (such reads take minutes to an hour)."""
    t0 = time.perf_counter()
    every = max(1, length // 16)
    marks = iter(range(every, length + every, every))
    mark = next(marks)

    def progress(done: int, total: int) -> None:
        nonlocal mark
        if total >= 1 << 17 and done >= mark:
            print(f"  {label} read {done:,}/{total:,} tokens, {done / (time.perf_counter() - t0):.0f} tok/s, "
                  f"peak RSS {peak_rss_bytes() / 2**20:,.0f} MiB", file=sys.stderr, flush=True)
            while mark <= done:
                mark = next(marks, length + 1)

    return progress


def run_indexpool(*args: str, threads: int | None = None) -> tuple[str, float]:
    """`indexpool ARGS` as a user runs it (the installed command): its standard output and its wall time, process
    start and model load included."""
    command = [str(INDEXPOOL), *args] + (["--threads", str(threads)] if threads else [])
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"indexpool {args[0]} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done.stdout, seconds


def add_schedule_option(parser: argparse.ArgumentParser) -> None:
    """--schedule, as the benchmarks take it: the indexer schedule (`IndexPoolConfig.schedule`), comma-separated."""
    from indexpool.model.indexpool_cache import IndexPoolConfig

    parser.add_argument("--schedule", type=lambda text: [kind.strip() for kind in text.split(",")],
                        default=list(IndexPoolConfig.schedule or ["full"]),
                        help="indexer schedule: full/shared, a pattern repeated over the layers (e.g. full,shared; "
                             "full: every layer)")


def machine_description(threads: int | None = None) -> str:
    """One line on what the figures were measured on: the CPU, those of its flags the kernels choose by, its cores,
    torch's version and the threads the work runs on (default: this process's torch threads, as set now)."""
    import torch

    cpu = {}
    if Path("/proc/cpuinfo").exists():  # Linux: the first processor's fields
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            cpu.setdefault(key.strip(), value.strip())
    flags = [flag for flag in CPU_FLAGS if flag in cpu.get("flags", "").split()]
    cores = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores  # taskset narrows it
    return (f"machine: {cpu.get('model name') or platform.processor() or platform.machine()}; "
            f"flags {' '.join(flags) or '(no AVX2)'}; {cores} cores"
            + (f" ({usable} usable here)" if usable != cores else "")
            + f"; torch {torch.__version__}; threads {threads or torch.get_num_threads()}")
