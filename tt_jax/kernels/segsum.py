"""Deterministic segmented sums over sorted members: the reductions of the TT backward (no float atomics).

Members sorted by run (a run = the members of one output slot; `sorted_runs` sorts them). Pass 1
(`_seg_tile_kernel`): program i owns members [iK, iK + K) (perfect balance whatever the skew); it sums each run
inside its tile (dense: one one-hot dot `[K, K] x [K, E]`; outer: one masked dot per run in the tile). A run
wholly inside the tile is stored to its output slot; a run cut by the tile's left or right edge stores a
partial to `edges[i, 0 or 1]`. Pass 2 (`_seg_span_kernel`): per tile boundary crossed by a run that starts in
the tile before it, one program sums that run's partials (contiguous tiles, in tile order) and stores it. A row
hit a million times is thus a million/K parallel tiles plus one pass-2 sum over contiguous partials. Each sum
runs in a fixed order, so a gradient is bitwise the same run to run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import aligned, pallas_call, pl, plgpu
from tbe_jax.specs import next_pow2
from tt_jax.kernels.config import PRECISIONS, TTBackwardConfig
from tt_jax.kernels.tiles import dot_contract, dot_exact01, dot_pad, masked_store

_BIG = 2**31 - 1


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
            # The one-hot operand is exact in TF32: two passes (`dot_exact01`; times in benchmarks/NOTES.md).
            part = dot_exact01(onehot, v, 1, 0, precision, exact="a")
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
            acc = dot_contract(jnp.where((local_c == a)[None, :], pt, 0.0), dp, 1, 0, precision, manual=False)
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


def segment_sum(mode, run, run_start, *, data: dict, out_slots: int, e_a: int, e_b: int, tile: int,
                config: TTBackwardConfig, interpret: bool, run_seg=None, zero_out=False, j_rows=1, psw_len=None,
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
        compiler_params=config.compiler_params(), interpret=interpret, name=f"tt_bwd_segsum_{mode}",
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
        input_output_aliases={len(args2) - 1: 0}, compiler_params=config.compiler_params(), interpret=interpret,
        name="tt_bwd_segsum_span",
    )(*args2)
    return (out, res[2]) if want_psw else out


def sorted_runs(keys, live, bound, *, presorted: bool = False):
    """Members sorted by key (stable): (order, run per sorted member, run -> key, run starts `[R + 1]`).

    `bound` is a static bound on the runs; dead members (not `live`) sort last with run = bound.
    `presorted`: the live members are a prefix and their keys are already non-decreasing (no sort).
    Keys stay int32 (int16 keys measured no faster: benchmarks/NOTES.md, session 13).
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
