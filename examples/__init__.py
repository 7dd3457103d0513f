"""Examples built on tbe_jax and tt_jax (not part of the installed packages: run them from the repository root)."""
