"""The DLRM demo: data generator, interaction layer, training and bit-exact checkpoint resume (CPU, tiny)."""

import dataclasses
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import tbe_jax
import tt_jax
from examples.dlrm import data as data_lib
from examples.dlrm import model as model_lib
from examples.dlrm import checkpoint, train

# --time-steps 0: no device-step timing after training (20 more steps per run otherwise).
TINY = ["--size", "tiny", "--impl", "xla", "--no-progress", "--time-steps", "0", "--eval-quantized", "none"]


def _tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb, (ta, tb)
    return all(np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(la, lb))


def test_generator_deterministic_format_and_signal():
    cfg = data_lib.DataConfig.preset("tiny")
    f, b = cfg.num_sparse, 256
    assert f == 26 and cfg.num_dense == 13
    assert min(cfg.table_rows) == 10 and max(cfg.table_rows) == 2000
    g1 = data_lib.ClickLogGenerator(cfg, b, seed=3)
    g2 = data_lib.ClickLogGenerator(cfg, b, seed=3)
    later = g1.batch(5)  # batch i depends on (seed, stream, i) only, not on what was drawn before
    for i in (0, 5):
        x, y = g1.batch(i), g2.batch(i)
        for k in ("dense", "indices", "offsets", "labels", "logit"):
            assert np.array_equal(getattr(x, k), getattr(y, k)), k
    assert np.array_equal(later.indices, g2.batch(5).indices)
    assert not np.array_equal(g1.batch(0).labels, g1.batch(1).labels)
    assert not np.array_equal(g1.batch(0).indices, data_lib.ClickLogGenerator(cfg, b, seed=4).batch(0).indices)
    assert not np.array_equal(g1.batch(0, "eval").indices, g1.batch(0, "train").indices)

    batches = [g1.batch(i) for i in range(8)]
    x = batches[0]
    # FBGEMM format: F*B+1 feature-major offsets; int32 ids in range of each feature's table.
    assert x.indices.dtype == np.int32 and x.offsets.dtype == np.int32
    assert x.offsets.shape == (f * b + 1,) and x.offsets[0] == 0 and np.all(np.diff(x.offsets) >= 0)
    assert x.dense.shape == (b, 13) and x.dense.dtype == np.float32 and x.labels.shape == (b,)
    n = x.num_ids
    assert len(x.indices) == g1.padded_len >= n and np.all(x.indices[n:] == 0)  # one padded shape
    lengths = np.diff(x.offsets).reshape(f, b)
    feat = np.repeat(np.arange(f), lengths.sum(1))
    ids = x.indices[:n]
    assert np.all(ids >= 0) and np.all(ids < np.asarray(cfg.table_rows)[feat])
    assert (lengths == 0).mean() > 0.02  # empty bags
    assert lengths.max() >= 5 and set(np.unique(lengths[0])) <= {0, 1}  # multi-hot and one-hot features
    # Zipf skew: in the largest table, the most frequent 1% of rows take far more than 1% of the lookups.
    big = int(np.argmax(cfg.table_rows))
    all_ids = []
    for bt in batches:
        feat_of_id = np.repeat(np.arange(f), np.diff(bt.offsets).reshape(f, b).sum(1))
        all_ids.append(bt.indices[: bt.num_ids][feat_of_id == big])
    all_ids = np.concatenate(all_ids)
    counts = np.sort(np.bincount(all_ids, minlength=cfg.table_rows[big]))[::-1]
    assert counts[: cfg.table_rows[big] // 100].sum() > 0.2 * counts.sum()

    # Planted signal: the hidden logit ranks the labels well; about `ctr` of them are clicks.
    logit = np.concatenate([bt.logit for bt in batches])
    labels = np.concatenate([bt.labels for bt in batches])
    assert 0.18 < labels.mean() < 0.32
    assert train.auc(logit, labels) > 0.8
    assert train.log_loss(logit, labels) < train.log_loss(np.full_like(logit, np.log(0.25 / 0.75)), labels) - 0.1


def test_auc_rank_formula_matches_pair_count():
    rng = np.random.default_rng(0)
    s = np.round(rng.normal(size=300), 1)  # many ties
    y = rng.random(300) < 0.3
    pos, neg = s[y], s[~y]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert train.auc(s, y) == pytest.approx(pairs, abs=1e-12)
    assert train.auc(np.arange(10), np.arange(10) >= 5) == 1.0


def test_interaction_shape_and_symmetry():
    rng = np.random.default_rng(1)
    b, d, f = 5, 4, 6
    bottom = rng.normal(size=(b, d)).astype(np.float32)
    pooled = rng.normal(size=(b, f * d)).astype(np.float32)
    out = np.asarray(model_lib.dot_interaction(jnp.asarray(bottom), jnp.asarray(pooled)))
    assert out.shape == (b, d + (f + 1) * f // 2)
    assert np.array_equal(out[:, :d], bottom)
    z = np.concatenate([bottom[:, None], pooled.reshape(b, f, d)], 1).astype(np.float64)
    pairs = list(zip(*model_lib.pair_indices(f + 1)))
    assert pairs == [(i, j) for i, j in itertools.combinations(range(f + 1), 2)]
    want = np.stack([np.einsum("bd,bd->b", z[:, i], z[:, j]) for i, j in pairs], 1)
    np.testing.assert_allclose(out[:, d:], want, rtol=1e-5, atol=1e-5)
    # Symmetric in the embedding features: permuting them permutes the pairs (<z_i, z_j> = <z_j, z_i>).
    perm = np.array([0] + list(1 + rng.permutation(f)))  # z positions; the bottom output stays first
    out_p = np.asarray(model_lib.dot_interaction(jnp.asarray(bottom),
                                                 jnp.asarray(z[:, perm[1:]].reshape(b, -1).astype(np.float32))))
    where = {p: k for k, p in enumerate(pairs)}
    for k, (i, j) in enumerate(pairs):
        a, c = sorted((perm[i], perm[j]))
        np.testing.assert_allclose(out_p[:, d + k], out[:, d + where[(a, c)]], rtol=1e-5, atol=1e-5)

    # The whole model on the tiny config: one logit per example.
    cfg = data_lib.DataConfig.preset("tiny")
    m = model_lib.DLRM(model_lib.DLRMConfig.preset("tiny", cfg.table_rows, impl="xla"))
    dense_params, emb_params = jax.jit(m.init)(jax.random.key(0))
    batch = data_lib.ClickLogGenerator(cfg, 16, seed=0).batch(0).arrays()
    logits = jax.jit(m.forward)(dense_params, emb_params, batch)
    assert logits.shape == (16,) and bool(jnp.all(jnp.isfinite(logits)))
    assert m.interaction_dim == 8 + 27 * 26 // 2


def test_short_training_lowers_loss_and_raises_auc():
    r = train.main(TINY + ["--steps", "60", "--eval-batches", "8", "--eval-quantized", "int8,int4"])
    assert r["steps"] == 60 and r["start_step"] == 0
    # the trained model served with its tables quantized (tbe_jax.quantize): int8 and int4 rows, the AUC kept
    q = r["quantized"]
    assert set(q) == {"int8", "int4"}
    assert abs(q["int8"]["auc"] - r["auc_after"]) < 0.005 and abs(q["int4"]["auc"] - r["auc_after"]) < 0.02
    float_bytes = sum(v.size * v.dtype.itemsize for v in r["state"].emb_params.values())
    # tiny tables have D 8: an fp16, int8 (12 bytes) and int4 (8 bytes) row all pad to 16 bytes
    assert q["int4"]["table_bytes"] <= q["int8"]["table_bytes"] <= float_bytes
    assert r["eval_loss_after"] < r["eval_loss_before"] - 0.05
    assert r["auc_after"] > r["auc_before"] + 0.1
    assert r["auc_after"] < r["oracle_auc"] + 0.01
    assert np.isfinite(r["final_loss"]) and r["steps_per_s"] > 0
    s = r["state"]
    assert isinstance(s.emb_state, tbe_jax.RowwiseAdagradState) and s.step == 60
    assert s.emb_state.count.dtype == jnp.int32 and int(s.emb_state.count) == 60

    # The embedding optimizer is an ordinary argument of the jitted step: another --emb-lr reuses its
    # compiled code. --emb-share times the embeddings alone (lookup + apply_gradients) against the step.
    r2 = train.main(TINY + ["--steps", "2", "--eval-batches", "1", "--emb-lr", "0.2", "--emb-share"])
    assert r2["steps"] == 2 and np.isfinite(r2["final_loss"]) and r2["emb_share"] > 0
    assert int(r2["state"].emb_state.count) == 2
    model = model_lib.DLRM(model_lib.DLRMConfig.preset("tiny", data_lib.DataConfig.preset("tiny").table_rows,
                                                       impl="xla"))
    built = train.build(model, train.SIZES["tiny"].lr, 0.2)
    assert built.emb_opt.learning_rate == 0.2
    assert built.train_step._cache_size() == 1  # one compile for emb_lr 0.05 and 0.2


def test_checkpoint_resume_is_bit_exact(tmp_path):
    # On a GPU the XLA path's scatter-adds use float atomics (run-to-run noise that 24
    # steps amplify); the Pallas kernels sum in a fixed order, so check those there.
    common = TINY + ["--eval-batches", "1"]
    if jax.default_backend() == "gpu":
        common = [a if a != "xla" else "pallas" for a in common]
    straight = train.main(common + ["--steps", "8", "--ckpt-dir", str(tmp_path / "a")])
    first = train.main(common + ["--steps", "3", "--ckpt-dir", str(tmp_path / "b")])
    assert (tmp_path / "b" / "3").is_dir() and (tmp_path / "b" / "run.json").is_file()
    resumed = train.main(common + ["--steps", "8", "--ckpt-dir", str(tmp_path / "b"), "--resume"])
    assert resumed["start_step"] == 3 and resumed["steps"] == 5

    a, b = straight["state"], resumed["state"]
    assert a.step == b.step == 8
    assert _tree_equal(a, b)  # dense params, Adam state, tables, row-wise accumulators: bitwise
    assert not _tree_equal(a.emb_params, first["state"].emb_params)  # (and training did move them)

    # What is on disk restores to the same bits and the same structure (NamedTuples included).
    tiny = train.SIZES["tiny"]
    model = model_lib.DLRM(model_lib.DLRMConfig.preset("tiny", data_lib.DataConfig.preset("tiny").table_rows,
                                                       impl="xla"))
    init_fn = train.build(model, tiny.lr, tiny.emb_lr)[0]
    on_disk_a = train.restore_checkpoint(train.latest_checkpoint(tmp_path / "a"), init_fn)
    on_disk_b = train.restore_checkpoint(train.latest_checkpoint(tmp_path / "b"), init_fn)
    assert on_disk_a.step == on_disk_b.step == 8
    assert isinstance(on_disk_b.emb_state, tbe_jax.RowwiseAdagradState)
    assert on_disk_b.emb_state.count.dtype == jnp.int32 and int(on_disk_b.emb_state.count) == 8
    assert _tree_equal(on_disk_a, a) and _tree_equal(on_disk_b, a)

    # Resuming with different settings is refused.
    with pytest.raises(SystemExit):
        train.main(common + ["--steps", "30", "--lr", "1e-2", "--ckpt-dir", str(tmp_path / "b"), "--resume"])


@pytest.mark.parametrize("tt", [False, True], ids=["tbe", "tbe+tt"])
def test_checkpoint_without_count_restores(tmp_path, tt):
    # A checkpoint written before the optimizer states had a step count (their NamedTuples were saved as
    # {"momentum": ...}) restores into today's states, the count set to the checkpoint's step.
    cfg = model_lib.DLRMConfig.preset("tiny", data_lib.DataConfig.preset("tiny").table_rows, impl="xla")
    if tt:
        cfg = dataclasses.replace(cfg, tt_tables=2, tt_ranks=(4, 4))
    model = model_lib.DLRM(cfg)
    init_fn = train.build(model, 1e-3, 0.05)[0]
    state = train.TrainState(7, *init_fn(jax.random.key(0)))
    state = state._replace(emb_state=jax.tree_util.tree_map(lambda x: x + 1, state.emb_state))

    def old(st):
        return {"momentum": st.momentum}

    legacy = old(state.emb_state) if not tt else {"tbe": old(state.emb_state["tbe"]), "tt": state.emb_state["tt"]}
    tree = dict(checkpoint._as_tree(state), emb_state=legacy)
    ckptr = checkpoint._ocp().StandardCheckpointer()
    ckptr.save((tmp_path / "7").absolute(), tree, force=True)
    ckptr.wait_until_finished()
    ckptr.close()
    back = train.restore_checkpoint(tmp_path / "7", init_fn)
    want = state.emb_state
    if tt:  # the TT state was saved with its count (1 after the +1 above); the TBE's gets the step
        want = {"tbe": want["tbe"]._replace(count=jnp.int32(7)), "tt": want["tt"]}
        assert isinstance(back.emb_state["tbe"], tbe_jax.RowwiseAdagradState)
        assert isinstance(back.emb_state["tt"], tt_jax.RowwiseAdagradState)
    else:
        want = want._replace(count=jnp.int32(7))
        assert isinstance(back.emb_state, tbe_jax.RowwiseAdagradState)
    assert back.step == 7 and _tree_equal(back.emb_state, want)
    assert _tree_equal(back.emb_params, state.emb_params)
    # And today's checkpoints (with the count) round-trip as they are.
    train.save_checkpoint(tmp_path / "new", state, {})
    assert _tree_equal(train.restore_checkpoint(tmp_path / "new" / "7", init_fn), state)


# -- TT tables (--tt-tables K): the K largest tables in tensor-train form, the rest in the TBE --------

TT = ["--tt-tables", "6", "--tt-rank", "8"]  # one configuration: main() reuses its compiled step


def test_tt_split_and_merge_equal_the_all_tbe_model():
    # The host split (TBE features / TT features) and the merge back into feature order are exact:
    # the TT model's pooled output equals one TBE over all 26 features whose TT tables are the
    # materialised TT tables, on the unsplit batch.
    cfg = data_lib.DataConfig.preset("tiny")
    base = model_lib.DLRMConfig.preset("tiny", cfg.table_rows, impl="xla")
    m = model_lib.DLRM(dataclasses.replace(base, tt_tables=3, tt_ranks=(4, 4)))
    dense = model_lib.DLRM(base)
    assert m.tt_features == tuple(sorted(np.argsort(cfg.table_rows)[::-1][:3]))
    assert sorted(m.tbe_features + m.tt_features) == list(range(26))
    gen = data_lib.ClickLogGenerator(cfg, 16, seed=1)
    arrays = gen.batch(0).arrays()
    batch = m.split_batch(arrays, (2048, 512))
    assert batch["offsets"].shape == (23 * 16 + 1,) and batch["tt_offsets"].shape == (3 * 16 + 1,)
    assert batch["offsets"][-1] + batch["tt_offsets"][-1] == arrays["offsets"][-1]  # every id, once
    params = jax.jit(m.init_tables)(jax.random.key(0))
    tables = [None] * 26
    for f, t in zip(m.tbe_features, m.emb.get_tables(params["tbe"])):
        tables[f] = t
    for f, t in zip(m.tt_features, jax.jit(m.tt.full_table)(params["tt"])):
        tables[f] = t
    want = jax.jit(dense.pooled)(dense.emb.set_tables(None, tables), arrays)
    got = jax.jit(m.pooled)(params, batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The TBE tables are the all-dense model's own (same draw, TT tables' rows dropped).
    dense_tables = dense.emb.get_tables(jax.jit(dense.init_tables)(jax.random.key(0)))
    for f, t in zip(m.tbe_features, m.emb.get_tables(params["tbe"])):
        assert np.array_equal(np.asarray(t), np.asarray(dense_tables[f]))


def test_tt_tables_train_and_shrink_table_memory():
    dense = model_lib.DLRM(train.configs("tiny", impl="xla")[1]).table_bytes()  # the all-TBE model's (trained: above)
    # 40 steps: AUC +0.22 and eval loss -0.060 on CPU (60 steps: +0.24, -0.079), twice the margins below.
    r = train.main(TINY + TT + ["--steps", "40", "--eval-batches", "8"])
    assert r["auc_after"] > r["auc_before"] + 0.1
    assert r["eval_loss_after"] < r["eval_loss_before"] - 0.03
    assert r["dense_table_bytes"] == dense["total"] == dense["dense"]
    assert r["table_bytes"] < 0.7 * dense["total"]
    s = r["state"]
    assert sorted(s.emb_params) == sorted(s.emb_state) == ["tbe", "tt"]
    assert isinstance(s.emb_state["tt"], tt_jax.RowwiseAdagradState)
    assert isinstance(s.emb_state["tbe"], tbe_jax.RowwiseAdagradState)
    assert int(s.emb_state["tt"].count) == int(s.emb_state["tbe"].count) == 40
    assert any(np.any(np.asarray(m) > 0) for m in jax.tree_util.tree_leaves(s.emb_state["tt"]))  # cores trained


def test_tt_checkpoint_resume_is_bit_exact(tmp_path):
    # The Pallas TT kernels on a GPU (deterministic), the XLA path on a CPU (TINY's: the programs of
    # test_tt_tables_train_and_shrink_table_memory). The XLA TT backward's GPU scatter-adds sum in an
    # unspecified order, so it is not bitwise reproducible there.
    tiny = TINY if jax.default_backend() != "gpu" else [a if a != "xla" else "pallas" for a in TINY]
    common = tiny + TT + ["--eval-batches", "1"]
    straight = train.main(common + ["--steps", "6", "--ckpt-dir", str(tmp_path / "a")])
    train.main(common + ["--steps", "2", "--ckpt-dir", str(tmp_path / "b")])
    saved = json.loads((tmp_path / "b" / "run.json").read_text())
    assert (saved["tt_tables"], saved["tt_rank"], saved["tt_opt"]) == (6, 8, "rowwise_adagrad")
    resumed = train.main(common + ["--steps", "6", "--ckpt-dir", str(tmp_path / "b"), "--resume"])
    assert resumed["start_step"] == 2 and resumed["steps"] == 4
    a, b = straight["state"], resumed["state"]
    assert isinstance(b.emb_state["tt"], tt_jax.RowwiseAdagradState)
    assert _tree_equal(a, b)  # TT cores and their accumulators included
    # A run without TT tables (or with other TT settings) does not resume this checkpoint.
    for other in (tiny, common + ["--tt-opt", "adagrad"]):
        with pytest.raises(SystemExit):
            train.main(other + ["--eval-batches", "1", "--steps", "8", "--ckpt-dir", str(tmp_path / "b"), "--resume"])


# -- MLPerf DLRMv2 (--model dcnv2): DCN v2's cross network, fixed bag sizes, Adagrad everywhere -------------------


def test_fixed_bag_sizes_host_and_device():
    sizes = np.asarray(data_lib.MLPERF_BAG_SIZES)
    cfg = data_lib.DataConfig.preset("tiny", fixed_bags=True)
    assert cfg.bag_sizes == tuple(sizes) and sizes.sum() == 214 and cfg.hidden_ranks == 1 << 16
    b = 8
    gen = data_lib.ClickLogGenerator(cfg, b, seed=0)
    host = gen.batch(0)
    dev = {k: np.asarray(v) for k, v in data_lib.DeviceClickLog(gen).batch(0).items()}
    hx = dict(host.arrays(), logit=host.logit)
    for x in (hx, dev):
        assert x["indices"].shape == (b * 214,) and x["offsets"].shape == (26 * b + 1,)  # no padding
        lengths = np.diff(x["offsets"]).reshape(26, b)
        assert np.all(lengths == sizes[:, None])  # every bag of feature f holds exactly its size
        feat = np.repeat(np.arange(26), lengths.sum(1))
        assert np.all(x["indices"] >= 0) and np.all(x["indices"] < np.asarray(cfg.table_rows)[feat])
    assert {k: (v.shape, v.dtype) for k, v in hx.items()} == {k: (v.shape, v.dtype) for k, v in dev.items()}
    assert np.array_equal(hx["offsets"], dev["offsets"])
    with pytest.raises(ValueError, match="bag_mean must equal"):
        data_lib.DataConfig(cfg.table_rows, cfg.bag_mean[:-1] + (2.0,), bag_sizes=cfg.bag_sizes)

    # MLPerf's tables: the hidden model only for each table's 2**16 most frequent ranks (a bounded size), the
    # generator built in seconds, ids in range of the 4e7-row tables.
    m = data_lib.DataConfig.preset("mlperf")
    assert sum(m.table_rows) == 204_184_588 and m.bag_sizes == tuple(sizes)
    gm = data_lib.ClickLogGenerator(m, 4, seed=0)
    assert gm.hidden_rows.shape[0] == sum(min(e, 1 << 16) for e in m.table_rows) < 1_000_000
    xm = gm.batch(0)
    feat = np.repeat(np.arange(26), np.diff(xm.offsets).reshape(26, 4).sum(1))
    assert xm.indices.shape == (4 * 214,) and np.all(xm.indices < np.asarray(m.table_rows)[feat])


def test_dcnv2_trains_toward_the_oracle_and_its_cross_layer(tmp_path):
    from benchmarks import dlrm_model
    from examples.dlrm import dcn

    # 40 steps (dense Adagrad lr 0.01, tables 0.02): AUC ~0.69-0.71 on seeds 0-2 against the oracle's ~0.87.
    r = train.main(TINY + ["--model", "dcnv2", "--steps", "40", "--eval-batches", "8"])
    assert (r["model"], r["dense_opt"], r["matmul_precision"]) == ("dcnv2", "adagrad", "tensorfloat32")
    assert r["auc_after"] > r["auc_before"] + 0.1
    assert r["oracle_auc"] - 0.25 < r["auc_after"] < r["oracle_auc"] + 0.01
    assert r["eval_loss_after"] < r["eval_loss_before"] - 0.05
    assert r["build_s"] > 0 and r["init_s"] > 0
    s = r["state"]
    d, w = 16, 27 * 16  # x0 = [bottom, 26 pooled]: width 27 * D
    cross = s.dense_params["cross"]
    assert [(c["v"].shape, c["u"].shape, c["b"].shape) for c in cross] == [((w, 32), (32, w), (w,))] * 3
    assert [x["w"].shape for x in s.dense_params["bottom"]] == [(13, 32), (32, d)]
    assert [x["w"].shape for x in s.dense_params["top"]] == [(w, 64), (64, 32), (32, 1)]
    assert isinstance(s.dense_opt_state[0], optax.ScaleByRssState)  # optax.adagrad
    model = model_lib.DLRM(model_lib.DLRMConfig.preset("tiny", data_lib.DataConfig.preset("tiny", True).table_rows,
                                                       impl="xla", model="dcnv2"))
    assert model.interaction_dim == w and model.config.dcn_layers == 3
    # The fixed multi-hot sizes reach the tables as their bag_size_hints (the forward's schedule for 1-2 ids).
    _, config = train.configs("tiny", "dcnv2")
    assert config.bag_size_hints == tuple(data_lib.MLPERF_BAG_SIZES)
    assert [t.bag_size_hint for t in model_lib.DLRM(config).emb.tables] == list(data_lib.MLPERF_BAG_SIZES)
    assert train.configs("tiny", "dlrm")[1].bag_size_hints is None
    with pytest.raises(ValueError, match="bag_size_hints"):
        dataclasses.replace(config, bag_size_hints=(1,))

    # One trained cross layer against x0 * (U (V^T x) + b) + x in float64; x0's layout [bottom, pooled].
    rng = np.random.default_rng(0)
    x0, x = rng.normal(size=(2, 4, w)).astype(np.float32)
    c = {k: np.asarray(v, np.float64) for k, v in cross[1].items()}
    want = x0 * ((x.astype(np.float64) @ c["v"]) @ c["u"] + c["b"]) + x
    got = dcn.cross_layer(jnp.asarray(x0), jnp.asarray(x), cross[1], precision="highest")
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    h, pooled = rng.normal(size=(4, d)).astype(np.float32), rng.normal(size=(4, 26 * d)).astype(np.float32)
    assert np.array_equal(np.asarray(model.x0(jnp.asarray(h), jnp.asarray(pooled))), np.concatenate([h, pooled], 1))

    # "bfloat16" matmuls are bf16 operands with fp32 sums (jax's own "bfloat16" name is TF32 on a GPU).
    assert dcn.precision_of("bfloat16") == dcn.precision_of("bf16") == jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    assert dcn.precision_of("default") is None and dcn.precision_of("tensorfloat32") == "tensorfloat32"
    got16 = dcn.cross_layer(jnp.asarray(x0), jnp.asarray(x), cross[1], precision=dcn.precision_of("bfloat16"))
    assert got16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got16), want, rtol=0.05, atol=0.05)

    # The benchmark (its compiled functions are the demo's), here with bf16 matmuls: the dumped batches' format
    # for the torch side, which reads the matmul precision from meta.json.
    out = dlrm_model.main(["--model", "dcnv2", "--size", "tiny", "--impl", "xla", "--steps", "2", "--no-split",
                           "--matmul-precision", "bfloat16",
                           "--dump", str(tmp_path / "d"), "--dump-batches", "2", "--out", str(tmp_path / "r.json")])
    assert out["full_step"]["examples_per_s"] > 0 and out["dumped_step"]["num_batches"] == 2
    assert np.isfinite(out["full_step"]["wall_ms"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["meta"]["model"] == "dcnv2" and saved["init_s"] > 0
    assert saved["meta"]["config"]["matmul_precision"] == "bfloat16"
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["matmul_precision"] == "bfloat16"
    assert meta["bag_sizes"] == list(data_lib.MLPERF_BAG_SIZES) and meta["batch_size"] == 256
    assert (meta["bottom_mlp"], meta["top_mlp"], meta["dcn_rank"]) == ([32, 16], [64, 32, 1], 32)
    for k in range(2):
        z = np.load(tmp_path / "d" / f"batch{k}.npz")
        assert z["indices"].shape == (256 * 214,) and z["indices"].dtype == np.int32
        assert z["offsets"].shape == (26 * 256 + 1,) and z["offsets"][-1] == 256 * 214
        assert z["dense"].shape == (256, 13) and z["labels"].shape == (256,) and z["labels"].dtype == np.float32


def test_demo_with_host_tables_learns_as_the_all_device_model():
    args = ["--size", "tiny", "--steps", "20", "--eval-quantized", "", "--time-steps", "0"]
    dev = train.main(args)
    host = train.main(args + ["--host-tables", "3", "--cache-load-factor", "0.3"])
    assert abs(host["auc_after"] - dev["auc_after"]) < 1e-3
    assert host["auc_after"] > host["auc_before"] + 0.05


def test_dlrm_compare_pairs_runs_by_batch_tables_and_matmuls():
    from benchmarks import dlrm_compare

    def ours(mm, step):
        return {"meta": {"batch_size": 64, "emb_dtype": "float16", "config": {"matmul_precision": mm}},
                "full_step": {"wall_ms": step, "device_share": 1.0}, "dumped_step": {"device_ms": step},
                "split": {"emb_ms": 1.0, "trace_ms": {"ours": 0.5, "sort": 0.1}}, "build_s": 1.0, "init_s": 1.0}

    def torch(mm, step):
        t = {"batch_size": 64, "emb_dtype": "float16", "step_ms": step, "examples_per_s": 64e3 / step,
             "device_share": 1.0, "tbe_alone_kernel_ms": 2.0, "tbe_kernel_ms_per_step": 1.2,
             "dense_kernel_ms_per_step": step - 1.2, "build_init_s": 1.0, "hbm": {"max_allocated_bytes": None},
             "dense_optimizer": {"impl": "foreach"}}
        return t if mm is None else {**t, "matmul": mm}

    # A torch result without "matmul" ran TF32 (before the flag); "bf16" and "bfloat16" are one precision.
    rows = dlrm_compare.compare([ours("tensorfloat32", 10.0), ours("bf16", 6.0)],
                                [torch("bfloat16", 9.0), torch(None, 13.0)])
    got = {r["matmul"]: r["throughput_ratio"] for r in rows}
    assert got == {"tensorfloat32": 1.3, "bfloat16": 1.5}
    assert "| bfloat16 |" in dlrm_compare.table(rows)
    assert dlrm_compare.compare([ours("float32", 10.0)], [torch(None, 13.0)]) == []
