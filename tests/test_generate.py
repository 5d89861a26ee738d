"""The generation loop on the real default model (SmolLM2-135M-Instruct): sampling, stop tokens, KV-cache reuse
across prompts in one Session, a full context, and the bf16 + int4/int8 decode path; plus Sampler unit tests on
hand-made logits."""

from __future__ import annotations

import pytest
import torch

from indexpool.kernels.cpu_attention import native_attention_takes
from indexpool.model.errors import ModelOutputError
from indexpool.model.generate import GenerationStats, Sampler, SamplingParams, Session
from indexpool.model.quant import DecodeQuantLinear
from indexpool.model.runtime import load_engine

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    """The default model in fp32 (no quantized decode weights): the numerically plain reference."""
    return load_engine(None, "fp32", decode_weights="off")


@pytest.fixture(scope="module")
def bf16_engine():
    # "bf16" and int4 decode copies explicitly (a bf16 model on the CPU computes on the file's blocks by default), so
    # the bf16 + quantized decode path is exercised on any CPU.
    return load_engine(None, "bf16", decode_weights="int4")


def greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0))


def run(model, prompt: list[int], sampler: Sampler, max_new_tokens: int, stop_ids=frozenset(), max_length: int = 256):
    """Generate in a fresh Session; returns (tokens, stats, session)."""
    session = Session(model, max_length)
    stats = GenerationStats()
    tokens = list(session.generate(prompt, sampler, max_new_tokens, stop_ids, stats))
    return tokens, stats, session


# ------------------------------------------------------------------------------------------ Sampler units

def log_probs_batch(probs: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1)


def test_temperature_zero_is_argmax():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    for seed in (0, 1, 2):
        sampler = Sampler(SamplingParams(temperature=0, top_k=40, top_p=0.95, seed=seed))
        assert torch.equal(sampler(logits), logits.argmax(dim=-1))


def test_top_k_one_is_argmax_under_any_seed():
    # Nearly flat logits: a sampler that ignored top_k would pick other tokens almost always.
    logits = torch.randn(256, 500, generator=torch.Generator().manual_seed(1)) * 0.01
    for seed in range(5):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=1, top_p=1.0, seed=seed))
        assert torch.equal(sampler(logits), logits.argmax(dim=-1))


def test_tiny_top_p_is_argmax():
    logits = torch.randn(256, 500, generator=torch.Generator().manual_seed(2)) * 0.01
    for seed in range(5):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1e-6, seed=seed))
        assert torch.equal(sampler(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.8, 2),  # 0.5 + 0.3 reaches 0.8 exactly: {0, 1} is the smallest set holding p, index 2 is not needed
        (0.75, 2),
        (0.85, 3),
        (0.5, 1),
        (1.0, 4),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    draws = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=top_p, seed=0))(log_probs_batch(probs, 2000))
    counts = torch.bincount(draws, minlength=4).tolist()
    assert all(c == 0 for c in counts[kept:]), counts
    assert all(c > 0 for c in counts[:kept]), counts
    # What is kept is sampled in proportion to its renormalised probability (2000 draws: ~4.5 sd margin).
    expected = probs[0] / sum(probs[:kept])
    assert abs(counts[0] / 2000 - expected) < 0.05, counts


def test_top_p_draws_one_at_a_time():
    """The same filter holds for single-row logits drawn one by one (the shape the generation loop uses)."""
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.8, seed=3))
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()  # unsorted: the best tokens are 1 and 3
    seen = {int(sampler(logits)) for _ in range(300)}
    assert seen == {1, 3}


def test_top_k_two_never_samples_beyond_the_two_best():
    logits = torch.tensor([1.0, 3.0, 0.5, 2.9, 2.8, -1.0]).repeat(2000, 1)
    draws = Sampler(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, seed=0))(logits)
    counts = torch.bincount(draws, minlength=6).tolist()
    assert counts[1] > 0 and counts[3] > 0, counts
    assert counts[1] + counts[3] == 2000, counts


