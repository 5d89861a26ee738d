import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The flag must be set before anything imports
# triton (transformers and our engine do), and triton cannot be re-imported later in the same process.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The package (`indexpool`) is installed in editable mode; the checkout's root on the path gives the tests the
# benchmarks (`benchmarks.doc_qa`) and the test helpers under `tests.` from any working directory.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture
def one_thread():
    """torch on one thread for the test (the fp32 prefill kernel runs only there), then as it was."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_gguf_metadata() -> dict:
    from indexpool.model.default_model import default_model_path
    from indexpool.model.gguf_file import read_gguf

    return read_gguf(default_model_path()).metadata


@pytest.fixture(scope="session")
def default_tokenizer(default_gguf_metadata):
    """Our tokenizer for the default model (SmolLM2-135M-Instruct)."""
    from indexpool.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(default_gguf_metadata)


@pytest.fixture(scope="session")
def reference_tokenizer():
    """transformers' tokenizer for the default GGUF, the reference for parity tests.

    transformers' GGUF loader builds a plain ByteLevel pre-tokenizer and ignores the file's `smollm` one, so the one
    the model was trained with (digits split one by one, then ByteLevel) is put back here.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from indexpool.model.default_model import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tokenizer
