"""The inference layers (Linen, NNX, Haiku) over quantized rows: each serves what `tbe_jax.quantize` of the
trained layer's core gives, and stays within the quantization error of the trained float layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax

TABLES = [tbe_jax.TableSpec(60, 8), tbe_jax.TableSpec(40, 12)]
IDX = jnp.array([1, 2, 3, 59, 7, 7, 0, 39], jnp.int32)  # 2 features x 2 bags, one empty
OFF = jnp.array([0, 3, 4, 4, 8], jnp.int32)


def _close_to_float(out, ref, tables, wt):
    """|quantized - float| within the pooled bound: per id half a step of its row (scale/2, plus fp16's
    rounding of scale and bias), summed over a bag's ids; generous 3x for the fp16 output."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    span = max(float(jnp.max(t) - jnp.min(t)) for t in tables)
    step = span / {"int8": 255, "int4": 15}[wt]
    assert np.max(np.abs(out - ref)) <= 3 * 4 * (step / 2 + 1e-3 * span) + 1e-3 * np.max(np.abs(ref))


@pytest.mark.parametrize("wt", ["int8", "int4"])
def test_linen(wt):
    from tbe_jax.linen import QUANT_COLLECTION, TableBatchedEmbed, quantize_layer

    layer = TableBatchedEmbed(TABLES, impl="xla")
    variables = layer.init(jax.random.key(0), IDX, OFF)
    emb = variables["params"]["embedding"]
    serving, qparams = quantize_layer(layer, emb, wt)
    out = serving.apply({QUANT_COLLECTION: {"qparams": qparams}}, IDX, OFF)
    qemb, q2 = tbe_jax.quantize(layer.tbe, emb, wt)
    assert serving.qemb == qemb
    np.testing.assert_array_equal(np.asarray(out), np.asarray(qemb(q2, IDX, OFF)))
    _close_to_float(out, layer.apply(variables, IDX, OFF), layer.tbe.get_tables(emb), wt)
    # an initialised serving layer holds zero rows (its shapes); the trained rows are copied in
    zero = serving.init(jax.random.key(1), IDX, OFF)[QUANT_COLLECTION]["qparams"]
    assert jax.tree.map(jnp.shape, dict(zero)) == jax.tree.map(jnp.shape, qparams)
    assert not np.any(np.asarray(serving.apply({QUANT_COLLECTION: {"qparams": zero}}, IDX, OFF)))


def test_linen_refuses_a_sharded_or_tt_core():
    from tbe_jax.linen import quantize_layer

    class Fake:
        tbe = object()

    with pytest.raises(TypeError, match="unsharded TableBatchedEmbed"):
        quantize_layer(Fake(), {}, "int8")


@pytest.mark.parametrize("wt", ["int8", "int4"])
def test_nnx(wt):
    import flax.nnx as nnx

    from tbe_jax.nnx import Quantized, QuantizedEmbed, TableBatchedEmbed

    layer = TableBatchedEmbed(TABLES, impl="xla", rngs=nnx.Rngs(0))
    serving = QuantizedEmbed.from_layer(layer, wt)
    qemb, q2 = tbe_jax.quantize(layer.tbe, layer.get_params(), wt)
    out = serving(IDX, OFF)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(qemb(q2, IDX, OFF)))
    _close_to_float(out, layer(IDX, OFF), layer.tbe.get_tables(layer.get_params()), wt)
    # the rows are Quantized variables, not Params: an optimizer over nnx.Param finds none
    assert not jax.tree.leaves(nnx.state(serving, nnx.Param))
    assert len(jax.tree.leaves(nnx.state(serving, Quantized))) == len(q2)
    # jitted through nnx
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, i, o: m(i, o))(serving, IDX, OFF)), np.asarray(out))


def test_haiku():
    hk = pytest.importorskip("haiku")
    from tbe_jax.haiku import QuantizedEmbed, TableBatchedEmbed, quantize_module

    train = hk.without_apply_rng(hk.transform(lambda i, o: TableBatchedEmbed(TABLES, impl="xla", name="embed")(i, o)))
    params = train.init(jax.random.key(0), IDX, OFF)
    core = tbe_jax.TableBatchedEmbedding(TABLES, impl="xla")
    qemb, state = quantize_module(core, params["embed"], "int8", name="embed")
    serve = hk.without_apply_rng(hk.transform_with_state(lambda i, o: QuantizedEmbed(qemb, name="embed")(i, o)))
    init_state = serve.init(jax.random.key(1), IDX, OFF)[1]
    assert jax.tree.map(jnp.shape, init_state) == jax.tree.map(jnp.shape, state)
    out, _ = serve.apply({}, state, IDX, OFF)
    emb_params = tbe_jax.haiku.core_params(params["embed"], core)
    q_direct = tbe_jax.quantize(core, emb_params, "int8")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(q_direct[0](q_direct[1], IDX, OFF)))
    _close_to_float(out, train.apply(params, IDX, OFF), core.get_tables(emb_params), "int8")


def test_quantize_in_chunks_equals_one_call():
    """`quantize` writes `chunk_rows` rows per call into the buffers (the last chunk overlaps the one before):
    the words equal one call's, also for tables sharing a buffer."""
    tables = [tbe_jax.TableSpec(37, 8), tbe_jax.TableSpec(5, 8), tbe_jax.TableSpec(23, 16)]
    emb = tbe_jax.TableBatchedEmbedding(tables, impl="xla")
    params = emb.init(jax.random.key(3))
    for wt in ("int4", "fp8", ["int8", "int8", "int2"]):
        _, whole = tbe_jax.quantize(emb, params, wt)
        _, parts = tbe_jax.quantize(emb, params, wt, chunk_rows=6)
        assert whole.keys() == parts.keys()
        for k in whole:
            np.testing.assert_array_equal(np.asarray(parts[k]), np.asarray(whole[k]))
    with pytest.raises(ValueError, match="chunk_rows"):
        tbe_jax.quantize(emb, params, "int8", chunk_rows=0)
