"""`tt_jax.shard`: TT tables data parallel over a mesh axis, against the unsharded embedding on the global batch.

CPU: 4 fake devices (tests/conftest.py); GPU: the devices present (2 on the 2-GPU machine). The XLA path
for most cases (small shapes: every distinct program is a compile), one small Pallas case (interpret mode
on CPU). Oracle: `emb` itself on the global batch (device 0's samples, then device 1's, ...), with the
cores copied to one device.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tbe_jax
from tbe_jax import testing
import tt_jax
from conftest import KERNEL_KW, assert_close

N_DEV = min(4, len(jax.devices()))
pytestmark = pytest.mark.skipif(N_DEV < 2, reason="needs 2+ devices")

# Table 0 is read by features 0 and 2 (shared slices), table 1 by feature 1. One stacked table group (same
# q_shapes and ranks) and two cores: small programs, as every distinct one is a compile.
SPECS = (tt_jax.TTSpec(30, 4, p_shapes=(6, 6), q_shapes=(2, 2), ranks=(3,)),
         tt_jax.TTSpec(19, 4, p_shapes=(5, 4), q_shapes=(2, 2), ranks=(3,)))
DIM = 12  # the output's width: 3 features of 4
FTM = (0, 1, 0)
B, CAP = 3, 16  # per device: b samples, room for CAP ids
RTOL = 1e-5


def make_emb(pooling="sum", specs=SPECS, ftm=FTM, **kw):
    kw = {"impl": "xla", **kw}
    return tt_jax.TTEmbeddingBag(list(specs), feature_table_map=ftm, pooling=pooling, **kw)


def mesh(n=N_DEV, auto=False):
    """`jax.make_mesh`'s mesh (explicit axes on jax 0.10+), or one with an automatic axis."""
    if auto:
        return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def local_batches(rng, emb, n=N_DEV, b=B, cap=CAP, bad=False):
    """Per device: ids [cap] (garbage past offsets[-1]), offsets [F*b+1], weights [cap]. Empty bags,
    duplicate ids (drawn from a few rows), an id -1 (pruned: skipped) and, with `bad`, ids past the table."""
    nf = len(emb.feature_table_map)
    idx = np.zeros((n, cap), np.int32)
    off = np.zeros((n, nf * b + 1), np.int32)
    for k in range(n):
        lens = rng.integers(0, 4, size=nf * b)
        lens[rng.integers(0, nf * b)] = 0
        while lens.sum() > cap - 1:
            lens = lens // 2
        off[k, 1:] = np.cumsum(lens)
        for f in range(nf):
            e = emb.specs[emb.feature_table_map[f]].num_embeddings
            a, z = off[k, f * b], off[k, (f + 1) * b]
            idx[k, a:z] = rng.choice(rng.integers(0, e, size=3), size=z - a)
        idx[k, off[k, -1]:] = rng.integers(-5, 100, size=cap - off[k, -1])
        if off[k, -1] > 2:
            idx[k, 1] = -1
            if bad:
                idx[k, 2] = 1000 + k
    w = rng.uniform(0.5, 1.5, size=idx.shape).astype(np.float32)
    return idx, off, w


def global_batch(emb, idx, off, w):
    """The devices' samples as one batch in `emb`'s format (feature-major: feature f's bags of device 0,
    then device 1, ...), ids and weights padded past offsets[-1] to one length (n*cap): the oracle compiles
    once for every step."""
    gi, go, gw, _ = testing.stack_batches(idx, off, w, num_features=len(emb.feature_table_map),
                                          pad_to=np.asarray(idx).size)
    return gi, go, gw


def on_host(tree):
    """A copy on the default device (the oracle's inputs must not carry the mesh)."""
    return jax.tree_util.tree_map(lambda x: jnp.asarray(np.asarray(x)), tree)


def assert_replicated(tree):
    """Every leaf replicated on the mesh, its copies bitwise identical."""
    for x in jax.tree_util.tree_leaves(tree):
        assert x.sharding.is_fully_replicated, x.sharding
        shards = [np.asarray(s.data) for s in x.addressable_shards]
        assert len(shards) == len(x.sharding.device_set)
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


