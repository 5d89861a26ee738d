"""Branches: several continuations of one held document decoded as one batch must attend exactly as each would
alone in the IndexPool cache (same selections, positions and evidence), on a tiny random fp32 model with its
history kept in fp32 (`kv_storage="full"`: the default bf16 store would round the C kernel's queries and not the
torch path's, and these tests compare the two paths' attention exactly)."""

from dataclasses import replace

import pytest
import torch

from indexpool.model.generate import Sampler, SamplingParams, Session
from indexpool.model.indexers import TrainingFreeIndexer
from indexpool.model.indexpool_branches import IndexPoolBranches
from indexpool.model.indexpool_cache import AttentionEvidence, IndexPoolConfig
from tests.test_indexpool_cache import CONFIG, prompts_for, tiny_model

# A window wide enough for branches of up to 20 tokens; past the 64-token context at a 120-token document.
SETTINGS = dict(kpool=4, topk=8, window=24, sinks=4, segment=16, query_tokens=6, kv_storage="full")


def sequential_logits(model, session, prompt, forced, evidence=None):
    """Logits of reading `prompt` after the held document, then of each forced token, one sequence alone (where its
    attention goes, into `evidence`)."""
    held = list(session.tokens)
    logits = [session.prefill(prompt, evidence=evidence)]
    with session.cache.reading(evidence=evidence):
        for i, token in enumerate(forced):
            logits.append(model(torch.tensor([[token]]), len(prompt) + i, session.cache)[:, -1])
    session.cache.truncate(len(held))
    session.tokens = held
    return torch.cat(logits)


def take_branches(session, document, prompts, branches):
    """Read each prompt after the held document (its branch's evidence taken) and move it into its branch; each
    branch's logits so far, a list of them per branch."""
    got = []
    for b, prompt in enumerate(prompts):
        got.append([session.prefill(document + prompt, evidence=branches.evidence[b])])
        branches.take_branch(b)
        session.tokens = list(document)
    return got


@pytest.mark.parametrize("query_topk", [8, 4])
@pytest.mark.parametrize("head_dim", [8, 32])
@pytest.mark.parametrize("document_length", [120, 36, 60, 12])
def test_branches_attend_as_each_branch_alone(document_length, head_dim, query_topk):
    """120: every branch selects far pools at remapped positions; 36: everything before each window is taken;
    60: branches of different lengths straddle both cases in one batch; 12: some branches' windows start at 0
    (no far tokens at all) while others' do not. Head size 32: the C decode kernel's path where it runs (far
    tokens gathered and rotated with each branch's own RoPE tables), 8: the torch path. query_topk 4: a branch's
    step, a short forward, takes fewer far tokens than topk (8) once it selects."""
    model = tiny_model(3, replace(CONFIG, head_dim=head_dim))
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS, query_topk=query_topk))
    document = prompts_for(5, [document_length])[0]
    session.prefill(document, query_tail=False)
    generator = torch.Generator().manual_seed(9)
    suffixes = [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist() for n in (3, 9, 1, 14)]
    forced = [torch.randint(0, CONFIG.vocab_size, (5,), generator=generator).tolist() for _ in suffixes]
    expected = [sequential_logits(model, session, document + s, f) for s, f in zip(suffixes, forced)]

    branches = IndexPoolBranches(session.cache, len(suffixes), capacity=20)
    with torch.inference_mode():
        got = take_branches(session, document, suffixes, branches)
        for step in range(5):
            logits = model(torch.tensor([[f[step]] for f in forced]), 0, branches)[:, -1]
            for b in range(len(suffixes)):
                got[b].append(logits[b : b + 1])
    for b in range(len(suffixes)):
        torch.testing.assert_close(torch.cat(got[b]), expected[b], atol=2e-5, rtol=1e-5)
    assert session.cache.length == document_length  # the document is held as before


