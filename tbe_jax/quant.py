"""Inference TBE with quantized rows: `tbe_jax.quantize` and `QuantizedTableBatchedEmbedding`.

A trained `TableBatchedEmbedding`'s tables, stored as FBGEMM's IntNBit rows (`tbe_jax.quant_format`: int8 /
int4 / int2 with a per-row fp16 scale and bias, FBGEMM's HFP8, fp16, fp32), looked up and pooled like the
training TBE (same inputs, pooling, bounds modes, VBE). The forward kernel is the training forward's
(`kernels.forward.pooled_forward`, `sequence_forward`): its gather loads the rows' int32 words and dequantizes
them in registers (`kernels.quant_rows`), sums in fp32; the pooled kernel has one branch per word buffer,
shared by the dims stored there (`QuantLayout.kernel_layout`). The inputs take the training TBE's pipeline
(`dispatch.forward` with this module's lookup: `inputs.prepare`, the bounds mode, `inputs.narrow`).

`impl="xla"` (the CPU default) gathers the words with `jnp`, dequantizes them (`quant_rows.take_rows`: the
kernels' decode) and pools with `reference.pooled_forward`: the oracle of the kernels; `get_tables` gives the
dequantized tables (`quant_format.dequantize_rows`), so `reference.pooled_forward` on them is the float model.
Inference only: no gradients, no optimizer step.
"""

from __future__ import annotations

import dataclasses

import functools
from collections.abc import Mapping
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, dispatch, inputs, preprocess, quant_format, reference, vbe
from tbe_jax.kernels import forward as fwd_kernels
from tbe_jax.kernels import quant_rows
from tbe_jax.quant_layout import QuantLayout
from tbe_jax.specs import FeaturePlan, TableSpec
from tbe_jax.tbe import TableBatchedEmbedding

__all__ = ["QuantizedTableBatchedEmbedding", "quantize"]


def _weight_dtype(value) -> str:
    if not isinstance(value, str):
        try:
            value = jnp.dtype(value).name
        except TypeError:
            pass
    if not isinstance(value, str) or value not in quant_format.WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {quant_format.WEIGHT_DTYPES}, got {value!r}")
    return value


def weight_dtypes_for(weight_dtype, tables: Sequence[TableSpec]) -> tuple[str, ...]:
    """`weight_dtype` (one name, or a sequence of one per table) as a tuple per table, each checked against its
    table's dim (`quant_format.row_bytes`: the values must fill whole bytes)."""
    if isinstance(weight_dtype, str) or not isinstance(weight_dtype, Sequence):
        wts = (_weight_dtype(weight_dtype),) * len(tables)
    else:
        if len(weight_dtype) != len(tables):
            raise ValueError(f"weight_dtype names {len(weight_dtype)} types; there are {len(tables)} tables")
        wts = tuple(_weight_dtype(w) for w in weight_dtype)
    for t, (spec, wt) in enumerate(zip(tables, wts)):
        try:
            quant_format.row_bytes(spec.embedding_dim, wt)
        except ValueError as e:
            raise ValueError(f"{spec.label(t)}: {e}") from None
    return wts