def assert_trees_close(a, b, rtol=RTOL):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if np.asarray(y).ndim == 0 and not np.issubdtype(np.asarray(y).dtype, np.floating):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        elif np.asarray(y).ndim == 0:  # a loss: its batch mean sums in another order on n devices
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
        else:
            assert_close(x, y, rtol)


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def init_params(sh, key=0):
    return sh.init(jax.random.key(key), std=0.3)  # a larger scale than the default: visible updates


# -- forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling,weighted", [("sum", False), ("mean", True)])
def test_forward_matches_global_batch(rng, pooling, weighted):
    emb = make_emb(pooling)
    sh = tt_jax.shard(emb, mesh(), "data")
    assert sh.plan.strategies == ("data", "data") and sh.plan.num_devices == N_DEV
    params = init_params(sh)
    assert_replicated(params)
    assert_trees_equal(params, emb.init(jax.random.key(0), std=0.3))  # emb.init's values
    idx, off, w = local_batches(rng, emb)
    out = sh(params, idx, off, w if weighted else None)
    assert out.shape == (N_DEV * B, DIM)
    assert out.sharding.spec == P("data") or out.sharding.spec == P("data", None)
    gi, go, gw = global_batch(emb, idx, off, w)
    ref = emb(on_host(params), gi, go, gw if weighted else None)
    assert_close(out, ref, RTOL)
    # Device k's rows are its own batch's lookups.
    assert_close(np.asarray(out)[B : 2 * B], emb(on_host(params), idx[1], off[1], w[1] if weighted else None), RTOL)


# -- training ------------------------------------------------------------------------------------

# (pooling, weighted, optimizer); Adam is trained through tbe_jax.train_step (test_train_step).
OPTS = {
    "sgd": ("sum", False, lambda: tt_jax.SGD(learning_rate=0.1)),
    "rowwise_adagrad": ("mean", True, lambda: tt_jax.RowwiseAdagrad(learning_rate=0.2)),
    "adam": ("mean", True, lambda: tt_jax.Adam(learning_rate=0.02, weight_decay=0.01)),
}


def run_steps(rng, sh, emb, opt, weighted, steps=3, n=N_DEV):
    """`steps` sharded updates and the oracle's on the same global batches: (sharded, oracle) (params, state)."""
    params = init_params(sh)
    state = sh.init_opt_state(params, opt)
    assert_replicated(state)
    p_ref = on_host(params)
    s_ref = emb.init_opt_state(p_ref, opt)
    for _ in range(steps):
        idx, off, w = local_batches(rng, emb, n=n)
        g = rng.normal(size=(n * B, DIM)).astype(np.float32)
        params, state = sh.apply_gradients(params, state, opt, idx, off, g, w if weighted else None)
        gi, go, gw = global_batch(emb, idx, off, w)
        p_ref, s_ref = emb.apply_gradients(p_ref, s_ref, opt, gi, go, g, gw if weighted else None)
    return (params, state), (p_ref, s_ref)


@pytest.mark.parametrize("name,sync", [("sgd", True), ("rowwise_adagrad", None)])
def test_training_matches_global_batch(rng, name, sync):
    """3 steps against `emb.apply_gradients` on the global batches; SGD with `sync_replicas=True` (device 0's
    step broadcast after each update, as on a GPU with the XLA backward)."""
    pooling, weighted, make_opt = OPTS[name]
    emb = make_emb(pooling)
    sh = tt_jax.shard(emb, mesh(), sync_replicas=sync)
    opt = make_opt()
    (params, state), (p_ref, s_ref) = run_steps(rng, sh, emb, opt, weighted)
    assert_replicated((params, state))
    moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
             zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(init_params(sh)))]
    assert all(moved)
    assert_trees_close(sh.get_cores(params), emb.get_cores(p_ref))
    assert int(state.count) == 3
    fields = [f for f in state._fields if f != "count"]
    for f in fields:
        assert_trees_close(sh.get_state(state, f), emb.get_state(s_ref, f))
    if name == "rowwise_adagrad":
        assert_trees_close(sh.get_momentum(state), emb.get_momentum(s_ref))


