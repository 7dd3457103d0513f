"""The XLA path's sparse update (`tbe_jax.sparse_update`) against the dense reference update
(`reference.apply_gradients`, the semantics): the same tables and state (up to a few roundings: two XLA programs;
bitwise where the dense update leaves a value unchanged), for every optimizer, with duplicate
ids, invalid ids, empty bags, padding past `offsets[-1]`, padded row layouts, fp16 stochastic rounding and
non-finite gradients; and its traced program has no op over a whole table but the in-place scatters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
from tbe_jax import reference, sparse_update, testing
from conftest import KERNEL_KW, jaxpr_eqns, specs

OPTS = [tbe_jax.SGD(0.1), tbe_jax.SGD(0.1, stochastic_rounding=True), tbe_jax.Adagrad(0.1),
        tbe_jax.RowwiseAdagrad(0.1, weight_decay=0.01, weight_decay_mode="decoupled"), tbe_jax.Adam(0.05),
        tbe_jax.PartialRowwiseAdam(0.05), tbe_jax.Lamb(0.05), tbe_jax.PartialRowwiseLamb(0.05)]


def _check(got, want, before, name):
    """`got` equals `want` up to a few roundings (XLA may fuse one rule's divisions and multiply-adds differently
    in two programs; on a GPU its scatter-adds sum a row's lookups in any order), and bitwise `before` wherever
    the dense update left it unchanged."""
    got, want, before = (np.asarray(x) for x in (got, want, before))
    eps = float(jnp.finfo(want.dtype).eps)
    g64, w64, b64 = (x.astype(np.float64) for x in (got, want, before))
    # Scale: the operands (the old and new value), and the array's largest value (a row's gradient sums lookups
    # whose contributions may cancel: its rounding is relative to them, not to the small sum).
    scale = np.abs(b64) + np.abs(w64) + np.abs(w64).max(initial=0)
    bad = np.abs(g64 - w64) > 16 * eps * scale + 1e-5 * np.abs(w64 - b64) + 1e-30
    assert not bad.any(), (name, np.argwhere(bad)[:5], g64[bad][:5], w64[bad][:5])
    keep = (w64 == b64) & (np.signbit(w64) == np.signbit(b64))
    np.testing.assert_array_equal(got[keep], before[keep], err_msg=name)


def _dense(emb, params, state, opt, idx, off, g, psw):
    plan = emb.plan_for(len(off))
    return jax.jit(lambda p, s, g: reference.apply_gradients(
        p, opt.slots(s), emb.layout, plan, jnp.asarray(idx), jnp.asarray(off),
        None if psw is None else jnp.asarray(psw), g, opt.rule(), opt.hyperparameters(s.count),
        pooling=emb.pooling))(params, state, jnp.asarray(g))


def _name(o):
    return type(o).__name__ + ("-sr" if getattr(o, "stochastic_rounding", False) else "")


# Every optimizer on fp32 sum pooling; the low-precision, weighted and mean configurations on one row-wise, one
# element-wise and the stochastically rounded optimizer (the update rule is shared; what differs is the storage).
CASES = ([(o, "sum", False, "float32") for o in OPTS]
         + [(o, "mean", True, "float16") for o in (OPTS[1], OPTS[3], OPTS[4])]
         + [(o, "sum", True, "bfloat16") for o in (OPTS[1], OPTS[6])])


@pytest.mark.parametrize("opt,pooling,weighted,wdtype", CASES,
                         ids=[f"{_name(o)}-{p}-{w}" for o, p, _, w in CASES])
def test_sparse_equals_dense(rng, opt, pooling, weighted, wdtype):
    rows, dims = [40, 7, 300], [5, 16, 8]  # D=5 fp16: a padded row layout
    fmap = [0, 1, 2, 0]
    emb = tbe_jax.TableBatchedEmbedding(specs(rows, dims), feature_table_map=fmap, pooling=pooling,
                                        weights_dtype=wdtype, impl="xla")
    params = emb.init(jax.random.key(1))
    state = emb.init_opt_state(params, opt)
    idx, off, psw = testing.make_batch(rng, [rows[t] for t in fmap], [6] * 4, (0, 9), weighted=weighted)
    idx[::5] = idx[0]  # duplicates
    idx[3] = -2  # invalid ids: no row
    idx[7] = rows[fmap[0]] + 3
    off[2] = off[1]  # an empty bag
    idx = np.concatenate([idx, np.zeros(5, idx.dtype)])  # padding past offsets[-1] refers to row 0
    if psw is not None:
        psw = np.concatenate([psw, np.ones(5, psw.dtype)])
    step = jax.jit(lambda p, s, g: emb.apply_gradients(p, s, opt, idx, off, g, psw))
    for k in range(2):
        g = rng.standard_normal((6, sum(dims[t] for t in fmap))).astype(np.float32)
        if k == 1:
            g[2, 1] = np.nan  # a non-finite gradient: its rows skipped (skip_nonfinite) on both
        want_w, want_s = _dense(emb, params, state, opt, idx, off, g, psw)
        old_w, old_s = params, opt.slots(state)
        params, state = step(params, state, g)
        for key in want_w:
            _check(params[key], want_w[key], old_w[key], key)
        for got, want, old in zip(opt.slots(state), want_s, old_s):
            for key in want:
                _check(got[key], want[key], old[key], key)


def test_sparse_sequence(rng):
    emb = tbe_jax.TableBatchedEmbedding(specs([30, 9], [8, 8]), pooling="none", impl="xla")
    opt = tbe_jax.RowwiseAdagrad(0.1)
    params = emb.init(jax.random.key(2))
    state = emb.init_opt_state(params, opt)
    idx, off, _ = testing.make_batch(rng, [30, 9], [4, 4], (0, 5))
    idx[1] = idx[0]
    g = rng.standard_normal((len(idx), 8)).astype(np.float32)
    want_w, want_s = _dense(emb, params, state, opt, idx, off, g, None)
    got_w, got_state = jax.jit(lambda p, s: emb.apply_gradients(p, s, opt, idx, off, g))(params, state)
    for key in want_w:
        _check(got_w[key], want_w[key], params[key], key)
        _check(opt.slots(got_state)[0][key], want_s[0][key], opt.slots(state)[0][key], key)


def test_touched_rows():
    rows = jnp.asarray([5, 2, 5, 0, 9, 2, 7], jnp.int32)
    live = jnp.asarray([1, 1, 1, 1, 0, 1, 1], bool)
    slot, slot_row, hit = sparse_update.touched_rows(rows, live, 8)
    assert slot_row.tolist() == [0, 2, 5, 7, 8, 8, 8]
    assert hit.tolist() == [True] * 4 + [False] * 3
    assert [int(slot_row[s]) for s, ok in zip(slot.tolist(), live.tolist()) if ok] == [5, 2, 5, 0, 2, 7]
    assert int(slot_row[int(slot[4])]) == 8  # a dead lookup's slot holds the sentinel


BIG = 1 << 18  # rows of the "large" tables: no batch-sized array of these tests comes near it


def _table_sized(fn, *args, rows=BIG):
    """The primitives of `fn`'s traced program (nested ones included) with an output of `rows` or more along some
    axis, the calls that only wrap nested programs (jit, shard_map) left out."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return sorted(e.primitive.name for e in jaxpr_eqns(jaxpr.jaxpr)
                  if e.primitive.name not in ("jit", "pjit", "shard_map")
                  and any(s >= rows for v in e.outvars for s in getattr(v.aval, "shape", ())))


