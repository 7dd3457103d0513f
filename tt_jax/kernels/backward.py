"""FlowTT backward in Pallas-Triton: deterministic core gradients with prefix reuse (no float atomics).

The math is `tt_jax.backward`'s (steps 1-4 of its docstring); this module replaces its scatters and segment
sums by reductions over sorted member lists, each summed in a fixed order, so a gradient is bitwise the
same run to run. Per table group (`prefix.StackedTables`), from the forward's `FlowPlan`:

1. `d_rows` (per distinct row u, dR_u = sum of s_n dY_{bag(n)} over its lookups n): a segmented reduction
   over the lookups sorted by row (`plan.perm`, `plan.sorted_row`).
2. `tt_bwd_groups`: one program per prefix group (`plan.group_meta`), or, for T = 3 when the forward kept
   each work item's prefix product (`plan.prefix_c`, see `forward.PREFIX_C_MAX_BYTES`), one per work item (a group cut
   into items is then several members of step 3's sums). The general kernel recomputes the group's prefix
   product as a list of `[q_1, r_{T-1}]` tiles, one per value of the middle digits (j_2 .. j_{T-1}), so the
   chain needs no register reshapes (T = 3: `_group_kernel3`, one `[q_1 q_2, r_2]` tile): P_1 = G_1[i_1],
   P_t tiles = P_{t-1} tile @ G_t[i_t][:, j_t, :]. It walks
   the group's distinct rows (`rows_per_step` at a time) with H = G_T[i_T(u)] and the dR tiles X_k:
     dC_k += X_k H^T (the prefix gradient, summed over the group's rows in registers),
     per row: C^T dR_u (its last-core contribution) -> `dlast[u]`, and its last-core slice -> `row_slice[u]`.
   Then the chain backwards: for a middle core t, it stores P_{t-1} and dP_t (the members of that core's
   reduction, below) and dP_{t-1} = sum_j dP_t[., j] G_t[i_t][:, j, :]^T; the first core's contribution
   dP_1 -> `dfirst[g]`.
3. Per core, the contributions are summed per slice (the slice ids of the members are scattered, so the
   members are sorted by slice with a stable XLA sort of small int32 keys: groups, or distinct rows for
   the last core): first and last cores sum dense vectors (`dfirst`, `dlast`); a middle core t sums outer
   products, dG_t[i] = sum over its groups of P_{t-1}^T dP_t (one tensor-core dot per member tile:
   `[r, (member, J)] x [(member, J), (j, r')]`), never materialising the per-group `[r, q, r']` blocks.

Segmented reduction (`_segment_sum`): members sorted by run (a run = the members of one output slot).
Pass 1: program i owns members [iK, iK + K) (perfect balance whatever the skew); it sums each run
inside its tile (dense: one one-hot dot `[K, K] x [K, E]`; outer: one masked dot per run in the tile). A
run wholly inside the tile is stored to its output slot; a run cut by the tile's left or right edge
stores a partial to `edges[i, 0 or 1]`. Pass 2: per tile boundary crossed by a run that starts in the
tile before it, one program sums that run's partials (contiguous tiles, in tile order) and stores it. A
row hit a million times is thus a million/K parallel tiles plus one pass-2 sum over contiguous partials.

The per-sample-weight gradient (d s_n = coef_n <R_u, dY_{bag(n)}>) is fused into pass 1 of `d_rows`,
with the rows R recomputed by the forward's rows kernel (`forward.tt_rows`).

Outputs are dense core-shaped fp32 gradients (zeros for untouched slices): the optimizers then update the
cores densely (`optim.update_dense`: a zero gradient leaves an SGD/Adagrad slice and its state bitwise
unchanged; Adam and weight decay keep the untouched slices by the plans' touched mask,
`tt_jax.backward.touched_slices`), which is O(core size) per step. Interpret mode (CPU): every dot at HIGHEST precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax._pallas import aligned, pallas_call, pl, plgpu, row_align
from tbe_jax.specs import next_pow2
from tt_jax import prefix
from tt_jax.backward import feature_col0, position_bags
from tt_jax.kernels.forward import (PRECISIONS, Tiles, TTKernelConfig, dot_general, dot_pad, for_each_i2_run,
                                    i2_window, load_last, load_suffixes,
                                    masked_store, prefix_loads, tf32_split, tt_rows)

_BIG = 2**31 - 1


def _dot(a, b, ca, cb, precision, *, manual: bool = True):
    """Dot contracting dim `ca` of a with dim `cb` of b (2-D), fp32 accumulation (`forward.dot_general`; TF32x3
    as three explicit passes unless `manual=False`: fewer registers in the group kernel, see there)."""
    return dot_general(a, b, (((ca,), (cb,)), ((), ())), precision, manual=manual)


def _dot_exact01(a, b, ca, cb, precision, *, exact: str):
    """`_dot` where one operand (`exact`: "a" or "b") holds only 0s and 1s (a selection or fold matrix).

    With TF32x3 (three tensor-core passes: x_hi y_hi + x_hi y_lo + x_lo y_hi), the 0/1 operand's TF32
    rounding is exact and its low part is 0, so one pass is wasted: split the other operand x here (x_hi:
    its TF32 bits, x_lo = x - x_hi, exact in fp32) and take two one-pass TF32 dots, with x_lo and with
    x_hi. Same accuracy (x_lo's own TF32 rounding is ~2^-21 of x), one pass fewer, one split fewer.
    """
    if precision != jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3:
        return _dot(a, b, ca, cb, precision)
    hi, x_lo = tf32_split(b if exact == "a" else a)
    one = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    lo = _dot(a, x_lo, ca, cb, one) if exact == "a" else _dot(x_lo, b, ca, cb, one)
    # An infinite x has x_lo = NaN: drop the low part there, as Triton's TF32x3 does, so inf stays inf.
    lo = jnp.where(jnp.isnan(lo), 0.0, lo)
    return lo + (_dot(a, hi, ca, cb, one) if exact == "a" else _dot(hi, b, ca, cb, one))


def _params(config: TTKernelConfig):
    return plgpu.CompilerParams(num_warps=config.bwd_num_warps, num_stages=1)


# -----------------------------------------------------------------------------
# Segmented reduction over sorted members (two passes, deterministic).
# -----------------------------------------------------------------------------


def _seg_tile_kernel(*refs, names, mode, k, j_rows, j_pad, e_a, e_b, n_members, n_runs, identity_seg, want_psw,
                     scaled, precision, interpret, align=1):
    ref = dict(zip(names, refs))
    run_ref, out_ref, edge_ref = ref["run"], ref["out"], ref["edges"]
    e = e_a * e_b
    i = pl.program_id(0)
    t0 = i * k
    run0 = plgpu.load(run_ref.at[t0])

    @pl.when(run0 < n_runs)
    def _():
        lane = jnp.arange(k, dtype=jnp.int32)
        m = t0 + lane
        run = plgpu.load(run_ref.at[m], mask=m < n_members, other=_BIG)
        live = run < n_runs
        local = jnp.where(live, run - run0, k)  # local run of each member, in [0, K)
        a_last = jnp.max(jnp.where(live, local, 0))
        prev = plgpu.load(run_ref.at[jnp.maximum(t0 - 1, 0)])
        open_left = (i > 0) & (prev == run0)
        nxt_pos = t0 + k
        nxt = plgpu.load(run_ref.at[jnp.minimum(nxt_pos, n_members - 1)])
        open_right = (nxt_pos < n_members) & (nxt == run0 + a_last)

        def dest(a):
            """(to edge slot 0, to edge slot 1) for local run(s) a."""
            left = (a == 0) & open_left
            right = (a == a_last) & open_right & ~left
            return left, right

        def seg_of(a, ok=None):
            if identity_seg:
                return run0 + a
            if ok is None:  # a scalar local run <= a_last: a live run
                return plgpu.load(ref["run_seg"].at[run0 + a])
            return plgpu.load(ref["run_seg"].at[run0 + a], mask=ok, other=0)

        if mode in ("lookups", "dense"):
            ep = dot_pad(e_b)  # e_a == 1: E = e_b
            cols = jnp.arange(ep, dtype=jnp.int32)
            col_ok = cols < e_b
            ok2 = live[:, None] & col_ok[None, :]
            if mode == "lookups":
                src = aligned(plgpu.load(ref["src"].at[m], mask=live, other=0), align)
                gy = plgpu.load(ref["g"].at[src[:, None] + cols[None, :]], mask=ok2, other=0.0)
                v = gy
                if scaled:
                    v = gy * plgpu.load(ref["scale"].at[m], mask=live, other=0.0)[:, None]
                if want_psw:
                    u = jnp.where(live, run, 0)
                    rows = plgpu.load(ref["rows"].at[(u * e_b)[:, None] + cols[None, :]], mask=ok2, other=0.0)
                    coef = plgpu.load(ref["coef"].at[m], mask=live, other=0.0)
                    pos = plgpu.load(ref["perm"].at[m], mask=live, other=0)
                    masked_store(ref["dpsw"], pos, coef * jnp.sum(rows * gy, axis=1), live, interpret)
            else:
                mid = plgpu.load(ref["ids"].at[m], mask=live, other=0)
                v = plgpu.load(ref["buf"].at[(mid * e_b)[:, None] + cols[None, :]], mask=ok2, other=0.0)
            onehot = (local[None, :] == lane[:, None]).astype(jnp.float32)  # [run, member]
            # [K, Ep]: row a = the sum of local run a
            # The one-hot operand is exact in TF32: two passes (`_dot_exact01`). Measured on the H200
            # (x3-20261201-1705-*): segsum_lookups 0.086 -> 0.074 ms, segsum_dense 0.069 -> 0.051 (255 -> 167
            # registers for the first, by benchmarks/kernel_resources.py).
            part = _dot_exact01(onehot, v, 1, 0, precision, exact="a")
            has = lane <= a_last
            left, right = dest(lane)
            inner = has & ~left & ~right
            seg = seg_of(lane, inner)
            col2 = cols[None, :]
            masked_store(out_ref, (seg * e_b)[:, None] + col2, part, inner[:, None] & col_ok[None, :], interpret)
            slot = (2 * i + right.astype(jnp.int32)) * e_b
            masked_store(edge_ref, slot[:, None] + col2, part, (has & (left | right))[:, None] & col_ok[None, :],
                         interpret)
            return

        # mode == "outer": contributions P^T dP, P [J, e_a] and dP [J, e_b] per member.
        c = jnp.arange(k * j_pad, dtype=jnp.int32)
        mc = t0 + c // j_pad
        jr = c % j_pad
        run_c = plgpu.load(run_ref.at[mc], mask=mc < n_members, other=_BIG)
        c_ok = (run_c < n_runs) & (jr < j_rows)
        local_c = jnp.where(c_ok, run_c - run0, k)
        gid = plgpu.load(ref["ids"].at[mc], mask=c_ok, other=0)
        row = gid * j_rows + jr
        xa = jnp.arange(dot_pad(e_a), dtype=jnp.int32)
        xb = jnp.arange(dot_pad(e_b), dtype=jnp.int32)
        a_ok, b_ok = xa < e_a, xb < e_b
        pt = plgpu.load(ref["p"].at[(row * e_a)[None, :] + xa[:, None]], mask=a_ok[:, None] & c_ok[None, :],
                        other=0.0)  # [e_a, (member, J)]
        dp = plgpu.load(ref["dp"].at[(row * e_b)[:, None] + xb[None, :]], mask=c_ok[:, None] & b_ok[None, :],
                        other=0.0)  # [(member, J), e_b]
        ok2 = a_ok[:, None] & b_ok[None, :]
        off = (xa * e_b)[:, None] + xb[None, :]

        def per_run(a, carry):
            # (Three explicit passes made this kernel spill more: kept on the dot algorithm's own passes.)
            acc = _dot(jnp.where((local_c == a)[None, :], pt, 0.0), dp, 1, 0, precision, manual=False)
            left, right = dest(a)
            edge = left | right
            seg = seg_of(a)
            masked_store(out_ref, seg * e + off, acc, ok2 & ~edge, interpret)
            masked_store(edge_ref, (2 * i + right.astype(jnp.int32)) * e + off, acc, ok2 & edge, interpret)
            return carry

        jax.lax.fori_loop(0, a_last + 1, per_run, jnp.int32(0))


def _seg_span_kernel(*refs, names, k, e, e_block, k_tiles, n_members, n_runs, identity_seg, interpret):
    ref = dict(zip(names, refs))
    run_ref, start_ref, edge_ref, out_ref = ref["run"], ref["run_start"], ref["edges"], ref["out"]
    b = pl.program_id(0)
    eb = pl.program_id(1)
    hi = jnp.minimum(b * k, n_members - 1)
    r_hi = plgpu.load(run_ref.at[hi])
    r_lo = plgpu.load(run_ref.at[jnp.maximum(b * k - 1, 0)])
    before = plgpu.load(run_ref.at[jnp.maximum((b - 1) * k - 1, 0)])
    crosses = (b >= 1) & (r_hi < n_runs) & (r_lo == r_hi)
    owner = crosses & ((b == 1) | (before != r_hi))  # the run starts in tile b - 1

    @pl.when(owner)
    def _():
        end = plgpu.load(start_ref.at[r_hi + 1])
        last_tile = (end - 1) // k
        cols = eb * e_block + jnp.arange(e_block, dtype=jnp.int32)
        col_ok = cols < e
        acc = plgpu.load(edge_ref.at[(2 * (b - 1) + 1) * e + cols], mask=col_ok, other=0.0)
        tt = jnp.arange(k_tiles, dtype=jnp.int32)

        def step(s, acc):
            tile = b + s * k_tiles + tt
            ok = (tile <= last_tile)[:, None] & col_ok[None, :]
            x = plgpu.load(edge_ref.at[(2 * tile * e)[:, None] + cols[None, :]], mask=ok, other=0.0)
            return acc + jnp.sum(x, axis=0)

        n = (last_tile - b + k_tiles) // k_tiles
        acc = jax.lax.fori_loop(0, n, step, acc)
        seg = r_hi if identity_seg else plgpu.load(ref["run_seg"].at[r_hi])
        masked_store(out_ref, seg * e + cols, acc, col_ok, interpret)


def _segment_sum(mode, run, run_start, *, data: dict, out_slots: int, e_a: int, e_b: int, tile: int,
                 config: TTKernelConfig, interpret: bool, run_seg=None, zero_out=False, j_rows=1, psw_len=None,
                 align=1):
    """Per run of the sorted members, the sum of their contributions, stored to `out[run_seg[run]]`.

    Args:
      mode: "lookups" (contribution scale * g[src + :E]; `data`: src, g, scale?, and for the fused
        per-sample-weight gradient rows, coef, perm), "dense" (buf[ids * E + :E]; `data`: ids, buf) or
        "outer" (P^T dP with P = p[ids, J, e_a], dP = dp[ids, J, e_b]; `data`: ids, p, dp).
      run: `[M]` int32 per sorted member its run (non-decreasing, consecutive from 0; dead members
        >= the run bound `run_start.shape[0] - 1`).
      run_start: `[R + 1]` int32: the first member of each run (valid runs: their end follows).
      out_slots: rows of the output (`[out_slots * e_a * e_b]` fp32); runs' slots are `run_seg` (None:
        the run itself). With `zero_out` the slots no run writes are zero, else unspecified.

    Returns:
      out (flat), or (out, d_psw `[psw_len]`) with `psw_len`.
    """
    m_total = run.shape[0]
    n_runs = run_start.shape[0] - 1
    n_tiles = -(-m_total // tile)
    e = e_a * e_b
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    names, args = ["run"], [run]
    if run_seg is not None:
        names.append("run_seg")
        args.append(run_seg)
    for key in ("src", "g", "scale", "rows", "coef", "perm", "ids", "buf", "p", "dp"):
        if key in data:
            names.append(key)
            args.append(data[key])
    want_psw = psw_len is not None
    out_shape = [jax.ShapeDtypeStruct((out_slots * e,), jnp.float32),
                 jax.ShapeDtypeStruct((2 * n_tiles * e,), jnp.float32)]
    aliases = {}
    if zero_out:
        aliases[len(args)] = 0
        names.append("out_in")
        args.append(jnp.zeros((out_slots * e,), jnp.float32))
    if want_psw:
        aliases[len(args)] = 2
        names.append("dpsw_in")
        args.append(jnp.zeros((psw_len,), jnp.float32))
        out_shape.append(jax.ShapeDtypeStruct((psw_len,), jnp.float32))
    names += ["out", "edges"] + (["dpsw"] if want_psw else [])
    kernel = functools.partial(
        _seg_tile_kernel, names=tuple(names), mode=mode, k=tile, j_rows=j_rows, j_pad=next_pow2(j_rows), e_a=e_a,
        e_b=e_b, n_members=m_total, n_runs=n_runs, identity_seg=run_seg is None, want_psw=want_psw,
        scaled="scale" in data, precision=precision, interpret=interpret, align=align)
    res = pallas_call(
        kernel, out_shape=tuple(out_shape), grid=(n_tiles,), input_output_aliases=aliases,
        compiler_params=_params(config), interpret=interpret, name=f"tt_bwd_segsum_{mode}",
    )(*args)
    out, edges = res[0], res[1]
    # Pass 2: runs crossing tile boundaries.
    e_block = min(next_pow2(e), 1024)
    names2 = ["run", "run_start"] + (["run_seg"] if run_seg is not None else []) + ["edges", "out_in", "out"]
    args2 = [run, run_start] + ([run_seg] if run_seg is not None else []) + [edges, out]
    kernel2 = functools.partial(
        _seg_span_kernel, names=tuple(names2), k=tile, e=e, e_block=e_block, k_tiles=max(1, 8192 // e_block),
        n_members=m_total, n_runs=n_runs, identity_seg=run_seg is None, interpret=interpret)
    out = pallas_call(
        kernel2, out_shape=jax.ShapeDtypeStruct((out_slots * e,), jnp.float32), grid=(n_tiles, -(-e // e_block)),
        input_output_aliases={len(args2) - 1: 0}, compiler_params=_params(config), interpret=interpret,
        name="tt_bwd_segsum_span",
    )(*args2)
    return (out, res[2]) if want_psw else out


def _runs(keys, live, bound, *, presorted: bool = False):
    """Members sorted by key (stable): (order, run per sorted member, run -> key, run starts `[R + 1]`).

    `bound` is a static bound on the runs; dead members (not `live`) sort last with run = bound.
    `presorted`: the live members are a prefix and their keys are already non-decreasing (no sort).
    Keys stay int32: with int16 keys (two radix digits instead of four) XLA on the H200 does not use CUB's
    radix sort but its own sort kernels, ~40 launches per sort, and the step got no faster
    (benchmarks/results/exact01-20261201-1246-*, NOTES.md session 13).
    """
    m = keys.shape[0]
    pos = jnp.arange(m, dtype=jnp.int32)
    if presorted:
        skey, order = jnp.where(live, keys, _BIG), pos
    else:
        skey, order = jax.lax.sort((jnp.where(live, keys, _BIG), pos), num_keys=1, is_stable=True)
    ok = skey != _BIG
    new = ok & jnp.concatenate([jnp.ones((1,), bool), skey[1:] != skey[:-1]])
    run = jnp.where(ok, jnp.cumsum(new.astype(jnp.int32)) - 1, bound)
    slot = jnp.where(new, run, bound + 1)
    run_seg = jnp.zeros((bound,), jnp.int32).at[slot].set(skey, mode="drop")
    run_start = jnp.full((bound + 1,), jnp.sum(ok.astype(jnp.int32)), jnp.int32).at[slot].set(pos, mode="drop")
    return order, run, run_seg, run_start


# -----------------------------------------------------------------------------
# Per prefix group: prefix products, the rows' contributions, the chain backwards.
# -----------------------------------------------------------------------------


def _group_kernel(*refs, names, t_cores, q, r, dim, rows_per_step, precision, interpret):
    ref = dict(zip(names, refs))
    meta_ref, ngroups_ref, suffix_ref, drows_ref = ref["meta"], ref["ngroups"], ref["suffix"], ref["d_rows"]
    cores = [ref[f"core{t}"] for t in range(t_cores)]
    cols = t_cores + 1
    g = pl.program_id(0)
    qp = dot_pad(q[0])
    rp = [dot_pad(x) for x in r]
    jj = jnp.arange(qp, dtype=jnp.int32)
    j_ok = jj < q[0]

    @pl.when(g < plgpu.load(ngroups_ref.at[g * 0]))
    def _():
        base = g * cols
        first = plgpu.load(meta_ref.at[base])
        count = plgpu.load(meta_ref.at[base + cols]) - first
        digits = [plgpu.load(meta_ref.at[base + 1 + t]) for t in range(t_cores - 1)]
        last_base = plgpu.load(meta_ref.at[base + t_cores])
        # -- prefix products: P_1 one tile [q1, r1]; P_t tiles = P_{t-1} tile @ W_t[j] --
        aa = jnp.arange(rp[1], dtype=jnp.int32)
        p1 = plgpu.load(cores[0].at[digits[0] * (q[0] * r[1]) + (jj * r[1])[:, None] + aa[None, :]],
                        mask=j_ok[:, None] & (aa < r[1])[None, :], other=0.0)
        prods, ws = [[p1]], [None]
        for t in range(1, t_cores - 1):
            ra_ = jnp.arange(rp[t], dtype=jnp.int32)
            rb_ = jnp.arange(rp[t + 1], dtype=jnp.int32)
            w_ok = (ra_ < r[t])[:, None] & (rb_ < r[t + 1])[None, :]
            w_t = [plgpu.load(cores[t].at[digits[t] * (r[t] * q[t] * r[t + 1]) + (ra_ * (q[t] * r[t + 1]))[:, None]
                                          + j * r[t + 1] + rb_[None, :]], mask=w_ok, other=0.0)
                   for j in range(q[t])]
            ws.append(w_t)
            prods.append([_dot(p, w, 1, 0, precision) for p in prods[-1] for w in w_t])
        c_tiles = prods[-1]
        n_c = len(c_tiles)
        # -- the group's rows, `rows_per_step` at a time --
        s_rows, qlp = rows_per_step, next_pow2(q[-1])
        ncol = s_rows * qlp
        col = jnp.arange(ncol, dtype=jnp.int32)
        lane, jt = col // qlp, col % qlp
        rl = r[-2]
        bb = jnp.arange(rp[-2], dtype=jnp.int32)
        b_ok = bb < rl
        ss = jnp.arange(s_rows, dtype=jnp.int32)

        def step(c, dcs):
            row = first + c * s_rows + lane
            lane_ok = c * s_rows + lane < count
            col_ok = lane_ok & (jt < q[-1])
            suffix = plgpu.load(suffix_ref.at[row], mask=lane_ok, other=0)
            h = plgpu.load(cores[-1].at[((last_base + suffix) * (rl * q[-1]) + jt)[None, :] + (bb * q[-1])[:, None]],
                           mask=b_ok[:, None] & col_ok[None, :], other=0.0)  # [r, S q_T]
            dlast = None
            new = []
            for kk in range(n_c):
                x = plgpu.load(drows_ref.at[(row * dim + jt)[None, :] + ((jj * n_c + kk) * q[-1])[:, None]],
                               mask=j_ok[:, None] & col_ok[None, :], other=0.0)  # [q1, S q_T]
                new.append(dcs[kk] + _dot(x, h, 1, 1, precision))
                part = _dot(c_tiles[kk], x, 0, 0, precision)  # [r, S q_T]
                dlast = part if dlast is None else dlast + part
            masked_store(ref["dlast"], (row * (rl * q[-1]) + jt)[None, :] + (bb * q[-1])[:, None], dlast,
                         b_ok[:, None] & col_ok[None, :], interpret)
            rows1 = first + c * s_rows + ss
            ok1 = c * s_rows + ss < count
            suffix1 = plgpu.load(suffix_ref.at[rows1], mask=ok1, other=0)
            masked_store(ref["row_slice"], rows1, last_base + suffix1, ok1, interpret)
            return tuple(new)

        zeros = tuple(jnp.zeros((qp, rp[-2]), jnp.float32) for _ in range(n_c))
        dp = list(jax.lax.fori_loop(0, (count + s_rows - 1) // s_rows, step, zeros))
        # -- the chain backwards --
        for t in range(t_cores - 2, 0, -1):
            prev = prods[t - 1]  # tiles of P_{t-1}: [q1, r_t]
            ea, eb = r[t], q[t] * r[t + 1]
            j_rows = len(prev) * q[0]
            ra_ = jnp.arange(rp[t], dtype=jnp.int32)
            rb_ = jnp.arange(rp[t + 1], dtype=jnp.int32)
            for kk, p in enumerate(prev):
                rowj = (g * j_rows + kk * q[0] + jj)[:, None]
                masked_store(ref[f"p{t}"], rowj * ea + ra_[None, :], p, j_ok[:, None] & (ra_ < ea)[None, :], interpret)
                for j in range(q[t]):
                    masked_store(ref[f"dp{t}"], rowj * eb + j * r[t + 1] + rb_[None, :], dp[kk * q[t] + j],
                                 j_ok[:, None] & (rb_ < r[t + 1])[None, :], interpret)
            new = []
            for kk in range(len(prev)):
                acc = None
                for j in range(q[t]):
                    x = _dot(dp[kk * q[t] + j], ws[t][j], 1, 1, precision)  # dP W^T: [q1, r_t]
                    acc = x if acc is None else acc + x
                new.append(acc)
            dp = new
        aa = jnp.arange(rp[1], dtype=jnp.int32)
        masked_store(ref["dfirst"], (g * q[0] + jj)[:, None] * r[1] + aa[None, :], dp[0],
                     j_ok[:, None] & (aa < r[1])[None, :], interpret)


def _group_kernel3(*refs, names, tl: Tiles, precision, interpret):
    """T = 3, the forward's tile layout (`forward.prefix_loads`): one program per prefix group.

    C = X @ Y with X `[(j1, j2), (j, a)]` = G1[i1, 0, j1, a] if j == j2 (else 0) and Y `[(j, a), b]` =
    G2[i2, a, j, b], so C is `[q1 q2, r2]` in one tile (rows (j1, j2)). Per step of S rows, with H `[r2,
    (s, j3)]` their last-core slices and Xd `[(j1, j2), (s, j3)]` their dR:
      dC += Xd H^T (contract (s, j3)),   dlast = C^T Xd  `[r2, (s, j3)]` (each row's last-core contribution).
    dC is stored as the middle core's member `dp1` (row-major over ((j1, j2), b), i.e. `[j1, (j2, b)]`), from
    which `_packed_dp1` computes dP1, the first core's contribution, for the members sharing G2[i2] together (8
    per 16-row dot when q1 = 2, where a dot here would be 8x padded; measured on the H200, workload a, B 32768,
    `packedc-20261201-1903-{2,4}`: this kernel 0.451 -> 0.161 ms plus the packed pass 0.056, the training step
    1.394 -> 1.159 ms of kernels). One dot per group (none when C comes from the forward, `prefix_c`) plus two per
    step, against 4 + 8 per step + 8 in the general kernel. Stores the buffers of `_group_kernel` but `dfirst`.
    """
    ref = dict(zip(names, refs))
    meta_ref, ngroups_ref, suffix_ref, drows_ref = ref["meta"], ref["ngroups"], ref["suffix"], ref["d_rows"]
    cores = [ref[f"core{t}"] for t in range(3)]
    q, r = tl.q, tl.r
    pid = pl.program_id(0)
    n_groups = plgpu.load(ngroups_ref.at[pid * 0])

    def do_group(g):
        base = g * 4
        first = plgpu.load(meta_ref.at[base])
        count = plgpu.load(meta_ref.at[base + 4]) - first
        digits = [plgpu.load(meta_ref.at[base + 1]), plgpu.load(meta_ref.at[base + 2])]
        last_base = plgpu.load(meta_ref.at[base + 3])
        jj = jnp.arange(tl.rows_m, dtype=jnp.int32)
        j_ok = jj < tl.rows_valid
        bb = jnp.arange(tl.r_pad[2], dtype=jnp.int32)
        b_ok = bb < r[2]
        if "prefix_c" in ref:  # the forward's C of this work item
            c = plgpu.load(ref["prefix_c"].at[g.astype(tl.addr) * (tl.rows_valid * r[2]) + (jj * r[2])[:, None]
                                               + bb[None, :]], mask=j_ok[:, None] & b_ok[None, :], other=0.0)
        else:
            x_op, y_op = prefix_loads(cores, digits, tl)  # [rows_m, k_x], [k_x, r_pad2]
            c = _dot(x_op, y_op, 1, 0, precision)  # [rows_m, r_pad2]
        ss = jnp.arange(tl.sub_rows, dtype=jnp.int32)

        def step(k, dc):
            suffix, lane, jt, col_ok = load_suffixes(suffix_ref, first, count, k, tl)
            h = load_last(cores[2], last_base, suffix, jt, col_ok, tl)  # [r_pad2, n_cols]
            row = first + lane
            xd = plgpu.load(drows_ref.at[(row * tl.dim + jt)[None, :] + (jj * q[2])[:, None]],
                            mask=j_ok[:, None] & col_ok[None, :], other=0.0)  # [rows_m, n_cols]
            dlast = _dot(c, xd, 0, 0, precision)  # [r_pad2, n_cols]
            masked_store(ref["dlast"], (row * (r[2] * q[2]) + jt)[None, :] + (bb * q[2])[:, None], dlast,
                         b_ok[:, None] & col_ok[None, :], interpret)
            rows1 = first + k * tl.sub_rows + ss
            ok1 = k * tl.sub_rows + ss < count
            suffix1 = plgpu.load(suffix_ref.at[rows1], mask=ok1, other=0)
            masked_store(ref["row_slice"], rows1, last_base + suffix1, ok1, interpret)
            return dc + _dot(xd, h, 1, 1, precision)

        dc = jax.lax.fori_loop(0, (count + tl.sub_rows - 1) // tl.sub_rows, step,
                               jnp.zeros((tl.rows_m, tl.r_pad[2]), jnp.float32))
        # The middle core's members: P1 = G1[i1] `[q1, r1]` and dP1 = dC as `[q1, (j2, b)]`.
        q1p = dot_pad(q[0])
        j1 = jnp.arange(q1p, dtype=jnp.int32)
        aa = jnp.arange(tl.r_pad[1], dtype=jnp.int32)
        a_ok = aa < r[1]
        p1_mask = (j1 < q[0])[:, None] & a_ok[None, :]
        p1 = plgpu.load(cores[0].at[digits[0] * (q[0] * r[1]) + (j1 * r[1])[:, None] + aa[None, :]], mask=p1_mask,
                        other=0.0)
        masked_store(ref["p1"], (g * q[0] + j1)[:, None] * r[1] + aa[None, :], p1, p1_mask, interpret)
        masked_store(ref["dp1"], g * (tl.rows_valid * r[2]) + (jj * r[2])[:, None] + bb[None, :], dc,
                     j_ok[:, None] & b_ok[None, :], interpret)

    @pl.when(pid < n_groups)
    def _():
        do_group(pid)


def _packed_dp1_kernel(meta_ref, *refs, q, r, pack, q1p, k_p, n_p, ordered, precision, interpret):
    """dP1 of `pack` members per program, taken in `order` (sorted by i2; `ordered`: in index order, already
    sorted by i2): per run of equal i2 (usually one),
    dP1[(slot, j1), a] = sum_{(j2, b)} dC[(slot, j1), (j2, b)] G2[i2, a, (j2, b)], one dot `[16, q2 r2] x [q2 r2,
    r1]` whose rows are the members' dC as stored by the group kernel (`dp1`, row-major `[j1, (j2, b)]`)."""
    order_ref = None if ordered else refs[0]
    nmembers_ref, dp1_ref, core1_ref, out_ref = refs[1 - ordered:]
    num = plgpu.load(nmembers_ref.at[pl.program_id(0) * 0])
    _, j1, member, has = i2_window(order_ref, num, pack, q1p)
    live = has & (j1 < q[0])
    i2 = plgpu.load(meta_ref.at[member * 4 + 2], mask=live, other=0)
    aa = jnp.arange(k_p, dtype=jnp.int32)
    cc = jnp.arange(n_p, dtype=jnp.int32)
    a_ok, c_ok = aa < r[1], cc < q[1] * r[2]
    dc = plgpu.load(dp1_ref.at[(member * (q[0] * q[1] * r[2]) + j1 * (q[1] * r[2]))[:, None] + cc[None, :]],
                    mask=live[:, None] & c_ok[None, :], other=0.0)  # [rows, n_p]
    out = ((member * q[0] + j1) * r[1])[:, None] + aa[None, :]

    def run(cur, mine):
        g2 = plgpu.load(core1_ref.at[cur * (r[1] * q[1] * r[2]) + (aa * (q[1] * r[2]))[:, None] + cc[None, :]],
                        mask=a_ok[:, None] & c_ok[None, :], other=0.0)  # [k_p, n_p]
        masked_store(out_ref, out, _dot(dc, g2, 1, 1, precision), mine[:, None] & a_ok[None, :], interpret)

    for_each_i2_run(i2, live, run)


