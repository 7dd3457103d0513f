"""The tuning choices that are config fields (issue 37: no module-level switch is read at trace time).

For each of `BackwardConfig`'s run classes, segments and preprocessing block sizes, `HistogramConfig.head` and the
TT plan's block sizes: a non-default value reaches the kernels (their grids and tile shapes in the traced program)
and gives the reference's result; two configs differing only in it are different cache keys; bad values raise.
The TT plan's sort-key limits and the TT kernels' forced 64-bit addressing: cache keys and bad values here, their
effect in tests/test_tt_kernel.py and tests/test_tt_plan.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
import tt_jax
from tbe_jax import dispatch, runs as runs_lib, testing
from tbe_jax.kernels import backward as bwd, histogram, scan
from tt_jax import prefix
from tt_jax.kernels import plan as plan_kernels
from tt_jax.kernels.config import TTForwardConfig, TTKernelConfig
from conftest import KERNEL_KW, assert_close, assert_runs_equal, specs, tables_f64, tolerance

XLA_RUNS = tbe_jax.BackwardConfig(rle_kernel=False, rank_sort_max=0, narrow_sort_keys=False)


def _kernels(closed) -> dict:
    """Per Pallas kernel of a traced program (by name): (grid, the shapes of its `iota`s, i.e. its tiles)."""
    out = {}

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                inner = eqn.params["jaxpr"]
                shapes = {tuple(e.params["shape"]) for e in inner.eqns if e.primitive.name == "iota"}
                for e in inner.eqns:  # iotas inside loops and conds
                    for v in e.params.values():
                        for sub in v if isinstance(v, (tuple, list)) else [v]:
                            sub = getattr(sub, "jaxpr", sub)
                            shapes |= {tuple(x.params["shape"]) for x in getattr(sub, "eqns", ())
                                       if x.primitive.name == "iota"}
                out[eqn.params["name"]] = (tuple(eqn.params["grid_mapping"].grid), shapes)
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else [v]:
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(closed.jaxpr)
    return out


def _batch(rng):
    emb = tbe_jax.TableBatchedEmbedding(specs([7, 700, 3], [4, 4, 4]))
    idx, off, psw = testing.make_batch(rng, [7, 700, 3], [5, 5, 5], (0, 60), weighted=True)
    idx[4] = -1
    return emb, emb.plan_for(len(off)), (jnp.asarray(idx), jnp.asarray(off), jnp.asarray(psw))


# -- the run classes and the segments -------------------------------------------------------------------------

def test_run_classes_and_segments_follow_the_config(rng):
    """`small_run_max=2`, `long_run=16` (no mid run chunked), `segment_buffers=1`: the runs are classified by those
    bounds (both the XLA ops and the run-length kernel), the long runs are cut into chunks of 16, a width class of
    three buffers becomes three segments, and the optimizer step equals the XLA reference's."""
    cfg = tbe_jax.BackwardConfig(small_run_max=2, long_run=16, split_chunk=0, segment_buffers=1)
    tables = specs([3, 20, 40], [5, 6, 7])  # one width class (8), two row parities: 2 segments by default
    emb = tbe_jax.TableBatchedEmbedding(tables, pad_rows=False, backward_config=cfg, **KERNEL_KW)
    assert len(bwd.run_segments(emb.layout, tbe_jax.BackwardConfig())) == 2
    assert [s.buffers for s in bwd.run_segments(emb.layout, cfg)] == [(1,), (0,), (2,)]
    idx, off, psw = testing.make_batch(rng, [3, 20, 40], [4, 4, 4], [(10, 20), (5, 15), (0, 6)], weighted=True)
    plan = emb.plan_for(len(off))
    args = (jnp.asarray(idx), jnp.asarray(off), jnp.asarray(psw))
    keys = np.concatenate([idx[off[4 * f]:off[4 * f + 4]] + base for f, base in enumerate([0, 3, 23])])
    lengths = np.unique(keys, return_counts=True)[1]
    want = [np.sum(lengths <= 2), np.sum((lengths > 2) & (lengths < 16)), np.sum(lengths >= 16),
            np.sum(-(-lengths[lengths >= 16] // 16))]
    assert min(want) > 0 and want != [np.sum(lengths <= 8), np.sum((lengths > 8) & (lengths < 256)), 0, 0]
    for rle_kernel in (False, True):
        c = dataclasses.replace(cfg, rle_kernel=rle_kernel)
        r = jax.jit(functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="mean", config=c,
                                      interpret=KERNEL_KW["interpret"]))(*args)
        np.testing.assert_array_equal(np.asarray(r.counts), want)
        assert r.mid.shape == (len(idx) // 3 + 1,) and r.long.shape == (len(idx) // 16 + 1,)
    ref = tbe_jax.TableBatchedEmbedding(tables, pad_rows=False, impl="xla")
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-3)
    params = emb.init(jax.random.key(1))
    state = emb.init_opt_state(params, opt)
    g = rng.standard_normal((4, 18)).astype(np.float32)
    got = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, *args[:2], g, args[2]))(params, state)
    want_p, want_s = ref.apply_gradients(params, state, opt, idx, off, g, psw)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves((want_p, want_s))):
        assert_close(a, b, 2e-5)