def test_mesh_of_one_is_emb_bitwise(rng):
    pooling, weighted, make_opt = OPTS["rowwise_adagrad"]
    # the kernels on GPU: XLA's GPU scatter-add sums in no fixed order, even between two runs of emb
    emb = make_emb(pooling, **({"impl": "pallas"} if jax.default_backend() == "gpu" else {}))
    sh = tt_jax.shard(emb, mesh(1))
    opt = make_opt()
    params = init_params(sh)
    idx, off, w = local_batches(rng, emb, n=1)
    out = sh(params, idx, off, w)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(emb(on_host(params), idx[0], off[0], w[0])))
    state = sh.init_opt_state(params, opt)
    p_ref, s_ref = on_host((params, state))
    for _ in range(2):
        idx, off, w = local_batches(rng, emb, n=1)
        g = rng.normal(size=(B, DIM)).astype(np.float32)
        params, state = sh.apply_gradients(params, state, opt, idx, off, g, w)
        p_ref, s_ref = emb.apply_gradients(p_ref, s_ref, opt, idx[0], off[0], g, w[0])
    assert_trees_equal((params, state), (p_ref, s_ref))


def test_jit(rng):
    """Under jax.jit (inputs and gradients traced) as eagerly."""
    pooling, weighted, make_opt = OPTS["rowwise_adagrad"]
    emb = make_emb(pooling)
    sh = tt_jax.shard(emb, mesh())
    opt = make_opt()
    params = init_params(sh)
    state = sh.init_opt_state(params, opt)
    idx, off, w = local_batches(rng, emb)
    g = rng.normal(size=(N_DEV * B, DIM)).astype(np.float32)

    @jax.jit
    def step(params, state, opt, idx, off, w, g):
        out = sh(params, idx, off, w)
        return out, sh.apply_gradients(params, state, opt, idx, off, g * 2.0, w)

    out_j, (p_j, s_j) = step(params, state, opt, idx, off, w, g / 2.0)
    p_e, s_e = sh.apply_gradients(params, state, opt, idx, off, g, w)
    assert_replicated((p_j, s_j))
    assert_close(out_j, sh(params, idx, off, w), RTOL)
    assert_trees_close((p_j, s_j), (p_e, s_e), 1e-6)


def test_train_step(rng):
    """`tbe_jax.train_step` with a sharded TT lookup, jitted, against the unsharded step on the global batch.
    An automatic mesh axis: with an explicit one, jax asks the loss itself how its batch reductions are sharded."""
    pooling, weighted, make_opt = OPTS["adam"]
    emb = make_emb(pooling)
    sh = tt_jax.shard(emb, mesh(auto=True))
    opt = make_opt()
    labels = rng.normal(size=(N_DEV * B,)).astype(np.float32)

    def loss_fn(head, pooled):
        return jnp.mean((pooled @ head["w"] + head["b"] - labels) ** 2)

    def step(e, head, params, state, idx, off, w):
        res = tbe_jax.train_step(loss_fn, head, tbe_jax.SparseLookup(e, opt, params, state, idx, off, w))
        return res.loss, res.grads, res.params, res.opt_state, res.report

    step_sh = jax.jit(lambda *a: step(sh, *a))
    step_ref = jax.jit(lambda *a: step(emb, *a))
    head = {"w": jnp.asarray(rng.normal(size=(DIM,)).astype(np.float32)), "b": jnp.zeros(())}
    params = init_params(sh)
    state = sh.init_opt_state(params, opt)
    p_ref, s_ref = on_host((params, state))
    for _ in range(2):
        idx, off, w = local_batches(rng, emb)
        loss, grads, params, state, report = step_sh(head, params, state, idx, off, w)
        gi, go, gw = global_batch(emb, idx, off, w)
        loss_r, grads_r, p_ref, s_ref, _ = step_ref(head, p_ref, s_ref, gi, go, gw)
        assert_close(loss, loss_r, RTOL)
        assert_trees_close(grads, grads_r)
        assert int(report.invalid_indices) == 0 and int(report.nonfinite_grads) == 0
    assert_replicated((params, state))
    assert_trees_close((params, state), (p_ref, s_ref))


