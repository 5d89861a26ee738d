"""The default model in our engine against transformers' LlamaForCausalLM loaded from the same GGUF: fp32 logits
on five prompts of up to 1,300 tokens (two 512-token segments and a tail), and 64 greedy tokens on each."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch

from indexpool.model.generate import Sampler, SamplingParams, Session

MAX_LOGIT_DIFF = 1e-3
NEW_TOKENS = 64
LONGEST = 1300  # the long prompt: two whole 512-token segments and a tail


@pytest.fixture(scope="module")
def ours():
    from indexpool.model.runtime import load_engine

    return load_engine(None, "fp32", decode_weights="off")  # fp32 weights throughout: parity, not quantization


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    from indexpool.model.default_model import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def prompts(tokenizer) -> list[list[int]]:
    """Five prompts of 9 to 1,300 tokens: a question, prose, code, a chat, and a long stretch of documentation."""
    import inspect
    import json

    docs = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    code = inspect.getsource(json.decoder)
    chat = tokenizer.encode_chat([{"role": "user", "content": "What does the `with` statement do in Python?"}])
    return [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode(docs[:1000]),
        tokenizer.encode(code)[:700],
        chat,
        tokenizer.encode(docs[5000:])[:LONGEST],
    ]


@torch.inference_mode()
def reference_greedy(model, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    out = model(torch.tensor([ids]), use_cache=True)
    logits, cache = out.logits, out.past_key_values
    token = int(logits[0, -1].argmax())
    generated = [token]
    for _ in range(n - 1):
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
        generated.append(token)
    return logits[0], generated


def test_prompt_lengths(ours):
    lengths = [len(p) for p in prompts(ours.tokenizer)]
    assert max(lengths) == LONGEST and min(lengths) < 16 and len(lengths) == 5


@pytest.mark.parametrize("which", range(5))
def test_logits_and_greedy_tokens_match_transformers(ours, reference, which):
    ids = prompts(ours.tokenizer)[which]
    expected_logits, expected_tokens = reference_greedy(reference, ids, NEW_TOKENS)

    # Our logits over the whole prompt, fed in the engine's default 512-token segments into a session's cache.
    model = ours.model
    session = Session(model, len(ids) + NEW_TOKENS)
    with torch.inference_mode():
        logits = torch.cat([model(torch.tensor([ids[s : s + 512]]), s, session.cache, all_logits=True)[0]
                            for s in range(0, len(ids), 512)])
    diff = (logits - expected_logits).abs().max().item()
    assert diff <= MAX_LOGIT_DIFF, f"max |logit difference| {diff:.2e} over {len(ids)} tokens"

    # The session holds the prompt: generate feeds its last token again (the longest common prefix is kept), then
    # decodes from there.
    session.tokens = list(ids)
    greedy = Sampler(SamplingParams(temperature=0.0))
    tokens = list(session.generate(ids, greedy, NEW_TOKENS, stop_ids=frozenset()))
    assert tokens == expected_tokens
