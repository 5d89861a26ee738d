"""The whole-step C decode (kernels/cpu_decode.c) against the model's own layer code (model/llama.py), on a small
random llama model with awkward shapes: an input width that leaves int4 rows a half pair (96, 160), three query
heads per KV head, int4 and int8 layers mixed, with and without a qkv bias, fp32 and bf16 caches, a first token
at position 0 and a prompt that is not a multiple of any block size."""

from __future__ import annotations

import pytest
from kernel_setting import use_kernels
import torch

from indexpool.kernels import cpu_attention, cpu_decode, cpu_linear
from indexpool.model.llama import BatchKVCache, LlamaConfig, Transformer
from indexpool.model.quant import quantize_for_decode


def needs_kernels():
    for name, built in (("linear", cpu_linear.native_library()), ("attention", cpu_attention.native_library()),
                        ("decode step", cpu_decode.native_library())):
        if built[0] is None:
            pytest.skip(f"the C {name} kernel does not build here: {built[1]}")


def tiny_model(qkv_bias: bool = False, qk_norm: bool = False, seed: int = 0) -> Transformer:
    config = LlamaConfig(vocab_size=50, dim=96, n_layers=3, n_heads=9, n_kv_heads=3, head_dim=32, ffn_dim=160,
                         context_length=256, qkv_bias=qkv_bias, qk_norm=qk_norm)
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # away from ones and zeros, so that a skipped one shows
                parameter.copy_(torch.rand_like(parameter) + 0.5 if "norm" in name else torch.randn_like(parameter))
    return quantize_for_decode(model.eval(), 4, keep_int8=("output", "layers.1.attention.wo", "layers.2.feed_forward.w2"))


def decode_both_ways(model: Transformer, prompt_length: int, steps: int, cache_dtype: torch.dtype,
                     step_threads: int | None = None):
    """Logits (steps, V) and the caches of `steps` one-token forwards after the same prompt, the C step's and the
    layer code's; the steps on step_threads torch threads when given (the prompt on the caller's: which prefill
    attention runs depends on the thread count)."""
    prompt_threads = torch.get_num_threads()
    model.cache_dtype = cache_dtype
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_length), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, model.config.vocab_size, (steps,), generator=torch.Generator().manual_seed(2))
    results = []
    with torch.inference_mode():
        for in_c in (True, False):
            cache = model.new_cache(prompt_length + steps)
            torch.set_num_threads(prompt_threads)
            if prompt_length:
                model(prompt, 0, cache)
            torch.set_num_threads(step_threads or prompt_threads)
            logits = []
            for i, token in enumerate(tokens.tolist()):
                if not in_c:
                    model._decode_layers = None  # the layer code
                assert model._decodes_in_c(cache, torch.zeros(1)) == in_c
                logits.append(model(torch.tensor([[token]]), prompt_length + i, cache)[0, 0])
            model._decode_layers = False  # looked at anew next time
            results.append((torch.stack(logits), cache))
    return results


@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("prompt_length", [0, 37])
def test_fp32_cache_matches_the_layer_code(one_thread, qkv_bias, prompt_length):
    """Both compute the same fp32 operations in the same order but for the summation order of the RMSNorm's sum of
    squares, rsqrt against 1/sqrt, exp in SiLU and fma contraction in RoPE: a few fp32 roundings per layer, each
    within 1e-6 relative, growing through 3 layers and the output layer; measured up to 2.5e-7 of the logits' size."""
    needs_kernels()
    (c_logits, c_cache), (py_logits, py_cache) = decode_both_ways(tiny_model(qkv_bias), prompt_length, 6,
                                                                  torch.float32)
    scale = py_logits.abs().max()
    assert (c_logits - py_logits).abs().max() <= 2e-6 * scale
    end = prompt_length + 6
    for c, py in ((c_cache.k, py_cache.k), (c_cache.v, py_cache.v)):
        assert torch.allclose(c[:, :, :, :end], py[:, :, :, :end], rtol=1e-5, atol=1e-5)