class QuantizedTableBatchedEmbedding:
    """Table-batched embedding bags over quantized rows, for inference (FBGEMM's IntNBit TBE).

    Usually made by `tbe_jax.quantize(emb, params, weight_dtype)` from a trained `TableBatchedEmbedding`.

    Args:
      tables: the `TableSpec`s.
      weight_dtypes: the rows' type, one of "int8", "int4", "int2", "fp8", "float16", "float32", or a
        sequence of one per table. A table's `D * bits` must fill whole bytes.
      feature_table_map, pooling, bounds_check, impl, interpret, kernel_config: as `TableBatchedEmbedding`'s
        (`kernel_config.row_tile_bytes` / `row_tile_elems` size the quantized rows' tiles).
      output_dtype: float16 (default, as FBGEMM's), float32 or bfloat16.

    Params (`qparams`): a dict of int32 word buffers, one per storage class (weight type, words per row), named
    `"{wt}_w{words}"` (`tbe_jax.quant_layout`). Immutable and hashable: a static argument of `jit`.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, tbe_jax
      >>> qemb = tbe_jax.QuantizedTableBatchedEmbedding([tbe_jax.TableSpec(10, 8)], "int8", impl="xla")
      >>> rows = np.zeros((10, 16), np.uint8)           # FBGEMM's rows: [scale fp16][bias fp16][8 bytes][pad]
      >>> rows[:, :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)   # scale 0.5, bias 0
      >>> rows[:, 4:12] = 2                             # every value 2 * 0.5 + 0 = 1
      >>> qparams = qemb.from_fbgemm([rows])
      >>> out = qemb(qparams, jnp.array([1, 2, 3], jnp.int32), jnp.array([0, 2, 3], jnp.int32))
      >>> out.dtype, np.asarray(out[:, 0]).tolist()
      (dtype('float16'), [2.0, 1.0])
    """

    def __init__(self, tables: Sequence[TableSpec], weight_dtypes, *, feature_table_map=None, pooling: str = "sum",
                 output_dtype=jnp.float16, bounds_check: str = "ignore", impl: str = "auto", interpret: bool = False,
                 kernel_config: fwd_kernels.ForwardConfig | None = None):
        # The training TBE's checks and normalisation of the shared options.
        base = TableBatchedEmbedding(tables, feature_table_map=feature_table_map, pooling=pooling,
                                     output_dtype=output_dtype, bounds_check=bounds_check, impl=impl,
                                     interpret=interpret, kernel_config=kernel_config, use_histogram=False,
                                     pad_rows=False)
        self._base = base
        self.tables = base.tables
        self.feature_table_map = base.feature_table_map
        self.pooling = base.pooling
        self.output_dtype = base.output_dtype
        self.bounds_check = base.bounds_check
        self.impl = base.impl
        self.interpret = base.interpret
        self.kernel_config = base.kernel_config
        self.weight_dtypes = weight_dtypes_for(weight_dtypes, self.tables)
        self.layout = QuantLayout.build(self.tables, self.weight_dtypes)

    # -- identity ------------------------------------------------------------------------------------------------
    def _key(self):
        return (self.tables, self.feature_table_map, self.pooling, self.weight_dtypes, self.output_dtype.name,
                self.bounds_check, self.impl, self.interpret, self.kernel_config)

    def __hash__(self):
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._key())
            self.__dict__["_hash"] = h
        return h

    def __eq__(self, other):
        if other is self:
            return True
        return (isinstance(other, QuantizedTableBatchedEmbedding) and hash(self) == hash(other)
                and self._key() == other._key())

    def __repr__(self):
        return (f"QuantizedTableBatchedEmbedding({len(self.tables)} tables, {self.num_features} features, "
                f"weight_dtypes={sorted(set(self.weight_dtypes))}, pooling={self.pooling!r}, "
                f"output_dtype={self.output_dtype.name}, impl={self.impl!r})")

    @property
    def num_features(self) -> int:
        return len(self.feature_table_map)

    @property
    def feature_dims(self) -> tuple[int, ...]:
        return tuple(self.tables[t].embedding_dim for t in self.feature_table_map)

    def uses_kernel(self) -> bool:
        """Whether lookups run the Pallas kernel (False: the XLA path); as `TableBatchedEmbedding.uses_kernel`."""
        return self._base.uses_kernel()

    def plan_for(self, num_offsets: int, batch_size_per_feature=None) -> FeaturePlan:
        """The static feature plan for an `offsets` of `num_offsets` entries (features read their table's group)."""
        plan = self._base.plan_for(num_offsets, batch_size_per_feature)  # the training TBE's checks
        return FeaturePlan.build(self.tables, self.layout, self.feature_table_map, plan.batch, plan.vbe)

    # -- params ----------------------------------------------------------------------------------------------------
    def check_params(self, params) -> None:
        """Raises unless `params` are this embedding's word buffers (keys, int32, shapes). Static."""
        if not isinstance(params, Mapping):
            raise TypeError(f"qparams must be the dict tbe_jax.quantize / from_fbgemm return, got "
                            f"{type(params).__name__}")
        want = {self.layout.buffer_key(b) for b in range(self.layout.num_buffers)}
        if set(params) != want:
            raise ValueError(f"qparams hold buffers {sorted(params)}; this embedding's are {sorted(want)} "
                             "(build them with tbe_jax.quantize or from_fbgemm)")
        for b in range(self.layout.num_buffers):
            key, shape = self.layout.buffer_key(b), self.layout.buffer_shape(b)
            x = params[key]
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise TypeError(f"qparams[{key!r}] must be an array (int32{list(shape)}), got {type(x).__name__}")
            if tuple(x.shape) != shape or x.dtype != jnp.int32:
                raise ValueError(f"qparams[{key!r}] must be int32{list(shape)}, got {x.dtype}{list(x.shape)}")

    def zero_params(self) -> dict:
        """Params of all-zero rows (every value dequantizes to 0): the shapes a layer initialises before the
        trained rows are copied in."""
        return {self.layout.buffer_key(b): jnp.zeros(self.layout.buffer_shape(b), jnp.int32)
                for b in range(self.layout.num_buffers)}

    def _table_words(self, params, t: int):
        b = self.layout.table_buffer[t]
        r0 = self.layout.table_row_offset[t]
        return params[self.layout.buffer_key(b)][r0 : r0 + self.tables[t].num_embeddings]

    def get_tables(self, params) -> list[jax.Array]:
        """Per table, its dequantized values: float32 `[E_t, D_t]` (`quant_format.dequantize_rows`)."""
        self.check_params(params)
        return [quant_format.dequantize_rows(quant_format.from_words(self._table_words(params, t)), wt,
                                             spec.embedding_dim)
                for t, (spec, wt) in enumerate(zip(self.tables, self.weight_dtypes))]

    def to_fbgemm(self, params) -> list[jax.Array]:
        """Per table, its rows in FBGEMM's IntNBit layout: uint8 `[E_t, quant_format.row_bytes(D_t, wt_t)]`."""
        self.check_params(params)
        return [quant_format.from_words(self._table_words(params, t)) for t in range(len(self.tables))]

    def from_fbgemm(self, rows: Sequence) -> dict:
        """The params holding `rows` (per table uint8 `[E_t, row_bytes]`, FBGEMM's IntNBit rows, as `to_fbgemm`
        returns or FBGEMM stores them): the tables' words stacked per buffer."""
        if isinstance(rows, Mapping) or not isinstance(rows, Sequence):
            raise TypeError(f"rows must be a sequence of {len(self.tables)} uint8 arrays, one per table, got "
                            f"{type(rows).__name__}")
        if len(rows) != len(self.tables):
            raise ValueError(f"expected {len(self.tables)} tables' rows, got {len(rows)}")
        parts: list[list] = [[] for _ in range(self.layout.num_buffers)]
        for t, (spec, wt, r) in enumerate(zip(self.tables, self.weight_dtypes, rows)):
            shape = (spec.num_embeddings, quant_format.row_bytes(spec.embedding_dim, wt))
            if not hasattr(r, "shape"):
                r = np.asarray(r)
            if getattr(r, "dtype", None) != np.uint8 or tuple(r.shape) != shape:
                raise ValueError(f"{spec.label(t)} ({wt}, D={spec.embedding_dim}): rows must be uint8{list(shape)}, "
                                 f"got {getattr(r, 'dtype', None)}{list(r.shape)}")
            parts[self.layout.table_buffer[t]].append(quant_format.to_words(jnp.asarray(r)))
        return {self.layout.buffer_key(b): p[0] if len(p) == 1 else jnp.concatenate(p, axis=0)
                for b, p in enumerate(parts)}

    # -- forward -----------------------------------------------------------------------------------------------------
    def __call__(self, params, indices, offsets, per_sample_weights=None, *, batch_size_per_feature=None,
                 max_batch_size=None):
        """Look up and pool: as `TableBatchedEmbedding.__call__` (same inputs, output layout and bounds modes), in
        `output_dtype`."""
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            return _jit_forward(*dispatch.eager_args(indices, offsets, per_sample_weights, bpf), params, qemb=self,
                                static_bpf=dispatch.static_bpf(bpf), warn=True)[0]
        return dispatch.forward(self, params, indices, offsets, per_sample_weights, bpf, True, lookup=_lookup)[0]

    def forward_with_report(self, params, indices, offsets, per_sample_weights=None, *,
                            batch_size_per_feature=None, max_batch_size=None):
        """`(out, BoundsReport)`: as `TableBatchedEmbedding.forward_with_report`."""
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        if self._eager(params, indices, offsets, per_sample_weights, bpf):
            return _jit_forward(*dispatch.eager_args(indices, offsets, per_sample_weights, bpf), params, qemb=self,
                                static_bpf=dispatch.static_bpf(bpf), warn=False)
        return dispatch.forward(self, params, indices, offsets, per_sample_weights, bpf, False, lookup=_lookup)

    def bounds_report(self, indices, offsets, *, batch_size_per_feature=None,
                      max_batch_size=None) -> bounds.BoundsReport:
        """Counts of bad ids and of malformed offsets entries, without a lookup (as the training TBE's)."""
        bpf = vbe.resolve(batch_size_per_feature, max_batch_size)
        indices = inputs.id_array("indices", inputs.as_array("indices", indices))
        offsets = inputs.id_array("offsets", inputs.as_array("offsets", offsets))
        offsets, size_fix = inputs.expand(self, offsets, bpf)
        plan = self.plan_for(offsets.shape[0], None if size_fix is not None else bpf)
        return inputs.add_size_fix(bounds.report(plan, indices, offsets)[1], size_fix)

    def _eager(self, *args) -> bool:
        """Outside any trace: one jitted program per shape (not in "fatal" mode, which raises from the host)."""
        return self.bounds_check != "fatal" and inputs.is_concrete(*jax.tree_util.tree_leaves(args))


