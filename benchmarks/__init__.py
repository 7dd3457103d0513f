"""Benchmarks of tbe_jax and tt_jax (meant for the GPU machine): `python -m benchmarks <suite> --help`."""
