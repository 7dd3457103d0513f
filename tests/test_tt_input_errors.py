"""tt_jax: bad inputs that used to give a silent wrong answer or an obscure internal error now raise a clear error.

Static checks only (shapes, dtypes, Python arguments): no kernel runs here, so the XLA path and tiny sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
import tt_jax

A = tt_jax.TTSpec(9, 4, p_shapes=(3, 3), q_shapes=(2, 2), ranks=(2,))
B = tt_jax.TTSpec(16, 4, p_shapes=(4, 4), q_shapes=(2, 2), ranks=(3,))  # another T = 2 spec: same D, other cores
C = tt_jax.TTSpec(8, 4, p_shapes=(2, 2, 2), q_shapes=(1, 2, 2), ranks=(2, 2))  # three cores

IDX = np.array([1, 2, 3], np.int32)
OFF = np.array([0, 2, 3], np.int32)
G = np.ones((2, 4), np.float32)
OPT = tt_jax.SGD(0.1)


def _emb(spec=A, **kw):
    return tt_jax.TTEmbeddingBag(spec, impl="xla", **kw)


@pytest.fixture(scope="module")
def params():
    return {s: _emb(s).init(jax.random.key(0)) for s in (A, B, C)}


# -- params that are not this embedding's ------------------------------------------------------------------------

_WRONG_SPEC = ("params\\['cores'\\]\\[0\\] must have shapes \\[\\(3, 1, 2, 2\\), \\(3, 2, 2, 1\\)\\] "
               "\\(table 0's spec\\)")

_CALLS = {
    # Cores of B (same T and D) used to be read with A's digits: a silent wrong output.
    "call": lambda emb, p: emb(p, IDX, OFF),
    "jit": lambda emb, p: jax.jit(lambda q: emb(q, IDX, OFF))(p),
    "full_table": lambda emb, p: emb.full_table(p),
    "get_cores": lambda emb, p: emb.get_cores(p),
    "init_opt_state": lambda emb, p: emb.init_opt_state(p, OPT),
    # These used to fail with a reshape TypeError deep in the optimizer step.
    "apply_gradients": lambda emb, p: emb.apply_gradients(p, OPT.init(p), OPT, IDX, OFF, G),
    "train_step": lambda emb, p: tbe_jax.train_step(
        lambda dense, out: jnp.sum(out**2), {}, tbe_jax.SparseLookup(emb, OPT, p, OPT.init(p), IDX, OFF)),
}


@pytest.mark.parametrize("call", list(_CALLS))
def test_params_of_another_spec(params, call):
    with pytest.raises(ValueError, match=_WRONG_SPEC + ", got \\[\\(4, 1, 2, 3\\), \\(4, 3, 2, 1\\)\\]"):
        _CALLS[call](_emb(), params[B])


def test_params_of_another_spec_pallas(params):
    # The check is static and comes before the kernels: the Pallas path (interpret mode here) raises at once too.
    emb = tt_jax.TTEmbeddingBag(A, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match=_WRONG_SPEC):
        emb(params[B], IDX, OFF)


def test_params_wrong_structure(params):
    emb = _emb()
    # Three cores for a two-core spec: used to be an IndexError in tt_jax.reference.
    with pytest.raises(ValueError, match=_WRONG_SPEC + ", got \\[\\(2, 1, 1, 2\\), \\(2, 2, 2, 2\\), "):
        emb(params[C], IDX, OFF)
    with pytest.raises(ValueError, match=_WRONG_SPEC):
        emb.full_table(params[C])
    # A transposed core of the right size: used to give a silent wrong output.
    c0, c1 = params[A]["cores"][0]
    with pytest.raises(ValueError, match=_WRONG_SPEC + ", got \\[\\(3, 1, 2, 2\\), \\(3, 1, 2, 2\\)\\]"):
        emb({"cores": ((c0, jnp.transpose(c1, (0, 3, 2, 1))),)}, IDX, OFF)
    with pytest.raises(ValueError, match=_WRONG_SPEC + ", got \\[\\(3, 1, 2, 2\\), 'list'\\]"):
        emb({"cores": ((c0, [1.0]),)}, IDX, OFF)
    # No table / a second table: an IndexError, or the extra table silently ignored.
    one_group = "params\\['cores'\\] must hold the stacked cores of 1 table group\\(s\\) \\[\\(0,\\)\\]"
    with pytest.raises(ValueError, match=one_group + ".*, got 0"):
        emb({"cores": ()}, IDX, OFF)
    with pytest.raises(ValueError, match=one_group + ".*, got 0"):
        emb.full_table({"cores": ()})  # used to return [] silently
    with pytest.raises(ValueError, match=one_group + ".*, got 2"):
        emb({"cores": params[A]["cores"] * 2}, IDX, OFF)
    # Not a params dict: KeyError 'cores' / "list indices must be integers".
    with pytest.raises(TypeError, match="params must be the dict emb.init/set_cores return"):
        emb({}, IDX, OFF)
    with pytest.raises(TypeError, match="params must be the dict emb.init/set_cores return"):
        emb(emb.get_cores(params[A]), IDX, OFF)
    # Integer cores: used to give all-zero outputs silently.
    int_cores = {"cores": tuple(tuple(c.astype(jnp.int32) for c in cs) for cs in params[A]["cores"])}
    with pytest.raises(TypeError, match="params\\['cores'\\]\\[0\\]\\[0\\] must be floating point \\(float32\\), "
                                        "got int32"):
        emb(int_cores, IDX, OFF)


def test_valid_params_still_accepted(params):
    emb = _emb()
    want = np.asarray(emb(params[A], IDX, OFF))
    as_lists = {"cores": emb.get_cores(params[A])}  # lists instead of tuples are fine
    np.testing.assert_array_equal(np.asarray(emb(as_lists, IDX, OFF)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda p: emb(p, IDX, OFF))(params[A])), want)
    two = tt_jax.TTEmbeddingBag([A, B], feature_table_map=np.array([1, 0]), impl="xla")  # numpy ints are ints
    assert two.feature_table_map == (1, 0)
    out = two({"cores": (params[A]["cores"][0], params[B]["cores"][0])}, IDX, np.array([0, 1, 3], np.int32))
    assert out.shape == (1, 8)


# -- constructor and init arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize("ftm", [[0.7, 1], [True, False], np.array([0.0, 1.0]), [None]])
def test_feature_table_map_must_hold_ints(ftm):
    # int() used to turn 0.7 into table 0 and True into table 1, silently.
    with pytest.raises(TypeError, match="feature_table_map must hold ints"):
        tt_jax.TTEmbeddingBag([A, B], feature_table_map=ftm)


@pytest.mark.parametrize("ftm", [1, "01"])
def test_feature_table_map_must_be_a_sequence(ftm):
    # An int used to raise "'int' object is not iterable"; "01" was read as tables (0, 1).
    with pytest.raises(TypeError, match="feature_table_map must be a sequence of ints"):
        tt_jax.TTEmbeddingBag([A, B], feature_table_map=ftm)


@pytest.mark.parametrize("interpret", ["no", "False", 0, None])
def test_interpret_must_be_a_bool(interpret):
    # bool("False") is True: the string silently turned interpret mode on.
    with pytest.raises(TypeError, match="interpret must be a bool"):
        tt_jax.TTEmbeddingBag(A, interpret=interpret)
    assert tt_jax.TTEmbeddingBag(A, interpret=np.bool_(True)).interpret is True


@pytest.mark.parametrize("std", [-0.1, float("nan"), float("inf"), True, "0.1", 1j, np.array([0.1, 0.2])])
def test_init_std_must_be_finite_and_non_negative(std):
    # A negative std used to act as its absolute value, nan/inf to give nan/inf cores.
    with pytest.raises(ValueError, match="std must be None or a finite number >= 0"):
        _emb().init(jax.random.key(0), std=std)


def test_init_std_zero_and_numpy_ok():
    emb = _emb()
    assert not any(np.any(np.asarray(c)) for c in emb.init(jax.random.key(0), std=0)["cores"][0])
    emb.init(jax.random.key(0), std=np.float32(0.1))
    emb.init(jax.random.key(0), std=jnp.float32(0.1))


def test_set_cores_checks_shapes_and_dtypes():
    emb = _emb()
    nested = [[np.zeros(s).tolist() for s in A.core_shapes()]]  # nested lists of the right shapes: converted
    assert [c.dtype for c in emb.set_cores(None, nested)["cores"][0]] == [jnp.float32] * 2
    with pytest.raises(ValueError, match="table 0 core 1 must have shape \\(3, 2, 2, 1\\), got \\(1,\\)"):
        emb.set_cores(None, [[np.zeros((3, 1, 2, 2)), [1.0]]])  # used to be an AttributeError on .shape
    with pytest.raises(TypeError, match="table 0 core 0 must hold real numbers \\(converted to float32\\), "
                                        "got complex64"):
        emb.set_cores(None, [[np.full((3, 1, 2, 2), 1j, np.complex64), np.zeros((3, 2, 2, 1))]])


# -- per_sample_weights ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("psw", [np.array([1j, 1, 1], np.complex64), np.array([1, 2, 3], np.int32),
                                 np.array([True, False, True])])
def test_per_sample_weights_must_be_float(params, psw):
    # Complex weights used to lose their imaginary part silently; ints and bools were cast (tbe_jax refuses them).
    emb = _emb()
    with pytest.raises(TypeError, match=f"per_sample_weights must be floating point, got {psw.dtype}"):
        emb(params[A], IDX, OFF, psw)
    with pytest.raises(TypeError, match="per_sample_weights must be floating point"):
        emb.apply_gradients(params[A], OPT.init(params[A]), OPT, IDX, OFF, G, psw)


def test_per_sample_weights_messages(params):
    emb = _emb()
    with pytest.raises(TypeError, match="per_sample_weights must be a float array"):
        emb(params[A], IDX, OFF, "abc")
    with pytest.raises(ValueError, match="per_sample_weights has shape \\(2,\\); it must match indices \\(3,\\)"):
        emb(params[A], IDX, OFF, np.ones(2, np.float32))
    out = emb(params[A], IDX, OFF, [1.0, 1.0, 1.0])  # a list of floats is fine
    np.testing.assert_allclose(np.asarray(out), np.asarray(emb(params[A], IDX, OFF)), rtol=1e-6)


@pytest.mark.parametrize("kw,err,match", [
    (dict(p_shapes=(3.5, 3), q_shapes=(2, 2)), TypeError, "p_shapes must hold ints"),
    (dict(ranks=(2.7,)), TypeError, "ranks must hold ints"),
    (dict(ranks=(True,)), TypeError, "ranks must hold ints"),
    (dict(ranks="22"), TypeError, "ranks must be a sequence of ints"),
    (dict(ranks=2), TypeError, "ranks must be a sequence of ints"),
    (dict(p_shapes=(), q_shapes=(2, 2), ranks=(2,)), ValueError, "must each have 2 factors"),
])
def test_spec_factor_types(kw, err, match):
    # int() would truncate 3.5 and 2.7, read True as rank 1 and "22" as ranks (2, 2); an empty
    # factorisation is not the default one (None).
    with pytest.raises(err, match=match):
        tt_jax.TTSpec(9, 4, **kw)


def test_spec_factors_from_numpy_and_lists():
    spec = tt_jax.TTSpec(9, 4, p_shapes=np.array([3, 3]), q_shapes=[2, 2], ranks=[np.int64(2)])
    assert spec.p_shapes == (3, 3) and spec.q_shapes == (2, 2) and spec.ranks == (2,)