def test_warning_mode_counts_over_the_mesh(rng):
    emb = make_emb("sum", bounds_check="warning")
    sh = tt_jax.shard(emb, mesh())
    params = init_params(sh)
    idx, off, w = local_batches(rng, emb, bad=True)
    nbad = sum(int(off[k, -1] > 2) for k in range(N_DEV))
    assert nbad > 0
    with pytest.warns(RuntimeWarning, match=f"{nbad} index"):
        out, rep = sh.forward_with_report(params, idx, off)
        out.block_until_ready()
        jax.effects_barrier()
    assert int(rep.invalid_indices) == nbad and int(rep.repaired_offsets) == 0
    gi, go, _ = global_batch(emb, idx, off, w)
    assert_close(out, make_emb("sum")(on_host(params), gi, go), RTOL)


def test_kernel_path(rng):
    """The Pallas path (interpret mode on CPU): forward and one SGD step, 2 devices, one small table. Oracle:
    the XLA path on the global batch (the two paths agree to rounding; interpret mode compiles slowly)."""
    specs, ftm = (SPECS[1],), (0, 0)
    emb = make_emb("sum", specs, ftm, **KERNEL_KW)
    ref = make_emb("sum", specs, ftm)
    n, b = 2, 2
    sh = tt_jax.shard(emb, mesh(n))
    params = init_params(sh)
    idx, off, w = local_batches(rng, emb, n=n, b=b, cap=8)
    gi, go, gw = global_batch(emb, idx, off, w)
    assert_close(sh(params, idx, off, w), ref(on_host(params), gi, go, gw), RTOL)
    opt = tt_jax.SGD(learning_rate=0.1)
    g = rng.normal(size=(n * b, 8)).astype(np.float32)
    p, _ = sh.apply_gradients(params, sh.init_opt_state(params, opt), opt, idx, off, g, w)
    p_ref, _ = ref.apply_gradients(on_host(params), ref.init_opt_state(on_host(params), opt), opt, gi, go, g, gw)
    assert_replicated(p)
    assert_trees_close(p, p_ref)


# -- true gradient -------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling,weighted,path", [("sum", False, "xla"), ("mean", True, "xla"),
                                                   ("mean", True, "kernel")])
def test_grad_matches_global_batch(rng, pooling, weighted, path):
    """`jax.jit(jax.grad(loss))` (and `value_and_grad`) through the sharded forward w.r.t. the replicated
    cores: the unsharded `emb`'s gradient on the global batch (the devices' shares summed over the axis),
    replicated. XLA: 4 devices, an explicit axis (grad) and an automatic one (value_and_grad). Kernel:
    the Pallas path in interpret mode on CPU (`check_vma` off there: shard_map's transpose sums the
    cotangent), 2 devices, one small table, against the XLA path on the global batch."""
    if path == "kernel":
        specs, ftm, n, b, cap = (SPECS[1],), (0, 0), 2, 2, 8
        emb, ref = make_emb(pooling, specs, ftm, **KERNEL_KW), make_emb(pooling, specs, ftm)
    else:
        specs, ftm, n, b, cap = SPECS, FTM, N_DEV, B, CAP
        emb = ref = make_emb(pooling)
    sh = tt_jax.shard(emb, mesh(n, auto=weighted))
    params = init_params(sh)
    idx, off, w_all = local_batches(rng, emb, n=n, b=b, cap=cap)
    w = w_all if weighted else None
    dim = sum(specs[t].embedding_dim for t in ftm)
    coef = jnp.asarray(rng.normal(size=(n * b, dim)).astype(np.float32))

    def loss(p, e, i, o, ww):
        return jnp.sum(jnp.tanh(e(p, i, o, ww)) * coef) / (n * b)

    gi, go, gw = global_batch(emb, idx, off, w_all)
    gw = gw if weighted else None
    want_loss, want = jax.jit(jax.value_and_grad(loss), static_argnums=1)(on_host(params), ref, gi, go, gw)
    if weighted:
        got_loss, got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, sh, idx, off, w)
        np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss), rtol=1e-6)
    else:
        got = jax.jit(jax.grad(loss), static_argnums=1)(params, sh, idx, off, w)
    assert_replicated(got)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert_trees_close(got, want)
    assert all(np.any(np.asarray(x) != 0) for x in jax.tree_util.tree_leaves(want))


