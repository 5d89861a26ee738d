"""The IndexPool cache in the engine: against a brute-force reference of the same attention, on a tiny random model.

The reference keeps every token's K/V and index keys, and for every query recomputes from scratch which positions
it attends to (sinks, selected far pools, the recent window), where they sit, and an fp64 softmax over them. The
real cache instead slides a window buffer, gathers from a (possibly int8 or memory-mapped) store, shares selections
across a segment, and merges two attention parts by their log-sum-exps; both must give the same logits.
"""

import math
from collections import Counter
from dataclasses import replace

import pytest
from kernel_setting import use_kernels
import torch

from indexpool.model.generate import Session
from indexpool.model.indexers import TrainingFreeIndexer
from indexpool.model.indexpool import PooledIndexCache, indexer_source_layers, layer_schedule, per_token_index_bytes, pool_keys
from indexpool.model import indexpool_cache
from indexpool.model.indexpool_cache import (FRAME_TEMPLATE, INDEX_DTYPES, MATCH_MAX_COUNT, MATCH_SPARSE, IndexPoolCache,
                                             IndexPoolConfig, place_far_tokens)
from indexpool.model.lightning_indexer import LightningIndexer, LightningIndexerConfig, ModelFingerprint
from indexpool.kernels.rope import apply_rope, rope_at
from indexpool.kernels.cpu_attention import native_attention_takes
from indexpool.model.llama import LlamaConfig, Transformer, inverse_frequencies

CONFIG = LlamaConfig(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
                     context_length=64, rope_theta=10000.0)
SETTINGS = dict(kpool=4, topk=8, window=8, sinks=4, segment=16, query_tokens=6, query_block=2, segment_block=7,
                segment_queries=3, segment_candidates=5)


def tiny_model(seed: int = 0, config: LlamaConfig = CONFIG) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for layer in model.layers:  # larger q/k weights make attention peaked, so selection matters
            layer.attention.wqkv.weight.mul_(4)
    return model