def quantize(emb: TableBatchedEmbedding, params, weight_dtype, *, output_dtype=jnp.float16, impl: str | None = None,
             interpret: bool | None = None, kernel_config: fwd_kernels.ForwardConfig | None = None,
             chunk_rows: int = 1 << 20):
    """`(qemb, qparams)`: the trained `emb`'s tables (`params`) quantized to `weight_dtype` (one name, or one per
    table) with FBGEMM's row quantizer (`quant_format.quantize_rows`).

    `qemb` is a `QuantizedTableBatchedEmbedding` with `emb`'s tables, features, pooling and bounds mode;
    `impl`, `interpret` and `kernel_config` default to `emb`'s, `output_dtype` to float16 (FBGEMM's default).
    `chunk_rows`: rows quantized per jitted call (the temporaries' size; the result does not depend on it).
    """
    if not isinstance(chunk_rows, int) or isinstance(chunk_rows, bool) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows!r}")
    if not isinstance(emb, TableBatchedEmbedding):
        raise TypeError(f"emb must be a tbe_jax.TableBatchedEmbedding, got {type(emb).__name__}")
    if any(t.location != "device" for t in emb.tables):
        # Tables in host memory (`location`): their merged rows, as an all-device embedding's (the serving tables
        # live on the device; a quantized host tier is not built).
        dev = TableBatchedEmbedding([dataclasses.replace(t, location="device") for t in emb.tables],
                                    feature_table_map=emb.feature_table_map, pooling=emb.pooling,
                                    weights_dtype=emb.weights_dtype, bounds_check=emb.bounds_check, impl=emb.impl,
                                    interpret=emb.interpret, kernel_config=emb.kernel_config, pad_rows=emb.pad_rows)
        emb, params = dev, dev.set_tables(None, emb.get_tables(params))
    qemb = QuantizedTableBatchedEmbedding(
        emb.tables, weight_dtype, feature_table_map=emb.feature_table_map, pooling=emb.pooling,
        output_dtype=output_dtype, bounds_check=emb.bounds_check, impl=emb.impl if impl is None else impl,
        interpret=emb.interpret if interpret is None else interpret,
        kernel_config=emb.kernel_config if kernel_config is None else kernel_config)
    emb.check_params(params)
    return qemb, _quantize_buffers(qemb, emb, params, chunk_rows)