def _kernel_updates(rng, tables, idx, off, psw, configs, seed):
    """(config, emb) for each `BackwardConfig` in `configs`, once its kernel update (row-wise Adagrad, weighted,
    batch of 4) has been checked against the XLA reference's."""
    ref = tbe_jax.TableBatchedEmbedding(tables, pad_rows=False, impl="xla")
    opt = tbe_jax.RowwiseAdagrad(0.05, 1e-3)
    params = ref.init(jax.random.key(seed))
    state = ref.init_opt_state(params, opt)
    g = rng.standard_normal((4, sum(t.embedding_dim for t in tables))).astype(np.float32)
    want = jax.tree_util.tree_leaves(ref.apply_gradients(params, state, opt, idx, off, g, psw))
    for cfg in configs:
        emb = tbe_jax.TableBatchedEmbedding(tables, pad_rows=False, backward_config=cfg, **KERNEL_KW)
        got = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, jnp.asarray(idx), jnp.asarray(off), g,
                                                       jnp.asarray(psw)))(params, state)
        for a, b in zip(jax.tree_util.tree_leaves(got), want):
            assert_close(a, b, 2e-5)
        yield cfg, emb


def test_long_block_sums_many_chunks(rng, monkeypatch):
    """A hot row of ~60 lookups at `long_run=4` is ~15 chunks: the long-run kernel sums them `long_block` a
    step (1, 4 and 8: several steps with a partial last one, and one step) to the reference's update, with
    weights and rows of two widths; `long_num_warps` reaches its launch alone (captured compiler params)."""
    seen = {}
    real = bwd.pallas_call

    def spy(kernel, **kw):
        seen[kw["name"]] = kw["compiler_params"].num_warps
        return real(kernel, **kw)

    monkeypatch.setattr(bwd, "pallas_call", spy)
    tables = specs([2, 30], [6, 12])
    idx, off, psw = testing.make_batch(rng, [2, 30], [4, 4], [(10, 20), (3, 9)], weighted=True)
    counts = np.unique(np.concatenate([idx[off[0]:off[4]], idx[off[4]:off[8]] + 2]), return_counts=True)[1]
    assert counts.max() >= 8 * 4 + 1  # a run of more than long_block * long_run lookups
    configs = [tbe_jax.BackwardConfig(small_run_max=2, long_run=4, long_block=block, long_num_warps=warps)
               for block, warps in ((1, None), (4, 4), (8, None))]
    for cfg, _ in _kernel_updates(rng, tables, idx, off, psw, configs, seed=2):
        assert seen["tbe_backward_long_runs"] == (cfg.long_num_warps or 1)
        assert seen["tbe_backward_mid_runs_chunks"] == 1
        seen.clear()