def test_bf16_cache_matches_the_layer_code(one_thread):
    """With a bf16 cache, keys, values and queries are rounded to bf16 on both paths; an fp32 rounding apart can put
    a value on the other side of a bf16 rounding midpoint (one bf16 step, 2^-8 relative, apart), which then moves
    the logits by up to that much: the bound is 2^-8 of the logits' size, as for the batch decode's bf16 cache
    (tests/test_batch_generate.py). The cached rows differ by at most one bf16 step, and in few elements."""
    needs_kernels()
    if not cpu_attention.native_attention_takes(torch.bfloat16, 32):
        pytest.skip("the C decode attention kernel does not read bf16 caches here")
    (c_logits, c_cache), (py_logits, py_cache) = decode_both_ways(tiny_model(True), 37, 6, torch.bfloat16)
    assert (c_logits - py_logits).abs().max() <= 2**-8 * py_logits.abs().max()
    assert torch.equal(c_logits.argmax(-1), py_logits.argmax(-1))
    for c, py in ((c_cache.k, py_cache.k), (c_cache.v, py_cache.v)):
        assert c.dtype == torch.bfloat16
        c, py = c[:, :, :, :43].float(), py[:, :, :, :43].float()
        apart = c != py
        assert apart.float().mean() < 0.01
        assert ((c - py).abs()[apart] <= 2**-7 * py.abs()[apart]).all()  # one bf16 step


def test_the_layer_code_runs_where_the_c_step_does_not(one_thread, monkeypatch):
    needs_kernels()
    model = tiny_model()
    cache = model.new_cache(8)
    x = torch.zeros(1)
    assert model._decodes_in_c(cache, x)
    use_kernels(monkeypatch, "torch")
    assert not model._decodes_in_c(cache, x) and "INDEXPOOL_KERNELS=torch" in model.decode_step_path()
    use_kernels(monkeypatch, "auto")
    assert model._decodes_in_c(cache, x) and model.decode_step_path().startswith("all layers in one call")
    assert not model._decodes_in_c(model.new_cache(8, batch=2, kind=BatchKVCache), x)
    assert not model._decodes_in_c(cache, torch.zeros(1, requires_grad=True))
    assert tiny_model(qk_norm=True)._decode_table() is None  # Qwen3's q/k norm: not in the C step
    model.cache_dtype = torch.float16  # a cache the attention kernel does not read
    assert not model._decodes_in_c(model.new_cache(8), x) and "does not read this cache" in model.decode_step_path()
    fp32_weights = tiny_model()
    for block in fp32_weights.layers:  # a layer without a decode copy (as with --decode-weights off)
        block.feed_forward.w2 = torch.nn.Linear(160, 96, bias=False)
    assert fp32_weights._decode_table() is None


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_threads_give_the_same_step_as_one(one_thread, threads):
    """The step's threads split each linear's output rows and the KV heads (3 here: with 2 threads one takes two
    heads, with 5 two take none); every output is computed whole by one thread, as one thread computes it: the
    same bits. A bf16 cache where the attention kernel reads one, else fp32."""
    needs_kernels()
    model = tiny_model(True)
    dtype = torch.bfloat16 if cpu_attention.native_attention_takes(torch.bfloat16, 32) else torch.float32
    (one, one_cache), _ = decode_both_ways(model, 37, 4, dtype)
    (many, many_cache), _ = decode_both_ways(model, 37, 4, dtype, step_threads=threads)
    assert torch.equal(one, many) and torch.equal(one_cache.k, many_cache.k) and torch.equal(one_cache.v, many_cache.v)


