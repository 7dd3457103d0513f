"""What the framework layers (tbe_jax and tt_jax; Linen, NNX, Haiku) share."""

from __future__ import annotations

import jax.numpy as jnp


def check_ids(indices, offsets) -> None:
    """Integer ids only (the layers' contract): a ValueError naming the dtype otherwise."""
    for name, x in (("indices", indices), ("offsets", offsets)):
        dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"{name} must hold integer ids (int32, or int64 with jax x64), got dtype {dtype}")


def check_optimizer(optimizer, fused_type: type, makers: str) -> None:
    """A layer's `optimizer`: None or a `fused_type` (e.g. from `makers`); a TypeError naming the type otherwise."""
    if optimizer is not None and not isinstance(optimizer, fused_type):
        raise TypeError(f"optimizer must come from {makers}, got {type(optimizer).__name__}")
