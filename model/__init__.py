"""The inference engine: model families, loaders, tokenizer, caches and generation."""

import os
import sys

# PyTorch's OpenMP threads (libgomp) spin for some milliseconds after each parallel operation, on the cores that the
# engine's C kernels hand their shares to next: a prompt's int8 kernel call took 14.5 ms alone and 21.8 ms right
# after a torch operation (2 threads, AVX512-BF16 EPYC), 14.5 either way with the threads passive. libgomp reads
# the policy once, when torch loads it: so it is set here, before the engine imports torch, unless the user chose
# one (an empty value keeps libgomp's default). Other engines get the user's (`user_environment`): llama.cpp's
# decode ran 25% slower with passive threads (its OpenMP threads meet once a token).
USER_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
if USER_OMP_WAIT_POLICY is None and "torch" not in sys.modules:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def user_environment() -> dict[str, str]:
    """The environment with the OpenMP policy as the user gave it: for another engine's process."""
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    if USER_OMP_WAIT_POLICY is not None:
        env["OMP_WAIT_POLICY"] = USER_OMP_WAIT_POLICY
    return env
