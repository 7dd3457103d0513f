"""Per-item prefix products C for T = 3 with prefix reuse (`packed_prefix_products`, the `tt_prefix_packed` launch).

The items sharing a middle-core slice G2[i2] are packed into one dot; the rows kernel then loads C instead of
computing it, and a forward for differentiation keeps C in its plan (`FlowPlan.prefix_c`) for the backward's
group kernel. `apply_gradients` without a forward, T = 2 or 4, and `prefix_reuse=False` recompute C in the
kernels. C is ~8x a row's size per work item and its buffer is sized by a static bound on the items (groups +
rows / chunk), so the buffers of one forward are capped by `TTForwardConfig.prefix_c_max_bytes`; past it a
table group's kernels compute C themselves, item by item. (Measurements: benchmarks/NOTES.md, "Design notes
moved from the kernel docstrings".)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2
from tt_jax import prefix
from tt_jax.kernels.config import PRECISIONS, TTForwardConfig
from tt_jax.kernels.tiles import INT32_MAX, dot_pad, for_each_i2_run, i2_window, masked_store, matmul


def prefix_c_size(layout: prefix.StackedTables, cap: int, config: TTForwardConfig) -> int | None:
    """Elements of `FlowPlan.prefix_c` (one `[q1 q2, r2]` tile per work item), or None where it is not kept
    (T != 3, or no prefix reuse: one item per row)."""
    bound = prefix.item_bound(layout, cap, config.chunk, config.prefix_reuse)
    if layout.num_cores != 3 or bound is None:
        return None
    q, r = layout.q_shapes, layout.full_ranks
    return bound * q[0] * q[1] * r[2]


def _packed_prefix_kernel(meta_ref, *refs, q, r, pack, q1p, k_p, n_p, wide, ordered, precision, interpret):
    """`pack` work items per program, taken in `order` (items sorted by their middle-core slice i2; `ordered`:
    in index order, which is sorted by i2 when the plan sorted by (i2, i1, i3), so no order operand): per run of
    equal i2 in the window (usually one), one dot A @ B with A `[(slot, j1), a]` = G1[i1(slot), j1, a] and B
    `[a, (j2, b)]` = G2[i2, a, j2, b]. Row (slot, j1) of the result is C[(j1, j2), b] of the slot's item for all
    (j2, b): contiguous at item * q1 q2 r2 + j1 q2 r2 in `prefix_c`'s row-major layout, so no reshape."""
    order_ref = None if ordered else refs[0]
    nitems_ref, core0_ref, core1_ref, c_ref = refs[1 - ordered:]
    num_items = plgpu.load(nitems_ref.at[pl.program_id(0) * 0])
    addr = jnp.int64 if wide else jnp.int32
    _, j1, item, has = i2_window(order_ref, num_items, pack, q1p)
    live = has & (j1 < q[0])
    i1 = plgpu.load(meta_ref.at[item * 4 + 1], mask=live, other=0)
    i2 = plgpu.load(meta_ref.at[item * 4 + 2], mask=live, other=0)
    aa = jnp.arange(k_p, dtype=jnp.int32)
    cc = jnp.arange(n_p, dtype=jnp.int32)
    a_ok, c_ok = aa < r[1], cc < q[1] * r[2]
    x = plgpu.load(core0_ref.at[(i1.astype(addr) * (q[0] * r[1]) + j1 * r[1])[:, None] + aa[None, :]],
                   mask=live[:, None] & a_ok[None, :], other=0.0)  # [rows_m, k_p]
    out = (item.astype(addr) * (q[0] * q[1] * r[2]) + j1 * (q[1] * r[2]))[:, None] + cc[None, :]

    def run(cur, mine):
        y = plgpu.load(core1_ref.at[cur.astype(addr) * (r[1] * q[1] * r[2]) + (aa * (q[1] * r[2]))[:, None]
                                    + cc[None, :]], mask=a_ok[:, None] & c_ok[None, :], other=0.0)  # [k_p, n_p]
        c = matmul(x, y, precision)  # [rows_m, n_p]
        masked_store(c_ref, out, c, mine[:, None] & c_ok[None, :], interpret)

    for_each_i2_run(i2, live, run)


def packed_prefix_products(cores: list[jax.Array], plan: prefix.FlowPlan, layout: prefix.StackedTables, *,
                           config: TTForwardConfig, interpret: bool) -> jax.Array:
    """`FlowPlan.prefix_c` for T = 3 with prefix reuse: each work item's C `[q1 q2, r2]` (row-major), from dots
    that pack the items sharing G2[i2] (8 items per 16-row dot when q1 = 2, where the rows kernel's own dot uses 2
    of its 16 rows per item and a block-diagonal operand 4x too long). The plan's items come sorted by i2
    (`StackedTables.prefix_digits` (1, 0)); where they do not (the (i1, i2, i3) order, kept for key ranges near
    2**31), one XLA sort orders them."""
    cap = plan.row_suffix.shape[0]
    size = prefix_c_size(layout, cap, config)
    if size is None:
        raise ValueError("packed_prefix_products needs T = 3 cores and prefix reuse")
    q, r = layout.q_shapes, layout.full_ranks
    bound = size // (q[0] * q[1] * r[2])
    q1p = next_pow2(q[0])
    pack = max(1, 16 // q1p)
    ordered = layout.prefix_digits[0] == 1
    order = []
    if not ordered:
        live = jnp.arange(bound, dtype=jnp.int32) < plan.num_items[0]
        key = jnp.where(live, plan.item_meta.reshape(cap + 1, 4)[:bound, 2], INT32_MAX)
        order = [jax.lax.sort((key, jnp.arange(bound, dtype=jnp.int32)), num_keys=1, is_stable=True)[1]]
    wide = config.force_int64_addressing or max([size] + [c.shape[0] for c in cores[:2]]) >= INT32_MAX
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    kernel = functools.partial(_packed_prefix_kernel, q=q, r=r, pack=pack, q1p=q1p, k_p=dot_pad(r[1]),
                               n_p=dot_pad(q[1] * r[2]), wide=wide, ordered=ordered, precision=precision,
                               interpret=interpret)
    call = pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((size,), jnp.float32), grid=(-(-bound // pack),),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1), interpret=interpret,
        name="tt_prefix_packed")
    with jax.enable_x64(wide):
        return call(plan.item_meta, *order, plan.num_items, cores[0], cores[1])