def _step(emb, opt, idx, off, prefetch=False):
    def step(p, s):
        if prefetch:
            p, s = emb.prefetch(p, idx, off, opt_state=s)
        res = tbe_jax.train_step(lambda _, out: jnp.sum(out * out), None, tbe_jax.SparseLookup(emb, opt, p, s, idx, off))
        return res.params, res.opt_state
    return step


def _abstract(emb, opt):
    params = jax.eval_shape(lambda: emb.init(jax.random.key(0)))
    return params, jax.eval_shape(lambda p: emb.init_opt_state(p, opt), params)


@pytest.mark.parametrize("opt", OPTS, ids=lambda o: type(o).__name__ + ("-sr" if getattr(o, "stochastic_rounding",
                                                                                         False) else ""))
def test_no_dense_work(opt):
    """The XLA path's update of large tables, by `apply_gradients` and by `train_step`, for every optimizer: every
    op but the final in-place scatters has batch-sized outputs (issue 36: no per-step work proportional to a
    table)."""
    emb = tbe_jax.TableBatchedEmbedding(specs([BIG + 5, BIG + 9, 100], [16, 8, 8]), impl="xla")
    params, state = _abstract(emb, opt)
    idx, off = np.zeros(64, np.int32), np.concatenate([np.arange(0, 64, 2), np.full(17, 64)]).astype(np.int32)
    g = jax.ShapeDtypeStruct((16, sum(emb.feature_dims)), jnp.float32)
    for fn, args in ((lambda p, s, g: emb.apply_gradients(p, s, opt, idx, off, g), (params, state, g)),
                     (_step(emb, opt, idx, off), (params, state))):
        big = _table_sized(fn, *args)
        assert big and set(big) == {"scatter"}, big


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the XLA path with host tables is refused on a GPU "
                    "(TableBatchedEmbedding raises): the kernels read and update pinned host rows in place there")
