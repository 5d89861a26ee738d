"""Tests switch the engine's kernels as a user does, with INDEXPOOL_KERNELS (for any subprocess), and put the
policy it gives in force for the test (`kernels.resolve_policy` runs at a model load; the ops read the policy)."""

from indexpool import kernels


def use_kernels(monkeypatch, setting: str) -> None:
    monkeypatch.setenv("INDEXPOOL_KERNELS", setting)
    monkeypatch.setattr(kernels, "_policy", kernels.KernelPolicy.from_environment())