def _quantize_buffers(qemb: QuantizedTableBatchedEmbedding, emb: TableBatchedEmbedding, params, chunk_rows: int):
    """The word buffers of `emb`'s tables quantized: the tables of at most `chunk_rows` rows in one jitted call,
    larger ones `chunk_rows` rows per call written in place into their buffer (donated). Besides the tables this
    takes the quantized buffers and one chunk's temporaries, not a float copy of every table (MLPerf's tables
    are 49-97 GiB)."""
    lay = qemb.layout
    big = tuple(t for t, spec in enumerate(qemb.tables) if spec.num_embeddings > chunk_rows)
    bufs = list(_quantize_small(params, qemb=qemb, emb=emb, skip=big))
    for t in big:
        e, wt = qemb.tables[t].num_embeddings, qemb.weight_dtypes[t]
        g, src0 = emb.layout.table_group[t], emb.layout.table_row_offset[t]
        b, dst0 = lay.table_buffer[t], lay.table_row_offset[t]
        # the last chunk starts at e - chunk_rows: it re-quantizes rows of the one before, to the same bytes
        for start in sorted({min(k, e - chunk_rows) for k in range(0, e, chunk_rows)}):
            bufs[b] = _quantize_chunk(bufs[b], params[emb.layout.key(g)], jnp.int32(src0 + start),
                                      jnp.int32(dst0 + start), dim=qemb.tables[t].embedding_dim, wt=wt,
                                      size=chunk_rows)
    return {lay.buffer_key(b): buf for b, buf in enumerate(bufs)}


