"""Pallas-Triton kernels of tbe_jax (each with its config next to it)."""
