"""tt_jax input validation: int64 narrowing, the bounds_check modes, bad ids on both impls, malformed offsets.

Tiny sizes (interpret-mode Pallas is slow on a CPU): every jitted function below is built once per module
and called with inputs of one shape, so each compiles once.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import tt_jax
from tbe_jax import testing
from tt_jax import reference
from conftest import KERNEL_KW, assert_close

# Two tables of one (q_shapes, ranks) group (stacked by the planner). Table 0: N = 10 of prod(p) = 16, so ids
# 10..15 have in-range digits; table 1: N = 6 of prod(p) = 9.
SPECS = (tt_jax.TTSpec(10, 4, p_shapes=(4, 4), q_shapes=(2, 2), ranks=(2,)),
         tt_jax.TTSpec(6, 4, p_shapes=(3, 3), q_shapes=(2, 2), ranks=(2,)))
BATCH = 2
# feature 0 (N=10): bag 0 = [1, 12 (digits (3, 0)), -1 (pruned)], bag 1 = [3, 15 (digits (3, 3))]
# feature 1 (N=6):  bag 0 = [5, 7 (digits (2, 1)), -5], bag 1 = [6 (digits (2, 0)), 0]
BAD_IDX = np.array([1, 12, -1, 3, 15, 5, 7, -5, 6, 0], np.int32)
OFF = np.array([0, 3, 5, 8, 10], np.int32)
BAD_POS = [1, 4, 6, 7, 8]  # bad ids other than -1
CLEAN_IDX = np.where(np.isin(np.arange(len(BAD_IDX)), BAD_POS), -1, BAD_IDX).astype(np.int32)
G_OUT = np.linspace(-1.0, 1.0, BATCH * 8).reshape(BATCH, 8).astype(np.float32)


def _emb(impl="xla", **kw):
    return tt_jax.TTEmbeddingBag(SPECS, **(dict(KERNEL_KW) if impl == "pallas" else dict(impl=impl)), **kw)


@functools.lru_cache(maxsize=None)
def _params():
    # Cached, and first called from whichever test runs first in a worker, possibly inside a jit trace:
    # built concretely there too, or the cache would hold (and leak) that trace's tracers.
    rng = np.random.default_rng(0)
    with jax.ensure_compile_time_eval():
        return _emb().set_cores(None, [[rng.normal(0, 0.5, c).astype(np.float32) for c in s.core_shapes()]
                                       for s in SPECS])


def _model(idx, off, pooling="sum"):
    """Float64 model: ids outside [0, N_t) contribute nothing."""
    full = [reference.numpy_rows(c, s) for c, s in zip(_emb().get_cores(_params()), SPECS)]
    return testing.numpy_pooled(full, [0, 1], [BATCH, BATCH], idx, off, None, pooling, False)


@functools.lru_cache(maxsize=None)
def _fwd(mode):
    """jit: the xla lookup of `bounds_check=mode` (one compile per mode and dtype)."""
    emb = _emb("xla", bounds_check=mode)
    return jax.jit(lambda cores, idx, off: emb({"cores": cores}, idx, off))


def _lookup(mode, idx, off=OFF):
    return _fwd(mode)(_params()["cores"], jnp.asarray(idx), jnp.asarray(off))


@functools.lru_cache(maxsize=None)
def _vjp_fn(impl):
    """jit: (out, d_cores) of the lookup for the cotangent G_OUT."""
    emb = _emb(impl)

    @jax.jit
    def f(cores, idx, off):
        out, vjp = jax.vjp(lambda c: emb({"cores": c}, idx, off), cores)
        return out, vjp(jnp.asarray(G_OUT))[0]

    return f


def _run(impl, idx, off=OFF):
    out, d_cores = _vjp_fn(impl)(_params()["cores"], jnp.asarray(idx), jnp.asarray(off))
    return np.asarray(out), [[np.asarray(d) for d in ds] for ds in d_cores]


def _flat(d_cores):
    return np.concatenate([d.reshape(-1) for ds in d_cores for d in ds])


# -- the default mode: bad ids contribute nothing and get nothing, identically on both impls -------------------


def test_default_is_ignore_and_key():
    emb = tt_jax.TTEmbeddingBag(SPECS)
    assert emb.bounds_check == "ignore"
    assert emb == tt_jax.TTEmbeddingBag(SPECS, bounds_check="ignore")
    others = [tt_jax.TTEmbeddingBag(SPECS, bounds_check=m) for m in ("none", "warning", "fatal")]
    assert len({emb, *others}) == 4  # the mode is part of the hash key (a static jit argument)
    with pytest.raises(ValueError, match="bounds_check must be one of"):
        tt_jax.TTEmbeddingBag(SPECS, bounds_check="strict")


@pytest.fixture(scope="module")
def runs():
    return {impl: (_run(impl, BAD_IDX), _run(impl, CLEAN_IDX)) for impl in ("xla", "pallas")}


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bad_ids_skipped_forward_and_grads(runs, impl):
    # Ids >= N_t whose digits are in range (12, 15, 7, 6) and negative ids give exactly what -1 (pruned) gives.
    (out, d_cores), (out_c, d_cores_c) = runs[impl]
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(_flat(d_cores), _flat(d_cores_c))
    assert_close(out, _model(CLEAN_IDX, OFF), 2e-6)
    # Core 0 of table 0 (the first of the stacked group), slice 3 (the first digit of 12 and 15, of no valid id):
    # no gradient.
    assert not np.any(d_cores[0][0][3])


def test_bad_ids_same_on_xla_and_pallas(runs):
    (out_x, d_x), _ = runs["xla"]
    (out_p, d_p), _ = runs["pallas"]
    assert_close(out_p, out_x, 2e-6)
    assert_close(_flat(d_p), _flat(d_x), 2e-6)
    # The same slices get a gradient on both.
    np.testing.assert_array_equal(_flat(d_p) != 0, _flat(d_x) != 0)


# -- int64 ids: narrowed without wrapping ----------------------------------------------------------------------


_WRAPS = [2**32 + 3, -(2**32) + 3, 2**31, -(2**31) - 1]  # as int32: 3, 3, -2**31, 2**31 - 1
WIDE_IDX = np.array([_WRAPS[0], 1, _WRAPS[1], 3, 0, _WRAPS[2], 2, _WRAPS[3], 4, 5], np.int64)


def test_int64_ids_with_x64_give_no_wrong_row():
    want = WIDE_IDX.copy()
    want[[0, 2, 5, 7]] = -1
    with jax.enable_x64(True):
        ids = jnp.asarray(WIDE_IDX)
        assert ids.dtype == jnp.int64
        assert_close(_lookup("ignore", ids, jnp.asarray(OFF, jnp.int64)), _model(want, OFF), 2e-6)
        with pytest.raises(ValueError, match="index 4294967299 \\(indices\\[0\\]\\) is outside \\[0, 10\\)"):
            _emb("xla", bounds_check="fatal")(_params(), ids, OFF)


def test_host_int64_ids_are_not_wrapped():
    # Without x64, host int64 ids are narrowed on the host, exactly (jnp.asarray would wrap 2**32 + 3 to 3).
    with pytest.raises(ValueError, match="index 4294967299 \\(indices\\[0\\]\\)"):
        _emb("xla", bounds_check="fatal")(_params(), WIDE_IDX, OFF)


# -- "warning" -------------------------------------------------------------------------------------------------


def test_warning_counts_and_skips():
    with pytest.warns(RuntimeWarning, match="5 index\\(es\\) outside their table were skipped and 0 offsets"):
        out = _lookup("warning", BAD_IDX)
        jax.block_until_ready(out)
        jax.effects_barrier()
    assert_close(out, _model(CLEAN_IDX, OFF), 2e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean batch issues no warning
        jax.block_until_ready(_lookup("warning", CLEAN_IDX))
        jax.effects_barrier()


def test_warning_repairs_offsets():
    idx = np.array([1, 2, 3, 4, 5, 0, 1, 2, 3, 4], np.int32)
    off = np.array([2, 4, 3, 12, 9], np.int32)  # first not 0, decreasing, past len(indices)
    fixed = np.array([0, 4, 4, 10, 10], np.int32)
    with pytest.warns(RuntimeWarning, match="0 index\\(es\\).*4 offsets"):
        out = _lookup("warning", idx, off)
        jax.block_until_ready(out)
        jax.effects_barrier()
    assert_close(out, _model(idx, fixed), 2e-6)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_default_mode_clamps_offsets(impl, pooling):
    # Non-decreasing offsets that start below 0 (the second case: two entries) and end past len(indices): the same
    # clamped bags on both impls, lookup and update, silently; the pooling kernel reads no id past the end. Until
    # 2026-12-04 the update (both impls) and the XLA mean lookup divided a mean bag by the raw offsets difference,
    # and the update put the ids of a bag starting at a negative offset inside the batch into the last bag.
    idx = np.array([1, 2, 3, 4, 5, 0, 1, 2, 3, 4], np.int32)
    emb = _emb(impl, pooling=pooling)
    lookup = jax.jit(lambda c, i, o: emb({"cores": c}, i, o))
    opt = tt_jax.SGD(0.5)
    params = _params()
    state = emb.init_opt_state(params, opt)
    g = G_OUT + 0.25
    for off, clamped in (([-2, 4, 4, 9, 14], [0, 4, 4, 9, 10]), ([-3, -1, 4, 9, 14], [0, 0, 4, 9, 10])):
        off, clamped = np.array(off, np.int32), np.array(clamped, np.int32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out = lookup(params["cores"], idx, off)
            jax.effects_barrier()
        assert_close(out, _model(idx, clamped, pooling), 2e-6)
        got = emb.apply_gradients(params, state, opt, idx, off, g)
        want = emb.apply_gradients(params, state, opt, idx, clamped, g)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            # one ulp apart on the GPU (XLA fuses the mean's division differently for the two offset arrays)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-7, atol=1e-7)


# -- "fatal" ---------------------------------------------------------------------------------------------------


def test_fatal_concrete():
    emb = _emb("xla", bounds_check="fatal")
    with pytest.raises(ValueError, match="feature 0 \\(table 0\\), bag 0: index 12 \\(indices\\[1\\]\\) is outside"):
        emb(_params(), BAD_IDX, OFF)
    idx = BAD_IDX.copy()
    idx[[1, 4]] = [9, -1]
    with pytest.raises(ValueError, match="feature 1 \\(table 1\\), bag 0: index 7 \\(indices\\[6\\]\\) is outside"
                                         " \\[0, 6\\)"):
        emb(_params(), idx, OFF)
    with pytest.raises(ValueError, match="offsets\\[2\\]=2 is invalid for feature 0 \\(table 0\\), bag 1"):
        emb(_params(), CLEAN_IDX, np.array([0, 3, 2, 8, 10], np.int32))
    with pytest.raises(ValueError, match="offsets\\[4\\]=11 is invalid"):
        emb(_params(), CLEAN_IDX, np.array([0, 3, 5, 8, 11], np.int32))


def test_fatal_under_jit_and_checkify():
    emb = _emb("xla", bounds_check="fatal")
    f = checkify.checkify(jax.jit(lambda i, o: emb(_params(), i, o)))
    err, _ = f(BAD_IDX, OFF)
    with pytest.raises(checkify.JaxRuntimeError, match="feature 0, bag 0: index 12 \\(indices\\[1\\]\\)"):
        err.throw()
    err, _ = f(CLEAN_IDX, np.array([0, 3, 2, 8, 10], np.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="offsets\\[2\\]=2 is invalid for feature 0, bag 1"):
        err.throw()
    err, out = f(CLEAN_IDX, OFF)  # -1 is not an error
    err.throw()
    assert_close(out, _model(CLEAN_IDX, OFF), 2e-6)
    with pytest.raises(ValueError, match=r"bounds_check='fatal' under jax.jit .*checkify.checkify.*'warning'"):
        jax.jit(lambda i, o: emb(_params(), i, o))(BAD_IDX, OFF)  # a plain jit: the way out in the error


# -- "none" ----------------------------------------------------------------------------------------------------


def test_none_skips_the_pruned_marker():
    # Documented for "none": -1 (and any negative id) contributes nothing; valid offsets are the caller's duty.
    idx = np.array([1, -1, -1, 3, 9, 5, -1, 2, 4, 0], np.int32)
    assert_close(_lookup("none", idx), _model(idx, OFF), 2e-6)