def _packed_dp1(layout: prefix.StackedTables, cores, group_meta, num_groups, order, dp1, n_groups: int, *,
                config: TTKernelConfig, interpret: bool):
    """`dfirst` (`[n_groups * q1 * r1]`) from the group kernel's `dp1`, members taken in `order` (by i2; None: in
    index order, which is by i2)."""
    q, r = layout.q_shapes, layout.full_ranks
    q1p = next_pow2(q[0])
    pack = max(1, 16 // q1p)
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    kernel = functools.partial(_packed_dp1_kernel, q=q, r=r, pack=pack, q1p=q1p, k_p=dot_pad(r[1]),
                               n_p=dot_pad(q[1] * r[2]), ordered=order is None, precision=precision,
                               interpret=interpret)
    return pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((n_groups * q[0] * r[1],), jnp.float32),
        grid=(-(-n_groups // pack),), compiler_params=_params(config), interpret=interpret,
        name="tt_bwd_dp1_packed",
    )(group_meta, *([] if order is None else [order]), num_groups.reshape(1), dp1, cores[1])


def _group_pass(layout: prefix.StackedTables, cores, plan: prefix.FlowPlan, d_rows, n_groups: int, group_meta,
                num_groups, prefix_c, *, config: TTKernelConfig, interpret: bool):
    """The per-group kernel over `group_meta`'s first `num_groups` rows (groups, or work items with `prefix_c`).
    The T = 3 "tiles3" kernel leaves out `dfirst` (see `_packed_dp1`)."""
    nc = layout.num_cores
    q, r = layout.q_shapes, layout.full_ranks
    cap = plan.row_suffix.shape[0]
    precision = jax.lax.Precision.HIGHEST if interpret else PRECISIONS[config.precision]
    names = ["meta", "ngroups", "suffix", "d_rows"] + [f"core{t}" for t in range(nc)]
    args = [group_meta, num_groups.reshape(1), plan.row_suffix, d_rows] + list(cores)
    if prefix_c is not None:
        names.append("prefix_c")
        args.append(prefix_c)
    outs = {"dlast": (cap * r[-2] * q[-1], jnp.float32), "row_slice": (cap, jnp.int32)}
    tiles3 = nc == 3 and config.bwd_group_kernel == "tiles3"
    if not tiles3:
        outs["dfirst"] = (n_groups * q[0] * r[1], jnp.float32)
    for t in range(1, nc - 1):
        j_rows = int(np.prod(q[:t]))
        outs[f"p{t}"] = (n_groups * j_rows * r[t], jnp.float32)
        outs[f"dp{t}"] = (n_groups * j_rows * q[t] * r[t + 1], jnp.float32)
    names += list(outs)
    if tiles3:
        kernel = functools.partial(_group_kernel3, names=tuple(names), tl=Tiles.make(layout, config.bwd_rows),
                                   precision=precision, interpret=interpret)
    else:
        kernel = functools.partial(
            _group_kernel, names=tuple(names), t_cores=nc, q=q, r=r, dim=layout.dim,
            rows_per_step=max(config.bwd_rows, 16 // next_pow2(q[-1])), precision=precision, interpret=interpret)
    res = pallas_call(
        kernel, out_shape=tuple(jax.ShapeDtypeStruct((n,), dt) for n, dt in outs.values()), grid=(n_groups,),
        compiler_params=_params(config), interpret=interpret, name="tt_bwd_groups",
    )(*args)
    return dict(zip(outs, res))


# -----------------------------------------------------------------------------
# Per table group and the public entry points.
# -----------------------------------------------------------------------------


def _lookup_sources(plan, offsets, per_sample_weights, *, batch, col0, total, pooling):
    """Per sorted lookup: its output-gradient offset in the flat `[B * total]` g, scale, and coef."""
    bag = position_bags(offsets, plan.perm.shape[0])[plan.perm]
    feat = bag // batch
    src = (bag - feat * batch) * total + jnp.asarray(np.asarray(col0, np.int32))[feat]
    coef = None
    if pooling == "mean":
        lengths = (offsets[1:] - offsets[:-1]).astype(jnp.float32)
        coef = 1.0 / jnp.maximum(lengths, 1.0)[bag]
    scale = coef
    if per_sample_weights is not None:
        w = per_sample_weights.astype(jnp.float32)[plan.perm]
        scale = w if scale is None else scale * w
    return src, scale, coef


def group_grads(layout: prefix.StackedTables, all_cores, plan: prefix.FlowPlan, offsets, per_sample_weights, g_out,
                *, batch: int, col0, pooling: str, want_psw: bool, config: TTKernelConfig, interpret: bool):
    """One table group: (per core its dense stacked gradient `[sum p_t, r, q, r']`, d_psw `[N]` or None)."""
    nc = layout.num_cores
    q, r = layout.q_shapes, layout.full_ranks
    dim = layout.dim
    cap = plan.row_suffix.shape[0]
    n = plan.perm.shape[0]
    total = g_out.shape[1]
    stacked = prefix.stack_cores(layout, all_cores)
    # 1. d_rows (and the per-sample-weight gradient).
    src, scale, coef = _lookup_sources(plan, offsets, per_sample_weights, batch=batch, col0=col0, total=total,
                                       pooling=pooling)
    data = {"src": src, "g": g_out.reshape(-1).astype(jnp.float32)}
    if scale is not None:
        data["scale"] = scale
    psw_len = None
    if want_psw:
        data["rows"] = tt_rows(stacked, plan, layout, config=config, interpret=interpret)
        data["coef"] = coef if coef is not None else jnp.ones((n,), jnp.float32)
        data["perm"] = plan.perm
        psw_len = n
    res = _segment_sum("lookups", plan.sorted_row, plan.row_start, data=data, out_slots=cap, e_a=1, e_b=dim,
                       tile=config.bwd_lookup_tile, config=config, interpret=interpret, psw_len=psw_len,
                       align=row_align((total,) + tuple(col0), 4))
    d_rows, d_psw = res if want_psw else (res, None)
    # 2. per prefix group; or, where the forward kept each work item's prefix product (`FlowPlan.prefix_c`), per
    # work item (a group's items are members of the per-slice sums below like whole groups).
    tiles3 = nc == 3 and config.bwd_group_kernel == "tiles3"  # its dP1 comes from `_packed_dp1`
    use_c = plan.prefix_c is not None and tiles3
    if use_c:
        n_groups = prefix.item_bound(layout, cap, config.chunk, config.prefix_reuse)
        group_meta, num_groups = plan.item_meta, plan.num_items[0]
    else:
        n_groups = max(1, min(cap, layout.prefix_base[-1]))
        group_meta, num_groups = plan.group_meta, plan.num_groups
    meta = group_meta[: n_groups * (nc + 1)].reshape(n_groups, nc + 1)
    live_g = jnp.arange(n_groups, dtype=jnp.int32) < num_groups
    p_stacked = [layout.core_base[t][-1] for t in range(nc)]
    # Groups and items are numbered in sort-key order (table, then the prefix digits in `layout.prefix_digits`
    # order; a table's stacked slices ascend with the table), so the slices of the most significant digit's core are
    # already non-decreasing: no sort for that core (the middle one for T = 3, else the first).
    presorted = layout.prefix_digits[0]
    # The members by middle slice: the middle core's sum below, and `_packed_dp1`'s order.
    by_mid = _runs(meta[:, 2], live_g, min(n_groups, p_stacked[1]), presorted=presorted == 1) if tiles3 else None
    bufs = _group_pass(layout, stacked, plan, d_rows, n_groups, group_meta, num_groups,
                       plan.prefix_c if use_c else None, config=config, interpret=interpret)
    if tiles3:
        bufs["dfirst"] = _packed_dp1(layout, stacked, group_meta, num_groups, None if presorted == 1 else by_mid[0],
                                     bufs["dp1"], n_groups, config=config, interpret=interpret)
    # 3. per core, the sum per slice.
    tile = config.bwd_member_tile
    grads = [None] * nc
    for t in range(nc - 1):
        order, run, run_seg, run_start = (by_mid if t == 1 and by_mid is not None else
                                          _runs(meta[:, 1 + t], live_g, min(n_groups, p_stacked[t]),
                                                presorted=t == presorted))
        if t == 0:
            out = _segment_sum("dense", run, run_start, data={"ids": order, "buf": bufs["dfirst"]},
                               out_slots=p_stacked[0], e_a=1, e_b=q[0] * r[1], tile=tile, config=config,
                               interpret=interpret, run_seg=run_seg, zero_out=True)
        else:
            out = _segment_sum("outer", run, run_start, data={"ids": order, "p": bufs[f"p{t}"], "dp": bufs[f"dp{t}"]},
                               out_slots=p_stacked[t], e_a=r[t], e_b=q[t] * r[t + 1], tile=tile, config=config,
                               interpret=interpret, run_seg=run_seg, zero_out=True, j_rows=int(np.prod(q[:t])))
        grads[t] = out.reshape(p_stacked[t], r[t], q[t], r[t + 1])
    live_u = jnp.arange(cap, dtype=jnp.int32) < plan.num_rows
    order, run, run_seg, run_start = _runs(bufs["row_slice"], live_u, min(cap, p_stacked[-1]))
    out = _segment_sum("dense", run, run_start, data={"ids": order, "buf": bufs["dlast"]}, out_slots=p_stacked[-1],
                       e_a=1, e_b=r[-2] * q[-1], tile=tile, config=config, interpret=interpret, run_seg=run_seg,
                       zero_out=True)
    grads[-1] = out.reshape(p_stacked[-1], r[-2], q[-1], 1)
    return grads, d_psw


def dense_core_grads(all_cores, specs, feature_table_map, plans, offsets, per_sample_weights, g_out, *, batch: int,
                     pooling: str, want_psw: bool, config: TTKernelConfig, interpret: bool):
    """Dense gradients of the pooled lookup (Pallas): (per table per core `d G_t` or None for a table no feature
    reads, d per_sample_weights or None). Same contract as `tt_jax.backward.pooled_vjp`."""
    groups = prefix.stack_tables(specs, feature_table_map)
    if len(groups) != len(plans):
        raise ValueError(f"{len(plans)} plans for {len(groups)} table groups")
    col0 = feature_col0(specs, feature_table_map)
    d_cores = [[None] * len(cs) for cs in all_cores]
    want_psw = want_psw and per_sample_weights is not None
    d_psw = None
    for (layout, _), plan in zip(groups, plans):
        grads, dp = group_grads(layout, all_cores, plan, offsets, per_sample_weights, g_out, batch=batch, col0=col0,
                                pooling=pooling, want_psw=want_psw, config=config, interpret=interpret)
        for t, dense in enumerate(grads):
            base = layout.core_base[t]
            for k, table in enumerate(layout.tables):
                d_cores[table][t] = dense[base[k] : base[k + 1]]
        if dp is not None:
            d_psw = dp if d_psw is None else d_psw + dp
    return d_cores, d_psw