def test_a_whole_generation_is_the_same_either_way(one_thread):
    """Greedy decoding of 12 tokens through the session API, with the C step and with the layer code: the same
    tokens (fp32 cache)."""
    needs_kernels()
    from indexpool.model.generate import Sampler, SamplingParams, Session

    model = tiny_model(seed=3)
    model.cache_dtype = torch.float32
    runs = []
    for in_c in (True, False):
        model._decode_layers = False if in_c else None
        session = Session(model, 64)
        runs.append(list(session.generate([1, 2, 3, 4, 5], Sampler(SamplingParams(temperature=0.0)), 12)))
    assert model._decode_layers is None and runs[0] == runs[1] and len(runs[0]) == 12


# Models on a GGUF file's blocks (`model.gguf_weights`), each layout exercising a part of the step's wiring: llama's
# Q/K rows stay permuted in the file (their outputs are written to reordered columns), Qwen2's qkv bias, and a
# mixed file as llama.cpp writes its _M formats (V and down in other types) with F16 rows besides: a layer of runs
# of several types. (The K-quants' kernels are the same calls; the gguf package cannot write them:
# tests/test_gguf_blocks.py tests them from blocks it makes itself.)
BLOCK_LAYOUTS = {
    "llama-Q4_0": ("llama", {}, "Q4_0", None),
    "qwen2-bias-Q8_0": ("qwen2", {}, "Q8_0", None),
    "llama-mixed": ("llama", {}, "Q5_0", {"attn_v": "Q8_0", "ffn_down": "Q4_1", "attn_output": "F16"}),
}


@pytest.fixture(scope="module", params=list(BLOCK_LAYOUTS))
def block_file(request, tmp_path_factory, default_gguf_metadata):
    from indexpool.kernels import gguf_blocks
    from tests.tiny_models import make_hf_model, write_gguf

    if gguf_blocks.native_library()[0] is None:
        pytest.skip(f"the GGUF block kernels do not build here: {gguf_blocks.native_library()[1]}")
    family, dims, qtype, qtypes = BLOCK_LAYOUTS[request.param]
    hf = make_hf_model(family, 49152, **{"hidden_size": 128, "intermediate_size": 96, **dims})
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", default_gguf_metadata,
                      arch=family, qtype=qtype, qtypes=qtypes)


@pytest.fixture(scope="module")
def block_model(block_file):
    from indexpool.model.loader import load_model

    return load_model(block_file, torch.float32, blocks=True).model


def test_a_step_on_gguf_blocks_matches_the_layer_code(one_thread, block_model):
    """The same kernels compute each linear either way, from activations rounded to int8 blocks of 32 by the same
    code; what differs is the fp32 rounding of RMSNorm, RoPE and SiLU before them, and where such a difference moves
    an activation across a rounding midpoint its int8 level moves by one, which moves the product by one level's
    share (1/127 of that block's largest activation times the weight). So the logits agree to a small fraction of
    their size rather than to fp32 roundings (the 135M default model, 30 layers: 2% of the largest logit), the
    greedy tokens are the same, and a wrongly wired part (a column, a bias, a run of another type) would be off by
    the size of its outputs."""
    needs_kernels()
    assert block_model._decode_table() is not None, block_model._not_in_c()
    (c_logits, c_cache), (py_logits, py_cache) = decode_both_ways(block_model, 37, 6, torch.float32)
    assert torch.equal(c_logits.argmax(-1), py_logits.argmax(-1))
    assert (c_logits - py_logits).abs().max() <= 0.01 * py_logits.abs().max()
    for c, py in ((c_cache.k, py_cache.k), (c_cache.v, py_cache.v)):
        assert (c[:, :, :, :43] - py[:, :, :, :43]).abs().max() <= 0.01 * py[:, :, :, :43].abs().max()