@functools.partial(jax.jit, static_argnames=("qemb", "emb", "skip"))
def _quantize_small(params, *, qemb, emb, skip):
    """Every buffer, with the tables not in `skip` quantized into it (the others' rows zero)."""
    lay = qemb.layout
    tables = emb.get_tables(params)
    bufs = [jnp.zeros(lay.buffer_shape(b), jnp.int32) for b in range(lay.num_buffers)]
    for t, (w, wt) in enumerate(zip(tables, qemb.weight_dtypes)):
        if t in skip or w.shape[0] == 0:
            continue
        words = quant_format.to_words(quant_format.quantize_rows(w.astype(jnp.float32), wt))
        b = lay.table_buffer[t]
        bufs[b] = jax.lax.dynamic_update_slice(bufs[b], words, (lay.table_row_offset[t], 0))
    return tuple(bufs)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("dim", "wt", "size"))
def _quantize_chunk(buf, src, src_row, dst_row, *, dim, wt, size):
    """`size` rows of the float buffer `src` from `src_row` (their first `dim` columns) quantized into `buf` at
    `dst_row`."""
    chunk = jax.lax.dynamic_slice(src, (src_row, jnp.int32(0)), (size, dim)).astype(jnp.float32)
    words = quant_format.to_words(quant_format.quantize_rows(chunk, wt))
    return jax.lax.dynamic_update_slice(buf, words, (dst_row, jnp.int32(0)))


