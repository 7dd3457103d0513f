"""`tt_rows`: the FlowTT rows kernel (`tt_prefix_rows`), the forward's first launch per table group.

Per work item of the plan it computes the prefix product once, in registers, then every distinct row of the
item as C @ G_T[i_T], and stores the rows to a `[cap, D]` buffer (tiles and schedules: `tt_jax.kernels.forward`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tt_jax import prefix
from tt_jax.kernels.config import PRECISIONS, TTForwardConfig
from tt_jax.kernels.prefix_c import prefix_c_size
from tt_jax.kernels.tiles import (INT32_MAX, Tiles, load_last, load_suffixes, masked_store, matmul,
                                  prefix_loads)


def _prefix_product(ops, tl: Tiles, precision):
    """The prefix product as a list of `[rows_m, r_pad[T-1]]` tiles (one per T=4 digit j3)."""
    if tl.t == 2:
        return ops
    c2 = matmul(ops[0], ops[1], precision)  # [rows_m, r_pad[2]]
    if tl.t == 3:
        return [c2]
    return [matmul(c2, g3, precision) for g3 in ops[2:]]


def _store_rows(out_ref, tiles, g, lane, jt, col_ok, first, tl: Tiles, precision, interpret):
    """R = C @ G per prefix tile, stored to the distinct rows `first + lane` (column J q_T + j of each)."""
    jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
    mask = (jj < tl.rows_valid)[:, None] & col_ok[None, :]
    row_base = ((first + lane).astype(tl.addr) * tl.dim + jt)[None, :]
    for jl, tile in enumerate(tiles):
        out = matmul(tile, g, precision)  # [rows_m, n_cols]
        d = (jj * tl.list_size + jl) * tl.q[-1]
        masked_store(out_ref, row_base + d[:, None], out, mask, interpret)


def _rows_kernel(meta_ref, nitems_ref, suffix_ref, *refs, tl: Tiles, schedule, programs, max_items, precision,
                 load_c, interpret):
    # inputs: meta_ref [(cap+1) * (T+1)], nitems_ref [1], suffix_ref [cap], T flat cores, (load_c) C per item,
    #         (queue) counter [1] aliased; outputs: rows [cap * D], (queue) counter [1]
    core_refs = refs[: tl.t]
    c_in = refs[tl.t] if load_c else None
    outs = refs[tl.t + load_c + (schedule == "queue"):]
    out_ref = outs[0]
    counter_ref = refs[-1] if schedule == "queue" else None
    cols = tl.t + 1
    pid = pl.program_id(0)
    num_items = plgpu.load(nitems_ref.at[pid * 0])

    def load_meta(t):
        """(first row, row count, last-core base, prefix digits...) of item t (any valid item past the end)."""
        base = jnp.minimum(t, max_items - 1) * cols
        first = plgpu.load(meta_ref.at[base])
        count = plgpu.load(meta_ref.at[base + cols]) - first
        last_base = plgpu.load(meta_ref.at[base + tl.t])
        return (t, first, count, last_base) + tuple(plgpu.load(meta_ref.at[base + 1 + k]) for k in range(tl.t - 1))

    def do_item(meta, prefetch=None):
        """One item. Program order is issue order on a GPU: this item's loads first, then `prefetch()` (the
        next item's metadata, whose latency then overlaps them), then the dependent loads and the dots."""
        item, first, count, last_base, *digits = meta
        suffix, lane, jt, col_ok = load_suffixes(suffix_ref, first, count, 0, tl)  # the first S rows (peeled)
        jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
        bb = jnp.arange(tl.r_pad[2], dtype=jnp.int32) if tl.t == 3 else None
        if load_c:  # T = 3: the item's C `[q1 q2, r2]`, computed by `packed_prefix_products`
            c_addr = item.astype(tl.addr) * (tl.rows_valid * tl.r[2]) + (jj * tl.r[2])[:, None] + bb[None, :]
            ops = [plgpu.load(c_in.at[c_addr], mask=(jj < tl.rows_valid)[:, None] & (bb < tl.r[2])[None, :],
                              other=0.0)]
        else:
            ops = prefix_loads(core_refs, digits, tl)
        nxt = prefetch() if prefetch is not None else None
        g = load_last(core_refs[-1], last_base, suffix, jt, col_ok, tl)
        tiles = ops if load_c else _prefix_product(ops, tl, precision)
        _store_rows(out_ref, tiles, g, lane, jt, col_ok, first, tl, precision, interpret)

        def sub(c, carry):
            suffix, lane, jt, col_ok = load_suffixes(suffix_ref, first, count, c, tl)
            g = load_last(core_refs[-1], last_base, suffix, jt, col_ok, tl)
            _store_rows(out_ref, tiles, g, lane, jt, col_ok, first, tl, precision, interpret)
            return carry

        jax.lax.fori_loop(1, (count + tl.sub_rows - 1) // tl.sub_rows, sub, jnp.int32(0))
        return nxt

    if schedule == "grid":
        @pl.when(pid < num_items)
        def _():
            do_item(load_meta(pid))
    elif schedule == "static":
        n_mine = jnp.maximum(num_items - pid + programs - 1, 0) // programs

        def step(i, meta):
            return do_item(meta, lambda: load_meta(pid + (i + 1) * programs))

        jax.lax.fori_loop(0, n_mine, step, load_meta(pid))
    elif not interpret:
        # Item pid first, then the next unclaimed one: programs + counter (starts at 0). The claim is issued
        # first and the claimed item's metadata is loaded during this item, so both latencies are hidden.
        def body(meta):
            nxt = programs + plgpu.atomic_add(counter_ref, jnp.int32(0), jnp.int32(1))
            return do_item(meta, lambda: load_meta(nxt))

        jax.lax.while_loop(lambda meta: meta[0] < num_items, body, load_meta(pid))
    else:
        # Same claims, as a fori_loop over the static bound (one item per step at most).
        def step(i, t):
            nxt = programs + plgpu.atomic_add(counter_ref, jnp.int32(0), jnp.int32(1))

            @pl.when(t < num_items)
            def _():
                do_item(load_meta(t))

            return jnp.where(t < num_items, nxt, t)

        jax.lax.fori_loop(0, max_items, step, pid)


def tt_rows(
    cores: list[jax.Array],  # per core, the group's stacked cores (flat fp32)
    plan: prefix.FlowPlan,
    layout: prefix.StackedTables,
    *,
    config: TTForwardConfig,
    interpret: bool,
    c_in: jax.Array | None = None,
):
    """`[cap * D]` distinct rows (row u at `u * D`; rows >= plan.num_rows are not written). With `c_in` (T = 3
    with prefix reuse: each work item's prefix product from `packed_prefix_products`, `FlowPlan.prefix_c`'s
    layout), C is loaded, not computed."""
    cap = plan.row_suffix.shape[0]
    tl = Tiles.make(layout, config.tile_rows)
    c_size = prefix_c_size(layout, cap, config) if c_in is not None else None
    if c_in is not None and c_size is None:
        raise ValueError("tt_rows(c_in=...) needs T = 3 cores and prefix reuse")
    wide = (config.force_int64_addressing
            or max([cap * tl.dim, c_size or 0] + [c.shape[0] for c in cores]) >= INT32_MAX)
    tl = dataclasses.replace(tl, wide=wide)
    programs = config.programs(cap)
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    kernel = functools.partial(
        _rows_kernel, tl=tl, schedule=config.schedule, programs=programs, max_items=cap, precision=precision,
        load_c=c_in is not None, interpret=interpret,
    )
    args = [plan.item_meta, plan.num_items, plan.row_suffix, *cores] + ([c_in] if c_in is not None else [])
    out_shape = [jax.ShapeDtypeStruct((cap * tl.dim,), jnp.float32)]
    aliases = {}
    if config.schedule == "queue":
        aliases = {len(args): len(out_shape)}
        args.append(jnp.zeros((1,), jnp.int32))
        out_shape.append(jax.ShapeDtypeStruct((1,), jnp.int32))
    call = pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(programs,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="tt_prefix_rows",
    )
    with jax.enable_x64(wide):  # int64 exists inside the kernel only; operands keep their int32 dtypes
        res = call(*args)
    return res[0]