def test_a_bf16_model_on_gguf_blocks_steps_in_c(one_thread, block_file):
    """A bf16 model on blocks (the engine's choice where bf16 is native) runs its steps in C too, in fp32 within:
    its embedding row, norms, bias and RoPE row widened, its bf16 cache written and read. The reference is the fp32
    layer code with the same weights (the bf16 model's norms and biases), reading a copy of the same cache: what
    differs is the rounding of the embedding row and RoPE to bf16 (2^-9 relative), which as in the fp32 test above
    moves an activation's int8 level by one at most, so the same bound; a part wired wrong (a bias or norm read
    unwidened, the cache written as fp32) would be off by the size of its outputs."""
    from indexpool.model.loader import load_model

    needs_kernels()
    if not cpu_attention.native_attention_takes(torch.bfloat16, 32):
        pytest.skip("the C decode attention kernel does not read bf16 caches here (no AVX512-BF16)")
    model = load_model(block_file, torch.bfloat16, blocks=True).model
    reference = load_model(block_file, torch.float32, blocks=True).model
    with torch.no_grad():
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            theirs.copy_(ours.float())
    reference._decode_layers = None  # the layer code
    assert model._decode_table() is not None, model._not_in_c()
    prompt = torch.randint(0, 49152, (1, 37), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        cache = model.new_cache(49)
        model(prompt, 0, cache)
        reference.cache_dtype = torch.bfloat16
        reference_cache = reference.new_cache(49)
        reference_cache.k.copy_(cache.k)
        reference_cache.v.copy_(cache.v)
        assert model._decodes_in_c(cache, torch.zeros(1)) and cache.k.dtype == torch.bfloat16
        c_logits = torch.stack([model(torch.tensor([[t]]), 37 + i, cache)[0, 0] for i, t in enumerate(tokens)])
        py_logits = torch.stack([reference(torch.tensor([[t]]), 37 + i, reference_cache)[0, 0]
                                 for i, t in enumerate(tokens)])
    apart = (c_logits - py_logits).abs().max()
    assert apart <= 0.01 * py_logits.abs().max()
    # the same greedy token wherever the reference's best two are further apart than the paths' difference can
    # reach (a random model's 49,152 logits are often within a hundredth of each other)
    best_two = py_logits.topk(2, dim=-1).values
    clear = best_two[:, 0] - best_two[:, 1] > 2 * apart
    assert clear.sum() >= 3 and torch.equal(c_logits.argmax(-1)[clear], py_logits.argmax(-1)[clear])
    for c, py in ((cache.k, reference_cache.k), (cache.v, reference_cache.v)):
        assert (c.float() - py.float()).abs().max() <= 0.01 * py.float().abs().max()


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_split_a_step_on_gguf_blocks_without_changing_it(one_thread, block_model, threads):
    """Each thread rounds its own copy of a layer's input to int8 blocks and computes its share of each run's rows:
    every output computed whole by one thread, as one thread computes it, so the same bits."""
    needs_kernels()
    (one, one_cache), _ = decode_both_ways(block_model, 37, 4, torch.float32)
    (many, many_cache), _ = decode_both_ways(block_model, 37, 4, torch.float32, step_threads=threads)
    assert torch.equal(one, many) and torch.equal(one_cache.k, many_cache.k) and torch.equal(one_cache.v, many_cache.v)


def test_a_layer_with_rows_the_block_kernels_do_not_take_runs_per_layer(one_thread, tmp_path, default_gguf_metadata):
    """BF16 rows go through torch (`gguf_blocks.linear`): a model with them decodes with the layer code, and says so."""
    from indexpool.model.loader import load_model
    from tests.tiny_models import make_hf_model, write_gguf

    needs_kernels()
    hf = make_hf_model("llama", 49152, hidden_size=128, intermediate_size=96)
    path = write_gguf(hf, tmp_path / "bf16-wo.gguf", default_gguf_metadata, qtype="Q4_0",
                      qtypes={"attn_output": "BF16"})
    model = load_model(path, torch.float32, blocks=True).model
    assert model._decode_table() is None and "GGUF blocks the C step takes" in model.decode_step_path()
