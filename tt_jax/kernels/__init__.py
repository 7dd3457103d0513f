"""Pallas-Triton kernels of tt_jax (each with its config next to it)."""
