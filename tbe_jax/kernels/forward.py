"""Pooled TBE forward as one Pallas-Triton launch over every feature.

Work decomposition ("bag-parallel"): a program owns `G` consecutive bags of one
feature. Step k gathers the k-th row of each of its bags, a `[G, Dp]` tile
(`Dp = next_pow2(D)`), scales it by the per-sample weights and adds it to a
`[G, Dp]` fp32 accumulator. `U` steps are unrolled so `U * G` row loads are in
flight before the first add. The accumulation is element-wise and sequential in
k, so fp32 weights can get an accumulation more accurate than FBGEMM's fp32 one
at no extra memory traffic: fp64 accumulators, or TwoSum-compensated fp32 pairs.

Specialisation: each storage buffer (one per distinct D) gets its own branch of
the kernel, compiled with its D as a constant (row stride known: 16-byte loads),
its own tile width `Dp` and bags per program, selected by program id. Programs
are ordered buffer by buffer, feature by feature, bag by bag, so neighbours read
the same table.

Quantized rows (the inference TBE, `tbe_jax.quant`): a buffer given a static
`kernels.quant_rows.RowFormat` (`pooled_forward`'s and `sequence_forward`'s
`formats` / `fmt`) holds int32 words; its branch's gather loads each value's
word once per lane and unpacks it to fp32 in registers (`quant_rows.load_packed`:
`per_word` tiles, one per position in the word), and the same accumulation
follows per tile (integer rows: their codes, with the scales applied by one fused
multiply-add per value and the biases summed per row, `quant_rows.codes_of`).
A quantized buffer may serve features of several dims (one
row length in words): its branch is compiled for the largest (tile width, bags
per program) and stores each feature's own dim, read at run time from the
feature table (`programs.DIM`, a column only such launches have). Buffers
without a format load their rows as before: the same program, op for op.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tbe_jax.pallas_compat import aligned, pallas_call, pl, plgpu, row_align
from tbe_jax.kernels import programs, quant_rows
from tbe_jax.kernels.forward_config import ForwardConfig  # (also re-exported: tbe_jax.ForwardConfig)
from tbe_jax.kernels.programs import DIM, NUM_ROWS, OUT_BASE, OUT_STRIDE, ROW_OFFSET, feature_table
from tbe_jax.specs import FeaturePlan, StorageLayout, next_pow2


@dataclasses.dataclass(frozen=True)
class _Branch:
    buffer: int  # position of the buffer among the kernel's weight refs
    seg: programs.Segment  # its programs (prog_start, prog_end, bags per program, ...)
    dim: int  # the dim of its features (the largest, with `dyn_dim`)
    block_dim: int  # tile columns: next_pow2(dim), or of the value words for quantized rows
    stride: int  # the buffer's stored row length (>= dim; padding columns are loaded, never stored)
    groups: int = 1  # sub-groups of `bags` bags per program (`bag_groups`, or `short_bag_groups` for hinted features)
    fmt: quant_rows.RowFormat | None = None  # quantized rows: their format (None: rows of the buffer's dtype)
    dyn_dim: bool = False  # features of several dims (quantized rows): each one's dim read from the feature table

    @property
    def bags(self) -> int:
        """Bags per sub-group: the tile's `G`."""
        return self.seg.bags // self.groups