@pytest.mark.parametrize("location", ["host", "host_cached"])
def test_no_dense_work_in_host_memory(location):
    """Tables in host memory (the XLA path of the CPU): the training step, with the cache's prefetch, touches a
    large table (its rows, its directory) only through scatters."""
    opt = tbe_jax.RowwiseAdagrad(0.1)
    tables = [tbe_jax.TableSpec(BIG + 5, 16, location=location), tbe_jax.TableSpec(BIG + 9, 8),
              tbe_jax.TableSpec(100, 8)]
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla", cache_load_factor=0.2)
    idx, off = np.zeros(64, np.int32), np.concatenate([np.arange(0, 64, 2), np.full(17, 64)]).astype(np.int32)
    big = _table_sized(_step(emb, opt, idx, off, prefetch=location == "host_cached"), *_abstract(emb, opt))
    assert big and set(big) == {"scatter"}, big


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (the CPU suite fakes them)")
@pytest.mark.parametrize("opt", [tbe_jax.RowwiseAdagrad(0.1), tbe_jax.Adam(0.01)], ids=["rowwise", "adam"])
def test_no_dense_work_sharded(opt):
    """Sharded over 4 devices, every strategy in one model (row, table, column, data): inside the devices'
    programs only scatters produce arrays as large as a device's share of a table."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    tables = specs([BIG + 5, BIG + 9, BIG + 7, 100], [16, 16, 8, 8])
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla")
    sharded = tbe_jax.shard(emb, mesh, "data", {0: "row", 1: "table", 2: "column", 3: "data"})
    b = 8
    idx = np.zeros((4, 4 * b * 2), np.int32)
    off = np.tile(np.arange(0, 4 * b * 2 + 1, 2, dtype=np.int32), (4, 1))
    big = _table_sized(_step(sharded, opt, idx, off), *_abstract(sharded, opt), rows=BIG // 8)
    assert big and set(big) == {"scatter"}, big


def _aliased_outputs(eqn) -> set:
    """The outputs of a `pallas_call` that alias one of its inputs (updated in place)."""
    return {o for _, o in eqn.params.get("input_output_aliases", ())}


@pytest.mark.parametrize("location", ["device", "host", "host_cached"])
def test_no_dense_work_on_the_kernel_path(location):
    """The kernels' training step (the GPU's path; interpret mode on the CPU), with the cache's prefetch: every
    table-sized array it produces is a kernel's output updated in place (aliased to its input) or a scatter's
    (on a GPU, host buffers also carry a memory-space mark, which moves nothing)."""
    opt = tbe_jax.RowwiseAdagrad(0.1)
    tables = [tbe_jax.TableSpec(BIG + 5, 16, location=location), tbe_jax.TableSpec(BIG + 9, 8),
              tbe_jax.TableSpec(100, 8)]
    emb = tbe_jax.TableBatchedEmbedding(tables, cache_load_factor=0.2, **KERNEL_KW)
    idx, off = np.zeros(64, np.int32), np.concatenate([np.arange(0, 64, 2), np.full(17, 64)]).astype(np.int32)
    jaxpr = jax.make_jaxpr(_step(emb, opt, idx, off, prefetch=location == "host_cached"))(*_abstract(emb, opt))
    seen = set()
    for e in jaxpr_eqns(jaxpr.jaxpr):
        if e.primitive.name in ("jit", "pjit", "shard_map") or _placement(e):
            continue
        big = [k for k, v in enumerate(e.outvars) if any(s >= BIG for s in getattr(v.aval, "shape", ()))]
        if not big:
            continue
        seen.add(e.primitive.name)
        if e.primitive.name == "pallas_call":
            assert set(big) <= _aliased_outputs(e), (e.params.get("name"), big, _aliased_outputs(e))
        else:
            assert e.primitive.name == "scatter", e.primitive.name
    assert "pallas_call" in seen, seen


def _placement(eqn) -> bool:
    """A `device_put` to a memory space only (`memory.keep_on_host`: on a GPU an updated host buffer is marked as
    staying in pinned host memory, where the kernel wrote it; a CPU backend has no such marks)."""
    return eqn.primitive.name == "device_put" and all(
        isinstance(d, jax.memory.Space) for d in eqn.params.get("devices", ()))
