"""Bad input to the sharded API (`tbe_jax.shard`, `tt_jax.shard`) and to the layers built on it: a clear error
(or the documented conversion), never an internal error or a silently different lookup.

Each test names the input and what it did before: an obscure error from deep inside (a NumPy broadcast, a
`KeyError`, `shard_map`'s divisibility message, an unhashable cache key), a silent cast (integer or complex
weights and gradients), or a silently different plan (a float table key or device truncated, a negative
device ignored). The single-device checks: tests/test_input_errors.py, tests/test_tt_input_errors.py.

CPU: 4 fake devices (tests/conftest.py); the XLA path; small shapes, mostly no compile at all (the checks run
before any program).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax
import tt_jax
from conftest import layer_build
from tbe_jax.shard_plan import ShardingPlan

N_DEV = min(4, len(jax.devices()))
pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

TABLES = [tbe_jax.TableSpec(37, 8), tbe_jax.TableSpec(50, 4), tbe_jax.TableSpec(9, 8)]
F, B, CAP = 3, 2, 8
OUT = 8 + 4 + 8
# Storage buffers "d8" and "d4", as the unsharded embedding's: a state of `emb` has the sharded one's keys,
# only its rows differ.
PLAN = {0: "row", 1: "table", 2: ("table", N_DEV - 1)}
SPECS = (tt_jax.TTSpec(30, 4, p_shapes=(6, 6), q_shapes=(2, 2), ranks=(3,)),
         tt_jax.TTSpec(19, 4, p_shapes=(5, 4), q_shapes=(2, 2), ranks=(3,)))


def mesh(n=N_DEV):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))


def batch(num_features=F, n=N_DEV):
    off = np.tile(np.arange(num_features * B + 1, dtype=np.int32), (n, 1))  # one id per bag
    idx = np.tile(np.arange(CAP, dtype=np.int32) % 9, (n, 1))
    return idx, off


@pytest.fixture(scope="module")
def setup():
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    sharded = tbe_jax.shard(emb, mesh(), "data", PLAN)
    emb_params = emb.init(jax.random.key(0))
    params = sharded.set_tables(None, emb.get_tables(emb_params))
    opt = tbe_jax.Adagrad(0.1)
    return emb, sharded, emb_params, params, opt, sharded.init_opt_state(params, opt)


# -- tbe_jax.shard's arguments ------------------------------------------------------------------------------


def test_mesh_must_be_a_mesh():
    # was: AttributeError: 'str' object has no attribute 'axis_names'
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got str"):
        tbe_jax.shard(emb, "data")


@pytest.mark.parametrize("capacity", [2.5, 2.0, float("nan"), np.float32(3), np.array(3.0), True, "3"])
def test_capacity_scalar_must_be_an_int(capacity):
    # was: TypeError: 'float' object is not iterable (a float; likewise a 0-d array), or a message about
    # sequences (a string)
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    with pytest.raises(ValueError, match="capacity must be None, an int >= 1 or one int >= 0 per feature"):
        tbe_jax.shard(emb, mesh(), "data", PLAN, capacity=capacity)


def test_capacity_integer_scalars_and_arrays_accepted():
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    assert tbe_jax.shard(emb, mesh(), "data", PLAN, capacity=np.array(3)).capacity == 3  # was: TypeError
    assert tbe_jax.shard(emb, mesh(), "data", PLAN, capacity=np.int64(5)).capacity == 5
    assert tbe_jax.shard(emb, mesh(), "data", PLAN, capacity=np.array([2, 2, 2])).feature_capacity == (2, 2, 2)


def test_sharding_plan_for_another_number_of_tables():
    # was: IndexError: tuple index out of range
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    plan = ShardingPlan(("table", "table"), (0, 1), N_DEV)
    with pytest.raises(ValueError, match="the plan has 2 tables; the embedding has 3"):
        tbe_jax.shard(emb, mesh(), "data", plan)


@pytest.mark.parametrize("entry,was", [
    ({0: ("table", N_DEV)}, "IndexError"),
    ({0: ("table", -1)}, "planner placed the table itself"),
    ({0: ("table", 1.7)}, "device 1"),
    ({0: ("table", True)}, "device 1"),
    ({0: ("table", "x")}, "int() error"),
    (["row", ("table", N_DEV + 3), "table"], "IndexError"),
])
def test_plan_pinned_device_must_be_a_device_index(entry, was):
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    with pytest.raises(ValueError, match=r"the device must be an int index in \[0, "):
        tbe_jax.shard(emb, mesh(), "data", entry)
    with pytest.raises(ValueError, match=r"the device must be an int index in \[0, "):
        tbe_jax.plan_sharding(emb, N_DEV, entry)


@pytest.mark.parametrize("key", [1.7, True, None])
def test_plan_table_key_must_be_an_index_or_a_name(key):
    # was: 1.7 and True read as table 1; None a TypeError from int()
    emb = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    with pytest.raises(ValueError, match="a table is named by its int index or its TableSpec.name"):
        tbe_jax.shard(emb, mesh(), "data", {key: "row"})
    assert tbe_jax.plan_sharding(emb, N_DEV, {np.int64(1): ("table", np.int64(0))}).owners[1] == 0


# -- inputs and gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_per_sample_weights_must_be_float(setup, dtype):
    # was: cast to float32 silently (a complex weight lost its imaginary part), where emb raises
    _, sharded, _, params, opt, st = setup
    idx, off = batch()
    w = np.ones(idx.shape, dtype)
    with pytest.raises(TypeError, match=f"per_sample_weights must be floating point, got {np.dtype(dtype)}"):
        sharded(params, idx, off, w)
    with pytest.raises(TypeError, match="per_sample_weights must be floating point"):
        sharded.apply_gradients(params, st, opt, idx, off, np.zeros((N_DEV * B, OUT), np.float32), w)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_grad_output_must_be_float(setup, dtype):
    # was: cast silently (tt_jax.shard and emb raise)
    _, sharded, _, params, opt, st = setup
    idx, off = batch()
    with pytest.raises(TypeError, match=f"grad_output must be floating point, got {np.dtype(dtype)}"):
        sharded.apply_gradients(params, st, opt, idx, off, np.zeros((N_DEV * B, OUT), dtype))


def test_opt_state_of_emb_or_another_mesh(setup):
    # was: shard_map's "not evenly divisible" error about args[1].momentum (or, where the rows divide, a
    # per-device shape error inside the program)
    emb, sharded, emb_params, params, opt, _ = setup
    idx, off = batch()
    g = np.zeros((N_DEV * B, OUT), np.float32)
    want = r"opt_state.momentum\['d8'\] must be \[.*\] \(this mesh's shards\).*to_unsharded"
    with pytest.raises(ValueError, match=want):  # emb's buffers hold the tables' rows, not n devices' shards
        sharded.apply_gradients(params, emb.init_opt_state(emb_params, opt), opt, idx, off, g)
    n = 2 if N_DEV > 2 else 1
    other = tbe_jax.shard(emb, mesh(n), "data", {0: "row", 1: "table", 2: ("table", n - 1)})
    other_st = other.init_opt_state(other.set_tables(None, emb.get_tables(emb_params)), opt)
    with pytest.raises(ValueError, match=r"opt_state.momentum\[.*another mesh.*from_unsharded"):
        sharded.apply_gradients(params, other_st, opt, idx, off, g)


def test_train_step_with_opt_state_of_emb(setup):
    # tbe_jax.train_step's update (`_step_update`): the same check, before the program
    emb, sharded, emb_params, params, opt, _ = setup
    idx, off = batch()
    lookup = tbe_jax.SparseLookup(sharded, opt, params, emb.init_opt_state(emb_params, opt), idx, off)
    with pytest.raises(ValueError, match=r"opt_state.momentum\['d8'\] must be .*to_unsharded"):
        tbe_jax.train_step(lambda _, out: jnp.sum(out), None, lookup)


def test_params_leaf_must_be_an_array(setup):
    # was: AttributeError: 'list' object has no attribute 'shape'
    _, sharded, _, params, _, _ = setup
    idx, off = batch()
    with pytest.raises(TypeError, match=r"params\['d4'\] must be an array"):
        sharded({**params, "d4": [[0.0] * 4]}, idx, off)


# -- tables and optimizer state in and out -------------------------------------------------------------------


def test_set_tables_inputs(setup):
    emb, sharded, emb_params, params, _, _ = setup
    tables = [np.asarray(t) for t in emb.get_tables(emb_params)]
    # was: cast silently, dropping the imaginary part (emb.set_tables raises)
    with pytest.raises(TypeError, match="table 0 must hold real numbers, got dtype complex64"):
        sharded.set_tables(None, [tables[0].astype(np.complex64)] + tables[1:])
    # was: ValueError "expected 3 tables, got 1" (a dict) / "object of type 'generator' has no len()"
    for bad in ({"t": tables[0]}, (t for t in tables)):
        with pytest.raises(TypeError, match="tables must be a sequence of 3 arrays"):
            sharded.set_tables(None, bad)
    # was: AttributeError: 'list' object has no attribute 'shape'; nested lists are arrays, as for emb
    got = sharded.set_tables(None, [t.tolist() for t in tables])
    for a, b in zip(sharded.get_tables(got), sharded.get_tables(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_get_state_of_emb_or_another_mesh(setup):
    emb, sharded, emb_params, _, opt, _ = setup
    emb_st = emb.init_opt_state(emb_params, opt)
    # was: a state of emb read as if sharded (its "d8" rows cut by the sharded layout); KeyError for other keys
    with pytest.raises(ValueError, match=r"opt_state.momentum\['d8'\] must be \["):
        sharded.get_momentum(emb_st)
    col = tbe_jax.shard(emb, mesh(), "data", {0: "column", 1: "table", 2: "table"})  # buffers d2, d4, d8
    with pytest.raises(ValueError, match="opt_state.momentum must hold this sharded embedding's buffers"):
        col.get_state(emb_st, "momentum")
    with pytest.raises(ValueError, match="opt_state.momentum must hold this sharded embedding's buffers"):
        col.to_unsharded(col.set_tables(None, emb.get_tables(emb_params)), emb_st)


def test_set_state_inputs(setup):
    _, sharded, _, _, _, st = setup
    values = [np.asarray(v) for v in sharded.get_momentum(st)]
    # was: NumPy's "could not broadcast input array from shape (3,8) into shape (10,8)"
    with pytest.raises(ValueError, match=r"values\[0\] \(table 0\) must have shape \(37, 8\)"):
        sharded.set_state(st, "momentum", [values[0][:3]] + values[1:])
    # was: a row-wise [E] value quietly turned the element-wise field into a row-wise one
    with pytest.raises(ValueError, match=r"values\[1\] \(table 1\) must have shape \(50, 4\)"):
        sharded.set_state(st, "momentum", [values[0], values[1][:, 0], values[2]])
    # was: AttributeError: 'AdagradState' object has no attribute 'nope'
    with pytest.raises(ValueError, match="its state fields are \\['momentum'\\], not 'nope'"):
        sharded.set_state(st, "nope", values)
    new = sharded.set_state(st, "momentum", [v + 1 for v in values])
    np.testing.assert_array_equal(np.asarray(sharded.get_momentum(new)[2]), values[2] + 1)


def test_from_unsharded_state_must_be_emb_s(setup):
    emb, sharded, emb_params, _, _, st = setup
    # was: NumPy's "could not broadcast input array from shape ..." (a sharded state passed as emb's)
    with pytest.raises(ValueError, match="emb_opt_state.momentum does not match emb's params"):
        sharded.from_unsharded(emb_params, st)
    with pytest.raises(TypeError, match="emb_opt_state must be an optimizer state of emb"):
        sharded.from_unsharded(emb_params, {"momentum": emb_params})


# -- tt_jax.shard -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tt_setup():
    emb = tt_jax.TTEmbeddingBag(list(SPECS), feature_table_map=(0, 1, 0), impl="xla")
    sharded = tt_jax.shard(emb, mesh(), "data")
    return emb, sharded, emb.init(jax.random.key(0))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64])
def test_tt_per_sample_weights_must_be_float(tt_setup, dtype):
    # was: cast to float32 silently (the unsharded TTEmbeddingBag raises)
    _, sharded, params = tt_setup
    idx, off = batch()
    with pytest.raises(TypeError, match=f"per_sample_weights must be floating point, got {np.dtype(dtype)}"):
        sharded(params, idx, off, np.ones(idx.shape, dtype))


def test_tt_per_sample_weights_must_be_an_array(tt_setup):
    # was: ValueError: could not convert string to float: 'w'
    _, sharded, params = tt_setup
    idx, off = batch()
    with pytest.raises(TypeError, match="per_sample_weights must be a float array"):
        sharded(params, idx, off, "w")


def test_tt_params_and_state_structure(tt_setup):
    emb, sharded, params = tt_setup
    idx, off = batch()
    flat = {"cores": [params["cores"][0][0]]}  # one array for the table group, not its cores
    with pytest.raises(ValueError, match=r"params\['cores'\]\[0\] must be a sequence of the group's 2 cores"):
        sharded(flat, idx, off)  # was: TypeError: len() of unsized object
    with pytest.raises(TypeError, match="emb_opt_state must be an optimizer state of emb"):
        sharded.from_unsharded(params, "x")  # was: jax's "Value 'x' with dtype <U1 is not a valid JAX array"


# -- the layers ---------------------------------------------------------------------------------------------

FRAMEWORKS = ["linen", "nnx", "haiku"]


def _tbe_layer(framework):
    pytest.importorskip("haiku" if framework == "haiku" else "flax")
    import importlib

    return importlib.import_module(f"tbe_jax.{framework}").TableBatchedEmbed


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_layer_plan_as_a_list_and_capacity_as_an_array(framework):
    # was: TypeError: unhashable type: 'list' (a list plan, as tbe_jax.shard takes; an array capacity); a
    # tuple plan was read as a dict of (key, value) pairs
    cls = _tbe_layer(framework)
    plan = ["row", ("table", N_DEV - 1), ["table", 0]]
    seen = {}

    if framework == "haiku":
        import haiku as hk

        def build():
            seen["core"] = cls(TABLES, impl="xla", mesh=mesh(), sharding_plan=plan, capacity=np.array([2, 2, 2])).tbe

        hk.transform(build).init(jax.random.key(0))
        core = seen["core"]
    elif framework == "nnx":
        core = layer_build("nnx", cls, TABLES, impl="xla", mesh=mesh(), sharding_plan=plan,
                           capacity=np.array([2, 2, 2])).tbe
    else:
        core = cls(TABLES, impl="xla", mesh=mesh(), sharding_plan=plan, capacity=np.array([2, 2, 2])).tbe
    assert core.plan.strategies == ("row", "table", "table") and core.plan.owners[1:] == (N_DEV - 1, 0)
    assert core.feature_capacity == (2, 2, 2)
    pairs = (("table", 1), ("table", 0), "row")
    if framework == "linen":
        assert cls(TABLES, impl="xla", mesh=mesh(), sharding_plan=pairs).tbe.plan.owners[:2] == (1, 0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_layer_mesh_and_capacity_errors(framework):
    cls = _tbe_layer(framework)
    # was: AttributeError: 'str' object has no attribute 'axis_names'
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        layer_build(framework, cls, TABLES, impl="xla", mesh="data")
    # was: TypeError: 'float' object is not iterable
    with pytest.raises(ValueError, match="capacity must be None, an int >= 1"):
        layer_build(framework, cls, TABLES, impl="xla", mesh=mesh(), capacity=2.5)
    with pytest.raises(ValueError, match="the device must be an int index"):
        layer_build(framework, cls, TABLES, impl="xla", mesh=mesh(), sharding_plan={0: ("table", N_DEV)})


@pytest.mark.parametrize("fmap", [(0, 1.7, 2), (0, True, 2), "012"])
def test_linen_feature_table_map_not_truncated(fmap):
    # was: int() on every entry: 1.7 and True read as table 1, "012" as (0, 1, 2): a lookup of other tables
    # than asked (tbe_jax.nnx / tbe_jax.haiku raised the core's error); also with a mesh. A core built
    # before for (0, 1, 2) must not be taken for the float or bool entry (the layers' memo cache).
    pytest.importorskip("flax")
    from tbe_jax.linen import TableBatchedEmbed

    assert TableBatchedEmbed(TABLES, feature_table_map=(0, 1, 2), impl="xla").tbe.feature_table_map == (0, 1, 2)
    for kw in ({}, {"mesh": mesh()}):
        with pytest.raises(TypeError, match="feature_table_map.* must be .*(int table index|sequence of table)"):
            TableBatchedEmbed(TABLES, feature_table_map=fmap, impl="xla", **kw)
    arr = TableBatchedEmbed(TABLES, feature_table_map=np.array([2, 0]), impl="xla").tbe  # an int array: fine
    assert arr.feature_table_map == (2, 0)


def test_linen_one_table_spec():
    # was: TypeError: 'TableSpec' object is not iterable (tbe_jax.nnx / haiku: the core's message)
    pytest.importorskip("flax")
    from tbe_jax.linen import TableBatchedEmbed

    with pytest.raises(TypeError, match="wrap a single table in a list"):
        TableBatchedEmbed(TABLES[0], impl="xla")


def test_tt_linen_feature_table_map_not_truncated():
    pytest.importorskip("flax")
    from tt_jax.linen import TTEmbeddingBag

    assert TTEmbeddingBag(SPECS, feature_table_map=(0, 1), impl="xla").tt.feature_table_map == (0, 1)
    with pytest.raises(TypeError, match=r"feature_table_map"):
        TTEmbeddingBag(SPECS, feature_table_map=(0, 1.5), impl="xla", mesh=mesh())


def test_tables_in_host_memory_take_table_or_row():
    """Was: a "host" table sharded silently became an HBM shard (a model sized for host memory would not fit);
    "host_cached" raised a bare NotImplementedError. Both are now sharded in host memory
    (tests/test_sharding_host.py); a strategy they cannot take is refused, naming the table."""
    for location in ("host", "host_cached"):
        tables = [tbe_jax.TableSpec(37, 8), tbe_jax.TableSpec(50, 4, location=location)]
        emb = tbe_jax.TableBatchedEmbedding(tables)
        assert emb.shard(mesh(), "data").cached == (location == "host_cached")
        with pytest.raises(ValueError, match=rf"table 1 .*location '{location}'.*'table' or 'row'"):
            tbe_jax.shard(emb, mesh(), "data", {1: "column"})
    with pytest.raises(ValueError, match="'host_cached' tables .* not 'column'"):
        tbe_jax.shard(emb, mesh(), "data", {0: "column"})
