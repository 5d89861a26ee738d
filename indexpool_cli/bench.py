"""`indexpool bench`: our engine against transformers (and llama.cpp when installed) on the same weights.

Each engine runs in its own process (so peak RSS is its own) on the same random token ids; every figure is the
median of `repeats` runs, and the ratios are taken against the best transformers figure (fp32 or bf16).
Run as a module, this file is the per-engine worker: `python -m indexpool_cli.bench ENGINE SPEC_JSON`.
"""

from __future__ import annotations

import importlib.util
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENGINES = {
    "indexpool": [{"dtype": "auto"}],
    "transformers": [{"dtype": "fp32"}, {"dtype": "bf16"}],
    "llama.cpp": [{"dtype": "gguf"}],
}


def run_bench(model, contexts, prefill_length, decode_tokens, repeats, engines, json_out,
              decode_weights: tuple[str, ...] = ("auto",), threads: int | None = None) -> None:
    """decode_weights: our engine runs once per choice (`--decode-weights`), in this order; the ratios are the
    first run's. threads: every engine's thread count (default: PyTorch's, one per physical core, as our engine)."""
    import torch
    from indexpool.model import user_environment
    from indexpool.model.default_model import default_model_path

    from .console import err_console

    path = str(default_model_path() if model in (None, "", "default") else Path(model).expanduser().resolve())
    threads = threads or torch.get_num_threads()
    spec = {"model": path, "contexts": contexts, "prefill_length": prefill_length, "decode_tokens": decode_tokens,
            "repeats": repeats, "threads": threads}
    results = []
    for engine in engines:
        if engine == "llama.cpp" and importlib.util.find_spec("llama_cpp") is None:
            results.append({"engine": engine, "dtype": "gguf", "error": "skipped: llama-cpp-python is not installed"})
            continue
        variants = [{**v, "decode_weights": d} for v in ENGINES[engine] for d in decode_weights] \
            if engine == "indexpool" else ENGINES[engine]
        for variant in variants:
            if engine == "transformers" and variant["dtype"] == "bf16" and not _native_bf16():
                results.append({"engine": engine, "dtype": "bf16", "error": "skipped: this CPU has no native bf16 "
                                "(emulated bf16 matmuls; fp32 is the reference here)"})
                continue
            job = {**spec, **variant}
            err_console.print(f"[dim]running {engine} ({', '.join(variant.values())})...[/dim]")
            proc = subprocess.run([sys.executable, "-m", "indexpool.bench", engine, json.dumps(job)], capture_output=True,
                                  text=True, env=None if engine == "indexpool" else user_environment())
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                results.append({"engine": engine, "dtype": variant["dtype"], "error": f"failed: {reason[:200]}"})
            else:
                results.append(json.loads(lines[-1]))
    report = {"model": path, "threads": threads, "repeats": repeats, "results": results, "ratios": _ratios(results, contexts)}
    if json_out:
        print(json.dumps(report))
    else:
        print(_table(report, contexts, prefill_length))


def _native_bf16() -> bool:
    """Whether bf16 runs natively where the bench runs: the engine's own choice for --dtype auto. Elsewhere
    transformers in bf16 is emulated: on an AVX2 EPYC it had not finished its figures after 20 minutes, where fp32
    took all of them in under 5."""
    import torch

    from indexpool.model.runtime import default_device, resolve_dtype

    return resolve_dtype("auto", default_device()) == torch.bfloat16


def _ratios(results, contexts) -> dict:
    """Our first run against the best transformers run, and against llama.cpp: {reference: {figure: ratio}}."""
    ours = next((r for r in results if r["engine"] == "indexpool" and "error" not in r), None)
    out = {}
    for engine, label in (("transformers", "best transformers"), ("llama.cpp", "llama.cpp")):
        refs = [r for r in results if r["engine"] == engine and "error" not in r]
        if not ours or not refs:
            continue
        ratios = {"prefill": ours["prefill_tps"] / max(r["prefill_tps"] for r in refs)}
        for c in contexts:
            ratios[f"decode@{c}"] = ours["decode_tps"][str(c)] / max(r["decode_tps"][str(c)] for r in refs)
        ratios["peak RSS"] = ours["peak_rss_mib"] / min(r["peak_rss_mib"] for r in refs)
        out[label] = {k: round(v, 2) for k, v in ratios.items()}
    return out