def test_high_temperature_flattens_and_low_sharpens():
    logits = torch.tensor([2.0, 1.0, 0.0]).repeat(4000, 1)

    def share_of_best(temperature: float) -> float:
        draws = Sampler(SamplingParams(temperature=temperature, top_k=0, top_p=1.0, seed=0))(logits)
        return (draws == 0).float().mean().item()

    # softmax([2,1,0]/T)[0]: T=0.25 -> 0.98, T=1 -> 0.67, T=4 -> 0.42
    assert share_of_best(0.25) > 0.95
    assert 0.62 < share_of_best(1.0) < 0.72
    assert 0.37 < share_of_best(4.0) < 0.47


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.7, top_k=40),
                                    dict(temperature=0.7, top_k=0, top_p=0.9), dict(temperature=1.0, top_k=0, top_p=1.0)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_logits_that_are_not_numbers_are_a_model_output_error(params, bad):
    """A model whose weights hold NaN (or whose dtype overflows) fails with one message, in every sampling mode;
    greedy decoding would otherwise emit the NaN's token and sampling fail inside torch.multinomial."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(5))
    logits[1, 123] = bad
    with pytest.raises(ModelOutputError, match="not numbers"):
        Sampler(SamplingParams(**params, seed=0))(logits)
    logits[1, 123] = 0.0
    assert Sampler(SamplingParams(**params, seed=0))(logits).shape == (3,)


def test_a_tiny_temperature_draws_the_best_token():
    """Logits divided by a temperature near zero must not overflow into inf - inf (NaN probabilities)."""
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(6)) * 30
    for top_k in (0, 40):
        draws = Sampler(SamplingParams(temperature=1e-40, top_k=top_k, top_p=0.95, seed=0))(logits)
        assert torch.equal(draws, logits.argmax(dim=-1))


def test_sampler_seed_reproducible():
    logits = torch.randn(128, 300, generator=torch.Generator().manual_seed(4))
    params = dict(temperature=0.8, top_k=40, top_p=0.95)
    a = Sampler(SamplingParams(**params, seed=11))(logits)
    b = Sampler(SamplingParams(**params, seed=11))(logits)
    c = Sampler(SamplingParams(**params, seed=12))(logits)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.01), dict(top_k=-1)],
    ids=["negative-temperature", "top_p-zero", "top_p-negative", "top_p-above-one", "negative-top_k"],
)
def test_invalid_params_raise(params):
    with pytest.raises(ValueError):
        Sampler(SamplingParams(**params))


# ------------------------------------------------------------------------------------------ the real model

def test_same_seed_same_tokens_different_seeds_differ(engine):
    tok = engine.tokenizer
    prompt = tok.encode("Once upon a time, in a small village,")

    def sample(seed: int) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=seed))
        tokens, stats, _ = run(engine.model, prompt, sampler, 24)
        assert len(tokens) == stats.new_tokens == 24
        assert stats.stop_reason == "max_new_tokens"
        return tokens

    first = sample(1)
    assert sample(1) == first
    others = [sample(2), sample(3)]
    assert len({tuple(first), *map(tuple, others)}) > 1, "three seeds gave the same 24 sampled tokens"


def test_greedy_chat_stops_on_a_stop_token(engine):
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Say hi."}])
    tokens, stats, session = run(engine.model, prompt, greedy(), 200, tok.stop_ids)
    assert stats.stop_reason == "stop_token"
    assert 0 < len(tokens) < 200
    assert not set(tokens) & tok.stop_ids
    assert stats.prompt_tokens == len(prompt) and stats.new_tokens == len(tokens)
    assert tok.decode(tokens).strip(), "the reply is empty"
    # The stop token itself is not cached: the session holds the prompt and the reply only.
    assert session.tokens == prompt + tokens

    short, short_stats, _ = run(engine.model, prompt, greedy(), 3, tok.stop_ids)
    assert short_stats.stop_reason == "max_new_tokens"
    assert len(short) == short_stats.new_tokens == 3
    assert short == tokens[:3]


def test_session_reuses_the_cached_prefix(engine):
    tok = engine.tokenizer
    model = engine.model
    a = tok.encode(PROMPT)
    session = Session(model, 256)
    out_a = list(session.generate(a, greedy(), 6))
    assert len(out_a) == 6
    assert session.tokens == a + out_a  # every yielded token was fed, so the next turn can reuse it

    b = a + tok.encode(" Paris, and the capital of Germany is")
    fed = []
    out_b = list(session.generate(b, greedy(), 8, on_prefill_progress=lambda done, total: fed.append(total)))
    common = 0
    for x, y in zip(a + out_a, b[:-1]):
        if x != y:
            break
        common += 1
    assert common >= len(a)
    # Only the tokens past the shared prefix were prefilled.
    assert fed and fed[-1] == len(b) - common
    assert session.tokens == b + out_b

    fresh, _, _ = run(model, b, greedy(), 8)
    assert out_b == fresh

    # A prompt that diverges inside the cached tokens: the stale cache entries after the divergence are overwritten.
    c = a[:2] + tok.encode(" best way to learn a language is")
    out_c = list(session.generate(c, greedy(), 8))
    fresh_c, _, _ = run(model, c, greedy(), 8)
    assert out_c == fresh_c
    assert session.tokens == c + out_c


def test_context_full(engine):
    tok = engine.tokenizer
    prompt = tok.encode(PROMPT)
    reference, _, _ = run(engine.model, prompt, greedy(), 12)

    session = Session(engine.model, len(prompt) + 5)
    stats = GenerationStats()
    tokens = list(session.generate(prompt, greedy(), 50, tok.stop_ids, stats))
    assert stats.stop_reason == "context_full"
    # generate() yields a token, then stops once the cache is full; the last yielded token is never fed, so
    # max_length - len(prompt) + 1 tokens come out.
    assert len(tokens) == stats.new_tokens == session.max_length - len(prompt) + 1 == 6
    assert tokens == reference[:6]
    assert session.tokens == prompt + tokens[:-1]
    assert len(session.tokens) == session.max_length


def test_bf16_quantized_decode_agrees_with_fp32_on_a_short_prefix(engine, bf16_engine):
    assert bf16_engine.model.dtype == torch.bfloat16
    layers = [m for m in bf16_engine.model.modules() if isinstance(m, DecodeQuantLinear)]
    assert len(layers) == 4 * bf16_engine.config.n_layers + 1  # qkv, o, gate/up, down per layer; output
    # The default model is stored in Q4_1 (5 bits per weight): its block weights decode in int4, the output in int8.
    assert sorted(m.bits for m in layers) == [4] * (4 * bf16_engine.config.n_layers) + [8]

    # bf16 weights (prefill) and int4/int8 weights (decode) round differently from fp32, and greedy decoding amplifies a
    # flipped argmax, so only the first 8 tokens are compared, and one of two prompts has to match.
    assert _agrees_on_a_short_prefix(bf16_engine.model, engine), \
        "bf16 + int4/int8 greedy output differs from fp32 within 8 tokens on both prompts"


def test_fp32_quantized_decode_agrees_with_fp32_on_a_short_prefix(engine):
    """On an fp32 model the C kernels of kernels/cpu_linear.c run the int4/int8 copies (up to
    DecodeQuantLinear.fp32_max_rows rows: these short prompts' prefill too). Quantization changes the logits as in
    the bf16 test above, so the same check: 8 greedy tokens, one of two prompts equal to the fp32 weights' tokens."""
    from indexpool.kernels import cpu_linear

    library, origin = cpu_linear.native_library()
    if library is None:
        pytest.skip(f"the C linear kernels do not build here: {origin}")
    quantized = load_engine(None, "fp32")
    layers = [m for m in quantized.model.modules() if isinstance(m, DecodeQuantLinear)]
    assert len(layers) == 4 * quantized.config.n_layers + 1 and all(m.native for m in layers)
    # its K/V cache is bf16 where the C decode-attention kernel reads one; --decode-weights off keeps it fp32
    bf16_cache = native_attention_takes(torch.bfloat16, quantized.config.head_dim)
    assert Session(quantized.model, 16).cache.k.dtype == (torch.bfloat16 if bf16_cache else torch.float32)
    assert Session(engine.model, 16).cache.k.dtype == torch.float32
    assert _agrees_on_a_short_prefix(quantized.model, engine), \
        "fp32 + int4/int8 greedy output differs from fp32 weights within 8 tokens on both prompts"


def test_an_fp32_model_reads_and_decodes_with_a_bf16_cache(engine):
    """An fp32 model with a bf16 dense cache: a prompt read in one forward, or in two (the second widening the
    cache it attends to, under a mask), gives the logits of an fp32 cache up to the rounding of K/V to bf16 (2^-9
    relative, through 30 layers: measured, a mean change of 0.025 and at most 0.23 in logits up to 39, and the same
    greedy tokens). The two readings agree exactly where the fp32 matmuls give the same bits for 49 rows as for
    145; MKL on an AMX Xeon does not (layer 1's keys 3e-6 apart), and a key that close to a bf16 rounding midpoint
    rounds the other way, so there the two agree only as each agrees with the fp32 cache."""
    if not native_attention_takes(torch.bfloat16, engine.config.head_dim):
        pytest.skip("an fp32 model keeps a bf16 cache only where the C decode-attention kernel reads one, which it "
                    "does not on this CPU (AVX-512 without AVX512-BF16)")
    model = engine.model
    prompt = engine.tokenizer.encode("The tallest mountains of the solar system are on Mars and on " * 12)
    split = len(prompt) * 2 // 3

    def logits(cache_dtype, parts):
        model.cache_dtype = cache_dtype
        try:
            cache = model.new_cache(len(prompt) + 4)
        finally:
            model.cache_dtype = None
        assert cache.k.dtype == (cache_dtype or torch.float32)
        with torch.inference_mode():
            rows = [model(torch.tensor([prompt[a:b]]), a, cache, all_logits=True)[0] for a, b in parts]
            step = model(torch.tensor([[prompt[-1]]]), len(prompt), cache)[0]  # a decode step: the C kernel's path
        return torch.cat(rows + [step])

    whole = [(0, len(prompt))]
    two = [(0, split), (split, len(prompt))]
    fp32 = logits(None, whole)
    for bf16 in (logits(torch.bfloat16, whole), logits(torch.bfloat16, two)):
        change = (bf16 - fp32).abs()
        assert change.mean().item() < 0.05 and change.max().item() < 0.01 * fp32.abs().max().item()
        assert torch.equal(bf16.argmax(-1)[-8:], fp32.argmax(-1)[-8:])


def _agrees_on_a_short_prefix(model, engine) -> bool:
    """Whether `model`'s first 8 greedy tokens equal the fp32 engine's on at least one of two prompts."""
    matches = []
    for text in (PROMPT, "One, two, three, four,"):
        prompt = engine.tokenizer.encode(text)
        ours, stats, _ = run(model, prompt, greedy(), 8)
        reference, _, _ = run(engine.model, prompt, greedy(), 8)
        assert len(ours) == 8 and stats.stop_reason == "max_new_tokens"
        matches.append(ours == reference)
    return any(matches)