# -- the lookup (dispatch.forward's `lookup`) ----------------------------------------------------------------------


def _lookup(emb: QuantizedTableBatchedEmbedding, plan, count, params, per_sample_weights, indices, offsets):
    """The lookup on the checked int32 batch: `(out, [2] int32 kernel counts)` (bad ids, malformed offsets)."""
    layout = emb.layout
    n_bad = jnp.zeros((2,), jnp.int32)
    if indices.shape[0] == 0:  # every bag is empty
        return jnp.zeros(dispatch.out_shape(emb, plan, 0), emb.output_dtype), n_bad
    if emb.pooling == "none":
        buffers = layout.group_buffers(params)
        return _sequence(emb, buffers, plan, indices, offsets, per_sample_weights), n_bad
    if not emb.uses_kernel():
        buffers, fmts = layout.group_buffers(params), layout.formats

        def load(g, rows):
            return quant_rows.take_rows(buffers[layout.key(g)], rows, fmts[g], layout.dims[g])

        return reference.pooled_forward(buffers, layout, plan, indices, offsets, per_sample_weights,
                                        pooling=emb.pooling, output_dtype=emb.output_dtype, load=load), n_bad
    # one kernel branch per buffer (the features of its several dims share it)
    klayout = layout.kernel_layout
    flat = fwd_kernels.pooled_forward(
        params, klayout, layout.kernel_plan(plan), indices, offsets, per_sample_weights, pooling=emb.pooling,
        output_dtype=emb.output_dtype, check_upper=emb.bounds_check != "none", config=emb.kernel_config,
        interpret=emb.interpret, count_invalid=count, short=dispatch.short_bag_features(emb),
        formats=klayout.formats)
    if count:
        flat, n_bad = flat
    if not plan.vbe:
        flat = flat.reshape(plan.batch[0] if plan.batch else 0, sum(emb.feature_dims))
    return flat, n_bad


def _sequence(emb, buffers, plan, indices, offsets, per_sample_weights):
    """`pooling="none"`: `[N, D]`, one kernel launch per group (all groups have one dim: one per buffer), or the
    XLA path's gather."""
    layout = emb.layout
    kernel = emb.uses_kernel()
    n = indices.shape[0]
    _, feat = preprocess.position_features(plan, offsets, n)
    ok = preprocess.valid_lookups(plan, indices, offsets, feat, check_upper=emb.bounds_check != "none" or not kernel)
    rows = jnp.asarray(np.asarray(plan.row_offset, np.int32))[feat] + indices
    group = jnp.asarray(np.asarray(plan.group, np.int32))[feat]
    used = sorted(set(plan.group))
    out = None
    for g in used:
        mine = ok if len(used) == 1 else ok & (group == g)
        if kernel:
            x = fwd_kernels.sequence_forward(
                buffers[layout.key(g)], jnp.where(mine, rows, -1), per_sample_weights, dim=layout.dims[g],
                output_dtype=emb.output_dtype, config=emb.kernel_config, interpret=emb.interpret,
                fmt=layout.formats[g])
        else:
            x = quant_rows.take_rows(buffers[layout.key(g)], jnp.where(mine, rows, 0), layout.formats[g],
                                     layout.dims[g])
        out = x if out is None else jnp.where((group == g)[:, None], x, out)
    if kernel:
        return out
    scale = ok.astype(jnp.float32)
    if per_sample_weights is not None:
        scale = jnp.where(ok, per_sample_weights, 0.0)
    return jnp.where(ok[:, None], out * scale[:, None], 0.0).astype(emb.output_dtype)


@functools.partial(jax.jit, static_argnames=("qemb", "static_bpf", "warn"))
def _jit_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, qemb, static_bpf, warn):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return dispatch.forward(qemb, params, indices, offsets, per_sample_weights, bpf, warn, lookup=_lookup)