def test_step_width_scales_narrow_steps(rng, monkeypatch):
    """`step_width` 64: segments of width 8 and 16 (dims 6 and 12) gather 8x / 4x `lookups_per_step` rows a step
    and sum 8x / 4x `long_block` partials a step (captured kernel arguments), and the update still equals the
    reference's, with mid runs, chunked runs and partial last steps; 0 leaves K and the block at every width;
    the default is 128."""
    cfg = tbe_jax.BackwardConfig
    assert cfg(step_width=128).steps_at(8, 16) == 64 and cfg(step_width=128).steps_at(16, 256) == 16
    assert cfg().steps_at(8, 16) == 64 and cfg(step_width=0).steps_at(8, 16) == 8
    assert cfg(step_width=16).steps_at(4, 32) == 4
    seen = {}
    real = bwd.pallas_call

    def spy(kernel, **kw):
        if isinstance(kernel, functools.partial) and kw["name"] in ("tbe_backward_mid_runs_chunks",
                                                                     "tbe_backward_long_runs"):
            seen[kw["name"]] = kernel.keywords.get("k", kernel.keywords.get("block"))
        return real(kernel, **kw)

    monkeypatch.setattr(bwd, "pallas_call", spy)
    tables = specs([2, 30], [6, 12])
    idx, off, psw = testing.make_batch(rng, [2, 30], [4, 4], [(10, 20), (3, 9)], weighted=True)
    configs = [cfg(small_run_max=2, long_run=8, lookups_per_step=2, long_block=1, step_width=sw) for sw in (0, 64)]
    for c, _ in _kernel_updates(rng, tables, idx, off, psw, configs, seed=4):
        scale = (8, 4) if c.step_width else (1, 1)
        assert seen["tbe_backward_mid_runs_chunks"] == tuple(2 * x for x in scale)
        assert seen["tbe_backward_long_runs"] == scale
        seen.clear()


def test_split_chunk_default_follows_long_run():
    """`split_chunk` None (the default) is `long_run` // 4 where that chunks some mid runs (`small_run_max` < 2C <
    `long_run`), else 0, so a config with a short `long_run` stays valid; a value given is used as given."""
    cfg = tbe_jax.BackwardConfig
    assert cfg().mid_chunk == 64 and cfg().chunked_min == 128 and cfg().max_chunks(1000) == 2 * 1000 // 64 + 1
    assert cfg(small_run_max=2, long_run=16).mid_chunk == 4 and cfg(long_run=16).mid_chunk == 0
    assert cfg(small_run_max=2, long_run=4).mid_chunk == 0 and cfg(long_run=128).mid_chunk == 32
    assert dataclasses.replace(cfg(), small_run_max=2, long_run=3).chunked_min == 3
    assert cfg(split_chunk=0).mid_chunk == 0 and cfg(split_chunk=0).chunked_min == 256
    assert cfg(split_chunk=100).mid_chunk == 100 and cfg(split_chunk=100).chunked_min == 200