def test_errors():
    emb = make_emb()
    m = mesh()
    with pytest.raises(TypeError, match="TTEmbeddingBag"):
        tt_jax.shard(tbe_jax.TableBatchedEmbedding([tbe_jax.TableSpec(10, 4)]), m)
    with pytest.raises(ValueError, match="axis_name"):
        tt_jax.shard(emb, m, "model")
    with pytest.raises(ValueError, match="fatal"):
        tt_jax.shard(make_emb(bounds_check="fatal"), m)
    for plan in ({1: "row"}, ["table", "data"], {0: ("table", 0)}):
        with pytest.raises(NotImplementedError, match="not supported for TT tables"):
            tt_jax.shard(emb, m, plan=plan)
    with pytest.raises(ValueError, match="strategy must be one of"):
        tt_jax.shard(emb, m, plan={0: "rows"})
    with pytest.raises(ValueError, match="table index"):
        tt_jax.shard(emb, m, plan={2: "data"})
    with pytest.raises(ValueError, match="2 tables"):
        tt_jax.shard(emb, m, plan=["data"])
    sh = tt_jax.shard(emb, m, plan={0: "data"})
    assert sh.strategies == ("data", "data")
    assert tt_jax.shard(emb, m, plan=sh.plan) == sh and hash(tt_jax.shard(emb, m)) == hash(sh)
    params = emb.init(jax.random.key(0))
    idx = np.zeros((N_DEV, 4), np.int32)
    off = np.zeros((N_DEV, 3 * B + 1), np.int32)
    with pytest.raises(ValueError, match="indices must be"):
        sh(params, idx[0], off)
    with pytest.raises(ValueError, match="F\\*b\\+1"):
        sh(params, idx, off[:, 1:])
    with pytest.raises(ValueError, match="per_sample_weights"):
        sh(params, idx, off, np.ones((N_DEV, 3), np.float32))
    with pytest.raises(ValueError, match="params"):
        sh({"cores": params["cores"][:0]}, idx, off)
    with pytest.raises(ValueError, match="holds per-table cores"):  # the two tables are one stacked group
        sh({"cores": tuple(map(tuple, emb.get_cores(params)))}, idx, off)
    opt = tt_jax.SGD(learning_rate=0.1)
    state = sh.init_opt_state(params, opt)
    with pytest.raises(ValueError, match="grad_output"):
        sh.apply_gradients(params, state, opt, idx, off, np.zeros((B, DIM), np.float32))
    with pytest.raises(ValueError, match="no lookup options"):
        sh.step_forward(params, idx, off, batch_size_per_feature=(1, 1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert repr(sh).startswith("ShardedTTEmbeddingBag(")


def test_plan_as_one_strategy_for_every_table():
    from tt_jax.sharding import plan_sharding

    specs = [tt_jax.TTSpec(30, 4, ranks=(2,)), tt_jax.TTSpec(20, 4, ranks=(2,))]
    emb = tt_jax.TTEmbeddingBag(specs, impl="xla")
    assert plan_sharding(emb, 2, "data").strategies == ("data", "data")
    with pytest.raises(NotImplementedError, match="not supported for TT tables"):
        plan_sharding(emb, 2, "table")
    with pytest.raises(ValueError, match="strategy must be one of"):
        plan_sharding(emb, 2, "diagonal")
