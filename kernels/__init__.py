"""Triton kernels for the IndexPool hot path, each next to a plain torch reference."""
