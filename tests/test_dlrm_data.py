"""The DLRM demo's on-device data (`--data device`, the default): `data.DeviceClickLog` / `data.draw`,
the on-device helpers, and the demo's training and timing with it (CPU, tiny)."""

import jax
import numpy as np
import pytest

from examples.dlrm import data as data_lib
from examples.dlrm import model as model_lib
from examples.dlrm import train

TINY = ["--size", "tiny", "--impl", "xla", "--no-progress"]
CFG = data_lib.DataConfig.preset("tiny")


def _np(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def _check_format(x, b, cap, rows=CFG.table_rows):
    """FBGEMM format of one (unsharded) batch: shapes, dtypes, padding, ids in range."""
    f = len(rows)
    assert x["dense"].shape == (b, CFG.num_dense) and x["dense"].dtype == np.float32
    assert x["indices"].shape == (cap,) and x["indices"].dtype == np.int32
    assert x["offsets"].shape == (f * b + 1,) and x["offsets"].dtype == np.int32
    assert x["labels"].shape == (b,) and x["labels"].dtype == np.float32
    assert x["logit"].shape == (b,) and x["logit"].dtype == np.float32
    assert set(np.unique(x["labels"])) <= {0.0, 1.0}
    assert np.all(np.isfinite(x["dense"])) and np.all(np.isfinite(x["logit"]))
    off = x["offsets"]
    n = int(off[-1])
    assert off[0] == 0 and np.all(np.diff(off) >= 0) and n <= cap
    assert np.all(x["indices"][n:] == 0)  # padding past offsets[-1]
    lengths = np.diff(off).reshape(f, b)
    feat = np.repeat(np.arange(f), lengths.sum(1))
    ids = x["indices"][:n]
    assert np.all(ids >= 0) and np.all(ids < np.asarray(rows)[feat])
    return lengths


def test_device_batch_format_padding_and_ids_in_range():
    gen = data_lib.ClickLogGenerator(CFG, 64, seed=0)
    dev = data_lib.DeviceClickLog(gen)
    x = _np(dev.batch(0))
    lengths = _check_format(x, 64, gen.padded_len)
    one_hot = np.asarray(CFG.bag_mean) < 1
    assert set(np.unique(lengths[one_hot])) <= {0, 1}
    assert lengths[~one_hot].max() >= 5 and (lengths == 0).mean() > 0.02
    max_len = [int(np.argmax(r >= 1.0)) for r in data_lib.length_cdf(CFG.bag_mean)]
    assert np.all(lengths <= np.asarray(max_len)[:, None])

    # Over capacity: the first `cap` ids are kept, the bags past them cut, consistently.
    z = _np(dev.batch(0, batch_size=64, cap=512))
    _check_format(z, 64, 512)
    assert z["offsets"][-1] == 512


def test_same_key_same_batch_and_streams_differ():
    gen = data_lib.ClickLogGenerator(CFG, 32, seed=5)
    dev = data_lib.DeviceClickLog(gen)
    a, b = _np(dev.batch(7)), _np(dev.batch(7))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # A second DeviceClickLog of the same seed (or the same draw under another jit) gives the same bits.
    c = _np(data_lib.DeviceClickLog(data_lib.ClickLogGenerator(CFG, 32, seed=5)).batch(7))
    assert all(np.array_equal(a[k], c[k]) for k in a)
    key = jax.random.fold_in(dev.stream_key("train"), 7)
    d = _np(jax.jit(lambda p, k: data_lib.draw(CFG, p, k, 32, gen.padded_len))(dev.params, key))
    assert all(np.array_equal(a[k], d[k]) for k in a)
    # Other step, stream or seed: other batches.
    for other in (dev.batch(8), dev.batch(7, "eval"),
                  data_lib.DeviceClickLog(data_lib.ClickLogGenerator(CFG, 32, seed=6)).batch(7)):
        assert not np.array_equal(a["indices"], np.asarray(other["indices"]))


def test_device_data_has_the_host_statistics():
    b, k = 256, 6
    gen = data_lib.ClickLogGenerator(CFG, b, seed=3)
    dev = data_lib.DeviceClickLog(gen)
    f = CFG.num_sparse
    big = int(np.argmax(CFG.table_rows))

    def stats(batches):
        lengths = np.concatenate([np.diff(x["offsets"]).reshape(f, b) for x in batches], 1)
        ids = []
        for x in batches:
            feat = np.repeat(np.arange(f), np.diff(x["offsets"]).reshape(f, b).sum(1))
            ids.append(x["indices"][: x["offsets"][-1]][feat == big])
        counts = np.bincount(np.concatenate(ids), minlength=CFG.table_rows[big])
        labels = np.concatenate([x["labels"] for x in batches])
        logit = np.concatenate([x["logit"] for x in batches])
        return lengths.mean(1), counts, labels, logit

    d_len, d_counts, d_labels, d_logit = stats([_np(dev.batch(i)) for i in range(k)])
    h_len, h_counts, _, _ = stats([gen.batch(i).arrays() | {"logit": gen.batch(i).logit} for i in range(k)])
    # Bag lengths: the configured means (Bernoulli p or Poisson mean), as the host's.
    np.testing.assert_allclose(d_len, CFG.bag_mean, rtol=0.1, atol=0.03)
    np.testing.assert_allclose(d_len, h_len, rtol=0.1, atol=0.03)
    # Zipf ids through the same rank-to-row map: the same hottest row, a skewed table.
    assert np.argmax(d_counts) == np.argmax(h_counts)
    top = np.sort(d_counts)[::-1]
    assert top[: CFG.table_rows[big] // 100].sum() > 0.2 * top.sum()
    # Labels from the hidden model: about ctr clicks, logit spread ~logit_std, ranks them well.
    assert 0.18 < d_labels.mean() < 0.32
    assert 1.6 < d_logit.std() < 2.4
    assert train.auc(d_logit, d_labels) > 0.8


def test_on_device_helpers_match_numpy():
    rng = np.random.default_rng(0)
    mulmod = jax.jit(data_lib.mulmod, static_argnums=3)
    for bits in (11, 20, 24):  # the float32-quotient path up to 20 bits, Horner above
        m = rng.integers(1, 2**bits, 4000)
        a, b = rng.integers(0, m), rng.integers(0, m)
        m[0], a[0], b[0] = 2**bits - 1, 2**bits - 2, 2**bits - 2
        got = np.asarray(mulmod(a.astype(np.int32), b.astype(np.int32), m.astype(np.int32), bits))
        want = [int(x) * int(y) % int(z) for x, y, z in zip(a, b, m)]
        assert got.tolist() == want, bits

    # bag_sums: per bag the sum of its rows (empty bags 0), F features of B bags each.
    f, b = 3, 5
    lengths = np.array([[0, 1, 1, 0, 1], [3, 0, 2, 1, 0], [4, 4, 0, 1, 2]])
    offsets = np.concatenate([[0], np.cumsum(lengths.ravel())]).astype(np.int32)
    vals = rng.normal(size=(offsets[-1] + 7, 2)).astype(np.float32)  # padded rows past the last bag
    got = np.asarray(jax.jit(data_lib.bag_sums, static_argnums=(2, 3))(vals, offsets, (1, 3, 4), b))
    want = np.stack([vals[offsets[j]:offsets[j + 1]].sum(0) for j in range(f * b)]).reshape(f, b, 2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    # select_features: the host split (model.split_features) on the device.
    gen = data_lib.ClickLogGenerator(CFG, 16, seed=1)
    x = _np(data_lib.DeviceClickLog(gen).batch(0))
    select = jax.jit(data_lib.select_features, static_argnums=(2, 3, 4))
    for feats in ((0, 5, 7), (25,), tuple(range(26))):
        want_i, want_o = model_lib.split_features(x["indices"], x["offsets"], 16, feats, 1024)
        got_i, got_o = select(x["indices"], x["offsets"], 16, feats, len(want_i))
        assert np.array_equal(np.asarray(got_o), want_o) and np.array_equal(np.asarray(got_i), want_i)


def test_sharded_device_batches_have_the_shard_batch_format():
    n = 2
    if len(jax.devices()) < n:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,))
    config = model_lib.DLRMConfig.preset("tiny", CFG.table_rows, impl="xla")
    model = model_lib.DLRM(config, mesh=mesh)
    gen = data_lib.ClickLogGenerator(CFG, 64, seed=1)
    data = train.DeviceData(gen, model)
    cap = train.local_padded_len(gen, n)
    x = data.batch(0)
    assert x["indices"].shape == (n, cap) and x["offsets"].shape == (n, 26 * 32 + 1)
    assert x["dense"].shape == (64, 13) and x["labels"].shape == (64,)
    assert x["indices"].sharding.spec[0] == "data" and x["dense"].sharding.spec[0] == "data"
    h = _np(x)
    for k in range(n):  # each device's local batch is a batch of 32 examples in the one-device format
        rows = slice(32 * k, 32 * (k + 1))
        _check_format({"dense": h["dense"][rows], "indices": h["indices"][k], "offsets": h["offsets"][k],
                       "labels": h["labels"][rows], "logit": h["logit"][rows]}, 32, cap)
    assert not np.array_equal(h["indices"][0], h["indices"][1])  # the devices draw different examples
    y = _np(data.batch(0))
    assert all(np.array_equal(h[k], y[k]) for k in h)


def test_training_with_device_data_and_the_device_step_timing():
    r = train.main(TINY + ["--steps", "4", "--eval-batches", "1", "--time-steps", "3"])
    assert r["data"] == "device" and r["steps"] == 4 and np.isfinite(r["final_loss"])
    assert r["wall_step_ms"] == r["step_ms"] > 0 and r["examples_per_s"] > 0
    assert r["device_step_ms"] > 0 and r["device_share"] == pytest.approx(r["device_step_ms"] / r["step_ms"])
    s = r["state"]
    assert s.step == 4 and int(s.emb_state.count) == 4  # the timing ran on copies of the state
    assert "device_step_ms" not in train.main(TINY + ["--steps", "2", "--eval-batches", "1", "--time-steps", "0"])


def test_host_data_resume_is_bit_exact_and_data_modes_do_not_mix(tmp_path):
    common = TINY + ["--eval-batches", "1", "--time-steps", "0", "--data", "host"]
    if jax.default_backend() == "gpu":  # the XLA path's scatter-adds use float atomics there: not bitwise
        common = [a if a != "xla" else "pallas" for a in common]
    straight = train.main(common + ["--steps", "6"])
    train.main(common + ["--steps", "3", "--ckpt-dir", str(tmp_path)])
    resumed = train.main(common + ["--steps", "6", "--ckpt-dir", str(tmp_path), "--resume"])
    assert resumed["start_step"] == 3 and resumed["data"] == "host"
    for x, y in zip(jax.tree_util.tree_leaves(straight["state"]), jax.tree_util.tree_leaves(resumed["state"])):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    # A host-data checkpoint (written without "data", as before --data existed) does not resume with device data.
    with pytest.raises(SystemExit):
        train.main(TINY + ["--eval-batches", "1", "--steps", "8", "--ckpt-dir", str(tmp_path), "--resume"])
