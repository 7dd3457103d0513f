"""The TT backward's per-group kernels (`tt_bwd_groups`, and T = 3's `tt_bwd_dp1_packed`).

One program per prefix group (or per work item where the forward kept the items' prefix products,
`FlowPlan.prefix_c`): the group's prefix product, its distinct rows' contributions (dR tiles against their
last-core slices), then the chain backwards, storing the members of each core's per-slice sum
(`tt_jax.kernels.backward`, step 2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax.pallas_compat import pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2
from tt_jax import prefix
from tt_jax.kernels.config import PRECISIONS, TTBackwardConfig
from tt_jax.kernels.tiles import (Tiles, dot_contract, dot_pad, for_each_i2_run, i2_window, load_last,
                                  load_suffixes, masked_store, prefix_loads)


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
            prods.append([dot_contract(p, w, 1, 0, precision) for p in prods[-1] for w in w_t])
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
                new.append(dcs[kk] + dot_contract(x, h, 1, 1, precision))
                part = dot_contract(c_tiles[kk], x, 0, 0, precision)  # [r, S q_T]
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
                    x = dot_contract(dp[kk * q[t] + j], ws[t][j], 1, 1, precision)  # dP W^T: [q1, r_t]
                    acc = x if acc is None else acc + x
                new.append(acc)
            dp = new
        aa = jnp.arange(rp[1], dtype=jnp.int32)
        masked_store(ref["dfirst"], (g * q[0] + jj)[:, None] * r[1] + aa[None, :], dp[0],
                     j_ok[:, None] & (aa < r[1])[None, :], interpret)


def _group_kernel3(*refs, names, tl: Tiles, precision, interpret):
    """T = 3, the forward's tile layout (`tiles.prefix_loads`): one program per prefix group.

    C = X @ Y with X `[(j1, j2), (j, a)]` = G1[i1, 0, j1, a] if j == j2 (else 0) and Y `[(j, a), b]` =
    G2[i2, a, j, b], so C is `[q1 q2, r2]` in one tile (rows (j1, j2)). Per step of S rows, with H `[r2,
    (s, j3)]` their last-core slices and Xd `[(j1, j2), (s, j3)]` their dR:
      dC += Xd H^T (contract (s, j3)),   dlast = C^T Xd  `[r2, (s, j3)]` (each row's last-core contribution).
    dC is stored as the middle core's member `dp1` (row-major over ((j1, j2), b), i.e. `[j1, (j2, b)]`), from
    which `packed_dp1` computes dP1, the first core's contribution, for the members sharing G2[i2] together (8
    per 16-row dot when q1 = 2, where a dot here would be 8x padded; times in benchmarks/NOTES.md). One dot per group (none when C comes from the forward, `prefix_c`) plus two per
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
            c = dot_contract(x_op, y_op, 1, 0, precision)  # [rows_m, r_pad2]
        ss = jnp.arange(tl.sub_rows, dtype=jnp.int32)

        def step(k, dc):
            suffix, lane, jt, col_ok = load_suffixes(suffix_ref, first, count, k, tl)
            h = load_last(cores[2], last_base, suffix, jt, col_ok, tl)  # [r_pad2, n_cols]
            row = first + lane
            xd = plgpu.load(drows_ref.at[(row * tl.dim + jt)[None, :] + (jj * q[2])[:, None]],
                            mask=j_ok[:, None] & col_ok[None, :], other=0.0)  # [rows_m, n_cols]
            dlast = dot_contract(c, xd, 0, 0, precision)  # [r_pad2, n_cols]
            masked_store(ref["dlast"], (row * (r[2] * q[2]) + jt)[None, :] + (bb * q[2])[:, None], dlast,
                         b_ok[:, None] & col_ok[None, :], interpret)
            rows1 = first + k * tl.sub_rows + ss
            ok1 = k * tl.sub_rows + ss < count
            suffix1 = plgpu.load(suffix_ref.at[rows1], mask=ok1, other=0)
            masked_store(ref["row_slice"], rows1, last_base + suffix1, ok1, interpret)
            return dc + dot_contract(xd, h, 1, 1, precision)

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
        masked_store(out_ref, out, dot_contract(dc, g2, 1, 1, precision), mine[:, None] & a_ok[None, :], interpret)

    for_each_i2_run(i2, live, run)


def packed_dp1(layout: prefix.StackedTables, cores, group_meta, num_groups, order, dp1, n_groups: int, *,
               config: TTBackwardConfig, interpret: bool):
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
        grid=(-(-n_groups // pack),), compiler_params=config.compiler_params(), interpret=interpret,
        name="tt_bwd_dp1_packed",
    )(group_meta, *([] if order is None else [order]), num_groups.reshape(1), dp1, cores[1])


def group_pass(layout: prefix.StackedTables, cores, plan: prefix.FlowPlan, d_rows, n_groups: int, group_meta,
               num_groups, prefix_c, *, config: TTBackwardConfig, interpret: bool):
    """The per-group kernel over `group_meta`'s first `num_groups` rows (groups, or work items with `prefix_c`).
    The T = 3 "tiles3" kernel leaves out `dfirst` (see `packed_dp1`)."""
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
    tiles3 = nc == 3 and config.group_kernel == "tiles3"
    if not tiles3:
        outs["dfirst"] = (n_groups * q[0] * r[1], jnp.float32)
    for t in range(1, nc - 1):
        j_rows = int(np.prod(q[:t]))
        outs[f"p{t}"] = (n_groups * j_rows * r[t], jnp.float32)
        outs[f"dp{t}"] = (n_groups * j_rows * q[t] * r[t + 1], jnp.float32)
    names += list(outs)
    if tiles3:
        kernel = functools.partial(_group_kernel3, names=tuple(names), tl=Tiles.make(layout, config.rows),
                                   precision=precision, interpret=interpret)
    else:
        kernel = functools.partial(
            _group_kernel, names=tuple(names), t_cores=nc, q=q, r=r, dim=layout.dim,
            rows_per_step=max(config.rows, 16 // next_pow2(q[-1])), precision=precision, interpret=interpret)
    res = pallas_call(
        kernel, out_shape=tuple(jax.ShapeDtypeStruct((n,), dt) for n, dt in outs.values()), grid=(n_groups,),
        compiler_params=config.compiler_params(), interpret=interpret, name="tt_bwd_groups",
    )(*args)
    return dict(zip(outs, res))
