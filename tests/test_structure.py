"""Structure of what a many-feature model compiles to, checked without a GPU.

The forward and the optimizer step are lowered for CUDA on this machine
(`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs every Triton
lowering rule without compiling PTX). Nothing in them may grow with the batch
size, and the number of kernel launches may not grow with the feature count.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tbe_jax

DIMS = (16, 32, 48, 64, 96, 128)


def _model(num_features: int, kernel_config=None) -> tbe_jax.TableBatchedEmbedding:
    rng = np.random.default_rng(num_features)
    rows = np.exp(rng.uniform(np.log(100), np.log(200_000), num_features)).astype(int)
    tables = [tbe_jax.TableSpec(int(e), DIMS[i % len(DIMS)]) for i, e in enumerate(rows)]
    emb = tbe_jax.TableBatchedEmbedding(tables, weights_dtype=jnp.float16, impl="pallas", kernel_config=kernel_config)
    emb.uses_kernel = lambda: True  # lowered for CUDA on this CPU machine: the kernel path, not run
    return emb


def _abstract(emb, batch, ids_per_bag=8):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float16)
              for k, s in ((emb.layout.key(g), (emb.layout.group_rows[g], d)) for g, d in enumerate(emb.layout.dims))}
    n = emb.num_features * batch * ids_per_bag
    indices = jax.ShapeDtypeStruct((n,), jnp.int32)
    offsets = jax.ShapeDtypeStruct((emb.num_features * batch + 1,), jnp.int32)
    return params, indices, offsets


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _forward_hlo(emb, batch):
    params, indices, offsets = _abstract(emb, batch)
    return _lowered_text(lambda p, i, o: emb(p, i, o), params, indices, offsets)


def _step_hlo(emb, batch):
    params, indices, offsets = _abstract(emb, batch)
    opt = tbe_jax.RowwiseAdagrad(learning_rate=0.01)
    state = jax.eval_shape(lambda p: emb.init_opt_state(p, opt), params)
    grad = jax.ShapeDtypeStruct((batch, sum(emb.feature_dims)), jnp.float32)

    def step(p, s, o, i, off, g):
        return emb.apply_gradients(p, s, o, i, off, g)

    return _lowered_text(step, params, state, opt, indices, offsets, grad)


def _custom_calls(text: str) -> int:
    return len(re.findall(r"stablehlo\.custom_call", text))


# The forward's default launch is a looping grid when its schedule outnumbers one resident wave (32 programs an
# SM), else a plain grid: which one depends on the batch and on the SM count (on an H100, 1024 bags a feature
# took the plain grid and 8192 the looping one, a longer kernel: the compiled suite, session 60). Each grid is
# pinned here, so that the two sizes compare the same kernel.
@pytest.mark.parametrize("build,config", [
    (_forward_hlo, tbe_jax.ForwardConfig(persistent_max_mean=0)),
    (_forward_hlo, tbe_jax.ForwardConfig(max_programs=64)),
    (_step_hlo, None)], ids=["forward-plain", "forward-looping", "step"])
def test_hlo_does_not_grow_with_batch(build, config):
    emb = _model(10, config)
    small, large = build(emb, 1024), build(emb, 8192)
    # Only shapes may differ (digits in type signatures), never the amount of text.
    assert abs(len(large) - len(small)) < 0.01 * len(small), (len(small), len(large))


@pytest.mark.parametrize("build", [_forward_hlo, _step_hlo], ids=["forward", "step"])
def test_launches_do_not_grow_with_features(build):
    counts, sizes = {}, {}
    for f in (10, 1000):  # two sizes (each lowering costs seconds); 10 features already hold every dim of DIMS
        text = build(_model(f), 1024)
        counts[f] = _custom_calls(text)
        sizes[f] = len(text)
    assert counts[10] == counts[1000], counts
    # At most a small constant per feature (the per-feature tables the kernels read).
    per_feature = (sizes[1000] - sizes[10]) / 990
    assert per_feature < 400, (sizes, per_feature)
    assert sizes[1000] < 2_000_000, sizes


def test_program_map_matches_explicit_table():
    """The on-device program lookup (`programs.locate`) equals the explicit per-program table."""
    from tbe_jax.kernels import programs

    rng = np.random.default_rng(0)
    arithmetic = 0
    batches = ([5, 5, 5, 5], [3, 0, 7, 1, 9], [0, 0, 4], [33] * 7)
    cases = [(b, order) for b in batches for order in ("shuffled", "sorted")]
    for batch, order in cases:
        bag_base = np.concatenate([[0], np.cumsum(batch)[:-1]]).tolist()
        feats = list(rng.permutation(len(batch))) if order == "shuffled" else list(range(len(batch)))
        pm = programs.build(bag_base, batch, [(feats[:2], 2), (feats[2:], 4)])
        # Consecutive features of one batch size locate by arithmetic (`Segment.feat0`), the others by lookup.
        arithmetic += sum(seg.feat0 >= 0 for seg in pm.segments)
        table = programs.rows(pm)
        flist, prefix = programs.operands(pm)
        got = []
        for seg in pm.segments:
            got.extend(_locate_interpret(seg, seg.prog_end - seg.prog_start, flist, prefix))
        np.testing.assert_array_equal(np.asarray(got, np.int32).reshape(-1, 4), table)
    assert arithmetic >= 4


def _locate_interpret(seg, n, flist, prefix):
    """`programs.locate` for programs 0..n-1 of `seg`, in interpret mode: one launch of n programs, each
    locating its own program id (traced, as in the kernels), instead of one compiled launch per program."""
    from jax.experimental import pallas as pl

    from tbe_jax.pallas_compat import plgpu
    from tbe_jax.kernels import programs

    def kernel(flist_ref, prefix_ref, out_ref):
        q = pl.program_id(0)
        vals = programs.locate(seg, q, flist_ref, prefix_ref)
        for k, v in enumerate(vals):
            plgpu.store(out_ref.at[4 * q + k], jnp.asarray(v, jnp.int32))

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4 * n,), jnp.int32), grid=(n,),
                         interpret=True)(flist, prefix)
    return [[int(v) for v in row] for row in np.asarray(out).reshape(n, 4)]