@pytest.mark.parametrize("head_dim", [8, 32])
def test_a_branch_leaves_out_its_questions_look_alikes_spans_in_the_window(head_dim):
    """A branch whose question (6 tokens, read twice) names a phrase the document holds far back and half of it
    just before its window: its steps attend the window without the half's span, as it would alone, and put no evidence
    there (the question's first read, which finds the look-alike, sees it); branches whose questions have a
    look-alike far back only, or none, read the whole window in the same batch."""
    model = tiny_model(3, replace(CONFIG, head_dim=head_dim))
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    generator = torch.Generator().manual_seed(4)
    document = prompts_for(6, [120])[0]
    questions = [torch.randint(0, CONFIG.vocab_size, (6,), generator=generator).tolist() for _ in range(3)]
    # The window starts at 96; the look-alike's span (3 pools before it, 4 after; its neighbours', which rank next,
    # passed over too) leaves out 96-115 of it.
    document[40:46], document[92:95] = questions[0], questions[0][:3]
    document[60:66], document[20:23] = questions[1], questions[1][3:]  # a look-alike far back only
    session.prefill(document, query_tail=False)
    forced = [torch.randint(0, CONFIG.vocab_size, (4,), generator=generator).tolist() for _ in questions]

    def evidence():
        return AttentionEvidence(4, 120, local_band=2)

    alone, read_only = [evidence() for _ in questions], [evidence() for _ in questions]
    expected = [sequential_logits(model, session, document + q, f, e) for q, f, e in zip(questions, forced, alone)]
    for question, e in zip(questions, read_only):  # the question's reads alone
        sequential_logits(model, session, document + question, [], e)
    branches = IndexPoolBranches(session.cache, len(questions), capacity=12)
    branches.evidence = [evidence() for _ in questions]
    with torch.inference_mode():
        got = take_branches(session, document, questions, branches)
        for step in range(4):
            logits = model(torch.tensor([[f[step]] for f in forced]), 0, branches)[:, -1]
            for b in range(len(questions)):
                got[b].append(logits[b : b + 1])
    left_out = [[] if h is None else h.tolist() for h in branches.question_hidden]
    assert left_out[0] == list(range(96, 116)) and not left_out[1] and not left_out[2]
    for b in range(len(questions)):
        torch.testing.assert_close(torch.cat(got[b]), expected[b], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(branches.evidence[b].mass, alone[b].mass, atol=1e-5, rtol=1e-4)
        hidden = [p - 4 for p in left_out[b]]  # the evidence's positions start at 4
        torch.testing.assert_close(alone[b].mass[hidden], read_only[b].mass[hidden], atol=1e-7, rtol=0)
        # the steps' evidence in the rest of the window, where the first read's is
        assert bool((alone[b].mass[112:] > read_only[b].mass[112:]).all())


@pytest.mark.parametrize("head_dim,band", [(8, 6), (32, 6), (32, 30)])
def test_only_live_branches_are_fed_and_evidence_matches(head_dim, band):
    """A branch that stopped is left out of later steps (the others go on unchanged), and each branch's evidence
    equals what the same tokens collect alone (head size 32: both from the C kernel's probabilities where it
    runs; 8: the torch path's logits). A local band of 30 reaches past the 24-token window into the far tokens."""
    model = tiny_model(4, replace(CONFIG, head_dim=head_dim))
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    document = prompts_for(6, [120])[0]
    session.prefill(document, query_tail=False)
    suffixes, forced = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]

    def evidence():
        return AttentionEvidence(4, 120, local_band=band)

    alone = []
    for s, f in zip(suffixes, forced):
        alone_evidence = evidence()
        expected = sequential_logits(model, session, document + s, f if s != suffixes[1] else f[:1], alone_evidence)
        alone.append((expected, alone_evidence))

    branches = IndexPoolBranches(session.cache, 3, capacity=10)
    branches.evidence = [evidence() for _ in suffixes]
    with torch.inference_mode():
        got = take_branches(session, document, suffixes, branches)
        for step in range(3):
            live = [0, 1, 2] if step == 0 else [0, 2]  # branch 1 stops after its first forced token
            branches.live = torch.tensor(live)
            logits = model(torch.tensor([[forced[b][step]] for b in live]), 0, branches)[:, -1]
            for row, b in enumerate(live):
                got[b].append(logits[row : row + 1])
    for b, (expected, alone_evidence) in enumerate(alone):
        torch.testing.assert_close(torch.cat(got[b]), expected, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(branches.evidence[b].mass, alone_evidence.mass, atol=1e-5, rtol=1e-4)
        assert branches.evidence[b].queries == alone_evidence.queries == len(suffixes[b]) + len(got[b]) - 1
        assert alone_evidence.mass.sum() > 0


def test_generate_branches_gives_each_prompt_its_greedy_continuation():
    model = tiny_model(5)
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    document = prompts_for(7, [100])[0]
    session.prefill(document, query_tail=False)
    prompts = [document + [3, 1, 4], document + [1, 5], document + [9, 2, 6, 5, 3]]
    greedy = Sampler(SamplingParams(temperature=0))
    expected = []
    for prompt in prompts:
        expected.append(list(session.generate(prompt, greedy, 8, stop_ids={7})))
        session.cache.truncate(len(document))
        session.tokens = list(document)
    results = session.generate_branches(prompts, greedy, 8, stop_ids={7})
    assert [tokens for tokens, _ in results] == expected
    assert [stats.new_tokens for _, stats in results] == [len(e) for e in expected]
    assert session.tokens == document and session.cache.length == len(document)


def test_branches_read_what_then_read_adds_after_their_prompt():
    """`then_read(b)` runs after prompt b is read and its tokens are read after it (a quote of what the reading
    found, by `read_shared`): each branch continues as `generate` continues the prompt read in the same steps; a
    branch given nothing more continues its prompt; more tokens than announced are refused."""
    model = tiny_model(9)
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    document = prompts_for(10, [100])[0]
    session.prefill(document, query_tail=False)
    prompts = [document + [3, 1], document + [8, 4, 2]]
    more = [[5, 9, 2, 6], []]
    greedy = Sampler(SamplingParams(temperature=0))
    expected = []
    for prompt, extra in zip(prompts, more):
        session.prefill(prompt)
        session.read_shared(prompt + extra)
        expected.append(list(session.generate(prompt + extra, greedy, 6)))
        session.cache.truncate(len(document))
        session.tokens = list(document)
    read_after = []

    def then_read(b: int) -> list[int]:
        read_after.append((b, list(session.tokens)))
        return more[b]

    results = session.generate_branches(prompts, greedy, 6, then_read=then_read, more_tokens=4)
    assert [tokens for tokens, _ in results] == expected
    assert read_after == [(0, prompts[0]), (1, prompts[1])]  # each called with its prompt just read
    assert [stats.prompt_tokens for _, stats in results] == [len(p) + len(m) for p, m in zip(prompts, more)]
    with pytest.raises(ValueError, match="more than more_tokens"):
        session.generate_branches(prompts, greedy, 6, then_read=then_read, more_tokens=3)


def test_read_shared_reads_new_tokens_with_one_selection_but_the_last():
    model = tiny_model(11)
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    document = prompts_for(12, [100])[0]
    session.prefill(document, query_tail=False)
    more = [5, 9, 2, 6, 1]
    selections = []
    def record(layer, positions, far):
        selections.append((layer, len(positions), far.shape[0]))

    session.read_shared(document + more, on_select=record)
    assert session.tokens == document + more[:-1]
    assert {(n, blocks) for layer, n, blocks in selections} == {(4, 1)}  # 4 queries, one selection per layer
    selections.clear()
    session.prefill(document + more, on_select=record)  # the last token, on its own
    assert {(n, blocks) for layer, n, blocks in selections} == {(1, 1)}
    selections.clear()
    session.cache.truncate(len(document))
    session.tokens = list(document)
    session.prefill(document + more, on_select=record)  # as a question's tokens are read: a selection per query
    assert {(n, blocks) for layer, n, blocks in selections} == {(5, 5)}


def test_branches_that_could_reach_their_own_tokens_are_refused():
    """A branch longer than window - kpool would select pools of its own tokens, which only the base cache holds
    for one sequence: refused, and the session says it cannot branch."""
    model = tiny_model(6)
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    document = prompts_for(8, [100])[0]
    session.prefill(document, query_tail=False)
    assert session.can_branch([document + [1, 2]], 18)
    assert not session.can_branch([document + [1, 2]], 19)
    assert not session.can_branch([[(document[0] + 1) % CONFIG.vocab_size] + document], 4)  # shares nothing held
    assert session.can_branch([document[:50] + [1]], 4)  # branches from the 48 tokens (a pool boundary) it shares
    with pytest.raises(ValueError, match="at most 20"):
        IndexPoolBranches(session.cache, 2, capacity=21)
    dense = Session(model, 256)
    dense.prefill(document)
    assert not dense.can_branch([document + [1]], 4)


def test_pools_past_each_limit_are_hidden_in_place():
    """hide_pools_past on a non-contiguous (B, T, P) view (the lightning indexer's scores) and on (n, H, P) logits
    with one limit per leading row: the same as masking every pool at or past its row's limit."""
    from indexpool.model.indexers import hide_pools_past

    scores = torch.randn(2, 5, 3).transpose(1, 2)  # (B 2, T 3, P 5)
    limits = torch.tensor([[5, 0, 2], [3, 1, 4]])
    expected = scores.masked_fill(torch.arange(5) >= limits[..., None], float("-inf"))
    assert hide_pools_past(scores, limits) is scores
    assert torch.equal(scores, expected)
    logits = torch.randn(3, 2, 6)
    expected = logits.masked_fill((torch.arange(6) >= torch.tensor([6, 2, 0])[:, None])[:, None], float("-inf"))
    assert torch.equal(hide_pools_past(logits, torch.tensor([6, 2, 0])), expected)


def test_training_free_scores_mask_pools_past_each_limit():
    """A query's softmax runs over the pools it may see only: equal to scoring that prefix alone."""
    indexer = TrainingFreeIndexer(CONFIG)
    torch.manual_seed(0)
    q = torch.randn(1, 3, CONFIG.n_heads, CONFIG.head_dim)
    weights = torch.rand(1, 3, CONFIG.n_heads)
    pooled = torch.randn(1, 11, CONFIG.kv_dim)
    limits = torch.tensor([[11, 4, 7]])
    scores = indexer.score(0, q, weights, pooled, limits)
    for t, limit in enumerate(limits[0].tolist()):
        alone = indexer.score(0, q[:, t : t + 1], weights[:, t : t + 1], pooled[:, :limit])[0, 0]
        torch.testing.assert_close(scores[0, t, :limit], alone)
        assert torch.isinf(scores[0, t, limit:]).all()
    # Against the definition: per head, softmax over pools of q . (its KV head's slice of the pooled key).
    D, G = CONFIG.head_dim, CONFIG.n_heads // CONFIG.n_kv_heads
    keys = pooled[0].view(11, CONFIG.n_kv_heads, D)
    logits = torch.einsum("thd,phd->thp", q[0], keys.repeat_interleave(G, dim=1)) * D**-0.5
    reference = (weights[0, :, :, None] * logits.softmax(-1)).sum(1)
    torch.testing.assert_close(indexer.score(0, q, weights, pooled)[0], reference, atol=1e-6, rtol=1e-5)