def test_split_chunk_chunks_mid_runs(rng):
    """`split_chunk` 3 at `long_run` 16: runs of 6-15 lookups are chunked in threes, longer ones in sixteens, shorter
    ones stay mid runs (one task) or small: the update equals the XLA reference's, weighted, two widths."""
    tables = specs([2, 6, 30], [6, 12, 12])
    idx, off, psw = testing.make_batch(rng, [2, 6, 30], [4, 4, 4], [(10, 20), (5, 10), (3, 9)], weighted=True)
    keys = np.concatenate([idx[off[0]:off[4]], idx[off[4]:off[8]] + 2, idx[off[8]:off[12]] + 8])
    counts = np.unique(keys, return_counts=True)[1]
    assert counts.max() >= 16 and np.any((counts >= 6) & (counts < 16)) and np.any((counts > 2) & (counts < 6))
    cfg = tbe_jax.BackwardConfig(small_run_max=2, long_run=16, split_chunk=3, long_block=4)
    (_, emb), = _kernel_updates(rng, tables, idx, off, psw, [cfg], seed=3)
    # the chunk count: ceil(L / 3) for runs of 6-15, ceil(L / 16) from 16 on
    plan = emb.plan_for(len(off))
    r = runs_lib.build_runs(emb.layout, plan, jnp.asarray(idx), jnp.asarray(off), jnp.asarray(psw), pooling="sum",
                            config=cfg, interpret=KERNEL_KW["interpret"])
    chunked = counts[counts >= 6]
    assert int(r.counts[2]) == len(chunked)
    assert int(r.counts[3]) == int(np.sum(np.where(chunked >= 16, -(-chunked // 16), -(-chunked // 3))))


def test_runs_built_with_another_config_are_refused(rng):
    emb, plan, args = _batch(rng)
    runs = runs_lib.build_runs(emb.layout, plan, *args, pooling="mean", config=XLA_RUNS)
    params = emb.init(jax.random.key(0))
    g = jnp.zeros((5, 12), jnp.float32)
    with pytest.raises(ValueError, match="not built with small_run_max=4, long_run=256"):
        bwd.fused_update(params, (), emb.layout, runs, g, None, config=tbe_jax.BackwardConfig(small_run_max=4),
                         interpret=True)


# -- the preprocessing kernels' block sizes --------------------------------------------------------------------

SMALL_BLOCKS = tbe_jax.BackwardConfig(keys_block=64, rle_block=64, scan_chunk=8, rank_sort_block_i=8,
                                      rank_sort_block_j=32, rank_sort_chunk=64, rank_sort_merge_block=32)


def test_block_sizes_reach_the_kernels(rng):
    """Traced for the GPU (not run): each preprocessing kernel's grid and tiles follow the config's sizes."""
    emb, plan, args = _batch(rng)
    n = args[0].shape[0]
    assert n > 64

    def kernels(cfg):
        fn = functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="mean", config=cfg, interpret=False)
        return _kernels(jax.make_jaxpr(fn)(*args))

    default, small = kernels(tbe_jax.BackwardConfig()), kernels(SMALL_BLOCKS)
    assert default["tbe_lookup_keys"][0] == (-(-n // 1024),) and (1024,) in default["tbe_lookup_keys"][1]
    assert small["tbe_lookup_keys"][0] == (-(-n // 64),) and (64,) in small["tbe_lookup_keys"][1]
    for name in ("tbe_runs_count", "tbe_runs_write"):
        assert default[name][0] == (n // 1024 + 1,) and small[name][0] == (n // 64 + 1,)
    assert (1024,) in default["prefix_scan"][1] and (8,) in small["prefix_scan"][1]
    # The rank sort: programs of block_i keys, steps of block_j, and the merge pass past one chunk.
    assert "tbe_rank_sort_merge" not in default and default["tbe_rank_sort"][0] == (-(-n // 16),)
    assert small["tbe_rank_sort"][0] == (-(-n // 8),) and (32,) in small["tbe_rank_sort"][1]
    # The merge: wide (16 keys a program, all chunks at once) while 16 x the chunks (padded) <= 512, else serial.
    chunks_p2 = 1 << (-(-n // 64) - 1).bit_length()
    assert small["tbe_rank_sort_merge"][0] == ((-(-n // 16),) if 16 * chunks_p2 <= 512 else (-(-n // 32),))
    serial = kernels(dataclasses.replace(SMALL_BLOCKS, rank_sort_wide_block=0))
    assert serial["tbe_rank_sort_merge"][0] == (-(-n // 32),)
    # rank_sort_max: past it, XLA's sort.
    assert "tbe_rank_sort" not in kernels(tbe_jax.BackwardConfig(rank_sort_max=n - 1))


def test_block_sizes_give_the_same_runs(rng):
    """Run (interpret mode on CPU) with the small sizes: the keys, the runs and the prefix sums are the XLA ops'."""
    emb, plan, args = _batch(rng)
    interp = KERNEL_KW["interpret"]
    cfg = dataclasses.replace(SMALL_BLOCKS, rank_sort_interpret=True)
    got = jax.jit(functools.partial(runs_lib.build_runs, emb.layout, plan, pooling="mean", config=cfg,
                                    interpret=interp))(*args)
    assert_runs_equal(got, runs_lib.build_runs(emb.layout, plan, *args, pooling="mean", config=XLA_RUNS))
    kw = dict(pooling="mean", kernel=True, interpret=interp, config=cfg)
    for x, y in zip(jax.jit(lambda *a: runs_lib.lookup_keys(emb.layout, plan, *a, **kw))(*args),
                    runs_lib.lookup_keys(emb.layout, plan, *args, pooling="mean")):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    counts = rng.integers(0, 100, size=(50, 3)).astype(np.int32)
    base, tot = jax.jit(functools.partial(scan.exclusive_scan, width=3, chunk=8, interpret=interp, kernel=True))(
        jnp.asarray(counts.reshape(-1)))
    np.testing.assert_array_equal(np.asarray(base).reshape(50, 3), np.cumsum(counts, axis=0) - counts)
    assert [int(t[0]) for t in tot] == counts.sum(axis=0).tolist()


# -- HistogramConfig.head ---------------------------------------------------------------------------------------

def test_histogram_head(rng):
    """`head=32`: the counts cover each bag's first 32 ids, the rest take the gather path; the output is the
    model's."""
    cfg = histogram.HistogramConfig(head=32)
    emb = tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(30, 64, bag_size_hint=64)], weights_dtype="float16",
                                        histogram_config=cfg, **KERNEL_KW)
    params = emb.init(jax.random.key(0))
    idx, off, _ = testing.make_batch(rng, [30], [20], (0, 80))
    plan = emb.plan_for(len(off))
    out, counts = histogram.histogram_forward(
        None, params, emb.layout, plan, [0], jnp.asarray(idx), jnp.asarray(off), pooling="sum", check_upper=False,
        interpret=KERNEL_KW["interpret"], config=cfg, save_counts=True)
    counts = np.asarray(counts)
    for r, (_, b) in enumerate(histogram.histogram_programs(plan, [0], cfg.bags)):
        if b >= 0:
            np.testing.assert_array_equal(counts[r, :30], np.bincount(idx[off[b]:off[b + 1]][:32], minlength=30))
    assert np.diff(off).max() > 32
    model = testing.numpy_pooled(tables_f64(emb, params), [0], [20], idx, off, None, "sum", False)
    assert_close(np.asarray(out).reshape(model.shape), model, tolerance("float32", 80))


# -- the TT plan's block sizes ----------------------------------------------------------------------------------

def test_tt_plan_block_sizes(rng):
    spec = tt_jax.TTSpec(200, 12, p_shapes=(4, 5, 11), q_shapes=(2, 3, 2), ranks=(3, 4))
    layout, feats = prefix.stack_tables((spec,), (0,))[0]
    idx, off, _ = testing.make_batch(rng, [200], [30], (0, 8))
    n = len(idx)
    assert n > 64

    def build(fused, interpret, **kw):
        common = dict(features=feats, feature_table_map=(0,), batch=30, chunk=4)
        if not fused:
            return lambda i, o: prefix.build_flow(layout, i, o, **common)
        return lambda i, o: plan_kernels.build_flow(layout, i, o, interpret=interpret, **common, **kw)

    # Traced for the GPU: the config's sizes reach the three passes and the scans.
    config = TTKernelConfig(plan_block=64, plan_scan_chunk=8)
    traced = _kernels(jax.make_jaxpr(lambda i, o: tt_jax.kernels.forward.flow_plans(
        (spec,), (0,), i, o, batch=30, config=config, fused=True, interpret=False))(idx, off))
    for name in ("tt_plan_count", "tt_plan_items", "tt_plan_write"):
        assert traced[name][0] == (n // 64 + 1,) and (64,) in traced[name][1]
    assert (8,) in traced["prefix_scan"][1]
    default = _kernels(jax.make_jaxpr(build(True, False))(idx, off))
    assert default["tt_plan_count"][0] == (n // 1024 + 1,)
    # Run: the same plan as the XLA bookkeeping.
    want = jax.jit(build(False, False))(idx, off)
    got = jax.jit(build(True, KERNEL_KW["interpret"], block=64, scan_chunk=8))(idx, off)
    for name, a, b in zip(want._fields, want, got):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


# -- cache keys -------------------------------------------------------------------------------------------------

FIELDS = [(tbe_jax.BackwardConfig, dict(small_run_max=4)), (tbe_jax.BackwardConfig, dict(long_run=128)),
          (tbe_jax.BackwardConfig, dict(long_block=2)), (tbe_jax.BackwardConfig, dict(long_num_warps=2)),
          (tbe_jax.BackwardConfig, dict(step_width=0)), (tbe_jax.BackwardConfig, dict(rle_fill=True)),
          (tbe_jax.BackwardConfig, dict(split_chunk=64)),
          (tbe_jax.BackwardConfig, dict(rank_sort_wide_block=64)),
          (tbe_jax.BackwardConfig, dict(rank_sort_wide_tile=64)),
          (tbe_jax.BackwardConfig, dict(segment_buffers=4)), (tbe_jax.BackwardConfig, dict(keys_block=512)),
          (tbe_jax.BackwardConfig, dict(rle_block=512)), (tbe_jax.BackwardConfig, dict(scan_chunk=512)),
          (tbe_jax.BackwardConfig, dict(rank_sort_max=1000)), (tbe_jax.BackwardConfig, dict(rank_sort_interpret=True)),
          (tbe_jax.BackwardConfig, dict(rank_sort_block_i=32)), (tbe_jax.BackwardConfig, dict(rank_sort_block_j=512)),
          (tbe_jax.BackwardConfig, dict(rank_sort_merge_block=128)), (histogram.HistogramConfig, dict(head=128)),
          (TTKernelConfig, dict(plan_block=512)), (TTKernelConfig, dict(plan_scan_chunk=512)),
          (TTKernelConfig, dict(packed_key_limit=1000)), (TTKernelConfig, dict(reorder_key_limit=0)),
          (TTKernelConfig, dict(force_int64_addressing=True))]


def _compiled_forwards(cls, configs) -> list[int]:
    """The size of the eager forward's program cache (one jitted program, the core a static argument) after each
    call, by cores that differ only in their `cls` config (the XLA path: it compiles in milliseconds, and the cache
    key is the same)."""
    idx, off = jnp.arange(4, dtype=jnp.int32), jnp.asarray([0, 2, 4], jnp.int32)
    if cls is TTKernelConfig:
        from tt_jax import tt as tt_module

        program = tt_module._jit_pooled
        cores = [tt_jax.TTEmbeddingBag(tt_jax.TTSpec(100, 8, ranks=(4, 4)), config=c, impl="xla") for c in configs]
    else:
        program = dispatch.jit_forward
        key = "backward_config" if cls is tbe_jax.BackwardConfig else "histogram_config"
        cores = [tbe_jax.TableBatchedEmbedding(specs([10], [4]), impl="xla", **{key: c}) for c in configs]
    sizes = []
    for core in cores:
        core(core.init(jax.random.key(0)), idx, off)
        sizes.append(program._cache_size())
    return sizes


@pytest.mark.parametrize("cls,kw", FIELDS, ids=[next(iter(kw)) for _, kw in FIELDS])
def test_field_is_part_of_the_cache_key(cls, kw):
    """Configs differing only in this field are unequal and hash apart, so the cores holding them (static
    arguments of the jitted programs: `dispatch.jit_forward`, `jit_apply`, ...) compile one program each; equal
    configs share one."""
    a, b = cls(), cls(**kw)
    assert a != b and hash(a) != hash(b)
    if cls is TTKernelConfig:
        assert a.forward_config != b.forward_config and hash(a.forward_config) != hash(b.forward_config)
    sizes = _compiled_forwards(cls, [a, cls(), b, cls(**kw)])
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0] + 1 and sizes[3] == sizes[2]


# -- bad values -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kw,match", [
    (tbe_jax.BackwardConfig, dict(small_run_max=0), "small_run_max=0 must be an int >= 1"),
    (tbe_jax.BackwardConfig, dict(long_run=8), "long_run=8 must be an int above small_run_max=8"),
    (tbe_jax.BackwardConfig, dict(small_run_max=300), "long_run=256 must be an int above small_run_max=300"),
    (tbe_jax.BackwardConfig, dict(segment_buffers=0), "segment_buffers=0 must be an int >= 1"),
    (tbe_jax.BackwardConfig, dict(keys_block=1000), "keys_block=1000 must be a power of two"),
    (tbe_jax.BackwardConfig, dict(rle_block=0), "rle_block=0 must be a power of two"),
    (tbe_jax.BackwardConfig, dict(scan_chunk=3), "scan_chunk=3 must be a power of two"),
    (tbe_jax.BackwardConfig, dict(long_block=3), "long_block=3 must be a power of two"),
    (tbe_jax.BackwardConfig, dict(split_chunk=128), "split_chunk=128 must be None, 0 or an int C with small_run_max=8"),
    (tbe_jax.BackwardConfig, dict(split_chunk=4), "split_chunk=4 must be None, 0 or an int C"),
    (tbe_jax.BackwardConfig, dict(split_chunk=True), "split_chunk=True must be None, 0 or an int C"),
    (tbe_jax.BackwardConfig, dict(rank_sort_wide_block=48), "rank_sort_wide_block=48 must be 0 or a power of two"),
    (tbe_jax.BackwardConfig, dict(rank_sort_wide_block=4096), "rank_sort_wide_block=4096 must be 0 or a power"),
    (tbe_jax.BackwardConfig, dict(long_num_warps=0), "long_num_warps=0 must be >= 1"),
    (tbe_jax.BackwardConfig, dict(long_num_warps=2.0), "long_num_warps=2.0 must be >= 1"),
    (tbe_jax.BackwardConfig, dict(long_block=True), "long_block=True must be a power of two"),
    (tbe_jax.BackwardConfig, dict(step_width=96), "step_width=96 must be 0 or a power of two"),
    (tbe_jax.BackwardConfig, dict(step_width=True), "step_width=True must be 0 or a power of two"),
    (tbe_jax.BackwardConfig, dict(lookups_per_step=8.0), "lookups_per_step=8.0 must be a power of two"),
    (tbe_jax.BackwardConfig, dict(rank_sort_max=None), "rank_sort_max=None must be an int >= 0"),
    (tbe_jax.BackwardConfig, dict(rank_sort_wide_tile=-1), "rank_sort_wide_tile=-1 must be an int >= 0"),
    (tbe_jax.BackwardConfig, dict(rank_sort_block_i=12), "rank_sort_block_i=12 must be a power of two"),
    (tbe_jax.BackwardConfig, dict(rank_sort_block_i=512), "rank_sort_block_j=256 must be a multiple of"),
    (tbe_jax.BackwardConfig, dict(rank_sort_merge_block=4096), "rank_sort_chunk=2048 must be a multiple of"),
    (tbe_jax.BackwardConfig, dict(rank_sort_chunk=100), "rank_sort_chunk=100 must be a multiple of"),
    (histogram.HistogramConfig, dict(head=0), "head=0 must be an int in"),
    (histogram.HistogramConfig, dict(head=4096), "head=4096 must be an int in"),
    (histogram.HistogramConfig, dict(head=64, ids_per_step=128), "ids_per_step=128 must be 0 .auto. or a power"),
    (histogram.HistogramConfig, dict(head=2048, ids_per_step=4), "would reach 512"),
    (TTForwardConfig, dict(plan_block=1000), "plan_block must be a power of 2"),
    (TTKernelConfig, dict(plan_scan_chunk=0), "plan_scan_chunk must be a positive int"),
    (TTForwardConfig, dict(packed_key_limit=-1), r"packed_key_limit must be an int in \[0, 2\*\*31 - 1\]"),
    (TTKernelConfig, dict(reorder_key_limit=2**31), r"reorder_key_limit must be an int in \[0, 2\*\*31 - 1\]"),
    (TTKernelConfig, dict(force_int64_addressing=1), "force_int64_addressing must be a bool"),
])
def test_bad_values_raise(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(**kw)


def test_valid_edges():
    histogram.HistogramConfig(head=255, ids_per_step=1)  # a counter sees 255 ids: fits in 8 bits
    histogram.HistogramConfig(head=2048, ids_per_step=16)
    tbe_jax.BackwardConfig(small_run_max=1, long_run=2, segment_buffers=1)
    # NumPy integers are integers (a config read from an array); bools and floats are not (the bad values above)
    assert tbe_jax.BackwardConfig(programs=np.int64(8), long_block=np.int32(4), long_num_warps=np.int64(2)) == \
        tbe_jax.BackwardConfig(programs=8, long_block=4, long_num_warps=2)
