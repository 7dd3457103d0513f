"""The one place that imports Pallas-Triton and silences its deprecation notice.

Shared by tbe_jax's kernels and tt_jax's (public, so tt_jax reaches it by name): `pl`, `plgpu`,
`pallas_call` (which also works inside `shard_map`), `sm_count`, `row_align` and `aligned`.

jax 0.11+ warns that the Pallas Triton backend "will be removed in a future JAX
version" each time a Triton kernel is lowered. We pin jax to the range where the
backend exists (see pyproject.toml), so the notice carries no information for our
users; it is filtered here, once, for every kernel in the package. (pytest resets
warning filters per test, so pyproject.toml repeats the filter for the suite.)
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

__all__ = ["aligned", "pallas_call", "pl", "plgpu", "row_align", "sm_count"]

_TRITON_DEPRECATION = r"(?s).*Pallas Triton backend is deprecated"


def _install_filter() -> None:
    warnings.filterwarnings(
        "ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning
    )


_install_filter()


def _varying(x) -> frozenset:
    """The mesh axes over which `x` varies inside `shard_map` (empty outside it)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", None) or ())


def _typed(x) -> bool:
    """Whether `x`'s type carries varying-axes information (a value inside `shard_map` with its checks)."""
    aval = jax.typeof(x)
    return getattr(aval, "manual_axis_type", None) is not None or getattr(aval, "vma", None) is not None


def _with_varying(sds, axes: frozenset, like):
    """`sds` (a ShapeDtypeStruct) marked as varying over `axes`, as `like`'s type is."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is not None:
        return jax.ShapeDtypeStruct(sds.shape, sds.dtype, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(sds.shape, sds.dtype, vma=axes)


def pallas_call(kernel, out_shape, **kwargs):
    """`pl.pallas_call` that also works inside `shard_map` with its default checks (`check_vma=True`).

    A `pallas_call`'s output types carry no varying-axes information of their own,
    which `shard_map`'s type checks refuse. Here the operands are brought to one set
    of varying axes (the union of theirs: `lax.pcast(..., to="varying")` where one
    lacks some) and the outputs are declared varying over the same axes. Outside
    `shard_map` this is `pl.pallas_call` unchanged.
    """

    def call(*args):
        leaves = [a for a in jax.tree_util.tree_leaves(args) if hasattr(a, "dtype")]
        axes = frozenset().union(*(_varying(a) for a in leaves)) if leaves else frozenset()
        in_shard_map = any(_typed(a) for a in leaves)
        if not axes and not in_shard_map:
            return pl.pallas_call(kernel, out_shape=out_shape, **kwargs)(*args)

        def lift(a):
            if not hasattr(a, "dtype"):
                return a
            missing = tuple(sorted(axes - _varying(a)))
            return jax.lax.pcast(a, missing, to="varying") if missing else a

        args = jax.tree_util.tree_map(lift, args)
        like = next(a for a in jax.tree_util.tree_leaves(args) if hasattr(a, "dtype"))
        shapes = jax.tree_util.tree_map(
            lambda s: _with_varying(s, axes, like), out_shape,
            is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))
        return pl.pallas_call(kernel, out_shape=shapes, **kwargs)(*args)

    return call


# SMs assumed for a GPU whose device does not report `core_count` (an H200 has 132).
_FALLBACK_GPU_SMS = 132
# "SMs" on a device without them (CPU: interpret mode, where programs run one after another): keeps derived
# program counts small.
_FALLBACK_OTHER_SMS = 2


def sm_count() -> int:
    """Streaming multiprocessors of the first device (`Device.core_count`), for the program counts derived from
    it; a GPU that does not report it counts as 132 (an H200), any other device (CPU) as 2."""
    dev = jax.devices()[0]
    n = getattr(dev, "core_count", None)
    if isinstance(n, int) and n > 0:
        return n
    return _FALLBACK_GPU_SMS if dev.platform == "gpu" else _FALLBACK_OTHER_SMS


def row_align(dims, itemsize: int) -> int:
    """Elements (a power of two, at most 16 bytes' worth) that every row offset of a `[B, sum D]` output (or
    output gradient) of features with dims `dims` is a multiple of: each offset is a sum of multiples of
    those dims (bag * sum D + a feature's first column; VBE and sequence layouts likewise), so the largest
    power of two dividing every dim divides them all."""
    g = 0
    for d in dims:
        g = math.gcd(g, int(d))
    return max(1, min(g & -g, 16 // itemsize))


def aligned(x, align: int):
    """Offsets `x` (int32, multiples of `align`) written as `(x / align) * align`: the same values, from which
    Triton's alignment analysis proves that `ref + x` (+ a column range) is 16-byte aligned when `align`
    fills 16 bytes, so the row is loaded or stored with vector instructions. An offset loaded from memory
    proves nothing, and the row then moves one element per instruction. (`pl.multiple_of` only marks kernel
    arguments in the Triton lowering.)"""
    if align == 1:
        return x
    return jax.lax.div(x, jnp.full(jnp.shape(x), align, jnp.int32)) * align
