"""The IndexPool engine on its Triton path against its torch path: same logits, same selections.

`INDEXPOOL_KERNELS=triton` routes pool compression (`PooledIndexCache.append`), the far + window attention
(`IndexPoolCache.attend`) and the lightning indexer's scoring through `kernels/`; `torch` keeps the engine's own
torch code. Without a GPU the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before anything imports Triton), on the tiny random model of tests/test_indexpool_cache.py; with one, on the GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_setting import use_kernels
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run in the CPU "
                    "interpreter: set it in tests/conftest.py (before any test module is imported), or run "
                    "tests/test_kernels_engine.py on its own", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from indexpool import kernels  # noqa: E402
from indexpool.kernels import kernel_backend  # noqa: E402
from indexpool.model.generate import Session  # noqa: E402
from indexpool.model.runtime import load_engine  # noqa: E402
from indexpool.kernels.index_math import FP8_DTYPE, fp8_dequantize, fp8_quantize  # noqa: E402
from indexpool.model.indexpool import PooledIndexCache  # noqa: E402
from indexpool.model.indexpool_cache import AttentionEvidence, IndexPoolConfig  # noqa: E402
from indexpool.model.lightning_indexer import LightningIndexer, LightningIndexerConfig, ModelFingerprint  # noqa: E402
from test_indexpool_cache import CONFIG, SETTINGS, prompts_for, run_session, tiny_model  # noqa: E402

BACKENDS = ("torch", "triton")


def session_logits(monkeypatch, backend: str, model, prompt, **options) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """run_session's logits on one backend, and every layer's far selection in the order they were made."""
    selections = []
    session_prefill = Session.prefill

    def recording_prefill(self, *args, **kwargs):
        assert self.cache.backend == backend
        return session_prefill(self, *args, on_select=lambda layer, positions, far: selections.append(far.clone()),
                               **kwargs)

    with monkeypatch.context() as patch:
        use_kernels(patch, backend)
        patch.setattr(Session, "prefill", recording_prefill)
        logits = run_session(model, SETTINGS, [prompt], new_tokens=4, **options)
    return logits, selections


@pytest.mark.parametrize("index_dtype, kv_storage", [("bf16", "full"), ("fp8", "int8")])
def test_triton_path_gives_the_torch_paths_logits(monkeypatch, index_dtype, kv_storage):
    """100 tokens, past the model's 64-token context: shared segment selections, per-block selections for the
    prompt's last tokens, remapped positions, then 4 decode steps. The history in the model's fp32 ("full": on
    the torch path "bf16" would be bf16 for an fp32 model, on Triton fp32) or int8 on both."""
    model = tiny_model(11).to(DEVICE)
    prompt = prompts_for(21, [100])[0]
    results = {backend: session_logits(monkeypatch, backend, model, prompt, index_dtype=index_dtype,
                                       kv_storage=kv_storage) for backend in BACKENDS}
    (torch_logits, torch_selections), (triton_logits, triton_selections) = results["torch"], results["triton"]
    # The same pools are chosen (pooled keys from pool_compress score like those from pool_keys), and selection
    # was active: some far tokens lie beyond the first N positions (N attended), and query blocks chose apart.
    assert len(triton_selections) == len(torch_selections)
    assert all(torch.equal(a, b) for a, b in zip(torch_selections, triton_selections))
    assert any(far.numel() and int(far.max()) >= far.shape[1] for far in torch_selections)
    assert any(far.shape[0] > 1 and not torch.equal(far[0], far[-1]) for far in torch_selections)
    # fp32 model on both paths; they differ in summation order only (one online softmax over far + window against
    # parts merged by log-sum-exp, another dot order): a few fp32 ulps (6e-8 relative) per attention output.
    # Through 3 layers, the MLPs and the head that is ~3e-6 on logits of magnitude ~2 (measured); 2e-5 leaves
    # room for GPU exp2 rounding, and is 10x below the 2e-4 at which both meet the fp64 reference.
    torch.testing.assert_close(triton_logits, torch_logits, atol=2e-5, rtol=0)


def test_evidence_forwards_fall_back_to_the_torch_path(monkeypatch):
    """AttentionEvidence needs each attention part's log-sum-exp, which the kernel does not return: with evidence
    on, short forwards run the torch path, so the evidence is what the torch path records."""
    model = tiny_model(12).to(DEVICE)
    prompt = prompts_for(22, [52])[0]
    evidence, logits = {}, {}
    for backend in BACKENDS:
        use_kernels(monkeypatch, backend)
        session = Session(model, 64, attention=IndexPoolConfig(**SETTINGS, kv_storage="full"))  # fp32 on both
        session.prefill(prompt[:-3], query_tail=False)  # the Triton path, on the triton backend
        evidence[backend] = AttentionEvidence(0, 52)
        with torch.no_grad(), session.cache.reading(evidence=evidence[backend]):
            logits[backend] = torch.cat([model(torch.tensor([[token]], device=DEVICE), position, session.cache)
                                         for position, token in enumerate(prompt[-3:], start=49)])
    per_forward = CONFIG.n_heads * CONFIG.n_layers  # each query row's probabilities sum to 1
    assert evidence["triton"].span_mass(0, 52) == pytest.approx(3 * per_forward, rel=1e-4)
    torch.testing.assert_close(evidence["triton"].mass, evidence["torch"].mass, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-5, rtol=0)  # as in the test above


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_pooled_index_appends_through_pool_compress(monkeypatch, dtype):
    """Chunks that start and end mid-pool, and single tokens, with learned-style gates and APE: the pools written
    by the kernel are those of the torch path, within one step of the storage dtype (the kernel's fp32 pooled
    value may sit on the other side of a rounding midpoint, rarely: see test_kernels.py)."""
    generator = torch.Generator().manual_seed(13)
    ape = torch.randn(2, 4, 24, generator=generator)
    keys, gates = (torch.randn(1, 30, 24, generator=generator).to(DEVICE) for _ in range(2))
    caches = {}
    for backend in BACKENDS:
        use_kernels(monkeypatch, backend)
        cache = caches[backend] = PooledIndexCache(ape, 32, 1, dtype, DEVICE)
        assert cache.backend == backend
        for layer in range(2):
            for start, end in [(0, 6), (6, 7), (7, 8), (8, 21), (21, 30)]:
                cache.append(layer, keys[:, start:end], gates[:, start:end])
    for layer in range(2):
        assert caches["triton"].n_pools(layer) == 7
        values, expected = caches["triton"]._pooled[layer, :, :7].float(), caches["torch"]._pooled[layer, :, :7].float()
        if dtype == FP8_DTYPE:
            assert torch.equal(caches["triton"]._scales[layer, :, :7], caches["torch"]._scales[layer, :, :7])
            step = 2.0 ** (torch.frexp(expected.abs().clamp_min(2.0**-6))[1] - 4)  # e4m3: 3 mantissa bits
        else:
            step = 2.0 ** (torch.frexp(expected.abs())[1] - 8)  # bf16: 7 mantissa bits
        assert ((values - expected).abs() <= step).all()
        assert (values != expected).float().mean() < 0.05
        for part, other in zip(caches["triton"].tail(layer), caches["torch"].tail(layer)):
            assert torch.equal(part, other)


def test_lightning_scores_on_triton_stay_within_the_torch_paths_rounding(monkeypatch):
    """The torch path rounds each head's logit to bf16 (its matmul runs in the pooled keys' dtype); the kernel keeps
    it in fp32. Both see the queries rounded to bf16, so they differ by that rounding (2**-8 of the logit) plus
    fp32 summation order, and nothing else."""
    fingerprint = ModelFingerprint("tiny", 0, CONFIG.n_layers, CONFIG.dim, CONFIG.n_heads, CONFIG.n_kv_heads,
                                   CONFIG.head_dim)
    torch.manual_seed(14)
    indexer = LightningIndexer(LightningIndexerConfig(fingerprint, key_dim=32, heads=4)).to(DEVICE)
    generator = torch.Generator().manual_seed(15)
    q = torch.randn(1, 19, 4, 32, generator=generator).to(DEVICE)
    weights = torch.randn(1, 19, 4, generator=generator).to(DEVICE)
    pooled = fp8_dequantize(*fp8_quantize(torch.randn(1, 70, 32, generator=generator).to(DEVICE)))  # as the cache
    scores = {}
    for backend in BACKENDS:
        use_kernels(monkeypatch, backend)
        with torch.no_grad():
            scores[backend] = indexer.score(0, q, weights, pooled)
    assert scores["triton"].shape == (1, 19, 70) and scores["triton"].isfinite().all()

    terms = q.to(pooled.dtype).double()[..., None, :] * pooled.double()[:, None, None]  # (B, T, H, P, d)
    logits, magnitudes = terms.sum(-1), terms.abs().sum(-1)
    # bf16 rounding of the logit; fp32 sums (32 products in two orders, 4 heads) of at most 2**-18 of |terms|.
    head_bound = 2.0**-8 * logits.abs() + 2.0**-17 * magnitudes
    bound = torch.einsum("bth,bthp->btp", weights.double().abs() * 32**-0.5, head_bound)
    assert ((scores["triton"].double() - scores["torch"].double()).abs() <= bound).all()
    assert not torch.equal(scores["triton"], scores["torch"])  # the kernel ran: its logits are not rounded

    with torch.enable_grad():  # distillation needs gradients, which the kernel has not: the torch path
        assert torch.equal(indexer.score(0, q, weights, pooled).detach(), scores["torch"])


def test_a_bad_kernel_setting_is_a_one_line_error_at_load(monkeypatch):
    monkeypatch.setenv("INDEXPOOL_KERNELS", "fast")
    with pytest.raises(ValueError, match="INDEXPOOL_KERNELS='fast' is not one of auto, torch, triton") as error:
        load_engine(None)  # the kernel policy is resolved before anything is read
    assert "\n" not in str(error.value)


def test_the_kernel_policy_is_read_at_load_not_per_call(monkeypatch):
    """The hot paths read the policy resolved at load: a later change of the environment changes nothing."""
    use_kernels(monkeypatch, "torch")
    monkeypatch.setenv("INDEXPOOL_KERNELS", "triton")
    assert kernel_backend("cpu") == "torch" and kernels.torch_forced()


def test_the_cpu_path_never_imports_triton():
    """auto on the CPU is the torch path, chosen without importing Triton (its import time, and its rule that
    TRITON_INTERPRET be set before the import, stay out of a CPU run)."""
    code = ("import sys, torch\n"
            "from model.generate import Session\n"
            "from model.indexpool_cache import IndexPoolConfig\n"
            "from model.llama import LlamaConfig, Transformer\n"
            "from model.lightning_indexer import LightningIndexer\n"
            "config = LlamaConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, "
            "ffn_dim=64, context_length=64)\n"
            "session = Session(Transformer(config), 64, attention=IndexPoolConfig(kpool=4, topk=8, window=8, "
            "sinks=4, segment=16, query_tokens=6))\n"
            "session.prefill(list(range(40)))\n"
            "assert session.cache.backend == 'torch', session.cache.backend\n"
            "assert 'triton' not in sys.modules, 'triton was imported'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("INDEXPOOL_KERNELS", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