def reference_matching_pools(document, question, kpool, count, repeat_share=0.0, uncounted_from=None,
                             frame_from=None, words=None):
    """`matching_pools`, one pair at a time: each occurrence in the document of a pair of consecutive question tokens
    met at most MATCH_MAX_COUNT times there (once per MATCH_SPARSE pairs where more) adds log(pairs / its count) to
    its pool; pools rank by twice that sum plus their neighbours', and are taken best first (ties: the earlier), none
    within 7 pools of one taken, nor one whose span (3 pools before, 4 after) holds in phrases (question pairs next
    to another) only pairs of a place taken, weighing less than repeat_share of that place's, or, where it lies
    before uncounted_from and its span holds a joint (two counted pairs in a row, both of question[frame_from:],
    their three tokens not three of the question's in a row), only pairs of the places taken, weighing less than
    repeat_share of theirs (passed over, and listed: a look-alike, or a stray when it holds no phrase); until `count`
    are taken before pool uncounted_from (all of them counting when it is None), or none is left. Then the last place
    taken holding a joint that the others pass over so is listed as a look-alike, and the taking goes on where it
    stopped, until no place taken is. Then, with frame_from, for each taken place and each run of consecutive pairs
    of question[frame_from:] met more often than that (and next to another question pair) starting in its span: each
    other such run of the same tokens, with FRAME_TEMPLATE tokens before and after them (together) the same as around
    the first (as words: words[token] where words is given), or FRAME_TEMPLATE - 1 where more than that limit of the
    other runs have that many, gives the pool where the taken place lies relative to its run's first pair, listed
    (framed) when it is none listed, lies more than 7 pools from every place taken, and its span passes the
    look-alike test against that place."""
    pairs = list(zip(document, document[1:]))
    # counted in the pairs wholly before pool uncounted_from; one met only after it, once
    before = len(pairs) if uncounted_from is None else max(1, min(len(pairs), uncounted_from * kpool - 1))
    wanted, counts = set(zip(question, question[1:])), Counter(pairs[:before])
    limit = max(indexpool_cache.MATCH_MAX_COUNT, before // MATCH_SPARSE)
    counts = {pair: max(counts[pair], 1) for pair in pairs}
    hits = {i for i, pair in enumerate(pairs) if pair in wanted}
    own = [0.0] * (len(document) // kpool)
    for i in hits:
        if counts[pairs[i]] <= limit and i // kpool < len(own):
            own[i // kpool] += math.log(before / counts[pairs[i]])
    score = [2 * own[p] + (own[p - 1] if p else 0.0) + (own[p + 1] if p + 1 < len(own) else 0.0) for p in range(len(own))]
    chosen, look_alikes, strays, framed, held = [], [], [], [], []
    counted_before = len(own) if uncounted_from is None else uncounted_from

    def span_phrase(p):
        span = range(max(p - 3, 0) * kpool, min(p + 5, len(own)) * kpool)
        phrase = {pairs[i] for i in span if i in hits and counts[pairs[i]] <= limit and
                  (i - 1 in hits or i + 1 in hits)}
        return (phrase, sum(math.log(before / counts[pair]) for pair in phrase),
                p < counted_before and any(span.start <= i < span.stop for i in joints))

    triples = set(zip(question, question[1:], question[2:]))
    asked = question if frame_from is None else question[frame_from:]
    asked_pairs = set(zip(asked, asked[1:]))
    joints = [i for i in hits if i + 1 in hits and counts[pairs[i]] <= limit and counts[pairs[i + 1]] <= limit and
              {pairs[i], pairs[i + 1]} <= asked_pairs and tuple(document[i: i + 3]) not in triples]

    def held_together(phrase, weight, joined, others):
        if any(phrase <= other and weight < repeat_share * other_weight for other, other_weight, _ in others):
            return True
        union = set().union(*(other for other, _, _ in others))
        return joined and phrase <= union and \
            weight < repeat_share * sum(math.log(before / counts[pair]) for pair in union)

    ranked = [p for p in sorted(range(len(score)), key=lambda p: -score[p]) if score[p] > 0]
    while True:
        while ranked and sum(c < counted_before for c in chosen) < count:
            p = ranked.pop(0)
            if any(abs(p - c) <= 7 for c in chosen):
                continue
            phrase, weight, joined = span_phrase(p)
            if held_together(phrase, weight, joined, held):
                (look_alikes if phrase else strays).append(p)
                continue
            chosen.append(p)
            held.append((phrase, weight, joined))
        covered = [i for i in range(len(chosen)) if held[i][2] and held_together(*held[i], held[:i] + held[i + 1:])]
        if not covered:
            break
        look_alikes.append(chosen.pop(covered[-1]))
        held.pop(covered[-1])
    if frame_from is not None and own:
        frame = sorted(i for i in hits if counts[pairs[i]] > limit and pairs[i] in asked_pairs and
                       (i - 1 in hits or i + 1 in hits))
        runs = []  # runs of consecutive frame pairs: (first pair, last pair)
        for i in frame:
            if runs and runs[-1][1] == i - 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])

        word = (lambda t: t) if words is None else (lambda t: words[t])

        def alike_around(a, b, step):  # how many words on from a and b, stepping by step, are the same
            n = 0
            while n < FRAME_TEMPLATE:
                i, j = a + step * (n + 1), b + step * (n + 1)
                if not (0 <= i < len(document) and 0 <= j < len(document) and
                        word(document[i]) == word(document[j])):
                    break
                n += 1
            return n

        listed = set(look_alikes) | set(strays)
        for place, (other, other_weight, _) in zip(chosen, held):
            for fa, fb in runs:
                if not max(place - 3, 0) * kpool <= fa < min(place + 5, len(own)) * kpool:
                    continue
                alike = {(ca, cb): alike_around(fa, ca, -1) + alike_around(fb + 1, cb + 1, 1) for ca, cb in runs
                         if (ca, cb) != (fa, fb) and list(map(word, document[ca: cb + 2])) == list(map(word, document[fa: fb + 2]))}
                need = FRAME_TEMPLATE - (sum(n >= FRAME_TEMPLATE - 1 for n in alike.values()) > limit)
                for ca, cb in runs:
                    if alike.get((ca, cb), -1) < need:
                        continue
                    p = min(max(ca // kpool + place - fa // kpool, 0), len(own) - 1)
                    phrase, weight, _ = span_phrase(p)
                    if p not in listed and all(abs(p - c) > 7 for c in chosen) and phrase <= other and \
                            weight < repeat_share * other_weight:
                        framed.append(p)
                        listed.add(p)
    return chosen, look_alikes, strays, framed


class ReferenceCache:
    """Brute force, per query, fp64 attention over the positions the IndexPool rules give it."""

    def __init__(self, config: LlamaConfig, settings: IndexPoolConfig, indexer, max_length: int,
                 segment_indexer=None):
        self.c, self.s, self.max_length = config, settings, max_length
        L, KV, D = config.n_layers, config.n_kv_heads, config.head_dim
        self.k = torch.zeros(L, max_length, KV, D, dtype=torch.float64)
        self.v = torch.zeros(L, max_length, KV, D, dtype=torch.float64)
        # Per indexer ("short" forwards; "segment" forwards, the same one unless a segment indexer is given): its
        # index keys and gates of every token.
        self.indexers = {"short": indexer, "segment": segment_indexer or indexer}
        self.index_keys = {kind: torch.zeros(L, max_length, i.key_dim) for kind, i in self.indexers.items()}
        self.gates = {kind: torch.zeros(L, max_length, i.key_dim) for kind, i in self.indexers.items()}
        self.inv_freq = inverse_frequencies(config)
        self.sources = indexer_source_layers(layer_schedule(settings.schedule, L))
        self.length = 0
        # The last question's pools, the window positions it leaves out, its place.
        self.question, self.hidden, self.question_start, self.question_end = None, set(), 0, 0
        self.scouting_question = False

    @property
    def settings(self):
        return self.s

    def truncate(self, length):
        if length < self.question_end:  # the question's tokens not all kept
            self.question, self.hidden = None, set()
        self.length = min(length, self.length) // self.s.kpool * self.s.kpool
        return self.length

    def asks(self, length):
        """A question (a short forward of 2 tokens or more that selects per query, at a pool boundary, not inside the
        last question) is read twice by Session.prefill (`read_question`)."""
        s = self.s
        ws = max(0, (self.length - s.window) // s.kpool * s.kpool)
        inside = self.question is not None and self.length < self.question_end
        return (s.question_pools or s.question_matches) > 0 and 2 <= length <= s.query_tokens and self.length % s.kpool == 0 and \
            ws - min(s.sinks, ws) > s.topk and min(s.query_topk, s.topk) > 0 and not inside

    def read_question(self, forward, tokens=None, held=0, question_from=None):
        start, self.scouting_question, self.scouted = self.length, True, None
        forward()
        end, self.scouting_question = self.length, False
        self.truncate(start)
        pools, self.hidden = None, set()
        if self.scouted is not None:  # the question's best pools by any of its queries, each with 3 before, 4 after
            first, P, scores = self.scouted
            s = self.s
            # Matched up to the question: its window's places too, those held before the question's call, which do
            # not count (they are read whole).
            document = tokens[first * s.kpool: max((first + P) * s.kpool, min(start, held))] if tokens else []
            matched, look_alikes, strays, framed = ([], [], [], []) if tokens is None else \
                reference_matching_pools(document, tokens[start:end], s.kpool, s.question_matches,
                                         s.match_repeat_share, uncounted_from=P,
                                         frame_from=None if question_from is None else
                                         min(max(question_from - start, 0), end - start))

            def spans(places, n):  # each place with 3 pools before and 4 after, clamped, once each, in order
                return list(dict.fromkeys(min(max(p + d, 0), n - 1) for p in places for d in range(-3, 5)))

            n_held = len(document) // s.kpool
            taken = set(spans(matched, n_held))
            shunned = set(spans(look_alikes + strays + framed, n_held)) - taken  # passed-over places' spans: not read
            # nor, a look-alike's or a template's other entry's, attended in the window
            self.hidden = {(p + first) * s.kpool + i for p in set(spans(look_alikes + framed, n_held)) - taken if p >= P
                           for i in range(s.kpool)}
            matched = [p for p in matched if p < P]
            best = [p for p in sorted(range(P), key=lambda p: -scores[p]) if p not in shunned]
            budget = min(s.query_topk, s.topk) // s.kpool  # cut there; filled up with the next best it scores
            pools = [p for p in spans(matched + best[: s.question_pools], P) if p not in shunned][:budget]
            pools += [p for p in best if p not in pools][: max(0, budget - len(pools))]
            pools = [p + first for p in pools]
        self.question, self.question_start, self.question_end = pools, start, end
        return forward()

    def begin(self, start, length):
        if length > self.s.query_tokens:  # a long forward after a question ends it and its answer
            self.question, self.hidden = None, set()
        self.start, self.end, self.length = start, start + length, start + length
        self.selected = {}
        self.summed_scores = None  # a short forward's scores, summed over the layers that scored

    def _selection(self, layer, x, q, ws, n_sinks):
        """Far positions per query, a list of T lists."""
        s, T = self.s, self.end - self.start
        if self.sources[layer] != layer:
            return self.selected[self.sources[layer]]
        if ws - n_sinks <= s.topk:
            return [list(range(n_sinks, ws))] * T
        first, last = n_sinks // s.kpool, ws // s.kpool
        kind = "segment" if T > s.query_tokens else "short"
        indexer = self.indexers[kind]
        pooled = pool_keys(self.index_keys[kind][layer, : last * s.kpool], self.gates[kind][layer, : last * s.kpool],
                           indexer.ape[layer], s.kpool)[first:]
        # Rounded as stored, scored in the model's dtype (fp32 here), as the cache does.
        pooled = pooled.to(INDEX_DTYPES[s.index_dtype]).to(torch.bfloat16).float()[None]
        index_q, weights = indexer.queries(layer, x, q[None])
        if T > s.query_tokens:
            # One selection per block of the segment: the summed scores of segment_queries of its queries, spread
            # from its last to its first, over the segment_candidates pools its mean index query scores best.
            blocks = [(b, min(b + s.segment_block, T)) for b in range(0, T, s.segment_block)]
            selection = []
            for b, e in blocks:
                m = min(s.segment_queries, s.segment_block, T)
                picks = [e - 1 - (e - 1 - b) * i // max(m - 1, 1) for i in range(m)]
                candidates = list(range(pooled.shape[1]))
                if len(candidates) > s.segment_candidates:
                    mean = indexer.score(layer, index_q[:, b:e].mean(1, keepdim=True),
                                         weights[:, b:e].mean(1, keepdim=True), pooled)[0, 0]
                    candidates = mean.topk(s.segment_candidates).indices.tolist()
                summed = sum(indexer.score(layer, index_q[:, i : i + 1], weights[:, i : i + 1],
                                           pooled[:, candidates])[0, 0] for i in picks)
                pools = sorted(candidates[c] + first for c in summed.topk(s.topk // s.kpool).indices.tolist())
                selection += [[p * s.kpool + i for p in pools for i in range(s.kpool)]] * (e - b)
            return selection
        scores = indexer.score(layer, index_q, weights, pooled)[0]
        if s.cumulative_scores:
            if self.summed_scores is not None:
                scores = scores + self.summed_scores
            self.summed_scores = scores
        P = scores.shape[1]
        if self.scouting_question:  # the last layer to score has the scores summed over all of them
            best = scores.max(0).values
            self.scouted = first, P, best
        kept = [] if self.scouting_question or self.question is None else \
            [p - first for p in self.question if 0 <= p - first < P]
        blocks = [(b, min(b + s.query_block, T)) for b in range(0, T, s.query_block)]
        scores = torch.stack([scores[b:e].sum(0) for b, e in blocks])
        selection = []
        for row, (b, e) in zip(scores, blocks):  # short forwards take query_topk (at most topk) far tokens
            k = min(s.query_topk, s.topk) // s.kpool
            chosen = kept[:k]  # the question's pools first, in their order
            chosen += [c for c in row.argsort(descending=True).tolist() if c not in chosen][: k - len(chosen)]
            pools = sorted(c + first for c in chosen)
            selection += [[p * s.kpool + i for p in pools for i in range(s.kpool)]] * (e - b)
        return selection

    def attend(self, layer, qk, v, x):
        H, KV, D, s = self.c.n_heads, self.c.n_kv_heads, self.c.head_dim, self.s
        q, k = qk[0, :, :H], qk[0, :, H:]
        for kind, indexer in self.indexers.items():
            keys, gates = indexer.keys(layer, x, k[None])
            self.index_keys[kind][layer, self.start : self.end] = keys[0]
            self.gates[kind][layer, self.start : self.end] = gates[0]
        self.k[layer, self.start : self.end], self.v[layer, self.start : self.end] = k.double(), v[0].double()
        ws = max(0, (self.start - s.window) // s.kpool * s.kpool)
        n_sinks = min(s.sinks, ws)
        selection = self.selected[layer] = self._selection(layer, x, q, ws, n_sinks)
        true_positions = ws - n_sinks <= s.topk and self.end <= self.c.context_length
        out = []
        for t, p in enumerate(range(self.start, self.end)):
            far = selection[t]
            # The window but a question's look-alikes (not in the read that finds them).
            window = [w for w in range(ws, p + 1) if self.scouting_question or w not in self.hidden]
            attended = list(range(n_sinks)) + far + window
            if true_positions:
                placed = attended
            else:
                # Closed up before the window; the sinks a gap further back, so that they sit sink_distance before
                # the forward's first query where the trained context leaves room for it.
                base = ws - len(far)
                room = self.c.context_length - (s.sinks + s.topk + s.window + s.segment + s.kpool)
                gap = max(0, min(s.sink_distance - s.window - s.topk, room))
                placed = list(range(base - gap - n_sinks, base - gap)) + list(range(base, base + len(far))) + window
            cos, sin = rope_at(self.inv_freq, torch.tensor(placed))
            keys = apply_rope(self.k[layer, attended], cos.double(), sin.double())
            cos_q, sin_q = rope_at(self.inv_freq, torch.tensor([p]))
            query = apply_rope(q[t : t + 1].double(), cos_q.double(), sin_q.double())[0]  # (H, D)
            keys = keys.repeat_interleave(H // KV, dim=1)  # (N, H, D)
            probs = (torch.einsum("hd,nhd->hn", query, keys) * D**-0.5).softmax(-1)
            values = self.v[layer, attended].repeat_interleave(H // KV, dim=1)
            out.append(torch.einsum("hn,nhd->hd", probs, values).reshape(-1))
        return torch.stack(out)[None].to(qk.dtype)


def run_session(model, settings, prompts, new_tokens=6, reference=False, segment_indexer=None, question_from=None,
                **cache_options):
    """Logits of every prefill and decode step over a sequence of prompts in one session (each prompt's question
    from `question_from`, `Session.prefill`). The history is kept in the model's fp32 unless asked otherwise: the
    reference keeps it exactly."""
    config = IndexPoolConfig(**settings, **{"kv_storage": "full"} | cache_options)
    session = Session(model, 256, attention=config, segment_indexer=segment_indexer)
    if reference:
        session.cache = ReferenceCache(CONFIG, config, session.cache.indexer, 256, segment_indexer)
    logits = []
    for prompt in prompts:
        logits.append(session.prefill(prompt, question_from=question_from))
        tokens = list(prompt)
        for _ in range(new_tokens):
            tokens.append(int(logits[-1].argmax()))
            logits.append(session.prefill(tokens))
    return torch.cat(logits)


def prompts_for(seed, lengths):
    generator = torch.Generator().manual_seed(seed)
    base = torch.randint(0, CONFIG.vocab_size, (max(lengths),), generator=generator).tolist()
    return [base[:n] for n in lengths]


@pytest.mark.parametrize("length, query_topk", [(21, 1024), (40, 1024), (150, 1024), (150, 4)])
def test_matches_reference_attention(length, query_topk):
    """21: dense inside the window; 40: everything selected at true positions; 150: past the model's 64-token
    context, with shared segment selections, per-block selections at the end, remapped positions and decode; there
    the short forwards take topk (8) far tokens, or 4 (query_topk)."""
    model = tiny_model()
    prompt = prompts_for(length, [length])
    settings = SETTINGS | {"query_topk": query_topk}
    ours = run_session(model, settings, prompt)
    reference = run_session(model, settings, prompt, reference=True)
    torch.testing.assert_close(ours, reference, atol=2e-4, rtol=0)


def tiny_lightning_indexer(seed: int = 0) -> LightningIndexer:
    """A random trained-kind indexer for the tiny model, its gates and APE randomised too (they start at zero)."""
    torch.manual_seed(seed)
    fingerprint = ModelFingerprint("tiny", 1, CONFIG.n_layers, CONFIG.dim, CONFIG.n_heads, CONFIG.n_kv_heads,
                                   CONFIG.head_dim)
    indexer = LightningIndexer(LightningIndexerConfig(fingerprint, key_dim=8, heads=3, kpool=4))
    with torch.no_grad():
        indexer.key_gate_proj.normal_(std=0.3)
        indexer.ape.normal_()
    return indexer.requires_grad_(False)


def test_a_segment_indexer_chooses_for_long_forwards_only():
    """--indexer hybrid: a second indexer (and pooled index) for the document's segments; the training-free one
    still chooses for short forwards. Against the reference, which keeps both indexers' keys."""
    model, segment_indexer = tiny_model(7), tiny_lightning_indexer()
    prompt = prompts_for(12, [150])
    ours = run_session(model, SETTINGS, prompt, segment_indexer=segment_indexer)
    torch.testing.assert_close(ours, run_session(model, SETTINGS, prompt, reference=True, segment_indexer=segment_indexer),
                               atol=2e-4, rtol=0)
    assert not torch.allclose(ours, run_session(model, SETTINGS, prompt), atol=2e-4, rtol=0)  # it did choose
    # The document cache's round trip keeps the second pooled index too.
    document, question = prompt[0][:140], prompts_for(13, [9])[0]
    original = Session(model, 256, attention=IndexPoolConfig(**SETTINGS), segment_indexer=segment_indexer)
    original.prefill(document, query_tail=False)
    state = {name: t.clone() for name, t in original.export_state().items()}
    assert "segment_pooled_index" in state
    restored = Session(model, 256, attention=IndexPoolConfig(**SETTINGS), segment_indexer=segment_indexer)
    restored.restore(document, state)
    long_question = question * 8  # longer than query_tokens: read as a segment, by the segment indexer
    assert torch.equal(restored.prefill(document + long_question), original.prefill(document + long_question))
    with pytest.raises(ValueError, match="does not match"):
        Session(model, 256, attention=IndexPoolConfig(**SETTINGS)).restore(document, state)


def test_short_input_equals_dense_attention():
    model = tiny_model(1)
    prompt = prompts_for(3, [24])[0]  # every forward sees at most topk far tokens: all selected
    sparse = Session(model, 64, attention=IndexPoolConfig(**SETTINGS, kv_storage="full")).prefill(prompt)
    dense = Session(model, 64).prefill(prompt)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=0)


def test_truncation_to_a_shared_prefix_matches_the_reference():
    """A second prompt that diverges from the first rolls the cache back (to a pool boundary, refilling the
    window from the store) instead of re-reading everything."""
    model = tiny_model(2)
    first, second = prompts_for(5, [140]), prompts_for(6, [60])
    prompts = [first[0], first[0][:97] + second[0]]
    ours = run_session(model, SETTINGS, prompts, new_tokens=3)
    reference = run_session(model, SETTINGS, prompts, new_tokens=3, reference=True)
    torch.testing.assert_close(ours, reference, atol=2e-4, rtol=0)


def test_shared_indexer_layers_reuse_the_full_layers_selection():
    model = tiny_model(3)
    settings = dict(SETTINGS, schedule=["full", "shared", "full"])
    prompt = prompts_for(7, [120])
    torch.testing.assert_close(run_session(model, settings, prompt), run_session(model, settings, prompt, reference=True),
                               atol=2e-4, rtol=0)
    # Without a question's pools, which fill the 2 pools a query takes here alike in every layer.
    session = Session(model, 256, attention=IndexPoolConfig(**settings, question_pools=0, question_matches=0))
    seen = {}
    session.prefill(prompt[0], on_select=lambda layer, positions, far: seen.__setitem__(layer, far))
    assert seen[1] is seen[0] and not torch.equal(seen[2], seen[0])
    # A shorter pattern repeats over the layers; the pooled index holds the full layers only.
    pattern = dict(settings, schedule=["full", "shared"])
    assert torch.equal(run_session(model, pattern, prompt), run_session(model, settings, prompt))
    every_layer = Session(model, 256, attention=IndexPoolConfig(**SETTINGS, schedule=["full"])).cache
    assert (session.cache.index.n_layers, every_layer.index.n_layers) == (2, 3)
    assert session.cache.bytes_per_token()["pooled_index"] == every_layer.bytes_per_token()["pooled_index"] * 2 / 3


def test_topk_0_reads_the_sinks_and_the_recent_window_alone(monkeypatch):
    """topk 0 (StreamingLLM; the window reader of benchmarks/ruler.py): every query sees the sinks and the recent
    window only, as the reference does under the same rules, and the indexer never scores a pool."""
    model = tiny_model(5)
    window_only = dict(SETTINGS, topk=0)
    prompt = prompts_for(14, [150])
    ours = run_session(model, window_only, prompt)
    torch.testing.assert_close(ours, run_session(model, window_only, prompt, reference=True), atol=2e-4, rtol=0)
    assert not torch.allclose(ours, run_session(model, SETTINGS, prompt), atol=2e-4, rtol=0)  # far tokens mattered
    session = Session(model, 256, attention=IndexPoolConfig(**window_only))
    monkeypatch.setattr(session.cache.indexer, "score", lambda *args: pytest.fail("a pool was scored"))
    seen = []
    session.prefill(prompt[0], on_select=lambda layer, positions, far: seen.append(far))
    assert seen and all(far.shape[1] <= SETTINGS["sinks"] and torch.equal(far[0], torch.arange(far.shape[1]))
                        for far in seen)
    IndexPoolConfig(topk=0).validate(8192)
    with pytest.raises(ValueError, match="topk must be 0 or a positive multiple"):
        IndexPoolConfig(topk=-4).validate(8192)


def test_offloaded_history_equals_in_memory(tmp_path):
    model = tiny_model(4)
    prompt = prompts_for(8, [130])
    in_memory = run_session(model, SETTINGS, prompt)
    offloaded = run_session(model, SETTINGS, prompt, offload_dir=str(tmp_path))
    assert torch.equal(in_memory, offloaded)
    assert list(tmp_path.iterdir()) == []  # the mapped file is unlinked at once: nothing left behind


def read_in_turn(model, kv_storage, prompts):
    """One session reads each prompt in turn: each one's logits and the far selections of its forward, and the
    session's cache."""
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS, kv_storage=kv_storage))
    selections, logits = [], []

    def record(layer, positions, far):
        selections[-1].append(far.clone())

    for prompt in prompts:
        selections.append([])
        logits.append(session.prefill(prompt, on_select=record))
    return logits, selections, session.cache


def test_int8_history_stays_close():
    model = tiny_model(5)
    prompts = prompts_for(9, [77, 100, 130, 161])  # no generated tokens: a different greedy pick would compound
    (exact, exact_selections, _), (quantized, quantized_selections, _) = (read_in_turn(model, storage, prompts)
                                                                          for storage in ("full", "int8"))
    same = [all(map(torch.equal, a, b)) for a, b in zip(exact_selections, quantized_selections)]
    # Per-head absmax scales: each far key/value is off by at most 1/254 of its vector's range. Logits of this
    # random model span about +-3; the bound is a thirtieth of that, where both runs attend to the same tokens: a
    # near-tie between pools that the rounding flips (here in two prompts of four) changes what is attended, and
    # that is a recall question (benchmarks/indexer_recall.py; fp8 index keys' round-trip error is tested in
    # test_indexpool_ops.py).
    assert sum(same) >= 2
    for a, b, agree in zip(exact, quantized, same):
        assert not torch.equal(a, b)
        if agree:
            assert (a - b).abs().max() < 0.1


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_an_fp32_models_bf16_history_stays_close(monkeypatch, backend):
    """An fp32 model on a CPU keeps its "bf16" (and, below a quarter of RAM, "auto") history in bf16: half the
    bytes of "full". Each stored key and value is rounded to bf16 (2^-9 relative): about 4x finer than int8's
    per-head steps (test above), so through the torch path, which keeps the queries in fp32, the bound where both
    attend to the same tokens is a fortieth of the logits' +-2 span, 0.05 (measured 0.013). The C kernel, where it
    reads bf16 (AVX512-BF16), reads the history as a bf16 model's: it rounds the far part's queries and softmax
    weights to bf16 too, three roundings more, and its deviation is the int8 history's, so is its bound (measured
    on a Xeon with AMX: at most 0.055, where int8 gave 0.067 on the same prompts; --kv-storage full keeps fp32)."""
    use_kernels(monkeypatch, backend)
    model = tiny_model(5, replace(CONFIG, head_dim=32))  # a head size the C kernel takes
    prompts = [tokens for prompt in prompts_for(9, [77, 100, 130, 161])
               for tokens in (prompt, prompt + [5], prompt + [5, 5])]  # a prompt, then one-token steps
    full, full_selections, full_cache = read_in_turn(model, "full", prompts)
    rounded, rounded_selections, rounded_cache = read_in_turn(model, "auto", prompts)
    assert rounded_cache.store.k.dtype == torch.bfloat16 and full_cache.store.k.dtype == torch.float32
    assert rounded_cache.bytes_per_token()["history_kv"] * 2 == full_cache.bytes_per_token()["history_kv"]
    same = [all(map(torch.equal, a, b)) for a, b in zip(full_selections, rounded_selections)]
    assert sum(same) >= len(same) - 2
    kernel_reads_bf16 = backend == "auto" and native_attention_takes(torch.bfloat16, 32)
    for a, b, agree in zip(full, rounded, same):
        assert not torch.equal(a, b)
        if agree:
            assert (a - b).abs().max() < (0.1 if kernel_reads_bf16 else 0.05)


@pytest.mark.parametrize("kv_storage, index_dtype", [("bf16", "bf16"), ("int8", "fp8")])
def test_a_restored_state_continues_exactly_like_the_original(kv_storage, index_dtype):
    """The document cache's round trip: a state exported after a long prefill (past the context, selection
    active), restored into a fresh session, gives the same logits for what follows as the session it came from."""
    model = tiny_model(6)
    settings = IndexPoolConfig(**SETTINGS, kv_storage=kv_storage, index_dtype=index_dtype)
    document, question = prompts_for(10, [140])[0], prompts_for(11, [9])[0]
    original = Session(model, 256, attention=settings)
    original.prefill(document, query_tail=False)
    state = {name: t.clone() for name, t in original.export_state().items()}
    restored = Session(model, 256, attention=settings)
    restored.restore(document, state)
    assert restored.cache.length == original.cache.length == 140
    assert torch.equal(restored.prefill(document + question), original.prefill(document + question))
    with pytest.raises(ValueError, match="does not match"):
        Session(model, 256, attention=IndexPoolConfig(**dict(SETTINGS, kpool=2, topk=8))).restore(document, state)


@pytest.mark.parametrize("kv_storage, index_dtype", [("bf16", "bf16"), ("int8", "fp8")])
def test_random_history_is_held_as_a_restored_state_would_be(kv_storage, index_dtype):
    """`benchmarks.indexpool_scale --held`: the first tokens' state is random, written in place; the session then
    reads on exactly as one that restored the same state through `import_state`."""
    from benchmarks.indexpool_scale import hold_random_history

    model = tiny_model(6)
    settings = IndexPoolConfig(**SETTINGS, kv_storage=kv_storage, index_dtype=index_dtype)
    document = prompts_for(12, [150])[0]
    held = Session(model, 256, attention=settings)
    assert hold_random_history(held, document[:139]) == 136  # cut to a pool boundary
    assert held.cache.length == 136 and held.tokens == document[:136]
    state = {name: t.clone() for name, t in held.export_state().items()}
    for name, part in state.items():  # every part written: the scales 0.02, the rest random
        assert torch.all(part == 0.02) if name.endswith("_scale") else part.float().std() > 0
    restored = Session(model, 256, attention=settings)
    restored.restore(document[:136], state)
    read = Session(model, 256, attention=settings)
    read.prefill(document[:136], query_tail=False)
    logits = held.prefill(document)
    assert torch.equal(logits, restored.prefill(document))
    assert not torch.equal(logits, read.prefill(document))  # the history held is random, not the text's


@pytest.mark.parametrize("head_dim", [8, 32])  # 32: the far part's probabilities from the C kernel where it runs
def test_evidence_points_at_what_the_queries_attend_to(head_dim):
    """AttentionEvidence sums attention probabilities: over a span covering every key a one-token forward
    attends to (itself included), each query row contributes exactly 1 per layer."""
    from indexpool.model.indexpool_cache import AttentionEvidence

    model = tiny_model(7, replace(CONFIG, head_dim=head_dim))
    session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
    prompt = prompts_for(12, [120])[0]
    session.prefill(prompt[:-4], query_tail=False)
    evidence = AttentionEvidence(0, 120)
    with torch.no_grad(), session.cache.reading(evidence=evidence):
        for position in range(116, 120):  # 4 one-token forwards, n_heads query rows each, in every layer
            model(torch.tensor([[prompt[position]]]), position, session.cache)
    assert evidence.span_mass(0, 120) == pytest.approx(4 * CONFIG.n_heads * CONFIG.n_layers, rel=1e-3)
    assert evidence.queries == 4
    attended = evidence.mass > 0
    assert 0 < int(attended.sum()) < 120  # past the context: only sinks, selected pools and the window are seen


@pytest.mark.parametrize("head_dim", [8, 32])
def test_evidence_does_not_change_what_the_queries_compute(head_dim):
    """With evidence on, the far part also gives each row's probabilities (the C kernel's where it runs, head
    size 32; else from the logits the torch path computes): the forwards give the same logits as without it, for
    a short forward selecting per block of queries (with a padded last block) and for one-token steps."""
    from indexpool.model.indexpool_cache import AttentionEvidence

    model = tiny_model(9, replace(CONFIG, head_dim=head_dim))
    prompt = prompts_for(14, [140])[0]
    logits = []
    for with_evidence in (False, True):
        session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
        session.prefill(prompt[:125], query_tail=False)
        with torch.no_grad(), session.cache.reading(evidence=AttentionEvidence(0, 140) if with_evidence else None):
            steps = [model(torch.tensor([prompt[125:130]]), 125, session.cache)]  # 5 queries, blocks of 2
            steps += [model(torch.tensor([[prompt[p]]]), p, session.cache) for p in range(130, 140)]
        assert session.cache.n_far > SETTINGS["topk"]  # far tokens were selected, not taken whole
        logits.append(torch.cat([step[0] for step in steps]))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [8, 32])
@pytest.mark.parametrize("band", [3, 20])
def test_evidence_leaves_out_the_local_band_before_the_query(band, head_dim):
    """With a local band, a query's evidence is its evidence without one, less the keys in the band before it
    (which are not computed at all: the band may cover the whole window)."""
    from indexpool.model.indexpool_cache import AttentionEvidence

    model = tiny_model(8, replace(CONFIG, head_dim=head_dim))
    prompt = prompts_for(13, [120])[0]
    found = []
    for local_band in (0, band):
        session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS))
        session.prefill(prompt[:-1], query_tail=False)
        found.append(AttentionEvidence(0, 120, local_band))
        with torch.no_grad(), session.cache.reading(evidence=found[-1]):
            model(torch.tensor([[prompt[119]]]), 119, session.cache)
    expected = found[0].mass.clone()
    expected[119 - band + 1 :] = 0
    torch.testing.assert_close(found[1].mass, expected, atol=1e-6, rtol=1e-5)
    assert found[1].mass[: 119 - band + 1].sum() > 0


def test_evidence_is_the_same_through_the_c_kernel_and_the_torch_path(monkeypatch):
    """The far part's probabilities from the C decode kernel (gathered, rotated keys) give the evidence the torch
    path's logits give, for a question read per query block (padded last block), for 10 tokens sharing one
    selection (20 query rows per KV head: the kernel takes them in chunks) and for one-token steps; fp32."""
    from indexpool.kernels.cpu_attention import native_library
    from indexpool.model.indexpool_cache import AttentionEvidence

    if native_library()[0] is None:
        pytest.skip(f"the C kernel is not available here: {native_library()[1]}")
    model = tiny_model(10, replace(CONFIG, head_dim=32))
    prompt = prompts_for(15, [140])[0]
    found = {}
    for backend in ("auto", "torch"):
        use_kernels(monkeypatch, backend)
        session = Session(model, 256, attention=IndexPoolConfig(**dict(SETTINGS, query_tokens=12), kv_storage="full"))
        session.prefill(prompt[:115], query_tail=False)
        found[backend] = AttentionEvidence(4, 140, local_band=3)
        with torch.no_grad():
            with session.cache.reading(evidence=found[backend]):
                model(torch.tensor([prompt[115:120]]), 115, session.cache)
            with session.cache.reading(evidence=found[backend], shared_selection=True):
                model(torch.tensor([prompt[120:130]]), 120, session.cache)
            with session.cache.reading(evidence=found[backend]):
                for position in range(130, 134):
                    model(torch.tensor([[prompt[position]]]), position, session.cache)
        assert session.cache.n_far > SETTINGS["topk"]  # far tokens were selected, not taken whole
    assert found["auto"].mass[:100].sum() > 0  # far tokens drew some of it
    torch.testing.assert_close(found["auto"].mass, found["torch"].mass, atol=1e-6, rtol=1e-5)


def test_bytes_per_token_and_memory_parts():
    cache = IndexPoolCache(CONFIG, IndexPoolConfig(**SETTINGS, kv_storage="int8", schedule=["full"]),
                           TrainingFreeIndexer(CONFIG), 64, torch.float32)
    parts = cache.bytes_per_token()
    width = CONFIG.kv_dim
    assert parts["history_kv"] == CONFIG.n_layers * 2 * (width + 4 * CONFIG.n_kv_heads)  # int8 + fp32 scales
    per_token = per_token_index_bytes(width, torch.bfloat16) * CONFIG.n_layers
    assert cache.unpooled_index_bytes() == per_token
    assert parts["pooled_index"] / per_token == 0.25


def test_a_segment_indexers_pooled_index_counts_in_the_bytes():
    """--indexer hybrid keeps a second pooled index (the segment indexer's own width, in the "full" layers only):
    both count in the pooled bytes and in the per-token comparison, which stays at 1/kpool."""
    settings = IndexPoolConfig(**SETTINGS, schedule=["full", "shared"])
    one = IndexPoolCache(CONFIG, settings, TrainingFreeIndexer(CONFIG), 64, torch.float32)
    two = IndexPoolCache(CONFIG, settings, TrainingFreeIndexer(CONFIG), 64, torch.float32,
                         segment_indexer=tiny_lightning_indexer())
    full_layers = 2  # layers 0 and 2 of 3
    assert sorted(one.index_slots) == [0, 2]
    extra = per_token_index_bytes(8, torch.bfloat16) * full_layers  # the tiny lightning indexer's 8-wide keys
    assert one.unpooled_index_bytes() == per_token_index_bytes(CONFIG.kv_dim, torch.bfloat16) * full_layers
    assert two.unpooled_index_bytes() == one.unpooled_index_bytes() + extra
    assert two.bytes_per_token()["pooled_index"] == one.bytes_per_token()["pooled_index"] + extra / 4
    assert two.bytes_per_token()["pooled_index"] / two.unpooled_index_bytes() == 0.25


@pytest.mark.parametrize("start", [20000, 20001, 20003])  # every rounding of the window start
def test_sinks_sit_sink_distance_back_inside_the_trained_context(start):
    """The default model's settings (8K context): once far tokens are selected, a forward's first query sees the
    last sink more than sink_distance back, its last query sees the first sink inside the trained context, and
    the far tokens stay closed up right before the window."""
    s, context = IndexPoolConfig(), 8192
    ws = (start - s.window) // s.kpool * s.kpool
    n_attended = s.sinks + s.topk
    placed = place_far_tokens(torch.arange(n_attended), ws, n_attended, s.sinks, s.sink_gap(context)).tolist()
    assert start - placed[s.sinks - 1] > s.sink_distance
    assert start + s.segment - 1 - placed[0] < context
    assert placed[: s.sinks] == list(range(placed[0], placed[0] + s.sinks))
    assert placed[s.sinks :] == list(range(ws - s.topk, ws))


def test_sink_gap_takes_only_the_room_left():
    assert place_far_tokens(torch.arange(100), 100, 100, 64, 1024).tolist() == list(range(100))  # all taken: true positions
    assert IndexPoolConfig(sink_distance=0).sink_gap(8192) == 0
    assert IndexPoolConfig(topk=4096).sink_gap(8192) == 0  # window + topk already reach past sink_distance
    tight = IndexPoolConfig(segment=4096)  # 64 + 2048 + 1024 + 4096 + 4: 956 positions of room
    assert tight.sink_gap(8192) == 956
    assert IndexPoolConfig(**SETTINGS).sink_gap(CONFIG.context_length) == \
        CONFIG.context_length - sum(SETTINGS[k] for k in ("sinks", "topk", "window", "segment", "kpool"))


def test_settings_are_validated():
    with pytest.raises(ValueError, match="trained context"):
        IndexPoolConfig(topk=2048, window=4096, segment=4096).validate(8192)
    with pytest.raises(ValueError, match="multiple of kpool"):
        IndexPoolConfig(topk=2050).validate(8192)
    with pytest.raises(ValueError, match="offload directory"):
        IndexPoolConfig(offload_dir="/nonexistent/dir").validate(8192)
    with pytest.raises(ValueError, match="sink distance"):
        IndexPoolConfig(sink_distance=-1).validate(8192)
    with pytest.raises(ValueError, match="query topk must be 0 or a positive multiple"):
        IndexPoolConfig(query_topk=1026).validate(8192)
    with pytest.raises(ValueError, match="match repeat share"):
        IndexPoolConfig(match_repeat_share=1.5).validate(8192)
    assert IndexPoolConfig(topk=128).short_topk() == 128 and IndexPoolConfig(query_topk=64).short_topk() == 64


def test_short_forwards_take_query_topk_far_tokens_once_they_select():
    """A 150-token prompt: its segments take nothing, then everything (4 sinks + 4), then select topk (8) far
    tokens after the sinks; its last query_tokens tokens (the question) and the decode steps after it select
    query_topk (4). A 20-token prompt: its question (from 16, the pool boundary after 20 - query_tokens) takes the
    sinks and the 4 tokens before its window, and the decode steps' 8 far tokens fit in topk: all are taken, though
    more than query_topk."""
    model = tiny_model()
    settings = IndexPoolConfig(**SETTINGS | {"query_topk": 4, "kv_storage": "full"})
    for length, long_far, short_far in ((150, {0, 8, 4 + 8}, {4 + 4}), (20, {0}, {4 + 4, 4 + 8})):
        session, seen, tokens = Session(model, 256, attention=settings), [], prompts_for(3, [length])[0]
        for _ in range(4):  # the prompt, then three greedy steps
            logits = session.prefill(tokens, on_select=lambda layer, queries, far: seen.append((len(queries),
                                                                                                 far.shape[-1])))
            tokens = tokens + [int(logits.argmax())]
        assert {n for queries, n in seen if queries > SETTINGS["query_tokens"]} == long_far
        assert {n for queries, n in seen if queries <= SETTINGS["query_tokens"]} == short_far


def test_pooled_index_truncates_only_at_pool_boundaries():
    cache = PooledIndexCache(torch.zeros(1, 4, 8), 32)
    cache.append(0, torch.randn(1, 10, 8), torch.randn(1, 10, 8))
    with pytest.raises(ValueError, match="multiple of kpool"):
        cache.truncate(6)
    cache.truncate(8)
    assert cache.n_pools(0) == 2 and cache.tail(0)[0].shape[1] == 0


def test_evidence_beyond_a_baseline_cancels_what_every_query_draws():
    """A token that draws attention whatever is asked (a sink-like " the") outweighs the token a question is about
    in the plain mass, not beyond a neutral question's mass scaled to the same number of queries."""
    from indexpool.model.indexpool_cache import AttentionEvidence

    baseline, asked = AttentionEvidence(10, 20), AttentionEvidence(10, 20)
    baseline.add(torch.tensor([12, 15]), torch.tensor([30.0, 2.0]))
    baseline.queries = 10
    asked.add(torch.tensor([12, 15, 17]), torch.tensor([60.0, 4.0, 9.0]))
    asked.queries = 20
    beyond = asked.beyond(baseline)
    assert int(asked.mass.argmax()) + 10 == 12 and int(beyond.argmax()) + 10 == 17
    torch.testing.assert_close(beyond[[2, 5, 7]], torch.tensor([0.0, 0.0, 9.0]))
    assert asked.span_mass(15, 18, beyond) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="same span"):
        asked.beyond(AttentionEvidence(0, 20))


@pytest.mark.parametrize("T", [1, 3, 5])
def test_fp32_queries_score_bf16_pools_as_stored(T, monkeypatch):
    """An fp32 model's index queries against the bf16 pooled index: up to 12 query rows (T = 1 and 3 here, 4 heads
    each: a decode step's) go to the C kernel with the keys as stored, more (T = 5: 20 rows) widen the keys once.
    Either way the scores are those against the widened keys up to fp32 summation order, pools past each query's
    limit -inf."""
    from indexpool.kernels import cpu_linear

    if not cpu_linear.kernel_runs():
        pytest.skip(f"the C linear kernels do not run here: {cpu_linear.linear_path()}")
    generator = torch.Generator().manual_seed(T)
    indexer = TrainingFreeIndexer(CONFIG, 4)
    q = torch.randn(1, T, CONFIG.n_heads, CONFIG.head_dim, generator=generator)
    weights = torch.rand(1, T, CONFIG.n_heads, generator=generator)
    pooled = torch.randn(1, 37, indexer.key_dim, generator=generator).bfloat16()
    limits = torch.tensor([[37, 20, 1, 30, 36][:T]])
    calls = []
    kernel = cpu_linear.linear_bf16
    monkeypatch.setattr(cpu_linear, "linear_bf16", lambda *args: calls.append(1) or kernel(*args))
    got = indexer.score(0, q, weights, pooled, limits)
    assert len(calls) == (1 if T * CONFIG.n_heads <= cpu_linear.BF16_ROWS else 0)
    widened = indexer.score(0, q, weights, pooled.float(), limits)
    assert got.dtype == torch.float32
    hidden = torch.arange(37) >= limits[..., None]
    assert torch.equal(torch.isinf(got), hidden) and torch.equal(torch.isinf(widened), hidden)
    torch.testing.assert_close(got[~hidden], widened[~hidden], atol=1e-6, rtol=1e-5)


def test_an_fp32_models_decode_steps_score_the_stored_pools(monkeypatch):
    """Read past the context (150 tokens), an fp32 model's decode steps score the bf16 pooled index through the C
    kernel (`scored_pools` hands it over unwidened); the logits are those of widening it first, up to fp32
    summation order."""
    from indexpool.kernels import cpu_linear

    if not cpu_linear.kernel_runs():
        pytest.skip(f"the C linear kernels do not run here: {cpu_linear.linear_path()}")
    model = tiny_model()
    prompt = prompts_for(150, [150])
    calls = []
    kernel = cpu_linear.linear_bf16
    monkeypatch.setattr(cpu_linear, "linear_bf16", lambda *args: calls.append(1) or kernel(*args))
    stored = run_session(model, SETTINGS, prompt)
    assert calls
    monkeypatch.setattr(TrainingFreeIndexer, "reads_stored_pools", False)
    calls.clear()
    widened = run_session(model, SETTINGS, prompt)
    assert not calls
    torch.testing.assert_close(stored, widened, atol=1e-5, rtol=0)


def test_a_questions_pools_span_its_best_pools_once_each():
    from indexpool.model.indexpool_cache import QUESTION_SPAN, question_pools

    # 10 first with its span (7..14), then 12's pools not yet taken (15, 16), then 1's (clamped at 0; 2..5 new).
    assert question_pools(torch.tensor([10, 12, 1]), 20).tolist() == [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0, 1, 2, 3,
                                                                      4, 5]
    assert question_pools(torch.tensor([10]), 12).tolist() == [7, 8, 9, 10, 11]  # clamped at the last pool, once
    assert question_pools(torch.tensor([1, 0]), 2).tolist() == [0, 1]
    assert question_pools(torch.tensor([], dtype=torch.long), 5).tolist() == []
    assert len(QUESTION_SPAN) == 8


def test_matching_pools_find_the_questions_rarest_wording():
    """The pools holding pairs of the question's consecutive tokens, the rarest pairs weighing most; a pair met more
    than MATCH_MAX_COUNT times counts nothing; two pools taken are more than a span apart."""
    from indexpool.model.indexpool_cache import matching_pools

    common = [5, 6] * (MATCH_MAX_COUNT + 1)  # the pair (5, 6) too often, and (6, 5) too
    document = [1] * 200
    document[0: len(common)] = common
    document[120:122] = [7, 8]  # once: the rarest
    document[80:82] = [9, 10]  # three times: here, at 160 and at 170, which lies within a span of 160's pool
    document[160:162] = [9, 10]
    document[170:172] = [9, 10]
    question = [3, 5, 6, 7, 8, 2, 9, 10]
    pools = matching_pools(torch.tensor(document), torch.tensor(question), 4, 8).places.tolist()
    assert (pools, [], [], []) == reference_matching_pools(document, question, 4, 8)
    assert pools == [30, 20, 40]  # the rarest pair's pool (120 // 4), then 80's and 160's, not 170's
    assert matching_pools(torch.tensor(document), torch.tensor(question), 4, 1).places.tolist() == [30]
    for none in (matching_pools(torch.tensor(document), torch.tensor([2, 3, 4]), 4, 8),  # nothing shared
                 matching_pools(torch.tensor(document[:3]), torch.tensor(question), 4, 8)):  # no whole pool
        assert none.places.tolist() == none.look_alikes.tolist() == none.strays.tolist() == none.framed.tolist() == []
    # Random ids, awkward lengths: the same pools as the reference, one pair at a time.
    generator = torch.Generator().manual_seed(0)
    for n in (5, 63, 401, 1203):
        document = torch.randint(0, 12, (n,), generator=generator)
        question = torch.randint(0, 12, (9,), generator=generator)
        for share in (0.0, 0.9):
            for uncounted in (None, n // 8, 0):
                assert tuple(t.tolist() for t in matching_pools(document, question, 4, 5, share, uncounted)) == \
                    reference_matching_pools(document.tolist(), question.tolist(), 4, 5, share, uncounted)


@pytest.mark.parametrize("length", [100_000, 200_000])
def test_a_frame_repeated_around_many_keys_ties_their_look_alikes_in_a_long_document(length):
    """40 entries "FRAME KEY_i VALUE_i" (the frame's pairs 40 times) and a question naming key 17 in the frame: up to
    128K tokens the frame's pairs are too common to count (32 at most), and the other entries are nothing to the
    match; past it a pair may occur once per 4,096 tokens (48 times in 200K), the frame counts, and every other entry
    holds only part of the taken one's phrase: a look-alike, passed over."""
    from indexpool.model.indexpool_cache import matching_pools

    frame, spacing = [50, 51, 52], (length - 4000) // 40
    document = [1] * length
    starts = [2000 + i * spacing for i in range(40)]
    for i, start in enumerate(starts):
        document[start: start + 7] = frame + [100 + 2 * i, 101 + 2 * i, 53, 200 + i]
    question = [60] + frame + [134, 135, 61]  # key 17's two tokens
    found = matching_pools(torch.tensor(document), torch.tensor(question), 4, 4, 0.9)
    assert tuple(t.tolist() for t in found) == reference_matching_pools(document, question, 4, 4, 0.9)
    entries = [(start + 3) // 4 for start in starts]  # the pool of each entry's key
    assert found.places.tolist() == [entries[17]]
    if length > MATCH_SPARSE * MATCH_MAX_COUNT:  # each other entry's pools (the key's and its neighbours)
        nearest = [min(entries, key=lambda entry: abs(entry - p)) for p in found.look_alikes.tolist()]
        assert set(nearest) == set(entries) - {entries[17]}
        assert all(abs(p - entry) <= 1 for p, entry in zip(found.look_alikes.tolist(), nearest))
    else:
        assert found.look_alikes.tolist() == [] and found.strays.tolist() == []


def frame_entries(length, n_entries, separator_every=0):
    """A document of `length` tokens holding n_entries entries "FRAME KEY_i VALUE_i" (the frame 3 tokens, 50-52;
    the key 2), evenly spaced, entry i's key at 100 + 2i; and, every separator_every tokens from 500 on, a section
    break (70, 71, 72), one of them just after entry 17 (inside its span). Returns the document and each entry's
    start."""
    document = [1] * length
    spacing = (length - 4000) // n_entries
    starts = [2000 + i * spacing for i in range(n_entries)]
    if separator_every:
        for at in range(500, length - 500, separator_every):
            document[at: at + 3] = [70, 71, 72]
        document[starts[17] + 8: starts[17] + 11] = [70, 71, 72]
    for i, start in enumerate(starts):
        document[start: start + 7] = [50, 51, 52, 100 + 2 * i, 101 + 2 * i, 53, 200 + i]
    return document, starts


def test_a_frame_of_the_questions_own_words_ties_look_alikes_at_any_length():
    """40 entries "FRAME KEY VALUE" in 20K tokens (the frame's pairs too common to rank places) and a question
    naming key 17 in the frame, read with the document's last tokens, a section break met everywhere (and beside
    entry 17) before it: where the question's own words begin (frame_from), a frame of them ties every other entry
    to the taken one, each listed where its key lies (the taken place's offset from its frame); the break, not
    the question's wording, ties nothing. From the first token read (frame_from 0) the break would make every
    section's start a look-alike; with no frame_from, none is taken."""
    from indexpool.model.indexpool_cache import matching_pools

    document, starts = frame_entries(20_000, 40, separator_every=300)
    question = [70, 71, 72] + [60, 50, 51, 52, 134, 135, 61]  # the document's last tokens, then key 17's question
    entries = [(start + 3) // 4 for start in starts]  # the pool of each entry's key
    found = {}
    for frame_from in (None, 0, 3):
        found[frame_from] = matching_pools(torch.tensor(document), torch.tensor(question), 4, 4, 0.9,
                                           frame_from=frame_from)
        assert tuple(t.tolist() for t in found[frame_from]) == \
            reference_matching_pools(document, question, 4, 4, 0.9, frame_from=frame_from)
        assert found[frame_from].places.tolist() == [entries[17]]
    assert all(found[f].look_alikes.tolist() == [] for f in found) and found[None].framed.tolist() == []
    assert found[3].framed.tolist() == entries[:17] + entries[18:]
    breaks = set(found[0].framed.tolist()) - set(entries)
    assert len(breaks) > 40 and all(document[p * 4 - 16: p * 4 + 16].count(70) for p in breaks)


def test_a_template_repeated_often_needs_one_word_fewer_around_its_frame():
    """40 entries "X ONE of FRAME KEY VALUE" in 20K tokens, X different in each, ONE a word met as two tokens (at a
    line's start and within a line: 48 and 47, alternately): around the frame the other entries share 2 words with
    the asked one's (ONE, of) where the tokens are taken as words, and 20 of them share 2 tokens. Where over
    MATCH_MAX_COUNT entries share 2 (as words), that template ties every other entry to the asked one; where fewer
    do (as tokens: 19), 3 are needed, and none is tied."""
    from indexpool.model.indexpool_cache import matching_pools

    document = [1] * 20_000
    starts = [2000 + i * 400 for i in range(40)]
    for i, start in enumerate(starts):
        document[start: start + 10] = [300 + i, 48 if i % 2 else 47, 49, 50, 51, 52, 100 + 2 * i, 101 + 2 * i, 53,
                                       200 + i]
    question = [60, 50, 51, 52, 134, 135, 61]  # key 17's
    words = torch.arange(400)
    words[48] = 47
    entries = [(start + 6) // 4 for start in starts]  # the pool of each entry's key
    for by_words, framed in ((False, []), (True, entries[:17] + entries[18:])):
        found = matching_pools(torch.tensor(document), torch.tensor(question), 4, 4, 0.9, frame_from=0,
                               words=words if by_words else None)
        assert tuple(t.tolist() for t in found) == reference_matching_pools(
            document, question, 4, 4, 0.9, frame_from=0, words=words.tolist() if by_words else None)
        assert found.places.tolist() == [entries[17]] and found.framed.tolist() == framed


def test_frame_look_alikes_match_the_reference_on_random_ids(monkeypatch):
    """Random ids with entries of one template ("A B C D E F KEY") and bare frames ("B C D" alone) put in at random,
    awkward lengths, the frame count lowered so that the frame passes it: the same places as the reference, one
    pair at a time, from every place the question's own words may begin; only the template's entries are framed."""
    from indexpool.model.indexpool_cache import matching_pools

    monkeypatch.setattr(indexpool_cache, "MATCH_MAX_COUNT", 3)
    generator = torch.Generator().manual_seed(1)
    framed = 0
    for n in (83, 401, 1203, 2001):
        document = torch.randint(0, 12, (n,), generator=generator)
        picks = torch.randperm(n // 40, generator=generator)[:8] * 40
        keys = torch.randint(40, 60, (len(picks), 3), generator=generator)
        for i, at in enumerate(picks.tolist()):
            entry = [19, 20, 21, 22, 23, 24] + keys[i].tolist() if i % 3 else [21, 22, 23]
            document[at: at + len(entry)] = torch.tensor(entry[: n - at])
        question = torch.tensor([5, 21, 22, 23] + keys[1].tolist() + [7, 3])
        for frame_from in (None, 0, 4, 8):
            for uncounted in (None, n // 8):
                found = matching_pools(document, question, 4, 5, 0.9, uncounted, frame_from)
                assert tuple(t.tolist() for t in found) == reference_matching_pools(
                    document.tolist(), question.tolist(), 4, 5, 0.9, uncounted, frame_from)
                framed += len(found.framed)
                assert (frame_from is None or frame_from >= 4) <= (len(found.framed) == 0)
                entries = [at // 4 for i, at in enumerate(picks.tolist()) if i % 3]
                # each framed place within 2 pools of an entry's start (its key's pool, the taken place's offset)
                assert all(min(abs(p - entry) for entry in entries) <= 2 for p in found.framed.tolist())
    assert framed > 0  # some frames were met


def test_matching_pools_pass_over_look_alikes_and_keep_repeats():
    """The asked phrase twice, a look-alike sharing its first three tokens, and two of its words met by chance: with
    a repeat share, the look-alike and the chance pair (a stray) are passed over, the repeat kept."""
    from indexpool.model.indexpool_cache import matching_pools

    question = [20, 21, 22, 23, 24]
    document = [1] * 400
    document[40:45] = document[200:205] = question  # pools 10 and 50
    document[120:124] = [20, 21, 22, 9]  # pool 30: a part of the phrase, then another word
    document[300:302] = [23, 24]  # pool 75: a pair on its own
    # (the look-alikes' neighbours, which their scores rank next, are met and passed over too)
    for share, expected in ((0.0, ([10, 50, 30, 75], [], [], [])), (0.9, ([10, 50], [30, 29, 31], [75, 74, 76], []))):
        found = tuple(t.tolist() for t in matching_pools(torch.tensor(document), torch.tensor(question), 4, 8, share))
        assert found == expected == reference_matching_pools(document, question, 4, 8, share)
    # Places from pool uncounted_from on (a recent window) do not count: with none counted, every place is met.
    assert matching_pools(torch.tensor(document), torch.tensor(question), 4, 1, 0.9).places.tolist() == [10]
    assert matching_pools(torch.tensor(document), torch.tensor(question), 4, 1, 0.9, 11).places.tolist() == [10]
    found = matching_pools(torch.tensor(document), torch.tensor(question), 4, 1, 0.9, uncounted_from=1)
    assert found.places.tolist() == [10, 50] and found.look_alikes.tolist() == [30, 29, 31]
    assert found.strays.tolist() == [75, 74, 76]
    # the look-alike weighs about half the phrase: kept where less than half passes a place over
    found = matching_pools(torch.tensor(document), torch.tensor(question), 4, 8, 0.4)
    assert found.places.tolist() == [10, 50, 30] and found.look_alikes.tolist() == []
    assert found.strays.tolist() == [75, 74, 76]


def test_a_place_holding_only_what_two_taken_places_hold_together_is_passed_over():
    """A question asking for three keys ("5-7 11", "8-9 10 12", "40-41", the hyphen 6) and a key joining words of
    the first two ("5-9 10 12": 5-9 is no three tokens of the question), which ranks above the first: taken before
    it, it holds only what the two hold together once both are taken, and is passed over then for the third key,
    which three places now hold. Asked for too, or in the recent window, it is kept."""
    from indexpool.model.indexpool_cache import matching_pools

    document = [1] * 400
    document[40:44] = [5, 6, 7, 11]  # pool 10
    document[120:125] = [8, 6, 9, 10, 12]  # pool 30
    document[200:205] = [5, 6, 9, 10, 12]  # pool 50: the joined key
    document[280:283] = [40, 6, 41]  # pool 70
    question = [2, 5, 6, 7, 11, 3, 8, 6, 9, 10, 12, 3, 40, 6, 41, 4]
    for share, expected in ((0.0, ([30, 50, 10], [], [], [])), (0.9, ([30, 10, 70], [50], [], []))):
        found = tuple(t.tolist() for t in matching_pools(torch.tensor(document), torch.tensor(question), 4, 3, share))
        assert found == expected == reference_matching_pools(document, question, 4, 3, share)
    # Two places asked for: the first key is not taken, and (5, 6) is held by no place taken.
    found = matching_pools(torch.tensor(document), torch.tensor(question), 4, 2, 0.9)
    assert found.places.tolist() == [30, 50] and found.look_alikes.tolist() == []
    # In the recent window (from pool 45), read whole, it is taken (without counting).
    found = tuple(t.tolist() for t in matching_pools(torch.tensor(document), torch.tensor(question), 4, 2, 0.9, 45))
    assert found == ([30, 50, 10], [], [], []) == reference_matching_pools(document, question, 4, 2, 0.9, 45)
    question += [5, 6, 9, 10, 12]
    found = tuple(t.tolist() for t in matching_pools(torch.tensor(document), torch.tensor(question), 4, 3, 0.9))
    assert found == ([30, 50, 10], [], [], []) == reference_matching_pools(document, question, 4, 3, 0.9)


def test_kept_question_pools_come_first_in_their_order():
    from indexpool.model.indexpool_cache import keep_question_pools

    scores = torch.rand(3, 40)
    kept = keep_question_pools(scores, torch.tensor([30, -1, 7, 45, 2]))  # -1 and 45 lie outside: skipped
    assert not torch.equal(kept, scores) and scores.max() <= 1  # the input is left as it was
    assert kept.topk(2).indices.tolist() == [[30, 7]] * 3
    top = kept.topk(6).indices
    assert top[:, :3].tolist() == [[30, 7, 2]] * 3
    assert torch.equal(top[:, 3:], scores.index_fill(1, torch.tensor([30, 7, 2]), -1).topk(3).indices)


def test_a_questions_kept_spans_are_cut_at_its_far_tokens():
    """More kept places than a short forward's far tokens hold: the list is cut at query_topk's pools, best first
    (the best place's span whole, the next one's start), and every query of the question reads exactly those."""
    config = replace(CONFIG, context_length=256)
    model = tiny_model(4, config)
    settings = IndexPoolConfig(**SETTINGS | dict(topk=64, query_topk=40, query_tokens=12, question_pools=3,
                                                 question_matches=0, segment_candidates=16, kv_storage="full"))
    prompt, seen = prompts_for(8, [300])[0], []
    session = Session(model, 400, attention=settings)
    session.prefill(prompt, on_select=lambda layer, queries, far: seen.append((len(queries), far)))
    kept = session.cache.question_pools
    assert kept is not None and len(kept) == 10 and len(set(kept.tolist())) == 10  # 40 tokens: 10 pools
    assert kept[:8].tolist() == list(range(int(kept[3]) - 3, int(kept[3]) + 5))  # the best pool's span whole
    kept_tokens = set((kept[:, None] * 4 + torch.arange(4)).flatten().tolist()) | set(range(settings.sinks))
    assert all(kept_tokens == set(row.tolist()) for n, far in seen if n == 12 for row in far)


def test_a_look_alikes_place_is_not_read_though_the_question_scores_it():
    """The question's wording at one place and its first half, then other words, at another: the second is a
    look-alike (`matching_pools` passes it over), and its span is kept out of the question's far tokens, which the
    question's scored pools fill to the last one besides."""
    from indexpool.model.indexpool_cache import matching_pools, question_pools

    config = replace(CONFIG, context_length=512)
    model = tiny_model(4, config)
    settings = IndexPoolConfig(**SETTINGS | dict(topk=200, query_topk=200, query_tokens=12, question_matches=2,
                                                 segment_candidates=64, kv_storage="full"))
    prompt = prompts_for(8, [300])[0]
    question = prompt[288:300]  # the prompt's last 12 tokens are read as the question
    prompt[100:112] = question
    prompt[200:206] = question[:6]
    session = Session(model, 400, attention=settings)
    session.prefill(prompt)
    cache, first = session.cache, settings.sinks // settings.kpool
    ws = cache._window_start(288)
    found = matching_pools(torch.tensor(prompt[first * 4: ws]), torch.tensor(question), 4, 2, 0.9)
    # The phrase's place (tokens 96-107 of the document, which starts at the sinks' end), the half's passed over
    # (tokens 196-201, and its neighbours).
    assert len(found.places) == 1 and 96 // 4 <= int(found.places[0]) <= 107 // 4
    assert len(found.look_alikes) and all(196 // 4 - 1 <= p <= 201 // 4 + 1 for p in found.look_alikes.tolist())
    kept = set((cache.question_pools - first).tolist())
    n_pools = ws // 4 - first
    shunned = set(question_pools(found.look_alikes, n_pools).tolist())
    assert len(kept) == 50 and set(question_pools(found.places, n_pools).tolist()) <= kept and not kept & shunned


def test_a_look_alike_in_the_recent_window_is_not_attended():
    """The question's wording far back and its first half, then other words, inside the recent window: the window's
    places the session held before the question came (the document) are matched too (not counted among the
    question's matches: they are read whole), so the half is a look-alike there, and the question's second read and
    its answer's steps attend the window without its span, as the reference does; the read that finds it sees it.
    Tokens read in the question's own call (its own words, which may begin before the tokens read twice) are not
    matched, nor is the window of a prompt read in one call."""
    from indexpool.model.indexpool_cache import matching_pools

    settings = SETTINGS | dict(window=32, query_tokens=12)
    config = IndexPoolConfig(**settings, kv_storage="full")
    model = tiny_model(4)
    prompt = prompts_for(8, [240])[0]
    question = prompt[228:240]  # the question read twice; its window starts at 196
    prompt[60:72] = question
    # Its span (3 pools before it, 4 after; its neighbours', which rank next, passed over too) leaves out 196-219.
    prompt[196:199] = question[:3]

    def hidden_after(document_end, prompt, settings=config):  # the document held, then the prompt read
        session = Session(model, 256, attention=settings)
        session.prefill(prompt[:document_end], query_tail=False)
        session.prefill(prompt)
        return session.cache.question_hidden

    assert hidden_after(224, prompt).tolist() == list(range(196, 220))
    torch.testing.assert_close(run_session(model, settings, [prompt[:224], prompt]),
                               run_session(model, settings, [prompt[:224], prompt], reference=True), atol=2e-4, rtol=0)
    # Without look-alikes passed over, nothing is left out, and the answer reads otherwise.
    assert hidden_after(224, prompt, replace(config, match_repeat_share=0.0)) is None
    assert not torch.allclose(run_session(model, settings | dict(match_repeat_share=0.0), [prompt[:224], prompt]),
                              run_session(model, settings, [prompt[:224], prompt]), atol=2e-4, rtol=0)
    # The window's tokens read with the question (the document held up to 196), or the prompt read in one call:
    # nothing matched there, nothing left out.
    assert hidden_after(196, prompt) is None
    one_call = Session(model, 256, attention=config)
    one_call.prefill(prompt)
    assert one_call.cache.question_hidden is None
    # Two of the question's words alone in the window (a stray: met by chance, no phrase) are passed over but
    # attended: they name no wrong answer.
    stray = list(prompt)
    stray[196:199] = prompts_for(9, [3])[0]
    stray[204:206] = question[5:7]
    first = config.sinks // 4
    found = matching_pools(torch.tensor(stray[first * 4: 224]), torch.tensor(question), 4, config.question_matches,
                           config.match_repeat_share, uncounted_from=196 // 4 - first)
    assert 204 // 4 - first in found.strays.tolist() and not len(found.look_alikes)
    assert hidden_after(224, stray) is None
    torch.testing.assert_close(run_session(model, settings, [stray[:224], stray]),
                               run_session(model, settings, [stray[:224], stray], reference=True), atol=2e-4, rtol=0)


def test_a_templates_other_entries_are_neither_read_nor_attended_in_the_window(monkeypatch):
    """Five entries of one template "87 88 89 FRAME KEY VALUE" (the frame's pairs over the count that ranks places)
    and a question naming the first entry's key in the frame, after its document: told where the question begins,
    the session takes the frame from its words, and the other entries' spans are kept out of the question's far
    tokens; not told, its far tokens take them. An entry inside the recent window is left out of what the question's
    second read and its answer attend, as the reference does; not told, it is attended."""
    from indexpool.model.indexpool_cache import question_pools

    monkeypatch.setattr(indexpool_cache, "MATCH_MAX_COUNT", 2)
    frame = [90, 91, 92]

    def with_entries(prompt, starts, question_at):  # each entry "87 88 89 FRAME KEY VALUE" from start - 3
        prompt = list(prompt)
        for i, start in enumerate(starts):
            prompt[start - 3: start + 6] = [87, 88, 89] + frame + [80 + 2 * i, 81 + 2 * i, 70 + i]
        prompt[question_at: question_at + 10] = [3] + frame + [80, 81] + [5, 6, 7, 8]  # the question's own words
        return prompt

    config = replace(CONFIG, context_length=512)
    model = tiny_model(4, config)
    settings = IndexPoolConfig(**SETTINGS | dict(topk=200, query_topk=200, query_tokens=12, question_matches=2,
                                                 segment_candidates=64, kv_storage="full"))
    starts = (100, 140, 180, 220, 250)
    prompt = with_entries(prompts_for(8, [300])[0], starts, 290)  # read twice from 288

    def kept_pools(question_from):  # the document held, then the prompt read
        session = Session(model, 400, attention=settings)
        session.prefill(prompt[:290], query_tail=False)
        session.prefill(prompt, question_from=question_from)
        first = settings.sinks // settings.kpool
        return set((session.cache.question_pools - first).tolist()), session.cache._window_start(288) // 4 - first

    kept, n_pools = kept_pools(290)
    # Each entry's span about its frame's pool (the asked one's place there), the document starting at pool 1.
    others = set(question_pools(torch.tensor([start // 4 - 1 for start in starts[1:]]), n_pools).tolist())
    asked = set(question_pools(torch.tensor([starts[0] // 4 - 1]), n_pools).tolist())
    assert asked <= kept and not kept & (others - asked)
    assert len(kept_pools(None)[0] & (others - asked)) > 10
    # Small settings, an entry in the recent window (from 196).
    small = SETTINGS | dict(window=32, query_tokens=12)
    prompt = with_entries(prompts_for(8, [240])[0], (60, 100, 140, 200), 230)

    def hidden(question_from):
        session = Session(tiny_model(4), 256, attention=IndexPoolConfig(**small, kv_storage="full"))
        session.prefill(prompt[:230], query_tail=False)
        session.prefill(prompt, question_from=question_from)
        return session.cache.question_hidden

    assert hidden(None) is None and set(range(197, 206)) <= set(hidden(230).tolist())
    told = run_session(tiny_model(4), small, [prompt[:230], prompt], question_from=230)
    torch.testing.assert_close(told, run_session(tiny_model(4), small, [prompt[:230], prompt], question_from=230,
                                                 reference=True), atol=2e-4, rtol=0)
    assert not torch.allclose(told, run_session(tiny_model(4), small, [prompt[:230], prompt]), atol=2e-4, rtol=0)


def test_a_question_is_read_twice_and_its_answer_keeps_its_pools():
    """The prompt's last tokens select per query: `Session.prefill` reads them once to find the question's pools
    (the evidence taken there, no on_select hook, nothing left in the cache), then again with those pools in every
    query's selection, and so do the decode steps after it, until a truncation to the question's start drops them."""
    from indexpool.model.indexpool_cache import AttentionEvidence

    config = replace(CONFIG, context_length=256)
    model = tiny_model(4, config)
    settings = IndexPoolConfig(**SETTINGS | dict(topk=64, query_topk=64, query_tokens=12, question_pools=1,
                                                 question_matches=0, segment_candidates=16, kv_storage="full"))
    prompt = prompts_for(8, [300])[0]
    session, seen = Session(model, 400, attention=settings), []
    evidence = AttentionEvidence(0, 300)
    logits = session.prefill(prompt, evidence=evidence,
                             on_select=lambda layer, queries, far: seen.append((queries.tolist(), far)))
    cache = session.cache
    assert cache.length == 300 and evidence.queries == 12  # the question's 12 tokens, counted once
    # Where the question looks of itself: the evidence of a session that reads it once, not the second read's.
    once, alone = Session(model, 400, attention=replace(settings, question_pools=0)), AttentionEvidence(0, 300)
    once.prefill(prompt, evidence=alone)
    assert once.cache.question_pools is None and alone.queries == 12
    assert torch.equal(evidence.mass, alone.mass) and evidence.mass.sum() > 0
    kept = cache.question_pools
    # Its best pool's span (3 before, 4 after), then the next best it scores, up to the 16 pools query_topk takes.
    assert kept is not None and len(kept) == 16 and (cache.question_start, cache.question_end) == (288, 300)
    assert kept[:8].tolist() == list(range(int(kept[3]) - 3, int(kept[3]) + 5))
    kept_tokens = set((kept[:, None] * 4 + torch.arange(4)).flatten().tolist()) | set(range(settings.sinks))
    question = [far for queries, far in seen if len(queries) == 12]
    assert len(question) == CONFIG.n_layers  # one read seen: the scouting read calls no hook
    assert all(kept_tokens == set(row.tolist()) for far in question for row in far)  # those and the sinks only
    # The answer's tokens (decode steps) select the question's pools too.
    token = logits.argmax().view(1, 1)
    with cache.reading(on_select=lambda layer, queries, far: seen.append((queries.tolist(), far))):
        model(token, 300, cache)
    assert all(kept_tokens == set(far[0].tolist()) for queries, far in seen if queries == [300])
    assert torch.equal(cache.question_pools, kept)
    # A truncation that keeps the question keeps them (the tokens re-read from the pool boundary are the same);
    # another question on the same document replaces them; a truncation that cuts it drops them.
    session.tokens = prompt + [int(token)]
    assert cache.truncate(301) == 300 and torch.equal(cache.question_pools, kept)
    follow_up = prompt[:298] + prompts_for(9, [12])[0]
    session.prefill(follow_up)
    # Read from 296 (the pool boundary before 298); the question from 300 (the one after 310 - query_tokens).
    assert (cache.question_start, cache.question_end) == (300, 310)
    cache.truncate(309)
    assert cache.question_pools is None
    # A question the window holds whole-document attention for (nothing to select) is read once.
    short = Session(model, 400, attention=settings)
    short.prefill(prompt[:40])
    assert short.cache.question_pools is None
