"""The fused FlowTT forward (`impl="pallas"`) against the jnp reference and a float64 NumPy model.

Compiled on a GPU, Pallas interpret mode on CPU (`KERNEL_KW`). Every call mixes
tables of T = 2, 3, 4 cores where it can, so one compile covers several kernels
(interpret-mode compiles dominate the CPU run time).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tt_jax
from conftest import KERNEL_KW, ON_GPU, assert_close
from tbe_jax import testing
from tt_jax import prefix, reference
from tt_jax.kernels.forward import TTKernelConfig


# The default GPU dot is TF32x3: a NumPy emulation of it on these shapes gave 1-2e-7 relative to max |ref|, as
# fp32 does; interpret mode and "ieee" are fp32. The GPU bound leaves room for Triton's split (truncation).
TOL_F32 = 2e-6
TOL = 5e-6 if ON_GPU else TOL_F32

# Tiny p keeps interpret mode fast; N is never a product of p.
T2 = tt_jax.TTSpec(97, 8, p_shapes=(10, 10), q_shapes=(2, 4), ranks=(1,))  # rank 1
T3 = tt_jax.TTSpec(200, 12, p_shapes=(4, 5, 11), q_shapes=(2, 3, 2), ranks=(8, 8))
T4 = tt_jax.TTSpec(350, 16, p_shapes=(3, 4, 5, 6), q_shapes=(2, 2, 2, 2), ranks=(2, 4, 3))
R64 = tt_jax.TTSpec(190, 32, p_shapes=(3, 8, 8), q_shapes=(2, 4, 4), ranks=(64, 64))  # rank 64, the (a) q
R64_T2 = tt_jax.TTSpec(60, 8, p_shapes=(8, 8), q_shapes=(2, 4), ranks=(64,))
T3_OTHER = tt_jax.TTSpec(150, 12, p_shapes=(3, 6, 9), q_shapes=(2, 3, 2), ranks=(8, 8))  # stacks with T3


def make_params(emb, rng, std=0.1):
    """Random cores (NumPy: `emb.init` compiles a sampler per core shape, too slow for interpret-mode runs)."""
    cores = []
    for spec in emb.specs:
        sigma = (std**2 / math.prod(spec.ranks)) ** (1.0 / (2 * spec.num_cores))
        cores.append([rng.uniform(-1.7 * sigma, 1.7 * sigma, shape).astype(np.float32) for shape in spec.core_shapes()])
    return emb.set_cores(None, cores)


def cfg(**kw):
    kw.setdefault("num_programs", 3)
    return TTKernelConfig(**kw)


def float64_pooled(emb, params, idx, off, psw, batch):
    cores = emb.get_cores(params)
    full = [reference.numpy_rows(c, s) for c, s in zip(cores, emb.specs)]
    nf = len(emb.feature_table_map)
    return testing.numpy_pooled(full, list(emb.feature_table_map), [batch] * nf, idx, off, psw, emb.pooling, False)


def check(emb, params, idx, off, psw, batch, tol=TOL, with_reference=False):
    """Kernel vs float64 (and, with_reference, the jnp reference `impl="xla"` vs float64 on the same inputs)."""
    out = jax.jit(lambda p, i, o, w: emb(p, i, o, w))(params, idx, off, psw)
    want = float64_pooled(emb, params, idx, off, psw, batch)
    assert_close(out, want, tol)
    if with_reference:
        xla = tt_jax.TTEmbeddingBag(emb.specs, feature_table_map=emb.feature_table_map, pooling=emb.pooling,
                                    impl="xla")
        assert_close(xla(params, idx, off, psw), want, TOL_F32)
    return np.asarray(out)


def skewed_batch(rng, specs, batch, bag_len, weighted, alpha=1.3):
    idx, off, psw = testing.make_batch(rng, [s.num_embeddings for s in specs], [batch] * len(specs), bag_len,
                                       alpha=alpha, weighted=weighted)
    return idx, off, psw


@pytest.mark.parametrize(
    "specs,pooling,weighted,config",
    [((0, 1, 2), "sum", False, cfg(schedule="queue", chunk=4)),
     ((0, 2), "mean", True, cfg(schedule="static", chunk=0)),
     ((1,), "sum", True, cfg(schedule="grid", chunk=3, tile_rows=2))],
    ids=["T234-sum-queue", "T24-mean-weighted-static", "T3-weighted-grid"],
)
def test_tables_match_float64(rng, specs, pooling, weighted, config):
    # Several table groups (T = 2 with rank 1, 3, 4) chained into one output; empty bags (lengths from 0);
    # ids out of range on both sides.
    specs = [(T2, T3, T4)[k] for k in specs]
    batch = 6
    emb = tt_jax.TTEmbeddingBag(specs, pooling=pooling, config=config, **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw = skewed_batch(rng, specs, batch, (0, 14), weighted)
    idx[[2, 9]] = [-3, 10_000]
    if off[batch] > 0:
        idx[off[batch] - 1] = specs[0].num_embeddings  # first past the end of table 0
    out = check(emb, params, idx, off, psw, batch, with_reference=config.schedule != "grid")
    lengths = np.diff(off).reshape(len(specs), batch)
    col = np.concatenate([[0], np.cumsum([s.embedding_dim for s in specs])])
    for f in range(len(specs)):
        for b in np.flatnonzero(lengths[f] == 0):
            assert not np.any(out[b, col[f] : col[f + 1]])


def test_rank_64(rng):
    specs = [R64, R64_T2]
    emb = tt_jax.TTEmbeddingBag(specs, config=cfg(chunk=8), **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw = skewed_batch(rng, specs, 5, (3, 12), True, alpha=1.1)
    check(emb, params, idx, off, psw, 5, with_reference=True)


@pytest.mark.parametrize(
    "config",
    [cfg(schedule="queue", chunk=2), cfg(schedule="static", chunk=0), cfg(schedule="grid", chunk=3),
     cfg(schedule="queue", prefix_reuse=False)],
    ids=["queue-chunk2", "static-whole-groups", "grid-chunk3", "unique-only"],
)
def test_one_hot_prefix(rng, config):
    # Every lookup shares one (i1, i2) prefix: one group of p_T = 24 suffixes, split into items by `chunk`.
    spec = tt_jax.TTSpec(24 * 20, 8, p_shapes=(4, 5, 24), q_shapes=(2, 2, 2), ranks=(4, 4))
    emb = tt_jax.TTEmbeddingBag(spec, pooling="mean", config=config, **KERNEL_KW)
    params = make_params(emb, rng)
    idx = (13 * 24 + rng.integers(0, 24, 90)).astype(np.int32)
    off = np.array([0, 0, 30, 31, 90], np.int32)
    check(emb, params, idx, off, None, 4)


def test_features_share_tables(rng):
    # Three features read table 0 (their lookups deduplicated together), one reads table 1; both tables have the
    # same q and ranks, so their cores are stacked into one group.
    specs = [T3, T3_OTHER]
    ftm = (0, 1, 0, 0)
    emb = tt_jax.TTEmbeddingBag(specs, feature_table_map=ftm, config=cfg(chunk=4), **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw = testing.make_batch(rng, [specs[t].num_embeddings for t in ftm], [4] * 4, (0, 10), alpha=1.4,
                                       weighted=True)
    check(emb, params, idx, off, psw, 4)


# Interpret mode discharges the kernel outside the kernel's x64 scope, and jnp indexing warns about its int64 ids.
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64:UserWarning")
def test_huge_table_paths(rng):
    # Stacked tables with 2**31 rows or more sort two int32 keys (table, id) instead of one, and buffers of 2**31
    # elements or more need 64-bit addresses in the kernels: both forced here through the config.
    specs = [T3, T3]  # two tables of one group: stacked cores, per-item table decode
    config = cfg(chunk=4, packed_key_limit=0, force_int64_addressing=True)
    emb = tt_jax.TTEmbeddingBag(specs, config=config, **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw = skewed_batch(rng, specs, 4, (0, 9), False)
    check(emb, params, idx, off, psw, 4)


def test_sort_order_rule():
    # T = 3 sorts by (i2, i1, i3) unless a table's p1 p2 p3 reaches the limit, or the larger key range (p1 p2 p3
    # per table instead of N) would turn the one packed key into two; T = 2 and 4 keep (i1, ..., i_{T-1}).
    def layout(**limits):
        return prefix.StackedTables((0, 1), (T3, T3_OTHER), **limits)

    spans = math.prod(T3.p_shapes) + math.prod(T3_OTHER.p_shapes)
    rows = T3.num_embeddings + T3_OTHER.num_embeddings
    assert layout().prefix_digits == (1, 0) and layout().key_base == (0, 220, spans) and layout().packed
    assert prefix.StackedTables((0,), (T4,)).prefix_digits == (0, 1, 2)
    small = layout(packed_limit=rows + 1)  # packed with N, not with p1 p2 p3
    assert small.prefix_digits == (0, 1) and small.key_base[-1] == rows and small.packed
    assert layout(packed_limit=1).prefix_digits == (1, 0)  # two keys either way: reorder
    assert not layout(packed_limit=1).packed
    assert layout(packed_limit=1, reorder_limit=math.prod(T3.p_shapes)).prefix_digits == (0, 1)
    # The config's fields set them (the plans of `flow_plans` and both backwards use these layouts).
    config = TTKernelConfig(packed_key_limit=rows + 1, reorder_key_limit=7).forward_config
    (got, _), = config.stack_tables((T3, T3_OTHER), (0, 1))
    assert got == layout(packed_limit=rows + 1, reorder_limit=7) and got != layout()
    with pytest.raises(ValueError, match="packed_limit must be an int in"):
        layout(packed_limit=2**31)


@pytest.mark.parametrize("prefix_reuse,chunk", [(True, 3), (True, 0), (False, 3)])
def test_flow_plan(rng, prefix_reuse, chunk):
    # Items cover every distinct row once, each within one prefix group, at most `chunk` rows (1 without reuse),
    # and the item's digits name the right stacked core rows; `inverse` maps lookups to their rows.
    specs = [T3, T3_OTHER]
    ftm = (1, 0, 1)
    layout, feats = prefix.stack_tables(specs, ftm)[0]
    assert layout.tables == (0, 1) and feats == (0, 1, 2)
    batch = 5
    idx, off, _ = testing.make_batch(rng, [specs[t].num_embeddings for t in ftm], [batch] * 3, (0, 12), alpha=1.3)
    idx[[0, 5]] = [-1, 200]
    plan = jax.jit(lambda i, o: prefix.build_flow(layout, i, o, features=feats, feature_table_map=ftm, batch=batch,
                                                  chunk=chunk, prefix_reuse=prefix_reuse))(idx, off)
    feat = (np.searchsorted(off, np.arange(len(idx)), side="right") - 1) // batch
    table = np.asarray(ftm)[feat]
    ok = (idx >= 0) & (idx < np.asarray([specs[t].num_embeddings for t in table]))
    # Rows in sort-key order: by table, then the id's digits as (i2, i1, i3) (T = 3: `prefix_digits`).
    assert layout.prefix_digits == (1, 0)

    def key(t, i):
        p = specs[t].p_shapes
        return t, (i // p[2]) % p[1], i // (p[1] * p[2]), i % p[2]

    assert int(prefix.sort_key(layout, np.int32(123), T3.p_shapes)) == ((123 // 11) % 5 * 4 + 123 // 55) * 11 + 123 % 11
    keys = sorted({(t, i) for t, i, v in zip(table, idx, ok) if v}, key=lambda k: key(*k))
    u = int(plan.num_rows)
    assert u == len(keys)
    inv = np.asarray(plan.inverse)
    assert np.all(inv[~ok] == -1)
    rows_of = {k: n for n, k in enumerate(keys)}
    np.testing.assert_array_equal(inv[ok], [rows_of[(t, i)] for t, i in zip(table[ok], idx[ok])])
    np.testing.assert_array_equal(np.asarray(plan.row_suffix)[:u], [i % specs[t].p_shapes[-1] for t, i in keys])
    prefixes = [(t, i // specs[t].p_shapes[-1]) for t, i in keys]
    assert int(plan.num_groups) == len(set(prefixes))
    m = np.asarray(plan.item_meta).reshape(-1, 4)
    ni = int(plan.num_items[0])
    assert m[ni, 0] == u
    covered = []
    for it in range(ni):
        first, count = m[it, 0], m[it + 1, 0] - m[it, 0]
        assert 1 <= count <= ((chunk or 99) if prefix_reuse else 1)
        (t, pre), = set(prefixes[first : first + count])
        p = specs[t].p_shapes
        assert tuple(m[it, 1:]) == (layout.core_base[0][layout.tables.index(t)] + pre // p[1],
                                    layout.core_base[1][layout.tables.index(t)] + pre % p[1],
                                    layout.core_base[2][layout.tables.index(t)])
        covered += range(first, first + count)
    assert covered == list(range(u))


@pytest.mark.parametrize("reorder", [True, False])
def test_grad_through_pallas_matches_xla(rng, reorder):
    # reorder False: the plan sorts by (i1, i2, i3) (keys of 2**31 or more, forced here), so the packed kernels
    # take the items in an order sorted by i2 (forward and backward) and the backward's first core needs no sort.
    specs = [T3]
    config = cfg() if reorder else cfg(reorder_key_limit=0)
    (layout, _), = config.forward_config.stack_tables(specs, (0,))
    assert layout.prefix_digits == ((1, 0) if reorder else (0, 1))
    kernel = tt_jax.TTEmbeddingBag(specs, pooling="mean", config=config, **KERNEL_KW)
    xla = tt_jax.TTEmbeddingBag(specs, pooling="mean", impl="xla")
    params = make_params(kernel, rng)
    idx, off, psw = skewed_batch(rng, specs, 3, (0, 8), True)
    ct = jnp.asarray(rng.normal(size=(3, 12)), jnp.float32)

    def loss(emb):
        return jax.jit(jax.grad(lambda p, w: jnp.sum(emb(p, idx, off, w) * ct), argnums=(0, 1)))

    gk = loss(kernel)(params, jnp.asarray(psw))
    gx = loss(xla)(params, jnp.asarray(psw))
    for a, b in zip(jax.tree.leaves(gk), jax.tree.leaves(gx)):
        assert_close(a, b, 1e-5)


def test_no_lookups_and_auto(rng):
    emb = tt_jax.TTEmbeddingBag([T2, T3], **KERNEL_KW)
    params = make_params(emb, rng)
    out = emb(params, np.zeros((0,), np.int32), np.zeros((7,), np.int32))
    assert out.shape == (3, 20) and not np.any(np.asarray(out))
    assert tt_jax.TTEmbeddingBag(T2).resolved_impl == ("pallas" if ON_GPU else "xla")
    assert tt_jax.TTEmbeddingBag(T2, impl="xla").resolved_impl == "xla"
    if not ON_GPU:
        with pytest.raises(NotImplementedError, match="interpret=True"):
            one = tt_jax.TTEmbeddingBag(T2, impl="pallas")
            one(one.init(jax.random.key(0)), np.array([1], np.int32), np.array([0, 1], np.int32))


def test_flat_config_defaults_are_the_parts_defaults():
    """`TTKernelConfig` repeats the two parts' fields (the flat form users pass): its defaults give the parts'
    defaults, and `from_parts` inverts `forward_config` / `backward_config`."""
    from tt_jax.kernels.config import TTBackwardConfig, TTForwardConfig

    flat = TTKernelConfig()
    assert flat.forward_config == TTForwardConfig() and flat.backward_config == TTBackwardConfig()
    other = TTKernelConfig(chunk=16, bwd_rows=4, precision="ieee")
    assert TTKernelConfig.from_parts(other.forward_config, other.backward_config) == other


def test_config_errors():
    with pytest.raises(ValueError, match="schedule"):
        TTKernelConfig(schedule="steal")
    with pytest.raises(ValueError, match="schedule"):  # measured slower, removed (benchmarks/NOTES.md)
        TTKernelConfig(schedule="blocked")
    with pytest.raises(TypeError, match="unexpected keyword argument 'order'"):
        TTKernelConfig(order="middle")
    with pytest.raises(ValueError, match="tile_rows"):
        TTKernelConfig(tile_rows=3)
    with pytest.raises(ValueError, match="precision"):
        TTKernelConfig(precision="fp16")
    with pytest.raises(ValueError, match="chunk"):
        TTKernelConfig(chunk=-1)
    with pytest.raises(ValueError, match="feature_table_map"):
        tt_jax.TTEmbeddingBag([T2], feature_table_map=(0, 1))
    with pytest.raises(TypeError, match="config"):
        tt_jax.TTEmbeddingBag([T2], config={"chunk": 4})


@pytest.mark.skipif(not ON_GPU, reason="the 'ieee' dot only differs from the default on a GPU")
def test_ieee_precision_is_fp32_exact(rng):
    emb = tt_jax.TTEmbeddingBag([R64, T4], config=cfg(precision="ieee"), **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw = skewed_batch(rng, [R64, T4], 8, (0, 20), True)
    check(emb, params, idx, off, psw, 8, tol=TOL_F32)


def test_bf16x3_precision(rng):
    # Three bf16 tensor-core passes (~16 mantissa bits): ~1e-5 relative error on the GPU, so a looser bound
    # than the tf32x3 default's; interpret mode computes its dots at HIGHEST whatever the setting.
    emb = tt_jax.TTEmbeddingBag([R64, T4], config=cfg(precision="bf16x3"), **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, psw = skewed_batch(rng, [R64, T4], 8, (0, 20), True)
    check(emb, params, idx, off, psw, 8, tol=1e-4 if ON_GPU else TOL_F32)


@pytest.mark.skipif(not ON_GPU, reason="a realistic size only compiled")
@pytest.mark.parametrize("schedule", ["queue", "static"])
def test_workload_a_shape_on_gpu(rng, schedule):
    # Workload (a)'s shapes at a small batch: N = 10M, ranks (32, 32), Zipf(1.1).
    spec = tt_jax.TTSpec(10_000_000, 32, p_shapes=(200, 200, 250), q_shapes=(2, 4, 4), ranks=(32, 32))
    emb = tt_jax.TTEmbeddingBag(spec, config=TTKernelConfig(schedule=schedule), **KERNEL_KW)
    params = make_params(emb, rng)
    idx, off, _ = testing.make_batch(rng, [spec.num_embeddings], [512], 20, alpha=1.1)
    out = jax.jit(lambda p, i, o: emb(p, i, o))(params, idx, off)
    uniq, inv = np.unique(idx, return_inverse=True)
    g1, g2, g3 = (np.asarray(c, np.float64) for c in emb.get_cores(params)[0])
    i1, i2, i3 = uniq // 50_000, uniq // 250 % 200, uniq % 250
    rows = np.einsum("nja,nakb,nbl->njkl", g1[i1][:, 0], g2[i2], g3[i3][..., 0]).reshape(len(uniq), 32)
    want = rows[inv.reshape(-1)].reshape(512, 20, 32).sum(1)
    assert_close(out, want, TOL)
    assert math.prod(spec.p_shapes) == spec.num_embeddings


@pytest.mark.skipif(ON_GPU, reason="on a GPU the other tests compile the kernels for real")
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64:UserWarning")
@pytest.mark.parametrize("case", ["a-queue", "T4-static-weighted", "tables-queue-wide", "T2-grid"])
def test_triton_lowering_for_gpu(case):
    # Without a GPU, lower for CUDA anyway: every Triton lowering rule the kernels need runs (the compiled
    # queue path, a while_loop with an atomic, cannot run in interpret mode). PTX compilation is not covered.
    from tt_jax.kernels.forward import pooled_forward

    spec_a = tt_jax.TTSpec(10_000_000, 32, p_shapes=(200, 200, 250), q_shapes=(2, 4, 4), ranks=(32, 32))
    specs, schedule, weighted = {
        "a-queue": ([spec_a], "queue", False),
        "T4-static-weighted": ([T4], "static", True),
        "tables-queue-wide": ([T3, T3_OTHER, R64], "queue", True),
        "T2-grid": ([T2], "grid", False),
    }[case]
    config = TTKernelConfig(schedule=schedule, force_int64_addressing=case.endswith("wide"))
    batch, n = 32, 640
    ftm = tuple(range(len(specs)))

    def fwd(cores, idx, off, w):
        return pooled_forward(cores, specs, ftm, idx, off, w, batch=batch, pooling="mean", config=config,
                              interpret=False).out

    cores = tuple(tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in spec.core_shapes()) for spec in specs)
    args = (cores, jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((len(specs) * batch + 1,), jnp.int32),
            jax.ShapeDtypeStruct((n,), jnp.float32) if weighted else None)
    text = jax.jit(fwd).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 2 * len({(s.q_shapes, s.ranks) for s in specs})


def test_train_step_sorts_three_times():
    # One T = 3 table, Adagrad `train_step`, lowered for CUDA: three sorts, no more. The lookups by (i2, i1, i3)
    # (the plan; the work items then come ordered by middle slice, as the packed kernels take them), the items by
    # first slice (the first core's sum), the rows by last slice (the last core's sum). The forward alone: one.
    import tbe_jax

    emb = tt_jax.TTEmbeddingBag([T3], impl="pallas", interpret=False)
    emb._check_backend = lambda: None  # lowered only
    opt = tt_jax.Adagrad(0.01)
    params = emb.init(jax.random.key(0))
    state = emb.init_opt_state(params, opt)

    def step(params, state, idx, off):
        res = tbe_jax.train_step(lambda _, out: 0.5 * jnp.sum(out**2), None,
                                 tbe_jax.SparseLookup(emb, opt, params, state, idx, off))
        return res.params, res.opt_state

    idx, off = jnp.zeros((64,), jnp.int32), jnp.arange(0, 65, 8, dtype=jnp.int32)
    text = jax.jit(step).trace(params, state, idx, off).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.sort") == 3
    fwd = jax.jit(emb).trace(params, idx, off).lower(lowering_platforms=("cuda",)).as_text()
    assert fwd.count("stablehlo.sort") == 1
