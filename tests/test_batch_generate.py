"""Independent prompts decoded as one dense batch (`BatchKVCache`, `Session.generate_batch`) must give each prompt
what it gets alone: the same logits step by step and the same greedy tokens and stop reasons, on a tiny random
fp32 model, with rows of very different lengths, rows that stop early, and a batch of one."""

import dataclasses

import pytest
import torch

from indexpool.kernels.cpu_attention import native_attention_takes
from indexpool.local import MAX_BATCH, section_batch_size
from indexpool.model.generate import GenerationStats, Sampler, SamplingParams, Session
from indexpool.model.indexpool_cache import IndexPoolConfig
from indexpool.model.llama import BatchKVCache
from tests.test_indexpool_cache import CONFIG, tiny_model

LENGTHS = (45, 1, 17, 6)  # very different lengths, the longest near the 64-token context


def random_prompts(seed: int, lengths) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0))


def alone(model, prompt, sampler, max_new_tokens, stop_ids=frozenset(), max_length=64):
    """`Session.generate` on a fresh dense session: the one-by-one reference."""
    stats = GenerationStats()
    tokens = list(Session(model, max_length).generate(prompt, sampler, max_new_tokens, stop_ids, stats))
    return tokens, stats


@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16], ids=["fp32-cache", "bf16-cache"])
def test_rows_attend_as_each_sequence_alone(cache_dtype):
    """Forced tokens fed to every row at once give the logits each sequence gets alone, also after a row in the
    middle of the batch has finished and the others were packed to the front; also with the bf16 cache an fp32
    model keeps where the C decode kernel reads one (`Transformer.cache_dtype`; head size 32, the least it takes)."""
    if cache_dtype is None:
        model = tiny_model(1)
    else:
        if not native_attention_takes(cache_dtype, 32):
            pytest.skip("an fp32 model keeps a bf16 cache only where the C decode kernel reads one, not here")
        model = tiny_model(1, dataclasses.replace(CONFIG, head_dim=32))
        model.cache_dtype = cache_dtype
    prompts = random_prompts(2, LENGTHS)
    forced = random_prompts(3, [6] * len(prompts))
    last_step = {0: 6, 1: 2, 2: 6, 3: 4}  # row 1 stops after its 2nd forced token, row 3 after its 4th
    expected = []
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, forced):
            session = Session(model, 64)
            logits = [session.prefill(prompt)]
            for i, token in enumerate(tokens):
                logits.append(model(torch.tensor([[token]]), len(prompt) + i, session.cache)[:, -1])
            expected.append(torch.cat(logits))

        session = Session(model, 64)
        batch = model.new_cache(64, len(prompts), BatchKVCache)
        got = []
        for b, prompt in enumerate(prompts):
            got.append([session.prefill(prompt)])
            batch.take_row(b, session.cache, len(prompt))
        live = list(range(len(prompts)))
        for step in range(6):
            kept = [row for row, b in enumerate(live) if step < last_step[b]]
            if len(kept) < len(live):
                batch.keep(kept)
                live = [live[row] for row in kept]
            logits = model(torch.tensor([[forced[b][step]] for b in live]), 0, batch)[:, -1]
            for row, b in enumerate(live):
                got[b].append(logits[row : row + 1])
    for b in range(len(prompts)):
        assert len(got[b]) == last_step[b] + 1
        want = expected[b][: last_step[b] + 1]
        if cache_dtype is None:
            torch.testing.assert_close(torch.cat(got[b]), want, atol=2e-5, rtol=1e-5)
        else:  # fp32 sums that differ in the last bits (a batch's matmuls) can round K, V and q to neighbouring bf16
            # values (2^-8 apart, relative): the logits then move by about 2^-8 of their size, not more
            assert (torch.cat(got[b]) - want).abs().max().item() <= 2**-8 * want.abs().max().item()
    assert batch.lengths[: batch.rows].tolist() == [LENGTHS[0] + 6, LENGTHS[2] + 6]


@pytest.mark.parametrize("lengths", [LENGTHS, (23,), (9, 9, 9)])
def test_generate_batch_gives_each_prompt_its_greedy_continuation(lengths):
    """Rows of different lengths, a batch of one, rows of one length (no mask needed); a stop token the last row
    meets early."""
    model = tiny_model(4)
    prompts = random_prompts(5, lengths)
    free_running = [alone(model, p, greedy(), 20)[0] for p in prompts]
    stop_ids = {free_running[-1][3]}  # the last row meets it at its 4th token, other rows perhaps too
    expected = [alone(model, p, greedy(), 20, stop_ids) for p in prompts]
    session = Session(model, 64)
    results = session.generate_batch(prompts, greedy(), 20, stop_ids)
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in expected]
    assert [(s.new_tokens, s.stop_reason, s.prompt_tokens) for _, s in results] == \
        [(s.new_tokens, s.stop_reason, s.prompt_tokens) for _, s in expected]
    assert results[-1][1].stop_reason == "stop_token" and results[-1][1].new_tokens == 3
    assert session.tokens == prompts[-1]  # the session holds the last prompt read


def test_a_row_that_fills_the_context_stops_as_it_would_alone():
    model = tiny_model(6)
    prompts = random_prompts(7, (30, 5))
    expected = [alone(model, p, greedy(), 12, max_length=36) for p in prompts]
    results = Session(model, 36).generate_batch(prompts, greedy(), 12)
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in expected]
    assert [s.stop_reason for _, s in results] == ["context_full", "max_new_tokens"]
    assert results[0][1].new_tokens == expected[0][1].new_tokens == 7  # positions 30..35, then one unfed token


def test_only_dense_sessions_batch():
    model = tiny_model(8)
    sparse = Session(model, 256, attention=IndexPoolConfig(kpool=4, topk=8, window=24, sinks=4, segment=16,
                                                           query_tokens=6))
    assert not sparse.can_batch()
    with pytest.raises(ValueError, match="dense"):
        sparse.generate_batch([[1, 2], [3]], greedy(), 4)
    assert Session(model, 64).generate_batch([], greedy(), 4) == []


def test_section_batch_size_follows_lengths_and_memory():
    model = tiny_model(9)
    session = Session(model, 64)
    row_bytes = CONFIG.kv_bytes_per_token(model.dtype) * (40 + 20)  # the longest prompt + new tokens
    lengths = [40, 10, 25]
    assert section_batch_size(session, lengths, 20, None) == 3
    assert section_batch_size(session, lengths, 20, 2 * 2 * row_bytes) == 2  # half the memory for the rows
    assert section_batch_size(session, lengths, 20, 2 * row_bytes - 1) == 1
    assert section_batch_size(session, [50] * 40, 20, None) == MAX_BATCH
    assert section_batch_size(session, [10], 20, None) == 1
    sparse = Session(model, 256, attention=IndexPoolConfig(kpool=4, topk=8, window=24, sinks=4, segment=16,
                                                           query_tokens=6))
    assert section_batch_size(sparse, lengths, 20, None) == 1
