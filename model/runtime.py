"""Choosing the device, dtype and threads the engine runs with, and loading a model ready to generate."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from .llama import LlamaConfig
from .loader import LoadedModel, load_model, model_path
from .tensor_cache import TensorCache, cache_key
from .quant import quantize_for_decode
from indexpool.kernels import cpu_linear, resolve_policy
from indexpool.kernels.cpu_attention import native_attention_takes
from indexpool.kernels.native_build import default_cache_dir

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (on older CPUs they are emulated and slower than fp32). Not
    where PyTorch was told to keep to AVX2 or less (`ATEN_CPU_CAPABILITY=avx2`): its bf16 kernels run emulated then,
    and the engine computes in fp32 as it would on an AVX2 CPU."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device != "cpu" or cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose auto, {', '.join(DTYPES)})")
    return DTYPES[name]


MAX_THREADS = 64  # the C kernels' fixed thread tables (kernels/cpu_decode.c, cpu_attention.c)


def set_threads(threads: int | None) -> int:
    """Use the given thread count, else PyTorch's default (one per physical core)."""
    if threads is not None:
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"--threads {threads} is out of range: give 1 to {MAX_THREADS} "
                             f"(this machine has {os.cpu_count()} CPUs)")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve large blocks from its heap and keep them there when freed (up to 2 GiB free at its
    top), instead of mapping fresh pages for each block over 32 MB and unmapping them at free: IndexPool gathers
    each query's far keys anew in every layer (~27 MB for a question's tokens), and faulting those pages in again
    cost more than gathering them (measured: docs/benchmarks.md). Resident memory then stays near its peak instead
    of shrinking between forwards; INDEXPOOL_KEEP_FREED_MEMORY=0 turns this off. False where it is off or the C
    library is not glibc."""
    if os.environ.get("INDEXPOOL_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


DECODE_WEIGHTS = ("auto", "gguf", "int4", "int8", "off")
# auto: a GGUF model with at least this many weights computes on the file's own blocks (`model.gguf_weights`):
# a dequantized copy of a 1B model took 10 GB here. Smaller ones (the default model, 135M) do too in bf16, where the
# decode copies are PyTorch's kernels called layer by layer and the blocks' one-call C step decoded 3x as fast
# (AMX); in fp32 they keep the dequantized weights and their decode copies, whose one-call step costs less
# perplexity and keeps a batch of questions' answers those of each one alone (docs/benchmarks.md).
BLOCKS_MIN_WEIGHTS = 500_000_000


def decode_bits(choice: str, source_bits_per_weight: float) -> int | None:
    """auto: int4 for models stored in 5 bits or fewer per weight (Q4_0, Q4_1, Q4_K...: int4 in groups of 32
    loses next to nothing more), int8 otherwise. gguf: no decode copies (the layers compute on the file's
    blocks)."""
    if choice not in DECODE_WEIGHTS:
        raise ValueError(f"unknown decode weights '{choice}' (choose {', '.join(DECODE_WEIGHTS)})")
    if choice == "auto":
        return 4 if source_bits_per_weight <= 5 else 8
    return {"int4": 4, "int8": 8, "off": None, "gguf": None}[choice]


def on_blocks(choice: str, path: Path, device: str, dtype: torch.dtype) -> bool:
    """Whether a model computes on its GGUF file's blocks: --decode-weights gguf (a GGUF file on the CPU), or auto
    for a llama-family GGUF model on the CPU in bf16, or in fp32 from BLOCKS_MIN_WEIGHTS weights."""
    from .errors import SettingsError
    from .gguf_file import read_gguf
    from .loader import GGUF_ARCHS

    if choice == "gguf" and (path.is_dir() or device != "cpu"):
        raise SettingsError("--decode-weights gguf computes on a GGUF file's blocks on the CPU: give a .gguf file "
                            "(and no GPU), or choose auto")
    if choice not in ("auto", "gguf") or path.is_dir() or device != "cpu":
        return False
    g = read_gguf(path)
    if g.architecture not in GGUF_ARCHS:
        return False
    import math

    weights = sum(math.prod(info.shape) for info in g.tensors.values())
    return choice == "gguf" or dtype == torch.bfloat16 or weights >= BLOCKS_MIN_WEIGHTS


def load_engine(model: str | os.PathLike | None, dtype: str = "auto", device: str | None = None, decode_weights: str = "auto") -> LoadedModel:
    """Load a model for generation. A GGUF model on the CPU in bf16, or in fp32 of 500M weights or more (or any,
    with `decode_weights` "gguf") computes on the file's own blocks, memory-mapped (`on_blocks`). Otherwise a bf16
    model on the CPU decodes with quantized weight copies unless `decode_weights` is "off", and so does an fp32 one
    where the C kernels of kernels/cpu_linear.c build. The
    output layer stays int8: GGUF files keep it at 8 bits or more (the default model's tied embedding is Q8_0), as
    the matrix whose rounding reaches the logits directly.

    A GGUF model's prepared weights (dequantized, plus the decode copies: seconds of work) are kept in the prepared
    weights cache (~/.cache/indexpool/models; INDEXPOOL_PREPARED_WEIGHTS=0 turns it off), so the next load reads
    them back instead."""
    resolve_policy()  # the kernel choices, read from the environment once
    keep_freed_memory()
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    decode_bits(decode_weights, 16)  # validate before the slow load
    path = model_path(model)
    if on_blocks(decode_weights, path, device, torch_dtype):
        return load_model(path, torch_dtype, device, blocks=True)
    store = None
    if path.is_file() and os.environ.get("INDEXPOOL_PREPARED_WEIGHTS", "1") != "0":
        store = TensorCache(default_cache_dir("models"), limit_bytes=PREPARED_LIMIT_BYTES)
        stat = path.stat()
        key = cache_key({"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                         "dtype": str(torch_dtype), "device": str(device), "decode_weights": decode_weights,
                         "code": _weights_code_hash()})
        damaged: list[str] = []
        saved = store.load(key, warn=damaged.append)  # a damaged entry is deleted and rebuilt below
        if saved is not None:
            loaded = load_model(path, torch_dtype, device, weights=False)
            _prepare_decode(loaded, decode_weights, torch_dtype, device, compute=False)
            targets = dict(loaded.model.named_parameters()) | dict(loaded.model.named_buffers())
            if {k: t.shape for k, t in targets.items()} == {k: t.shape for k, t in saved[1].items()}:
                with torch.no_grad():
                    for name, tensor in saved[1].items():  # the read tensors become the weights: no second copy
                        targets[name].data = tensor.to(targets[name].dtype)
                return loaded
    loaded = load_model(path, torch_dtype, device)
    _prepare_decode(loaded, decode_weights, torch_dtype, device)
    if store is not None:
        loaded.model.load_notes = [*getattr(loaded.model, "load_notes", []),
                                   *(f"prepared weights: {message}" for message in damaged)]
        tensors = dict(loaded.model.named_parameters()) | dict(loaded.model.named_buffers())
        try:
            store.save(key, [], tensors, loaded.name)
        except OSError:  # no room or no permission: loading works without it
            pass
    return loaded


PREPARED_LIMIT_BYTES = 4 * 1024**3


def _prepare_decode(loaded: LoadedModel, decode_weights: str, dtype: torch.dtype, device: str, compute: bool = True) -> None:
    bits = decode_bits(decode_weights, loaded.source_bits_per_weight)
    # Only the llama family decodes with quantized copies. In glm5_next most weights are routed experts (not
    # nn.Linear layers), and rounding its indexer projections would flip near-tied pool rankings. fp32 (a CPU
    # without native bf16) takes them where the C kernels of kernels/cpu_linear.c build, else keeps fp32 weights
    # (`indexpool info` says which).
    if not (bits and device == "cpu" and isinstance(loaded.config, LlamaConfig)):
        return
    if dtype == torch.bfloat16 or (dtype == torch.float32 and cpu_linear.kernel_runs()):
        quantize_for_decode(loaded.model, bits, keep_int8=("output",), compute=compute)
    # Nor is an fp32 model's decode kept at full precision: its dense K/V cache is bf16 where the C decode-attention
    # kernel reads one (a step at 4K reads half the bytes: docs/benchmarks.md).
    if dtype == torch.float32 and native_attention_takes(torch.bfloat16, loaded.config.head_dim):
        loaded.model.cache_dtype = torch.bfloat16


def _weights_code_hash() -> str:
    """The source of the code that turns a file into prepared weights: an edit to it invalidates the cache."""
    import hashlib

    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in ("gguf_file.py", "loader.py", "llama.py", "quant.py", "../kernels/cpu_linear.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]