def _table(report, contexts, prefill_length) -> str:
    head = ["engine", "dtype", "load s", f"prefill@{prefill_length} tok/s"] + [f"decode@{c} tok/s" for c in contexts] + ["peak RSS MiB"]
    rows = [head]
    for r in report["results"]:
        if "error" in r:
            rows.append([r["engine"], r["dtype"], r["error"]])
            continue
        rows.append([r["engine"], r["dtype"], f"{r['load_seconds']:.1f}", f"{r['prefill_tps']:.0f}"] + [f"{r['decode_tps'][str(c)]:.1f}" for c in contexts] + [f"{r['peak_rss_mib']:.0f}"])
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if report["ratios"]:
        lines.append("")
    for reference, ratios in report["ratios"].items():
        lines.append(f"indexpool / {reference}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    lines.append(f"(median of {report['repeats']} runs, {report['threads']} thread{'s' if report['threads'] != 1 else ''} each; model {report['model']})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the worker

def _token_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(17, vocab, (n,), generator=g).tolist()


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _worker_indexpool(job):
    from indexpool.model.generate import Session
    from indexpool.model.runtime import load_engine

    from indexpool.model.gguf_weights import block_parts
    from indexpool.model.quant import DecodeQuantLinear

    loaded = load_engine(job["model"], job["dtype"], decode_weights=job.get("decode_weights", "auto"))
    model, vocab = loaded.model, loaded.config.vocab_size
    bits = sorted({m.bits for m in model.modules() if isinstance(m, DecodeQuantLinear)})
    label = str(model.dtype).removeprefix("torch.") + (f", decode {'+'.join(f'int{b}' for b in bits)}" if bits else "")
    if block_parts(model):
        label += ", gguf blocks"

    def prefill_time(n, room=1):
        session = Session(model, n + room)
        ids = _token_ids(n, vocab)
        return _time(lambda: session.prefill(ids)), session

    def decode_time(ctx):
        import torch

        _, session = prefill_time(ctx, room=job["decode_tokens"] + 8)
        token = torch.tensor([[42]])
        with torch.inference_mode():
            for pos in range(ctx, ctx + 3):  # warm-up
                model(token, pos, session.cache)

            def steps():
                t = token
                for pos in range(ctx + 3, ctx + 3 + job["decode_tokens"]):
                    t = model(t, pos, session.cache)[:, -1].argmax(-1, keepdim=True)

            return _time(steps)

    return label, prefill_time, decode_time


def _worker_transformers(job):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[job["dtype"]]
    path = Path(job["model"])
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval()
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill_time(n):
        ids = torch.tensor([_token_ids(n, vocab)])
        out = {}
        # Logits of the last position only, as transformers' generate() asks for and as our engine computes: all
        # of them would add a 49,152-wide output row per token (4K tokens, fp32, AVX2: 24.1 s against 19.7 s).
        seconds = _time(lambda: out.setdefault("o", model(ids, use_cache=True, logits_to_keep=1)))
        return seconds, out["o"].past_key_values

    @torch.inference_mode()
    def decode_time(ctx):
        _, cache = prefill_time(ctx)
        token = torch.tensor([[42]])
        for _ in range(3):
            cache = model(token, past_key_values=cache, use_cache=True).past_key_values

        def steps():
            nonlocal cache
            t = token
            for _ in range(job["decode_tokens"]):
                out = model(t, past_key_values=cache, use_cache=True)
                cache, t = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

        return _time(steps)

    return job["dtype"], prefill_time, decode_time


def _worker_llama_cpp(job):
    from llama_cpp import Llama

    n_ctx = max(max(job["contexts"]), job["prefill_length"]) + job["decode_tokens"] + 16
    llm = Llama(model_path=job["model"], n_ctx=n_ctx, n_threads=job["threads"], n_threads_batch=job["threads"],
                n_batch=512, verbose=False)
    vocab = llm.n_vocab()

    def prefill_time(n):
        llm.reset()
        ids = _token_ids(n, vocab)
        return _time(lambda: llm.eval(ids)), None

    def decode_time(ctx):
        prefill_time(ctx)

        def steps():
            for _ in range(job["decode_tokens"]):
                llm.eval([42])

        return _time(steps)

    return "gguf", prefill_time, decode_time


def _worker(engine: str, job: dict) -> dict:
    import torch

    make = {"indexpool": _worker_indexpool, "transformers": _worker_transformers, "llama.cpp": _worker_llama_cpp}[engine]
    torch.set_num_threads(job["threads"])  # our engine's and transformers' (llama.cpp takes its own count)
    t0 = time.perf_counter()
    dtype, prefill_time, decode_time = make(job)
    load = time.perf_counter() - t0
    prefill_time(64)  # warm-up: first calls allocate and pick kernels
    n = job["prefill_length"]
    prefill = statistics.median(n / prefill_time(n)[0] for _ in range(job["repeats"]))
    decode = {
        str(c): statistics.median(job["decode_tokens"] / decode_time(c) for _ in range(job["repeats"])) for c in job["contexts"]
    }
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"engine": engine, "dtype": dtype, "load_seconds": load, "prefill_tps": prefill, "decode_tps": decode,
            "peak_rss_mib": peak, "repeats": job["repeats"]}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m indexpool_cli.bench ENGINE SPEC_JSON")
    engine_name, spec_json = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(_worker(engine_name, spec_json)))