def _schedule(layout: StorageLayout, plan: FeaturePlan, cfg: ForwardConfig, features, short=frozenset(),
              formats=None):
    """Per used buffer a branch per segment of programs (the `short` features, those with bags of at most two
    ids, in a segment of their own), the program map and the feature table. `formats`: per buffer of `layout`
    its quantized `RowFormat` (None: float rows).

    A quantized buffer may serve features of several dims (`plan.dim`; its rows are long enough for the
    largest): its branches' tiles and bags per program are the largest dim's, and the feature table then
    carries each feature's dim (`programs.DIM`) for the store mask."""
    used = sorted({plan.group[f] for f in features})
    fmt = (lambda g: None) if formats is None else (lambda g: formats[g])
    groups, tile, dim = [], {}, {}
    for g in used:
        feats = [f for f in features if plan.group[f] == g]
        dims = {plan.dim[f] for f in feats}
        if len(dims) > 1 and fmt(g) is None:
            raise ValueError(f"float buffer {layout.key(g)} holds features of several dims {sorted(dims)}")
        dim[g] = max(dims)
        row_bytes = None if fmt(g) is None else fmt(g).row_bytes
        bags = cfg.bags_per_program(dim[g], max(plan.batch[f] for f in feats), row_bytes)
        tile[g] = bags
        for part, sub in (([f for f in feats if f not in short], cfg.bag_groups),
                          ([f for f in feats if f in short], cfg.short_bag_groups)):
            if part:  # no more sub-groups than the part's largest feature's bags fill
                sub = max(1, min(sub, next_pow2(-(-max(plan.batch[f] for f in part) // bags))))
                groups.append((part, bags * sub))
    pm = programs.build(plan.bag_base, plan.batch, groups)
    branches = []
    for seg in pm.segments:
        f0 = int(pm.flist[seg.feat_base, 0])
        g = plan.group[f0]
        d = dim[g]
        width = next_pow2(d) if fmt(g) is None else quant_rows.tile_words(fmt(g), d)  # quantized: a lane per word
        dyn = any(plan.dim[f] != d for f in pm.flist[seg.feat_base : seg.feat_base + seg.num_feats, 0].tolist())
        branches.append(_Branch(used.index(g), seg, d, width, layout.strides[g], seg.bags // tile[g], fmt(g), dyn))
    return used, tuple(branches), pm, feature_table(plan, dims=any(br.dyn_dim for br in branches))


def _merge(layout, plan, config: ForwardConfig, features, short, formats, num_ids: int, num_bags: int,
           num_buffers: int) -> bool:
    """Whether the `num_buffers` buffers of `features`, more than `config.segment_buffers`, stay one launch: at
    most twice as many, and at most `config.merge_programs` programs in the one launch (`ForwardConfig`)."""
    if not config.merge_programs or num_buffers > 2 * config.segment_buffers:
        return False
    launch = config.for_launch(dims=[plan.dim[f] for f in features], num_ids=num_ids, num_bags=num_bags,
                               quantized=formats is not None)
    return _schedule(layout, plan, launch, features, frozenset(short), formats)[2].num_programs <= config.merge_programs


def _two_sum(s, c, x):
    t = s + x
    z = t - s
    return t, c + ((s - (t - z)) + (x - z))


def _pool_branch(
    pid, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, psw_ref, w_ref, out_ref, bad_ref,
    *, br: _Branch, unroll: int, prefetch: bool, pooling: str, check_upper: bool, accumulation: str, align: int,
    meta_cols: int, num_warps: int = 1, live=None,
):
    # Metadata tables are flat (row-major) so every index is a traced int32:
    # interpret mode rejects Python ints as ref indices. The program's feature row
    # names its first bag in `offsets` directly, so the offsets load waits for one
    # load only (each dependent load costs a full memory latency).
    f, first, nbags, b0 = programs.locate(br.seg, pid - br.seg.prog_start, flist_ref, prefix_ref, live)

    def feat_meta(col):
        return plgpu.load(feat_ref.at[meta_cols * f + col])

    num_rows = feat_meta(NUM_ROWS)
    row_offset = feat_meta(ROW_OFFSET)
    out_base = feat_meta(OUT_BASE)
    out_stride = feat_meta(OUT_STRIDE)

    # Quantized rows are gathered a word per lane (`quant_rows.load_packed`): `parts` tiles of `[G, Wp]`, tile k's
    # column c holding value `c * parts + k`; float rows are one `[G, Dp]` tile in value order (`parts` = 1).
    parts = 1 if br.fmt is None else br.fmt.per_word
    int_rows = br.fmt is not None and br.fmt.header_words > 0  # int8 / int4 / int2: q * scale + bias
    cols = jnp.arange(br.block_dim, dtype=jnp.int32)
    out_cols = cols if parts == 1 else jnp.arange(br.block_dim * parts, dtype=jnp.int32)  # the stored tile's
    # A branch of several dims stores the feature's own `dim` columns; the lanes past them (row padding, or
    # masked past the row) are summed, never stored.
    dim_limit = feat_meta(DIM) if br.dyn_dim else br.dim
    col_ok = out_cols < dim_limit
    shape = (br.bags, br.block_dim)
    # Integer rows whose value words are not a power of two load them as two tiles where that saves lanes
    # (`quant_rows.word_pieces`: int8 D = 96 as 16 + 8 word lanes, not 32); per piece (start word, width, its word
    # columns, its stored columns and their mask). Every other branch has one piece, the tile above.
    pieces = [(0, br.block_dim, cols, out_cols, col_ok)]
    split = quant_rows.word_pieces(br.fmt, br.dim, br.bags, 32 * num_warps) if int_rows else ()
    if len(split) > 1:
        pieces = []
        for start, width in split:
            pc = start + jnp.arange(width, dtype=jnp.int32)
            oc = start * parts + jnp.arange(width * parts, dtype=jnp.int32)
            pieces.append((start, width, pc, oc, oc < dim_limit))

    def row_mask(ok):
        # Rows load up to the stride: a padded row (16-byte multiple) then moves in 16-byte vectors. The
        # padding columns' sums are never stored.
        if br.block_dim == br.stride:
            return jnp.broadcast_to(ok[:, None], shape)
        return ok[:, None] & (cols < br.stride)[None, :]

    def fetch(start, length, k0, steps):
        """Ids (and per-sample weights) of steps k0 .. k0+steps-1; -1 past a bag's end."""
        ids, ws = [], []
        for u in range(steps):
            live = (k0 + u) < length
            pos = start + (k0 + u)
            ids.append(plgpu.load(indices_ref.at[pos], mask=live, other=-1))
            if psw_ref is not None:
                ws.append(plgpu.load(psw_ref.at[pos], mask=live, other=0.0))
        return tuple(ids), tuple(ws)

    def count_bad(ids):
        """Per bag, ids outside [0, E) other than the pruned marker -1 (-1 also pads past a bag's end); summed
        over the bags once, after the loop (a cross-lane sum per step would cost more than the compares)."""
        n = jnp.zeros((br.bags,), jnp.int32)
        if bad_ref is not None:
            for idx in ids:
                n += ((idx != -1) & ((idx < 0) | (idx >= num_rows))).astype(jnp.int32)
        return n

    def gather(ids):
        tiles = []
        for idx in ids:
            ok = idx >= 0
            if check_upper:
                ok = ok & (idx < num_rows)
            rows = row_offset + idx
            if br.fmt is None:
                tiles.append((plgpu.load(w_ref.at[rows[:, None], cols[None, :]], mask=row_mask(ok), other=0),))
            elif int_rows:  # integer codes per piece, their rows' scales and biases (summed apart: `accumulate`)
                words = [quant_rows.load_words(w_ref, rows, ok, pc, br.fmt, br.dim, start)
                         for start, _, pc, _, _ in pieces]
                header = quant_rows.load_header(w_ref, rows, ok)
                codes = [quant_rows.codes_of(w, br.fmt) for w in words]
                tiles.append((codes, *quant_rows.scale_bias(header)))
            else:  # int32 words, dequantized to fp32 here
                tiles.append(tuple(quant_rows.load_packed(w_ref, rows, ok, cols, br.fmt, br.dim)))
        return tiles

    def accumulate(s, c, tiles, ws):
        """`s`, `c`: per part the sum and its error term; `tiles`: per step its parts. Integer rows: per step
        (codes, scale, bias); a bag's sum is `sum(q * scale * w) + sum(bias * w)`: one fused multiply-add per
        value, the biases (one per row) summed in `c[0]` and added once, in `finish`. Tile k's codes are `q *
        2**(k * bits)`, so its sums are `2**(k * bits)` times the bag's: every rounding scaled by a power of two,
        the same float32 values once `finish` scales them back (barring subnormal partial sums)."""
        s, c = list(s), list(c)
        if int_rows:  # `s`: piece p's tile k at p * parts + k; `c`: per piece its bias sums
            for u, (codes, scale, bias) in enumerate(tiles):
                if ws:
                    scale, bias = scale * ws[u], bias * ws[u]
                for p, piece in enumerate(codes):
                    for k, q in enumerate(piece):  # tile k sums q * 2**(k * bits) * scale: scaled back in `finish`
                        s[p * parts + k] = s[p * parts + k] + q * scale[:, None]
                    c[p] = c[p] + bias[:, None]  # [G, W] as the piece's tiles (a [G] or [G, 1] sum gets a layout
                    # of its own, and Triton then loads the ids a second time in it)
            return tuple(s), tuple(c)
        for u, step in enumerate(tiles):
            for k, x in enumerate(step):
                x = x.astype(jnp.float32)
                if ws:
                    x = x * ws[u][:, None]
                if accumulation == "twosum":
                    s[k], c[k] = _two_sum(s[k], c[k], x)
                else:
                    s[k] = s[k] + x.astype(s[k].dtype)
        return tuple(s), tuple(c)

    zeros = (jnp.zeros(shape, jnp.float32),) * parts
    acc0 = (jnp.zeros(shape, jnp.float64),) * parts if accumulation == "fp64" else zeros
    if int_rows:  # `c`: the bags' bias sums
        zeros = (jnp.zeros(shape, jnp.float32),)
    if len(pieces) > 1:  # per piece its `parts` code sums, and (`c`) its copy of the bags' bias sums
        acc0 = tuple(jnp.zeros((br.bags, width), jnp.float32) for _, width, _, _, _ in pieces for _ in range(parts))
        zeros = tuple(jnp.zeros((br.bags, width), jnp.float32) for _, width, _, _, _ in pieces)
    nbad0 = jnp.zeros((br.bags,), jnp.int32)

    def pool(start, length, k0, acc, ahead=None):
        """Steps k0.. of the sub-group's bags into `acc` (= (s, c, nbad)), `unroll` steps per iteration;
        `ahead`: the ids (and weights) of the first iteration, already fetched (prefetch only)."""
        n_iter = (jnp.max(length) - k0 + unroll - 1) // unroll
        if prefetch:
            # Software pipelining by hand: the ids of step it+1 are loaded while the
            # rows of step it are in flight, so each iteration waits on one latency.
            def body(it, carry):
                s, c, nbad, ids, ws = carry
                tiles = gather(ids)
                nxt_ids, nxt_ws = fetch(start, length, k0 + (it + 1) * unroll, unroll)
                s, c = accumulate(s, c, tiles, ws)
                return s, c, nbad + count_bad(ids), nxt_ids, nxt_ws

            ahead = fetch(start, length, k0, unroll) if ahead is None else ahead
            s, c, nbad, _, _ = jax.lax.fori_loop(0, n_iter, body, acc + ahead)
            return s, c, nbad

        def body(it, carry):
            s, c, nbad = carry
            ids, ws = fetch(start, length, k0 + it * unroll, unroll)
            s, c = accumulate(s, c, gather(ids), ws)
            return s, c, nbad + count_bad(ids)

        return jax.lax.fori_loop(0, n_iter, body, acc)

    def finish(acc, length, bag, bag_ok):
        s, c, _ = acc
        if int_rows:  # tile k's codes were q * 2**(k * bits): times 2**-(k * bits) (exact), plus the bias sums
            for p, (_, _, _, oc, ok_cols) in enumerate(pieces):
                out = [(x * quant_rows.code_scale(br.fmt, k) if quant_rows.code_scale(br.fmt, k) != 1 else x) + c[p]
                       for k, x in enumerate(s[p * parts : (p + 1) * parts])]
                store(out, length, bag, bag_ok, oc, ok_cols)
            return
        store([s[k] + c[k] for k in range(parts)] if accumulation == "twosum" else s, length, bag, bag_ok,
              out_cols, col_ok)

    def store(out, length, bag, bag_ok, out_cols, col_ok):
        out = out[0] if parts == 1 else quant_rows.interleave(out)  # quantized: back in value order
        if pooling == "mean":
            out = out / jnp.maximum(length, 1).astype(out.dtype)[:, None]
        ptr = aligned(out_base + bag * out_stride, align)[:, None] + out_cols[None, :]
        plgpu.store(out_ref.at[ptr], out.astype(out_ref.dtype), mask=bag_ok[:, None] & col_ok[None, :])

    g = jnp.arange(br.bags, dtype=jnp.int32)
    n_bad, n_malformed = jnp.int32(0), jnp.int32(0)
    if br.groups == 1:
        bag_ok = g < nbags
        start, length, malformed = programs.bag_extent(offsets_ref, first + g, bag_ok, indices_ref.shape[0])
        acc = pool(start, length, 0, (acc0, zeros, nbad0))
        finish(acc, length, b0 + g, bag_ok)
        n_bad = jnp.sum(acc[2], dtype=jnp.int32)
        n_malformed = jnp.sum(malformed, dtype=jnp.int32)
    else:
        # Sub-groups: every bag's first row is loaded up front (one latency for all of them), then each
        # sub-group pools its remaining rows (steps 1..) and stores, one sub-group after the other. The sums
        # run in the same order as with one group (0 + row 0 + row 1 + ...): the results are bitwise equal.
        subs = []
        for j in range(br.groups):
            gj = j * br.bags + g
            ok_j = gj < nbags
            start, length, malformed = programs.bag_extent(offsets_ref, first + gj, ok_j, indices_ref.shape[0])
            subs.append((gj, ok_j, start, length, malformed))
        firsts = [fetch(start, length, 0, 1) for _, _, start, length, _ in subs]
        aheads = [fetch(start, length, 1, unroll) if prefetch else None for _, _, start, length, _ in subs]
        tiles0 = [gather(ids)[0] for ids, _ in firsts]
        for (gj, ok_j, start, length, malformed), (ids, ws), ahead, tile in zip(subs, firsts, aheads, tiles0):
            s, c = accumulate(acc0, zeros, [tile], ws)
            acc = pool(start, length, 1, (s, c, count_bad(ids)), ahead)
            finish(acc, length, b0 + gj, ok_j)
            n_bad = n_bad + jnp.sum(acc[2], dtype=jnp.int32)
            n_malformed = n_malformed + jnp.sum(malformed, dtype=jnp.int32)
    if bad_ref is not None:  # two slots per program (bad ids, malformed offsets): no atomics, summed by the caller
        plgpu.store(bad_ref.at[2 * pid], n_bad)
        plgpu.store(bad_ref.at[2 * pid + 1], n_malformed)


def _pooled_kernel(*refs, branches, n_buffers, weighted, unroll, prefetch, pooling, check_upper,
                   accumulation, count_invalid, align, meta_cols, num_warps, take, loops, each):
    flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref = refs[:5]
    live = None if take is None else (refs[5], take)  # `pooled_forward`'s `long_bags` operand
    rest = refs[5 + (take is not None):]
    psw_ref = rest[0] if weighted else None
    w_refs = rest[int(weighted) : int(weighted) + n_buffers]
    out_ref, bad_ref = (rest[-2], rest[-1]) if count_invalid else (rest[-1], None)

    def run(pid):  # entry `pid` of the schedule
        for br in branches:
            @pl.when((pid >= br.seg.prog_start) & (pid < br.seg.prog_end))
            def _(br=br):
                _pool_branch(
                    pid, flist_ref, prefix_ref, feat_ref, offsets_ref, indices_ref, psw_ref, w_refs[br.buffer], out_ref,
                    bad_ref, br=br, unroll=unroll, prefetch=prefetch, pooling=pooling, check_upper=check_upper,
                    accumulation=accumulation, align=align, meta_cols=meta_cols, num_warps=num_warps, live=live,
                )

    pid = pl.program_id(0)
    if not each:
        run(pid)
        return
    # A persistent grid (`ForwardConfig.max_programs`): the first `loops` programs run entries pid, pid + loops,
    # ... (`each` of them) one after another, and every later program one entry of the rest: launched as the
    # loops finish, those balance the end as a plain grid does.
    looping = pid < loops
    first = jnp.where(looping, pid, loops * each + pid - loops)
    count = jnp.where(looping, jnp.int32(each), jnp.int32(1))  # int32, as the loop's other bounds

    def step(i, carry):
        run(first + i * loops)
        return carry

    jax.lax.fori_loop(0, count, step, jnp.int32(0))


def pooled_forward(
    buffers: dict,
    layout: StorageLayout,
    plan: FeaturePlan,
    indices: jax.Array,  # [N] int32
    offsets: jax.Array,  # [num_bags + 1] int32
    per_sample_weights: jax.Array | None,  # [N] float32
    *,
    pooling: str,
    output_dtype,
    check_upper: bool,
    config: ForwardConfig,
    interpret: bool,
    count_invalid: bool = False,
    features=None,
    long_bags=None,
    out_flat=None,
    short=frozenset(),
    formats=None,
):
    """Flat pooled output of `plan.out_size` elements (reshape is the caller's).

    `formats`: per buffer of `layout`, the `quant_rows.RowFormat` of its int32 word rows, or None for all
    float buffers (the training TBE). A quantized buffer's features may have several dims (`plan.dim`, each
    at most what its rows hold): they share its branch.

    `short`: features whose bags are known to hold at most two ids (their tables' `bag_size_hint`): their
    programs take `config.short_bag_groups` sub-groups of bags.

    Only `features` (default: all) are computed; other features' columns are
    left for another kernel to write (see `histogram.histogram_forward`).
    `long_bags` (a traced `[F]` 0/1 array, `histogram.long_bags`) drops more of them
    at run time: a feature of `features` with `long_bags == 1` is left unwritten too (the histogram kernel,
    given the same array, writes it).

    With `count_invalid`, also returns `[2]` int32 counts made by the kernel itself:
    ids outside `[0, E)` (other than -1) inside the bags, and malformed entries of
    `offsets` (see `programs.bag_extent`).

    `out_flat`: an output whose other columns are already written (aliased and
    filled in place, no copy). Models with more than `config.segment_buffers`
    storage buffers among `features` get one launch per that many, chained so
    (unless `config.merge_programs` keeps a small launch whole: `_merge`).
    """
    if features is None:
        features = range(plan.num_features)
    features = tuple(features)
    used = sorted({plan.group[f] for f in features})
    seg = config.segment_buffers
    bags = sum(plan.batch)
    if len(used) > seg and not _merge(layout, plan, config, features, short, formats, indices.shape[0], bags,
                                      len(used)):
        out, n_bad = out_flat, jnp.zeros((2,), jnp.int32)
        for i in range(0, len(used), seg):
            part = set(used[i : i + seg])
            res = pooled_forward(
                buffers, layout, plan, indices, offsets, per_sample_weights, pooling=pooling,
                output_dtype=output_dtype, check_upper=check_upper, config=config, interpret=interpret,
                count_invalid=count_invalid, features=[f for f in features if plan.group[f] in part],
                long_bags=long_bags, out_flat=out, short=short, formats=formats)
            out, n_bad = (res[0], n_bad + res[1]) if count_invalid else (res, n_bad)
        return (out, n_bad) if count_invalid else out
    config = config.for_launch(dims=[plan.dim[f] for f in features], num_ids=indices.shape[0],
                               num_bags=bags, quantized=formats is not None)
    used, branches, pm, feat_meta = _schedule(layout, plan, config, features, frozenset(short), formats)
    if not branches or plan.out_size == 0:
        out = jnp.zeros((plan.out_size,), output_dtype) if out_flat is None else out_flat
        return (out, jnp.zeros((2,), jnp.int32)) if count_invalid else out
    all_fp32 = all(buffers[layout.key(g)].dtype == jnp.float32 for g in used)
    accumulation = config.fp32_accumulation if all_fp32 else "fp32"
    warps = config.launch_warps(fp32_rows=all_fp32 and formats is None, weighted=per_sample_weights is not None,
                                block_dims=[br.block_dim for br in branches])

    loops = config.launch_programs(warps=warps, num_ids=indices.shape[0], num_bags=bags, quantized=formats is not None,
                                   mean_dim=sum(b * d for b, d in zip(plan.batch, plan.dim)) / max(bags, 1))
    each = 0 if loops is None else pm.num_programs // loops - 1  # entries a looping program runs
    grid = pm.num_programs
    if each > 1:  # else a plain grid: one entry a program
        grid = pm.num_programs - loops * (each - 1)  # the loops, then the rest (loops .. 2 * loops - 1) one each
    else:
        loops, each = 0, 0
    kernel = functools.partial(
        _pooled_kernel,
        branches=branches,
        n_buffers=len(used),
        weighted=per_sample_weights is not None,
        unroll=config.unroll,
        prefetch=config.prefetch,
        pooling=pooling,
        check_upper=check_upper,
        accumulation=accumulation,
        count_invalid=count_invalid,
        align=row_align(plan.dim, jnp.dtype(output_dtype).itemsize),
        meta_cols=feat_meta.shape[1],
        num_warps=warps,
        take=None if long_bags is None else 0,
        loops=loops,
        each=each,
    )
    args = [*programs.operands(pm), programs.const(feat_meta), offsets, indices]
    if long_bags is not None:
        args.append(long_bags)
    if per_sample_weights is not None:
        args.append(per_sample_weights)
    args.extend(buffers[layout.key(g)] for g in used)
    aliases = {}
    if out_flat is not None:  # an input after the weights: the kernel takes its refs from the end
        aliases = {len(args): 0}
        args.append(out_flat)
    out_shape = jax.ShapeDtypeStruct((plan.out_size,), output_dtype)
    if count_invalid:
        out_shape = (out_shape, jax.ShapeDtypeStruct((2 * pm.num_programs,), jnp.int32))
    call = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(grid,),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=config.num_stages),
        interpret=interpret,
        name="tbe_pooled_forward",
    )
    if accumulation != "fp64":
        res = call(*args)
    else:
        # fp64 accumulators exist only inside the kernel: its body is traced with x64
        # on (else jnp would canonicalise float64 to float32); every operand and the
        # result keep their explicit 32-bit dtypes, so the caller's mode is untouched.
        with jax.enable_x64(True):
            res = call(*args)
    if count_invalid:
        return res[0], jnp.sum(res[1].reshape(-1, 2), axis=0, dtype=jnp.int32)
    return res


def _sequence_kernel(rows_ref, *refs, weighted, dim, stride, block_dim, block_rows, n, fmt):
    psw_ref = refs[0] if weighted else None
    w_ref, out_ref = refs[-2], refs[-1]
    pos = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    in_range = pos < n
    rows = plgpu.load(rows_ref.at[pos], mask=in_range, other=-1)
    cols = jnp.arange(block_dim, dtype=jnp.int32)
    # quantized rows: a lane per word, unpacked into per_word tiles and interleaved back (`quant_rows`)
    out_cols = cols if fmt is None else jnp.arange(block_dim * fmt.per_word, dtype=jnp.int32)
    col_ok = out_cols < dim
    ok = rows >= 0
    if fmt is None:
        x = plgpu.load(w_ref.at[rows[:, None], cols[None, :]], mask=ok[:, None] & (cols < stride)[None, :], other=0)
    else:
        x = quant_rows.load_packed(w_ref, rows, ok, cols, fmt, dim)
        x = x[0] if len(x) == 1 else quant_rows.interleave(x)
    x = x.astype(jnp.float32)
    if psw_ref is not None:
        x = x * plgpu.load(psw_ref.at[pos], mask=in_range, other=0.0)[:, None]
    plgpu.store(out_ref.at[pos[:, None], out_cols[None, :]], x.astype(out_ref.dtype),
                mask=in_range[:, None] & col_ok[None, :])


def sequence_forward(
    weights: jax.Array,  # [R, stride] the one storage buffer
    rows: jax.Array,  # [N] int32 buffer row per position, -1 for "contributes zeros"
    per_sample_weights: jax.Array | None,
    *,
    dim: int,  # the tables' embedding_dim (<= the buffer's stride)
    output_dtype,
    config: ForwardConfig,
    interpret: bool,
    fmt: quant_rows.RowFormat | None = None,
) -> jax.Array:
    """`pooling="none"`: row `rows[p]` of `weights` (zeros where -1), times `per_sample_weights[p]`, per position.
    `fmt`: the format of quantized rows (`weights` then holds int32 words), None for float rows."""
    n = rows.shape[0]
    if n == 0:
        return jnp.zeros((0, dim), output_dtype)
    block_dim = next_pow2(dim) if fmt is None else quant_rows.tile_words(fmt, dim)
    block_rows = max(1, min(256, config.tile_elems // next_pow2(dim)))
    kernel = functools.partial(
        _sequence_kernel, weighted=per_sample_weights is not None, dim=dim, stride=weights.shape[1],
        block_dim=block_dim, block_rows=block_rows, n=n, fmt=fmt,
    )
    args = [rows] + ([per_sample_weights] if per_sample_weights is not None else []) + [weights]
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, dim), output_dtype),
        grid=(pl.cdiv(n, block_rows),),
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps or 1, num_stages=1),
        interpret=interpret,
        name="tbe_sequence_forward",
    )(*args)
