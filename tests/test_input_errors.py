"""Bad input to the single-device API: a clear error naming the problem, or an exact, tested repair.

Each case here used to give a silent wrong answer or an obscure internal error (OverflowError deep in
the index narrowing, AttributeError, KeyError, a dict-update error); see the comment on each test.
The XLA path throughout: what is tested is the argument handling in front of every path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tbe_jax
from conftest import KERNEL_KW, specs  # noqa: F401  (KERNEL_KW: the suite's convention)

TABLES = specs([300, 20], [8, 16])
IDX = np.array([1, 2, 3, 4], np.int32)
OFF = np.array([0, 1, 2, 3, 4], np.int32)  # F=2, B=2


def _emb(**kw):
    return tbe_jax.TableBatchedEmbedding(TABLES, impl="xla", **kw)


@pytest.fixture(scope="module")
def params():
    return _emb().init(jax.random.key(0))


# -- ids and offsets: dtypes -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16])
def test_narrow_integer_ids_and_offsets_are_widened_exactly(params, dtype):
    # Was: OverflowError ("... Got <class 'int'> with value 2147483648") from the int32 narrowing of
    # indices, on every call, eager or jitted. Now: widened to int32 (every value fits), same result.
    emb = _emb()
    want = emb(params, IDX, OFF)
    np.testing.assert_array_equal(emb(params, IDX.astype(dtype), OFF.astype(dtype)), want)
    np.testing.assert_array_equal(jax.jit(emb.__call__)(params, IDX.astype(dtype), OFF), want)
    opt = tbe_jax.SGD(0.1)
    g = np.ones(want.shape, np.float32)
    got = emb.apply_gradients(params, opt.init(params), opt, IDX.astype(dtype), OFF.astype(dtype), g)[0]
    ref = emb.apply_gradients(params, opt.init(params), opt, IDX, OFF, g)[0]
    for k in ref:
        np.testing.assert_array_equal(got[k], ref[k])


def test_int8_offsets_are_not_clamped_in_warning_mode(params):
    # Was a silent wrong answer: with int8 offsets and 200 ids, bounds_check="warning" clamped every
    # (valid) offset to len(indices) computed in int8 (200 -> -56), zeroing the output and reporting
    # 5 repaired offsets. Now: the offsets are widened first; nothing is repaired.
    emb = _emb(bounds_check="warning")
    idx = np.ones(200, np.int32)
    off = np.array([0, 50, 100, 120, 127], np.int8)
    out, rep = emb.forward_with_report(params, idx, off)
    assert int(rep.repaired_offsets) == 0 and int(rep.invalid_indices) == 0
    np.testing.assert_array_equal(out, emb(params, idx, off.astype(np.int32)))
    assert int(emb.bounds_report(idx, off).repaired_offsets) == 0


def test_unsigned_32_bit_indices_are_refused(params):
    # Was: OverflowError (comparing uint32 ids with -1). Unsigned ids have no -1 (pruned row) and may
    # exceed int32: refused by name.
    emb = _emb()
    with pytest.raises(TypeError, match="indices must be a signed integer type.*uint32"):
        emb(params, IDX.astype(np.uint32), OFF)
    with pytest.raises(TypeError, match="indices must be a signed integer type"):
        jax.jit(emb.__call__)(params, IDX.astype(np.uint32), OFF)


def test_int64_ids_past_int32_without_x64_are_refused_not_wrapped(params):
    # Was a silent wrong answer: with jax_enable_x64 off, NumPy int64 id 2**32 + 3 was wrapped by the
    # array conversion to 3, a valid row, and looked up, in every bounds_check mode ("fatal" included).
    with jax.enable_x64(False):
        idx = np.array([1, 2**32 + 3, 3, 4], np.int64)
        off = np.array([0, 2, 2, 3, 4], np.int64)
        for mode in ("ignore", "warning", "fatal"):
            with pytest.raises(ValueError, match=r"indices holds 4294967299, outside int32.*jax_enable_x64"):
                _emb(bounds_check=mode)(params, idx, off)
        with pytest.raises(ValueError, match="offsets holds -4294967296, outside int32"):
            _emb()(params, IDX, np.array([-(2**32), 1, 2, 3, 4], np.int64))
        emb = _emb()
        opt = tbe_jax.SGD(0.1)
        with pytest.raises(ValueError, match="indices holds 4294967299"):
            emb.apply_gradients(params, opt.init(params), opt, idx, off, np.ones((2, 24), np.float32))
        with pytest.raises(ValueError, match="indices holds 4294967299"):
            emb.bounds_report(idx, off)
        # int64 arrays whose values fit are fine (NumPy's default integer type).
        np.testing.assert_array_equal(emb(params, IDX.astype(np.int64), OFF.astype(np.int64)),
                                      emb(params, IDX, OFF))


def test_missing_ids_are_named(params):
    # Was: "None is not a valid value for jnp.array", naming no argument.
    emb = _emb()
    with pytest.raises(TypeError, match="indices must be an array, got None"):
        emb(params, None, OFF)
    with pytest.raises(TypeError, match="offsets must be an array, got None"):
        emb.forward_with_report(params, IDX, None)
    opt = tbe_jax.SGD(0.1)
    with pytest.raises(TypeError, match="grad_output must be an array.*got None"):
        emb.apply_gradients(params, opt.init(params), opt, IDX, OFF, None)


def test_bounds_report_checks_its_inputs():
    # Was a silent wrong answer: bounds_report skipped the input checks, so float ids reported 0
    # invalid ids and 2-D ids [2, 2] reported 2 repaired offsets.
    emb = _emb(bounds_check="warning")
    with pytest.raises(TypeError, match="indices must hold integers"):
        emb.bounds_report(IDX.astype(np.float32), OFF)
    with pytest.raises(TypeError, match="offsets must hold integers"):
        emb.bounds_report(IDX, OFF.astype(np.float32))
    with pytest.raises(ValueError, match="indices must be a 1-D array"):
        emb.bounds_report(IDX.reshape(2, 2), OFF)
    with pytest.raises(ValueError, match="indices must be a 1-D array"):
        jax.jit(emb.bounds_report)(IDX.reshape(2, 2), OFF)


# -- params and tables -----------------------------------------------------------------------------


def test_get_tables_checks_the_params(params):
    # Was: a buffer of the wrong shape gave silently truncated tables ([5, 16] for a [20, 16] table);
    # a missing buffer a bare KeyError.
    emb = _emb()
    with pytest.raises(ValueError, match=r"params\['d16'\] must be float32\[20, 16\], got float32\[5, 16\]"):
        emb.get_tables(dict(params, d16=jnp.zeros((5, 16))))
    with pytest.raises(ValueError, match=r"params hold buffers \['d8'\]"):
        emb.get_tables({"d8": params["d8"]})
    # The dtype is not checked: get_tables also reads gradients and casts of the params.
    f16 = jax.tree.map(lambda x: x.astype(jnp.float16), params)
    assert [t.dtype for t in emb.get_tables(f16)] == [jnp.float16, jnp.float16]


def test_params_buffers_must_be_arrays(params):
    # Was: AttributeError ("'list' object has no attribute 'shape'").
    emb = _emb()
    with pytest.raises(TypeError, match=r"params\['d8'\] must be an array .*got list"):
        emb(dict(params, d8=np.zeros((300, 8)).tolist()), IDX, OFF)
    with pytest.raises(TypeError, match=r"params\['d16'\] must be an array .*got NoneType"):
        emb.init_opt_state(dict(params, d16=None), tbe_jax.SGD(0.1))


def test_set_tables_argument_forms(params):
    emb = _emb()
    tables = [np.full((300, 8), 1.0), np.full((20, 16), 2.0)]
    # Was: AttributeError on nested lists. Now converted like arrays (the documented cast).
    back = emb.get_tables(emb.set_tables(None, [t.tolist() for t in tables]))
    for got, want in zip(back, tables):
        np.testing.assert_array_equal(got, want)
    # Was: AttributeError ("'str' object has no attribute 'shape'") when given a dict, e.g. the params.
    with pytest.raises(TypeError, match="tables must be a sequence of 2 arrays.*got dict"):
        emb.set_tables(None, params)
    with pytest.raises(TypeError, match="tables must be a sequence of 2 arrays.*got generator"):
        emb.set_tables(None, (t for t in tables))
    # Was: the imaginary part dropped (only a NumPy ComplexWarning).
    with pytest.raises(TypeError, match=r"table 0 \('t0'\) must hold real numbers, got dtype complex64"):
        emb.set_tables(None, [tables[0].astype(np.complex64), tables[1]])


# -- construction ----------------------------------------------------------------------------------


def test_feature_table_map_must_hold_ints():
    # Was a silent wrong answer: int() truncated 1.9 to table 1, and "10" read as [1, 0].
    t = specs([10, 20], [4, 4])
    with pytest.raises(TypeError, match=r"feature_table_map\[1\] must be an int table index, got 1.9"):
        tbe_jax.TableBatchedEmbedding(t, feature_table_map=[0, 1.9])
    with pytest.raises(TypeError, match="feature_table_map must be a sequence of table indices, got '10'"):
        tbe_jax.TableBatchedEmbedding(t, feature_table_map="10")
    with pytest.raises(TypeError, match=r"feature_table_map\[0\] must be an int table index, got True"):
        tbe_jax.TableBatchedEmbedding(t, feature_table_map=[True, 0])
    for fmap in (np.array([1, 0, 1]), jnp.array([1, 0, 1]), (np.int32(1), 0, 1)):
        assert tbe_jax.TableBatchedEmbedding(t, feature_table_map=fmap).feature_table_map == (1, 0, 1)


def test_tables_and_specs():
    # Was: "'TableSpec' object is not iterable".
    with pytest.raises(TypeError, match="tables must be a sequence of TableSpec"):
        tbe_jax.TableBatchedEmbedding(tbe_jax.TableSpec(10, 4))
    # Was: bag_size_hint=True accepted as a hint of 1.
    with pytest.raises(ValueError, match="bag_size_hint must be None or an int >= 0, got True"):
        tbe_jax.TableSpec(10, 64, bag_size_hint=True)


def test_static_batch_sizes_must_be_ints(params):
    # Was a silent wrong answer: (1.5, 2.5) was truncated to (1, 2), which matched the 4 offsets.
    emb = _emb()
    off = np.array([0, 1, 2, 3], np.int32)
    with pytest.raises(TypeError, match=r"batch_size_per_feature must hold ints, got 1.5"):
        emb(params, IDX, off, batch_size_per_feature=(1.5, 2.5))
    with pytest.raises(TypeError, match=r"batch_size_per_feature must hold ints, got True"):
        emb(params, IDX, off, batch_size_per_feature=(True, 2))
    with pytest.raises(TypeError, match=r"batch_size_per_feature must hold ints, got '1'"):
        jax.jit(lambda p, i, o: emb(p, i, o, batch_size_per_feature=("1", "2")))(params, IDX, off)
    # Was: "'int' object is not iterable".
    with pytest.raises(TypeError, match="batch_size_per_feature must be a sequence of ints"):
        emb(params, IDX, OFF, batch_size_per_feature=2)
    want = emb(params, IDX, off, batch_size_per_feature=(1, 2))
    for sizes in (np.array([1, 2]), [np.int64(1), np.int32(2)]):
        np.testing.assert_array_equal(emb(params, IDX, off, batch_size_per_feature=sizes), want)


# -- training --------------------------------------------------------------------------------------


def test_train_step_lookups_must_be_a_lookup_or_a_dict(params):
    # Was: "dictionary update sequence element #0 has length 8; 2 is required".
    emb = _emb()
    opt = tbe_jax.SGD(0.1)
    lk = tbe_jax.SparseLookup(emb, opt, params, opt.init(params), IDX, OFF)
    with pytest.raises(TypeError, match="lookups must be a tbe_jax.SparseLookup or a dict of them.*got list"):
        tbe_jax.train_step(lambda d, out: jnp.sum(out), None, [lk])


@pytest.mark.parametrize("cls", [tbe_jax.SGD, tbe_jax.RowwiseAdagrad, tbe_jax.Adagrad, tbe_jax.Adam,
                                 tbe_jax.Lamb, tbe_jax.PartialRowwiseAdam, tbe_jax.PartialRowwiseLamb])
def test_optimizer_hyperparameters_must_be_finite(cls):
    # Was a silent wrong answer: learning_rate=inf passed the "> 0" check and turned every looked-up
    # row into inf/NaN on the first step.
    with pytest.raises(ValueError, match=f"{cls.__name__}.learning_rate must be finite, got inf"):
        cls(float("inf"))
    with pytest.raises(ValueError, match="learning_rate must be finite, got nan"):
        cls(jnp.float32(np.nan))
    if cls is not tbe_jax.SGD:
        with pytest.raises(ValueError, match=f"{cls.__name__}.eps must be finite, got inf"):
            cls(0.1, eps=float("inf"))
    cls(optax.constant_schedule(0.1))  # schedules are still taken as they are
