"""The lookup and the optimizer step of a `TableBatchedEmbedding`: the kernels or the XLA reference, behind one API.

- `forward`: the checked lookup and its bounds report (`emb(...)`, `emb.forward_with_report`; also the
  quantized TBE's, `tbe_jax.quant`, with its own `lookup`);
- `apply_gradients`: the checked fused optimizer step (`emb.apply_gradients`);
- `step_forward`, `step_update`: the training step's halves (`emb.step_forward`, `emb.step_update`), the batch
  checked once for both;
- `sorted_runs`: the sorted runs of a batch's lookups, which the backward kernels read (`step_forward` builds
  them in the forward when `BackwardConfig.sort_in_forward`);
- `jit_forward`, `jit_apply`, `jit_step_forward`, `jit_step_update`: eager calls (outside `jit`) as one jitted
  program each, and `eager_args`, `static_bpf`, their arguments;
- `out_shape`: a batch's output shape.

The way down of a batch's `indices` (each stop once, in this order):

1. `TableBatchedEmbedding.__call__` / `forward_with_report` / `apply_gradients` / `step_forward` (`tbe.py`):
   `vbe.resolve` the batch sizes; outside a trace, `eager_args` and one `jit_*` program;
2. `inputs.prepare`: the checks (arrays, 1-D integer ids, narrow integer types widened, weights, params), array
   batch sizes expanded into the offsets (`vbe`), the static `FeaturePlan`;
3. the bounds mode: `inputs.check_fatal` ("fatal"), `bounds.repair_offsets` ("warning"), the report's counts
   (`bounds.count_invalid` / `count_malformed`, or the pooled kernels' own);
4. `inputs.narrow`: int32 ids and offsets, fp32 weights (the kernels' types);
5. `preprocess`: each lookup's bag, feature, validity and weight, for the XLA path and around the kernels
   (`_sequence`'s rows, `runs.lookup_keys`' keys);
6. the forward, `_lookup`: `kernels.forward` / `kernels.histogram`, or `reference.pooled_forward` /
   `sequence_forward`; the update, `_update`: `sorted_runs` (`runs.build_runs`: keys, sort, runs) then
   `kernels.backward.fused_update` / `kernels.histogram_backward.histogram_update`, or `sparse_update` (XLA).

`step_update` starts at 6 with `step_forward`'s checked int32 batch (and its runs): stops 1-4 run once per step.

The differentiable core is `_lookup`, a `custom_vjp` on validated int32 inputs: the forward kernels (generic and
histogram), the sequence kernel, or the jnp reference; its VJP is the sorted-run backward storing the true
gradient, the same kernels `apply_gradients` runs with an optimizer instead. Every function takes the embedding
first and reads only its public attributes and methods (`uses_kernel`, `plan`, `plan_for`, `layout`, ...).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tbe_jax import bounds, inputs, memory, preprocess, reference, runs as runs_lib, sparse_update, vbe
from tbe_jax.kernels import backward as bwd_kernels
from tbe_jax.kernels import forward as fwd_kernels
from tbe_jax.kernels import histogram as hist_kernels
from tbe_jax.kernels import histogram_backward as hist_bwd


def forward(emb, params, indices, offsets, per_sample_weights, batch_size_per_feature, warn, lookup=None):
    """The forward: `(out, BoundsReport)`; `warn` issues the warning-mode callback.

    `lookup(emb, plan, count, params, per_sample_weights, indices, offsets) -> (out, [2] kernel counts)`: the
    lookup on the checked int32 batch; None: this module's (the training TBE's kernels or XLA reference). The
    quantized TBE (`tbe_jax.quant`) passes its own, so its inputs take this same pipeline.
    """
    out, report, _ = checked_forward(emb, params, indices, offsets, per_sample_weights, batch_size_per_feature,
                                      warn, lookup)
    return out, report


def checked_forward(emb, params, indices, offsets, per_sample_weights, batch_size_per_feature, warn,
                     lookup=None):
    """`forward`, and the batch it looked up: `(out, report, (plan, int32 indices, offsets, fp32 weights))`, the
    inputs after the checks and the bounds mode's repairs (what `inputs.validated` returns)."""
    plan, indices, offsets, per_sample_weights, size_fix = inputs.prepare(
        emb, params, indices, offsets, per_sample_weights, batch_size_per_feature)
    n = indices.shape[0]

    # The report: wanted by `forward_with_report` (and the training step, through it) in every mode, by a plain
    # call (`warn`) in "warning" mode only. The pooled kernels count the ids they skip and the malformed offsets
    # entries themselves (two slots per program; with the counting on, the forward kernel ran 1.14x its time of
    # the session before on 81 sweep shards, median, up to 1.87x: `benchmarks/NOTES.md`, session 24; so a plain
    # call's kernels do not count); the other paths count with XLA passes. "warning" repairs the offsets first
    # (its count: the entries changed).
    mode = emb.bounds_check
    wanted = not warn or mode == "warning"
    # No kernel runs on a batch without ids or without bags (the lookup returns zeros): XLA counts then.
    count = wanted and emb.pooling != "none" and emb.uses_kernel() and n > 0 and plan.num_bags > 0
    n_fixed = None
    if mode == "fatal":
        offsets = inputs.check_fatal(emb, plan, indices, offsets)
    elif mode == "warning":
        offsets, n_fixed = bounds.repair_offsets(offsets, n)
    counts = None
    if wanted and not count and mode != "fatal":
        counts = (bounds.count_invalid(plan, indices, offsets),
                  n_fixed if n_fixed is not None else bounds.count_malformed(offsets, n))
    indices, offsets, per_sample_weights = inputs.narrow(indices, offsets, per_sample_weights)

    out, kernel_counts = (lookup or _lookup)(emb, plan, count, params, per_sample_weights, indices, offsets)
    batch = (plan, indices, offsets, per_sample_weights)
    if mode == "fatal" or not wanted:  # checked, or not asked for: nothing to report
        return out, bounds.BoundsReport(jnp.int32(0), jnp.int32(0)), batch
    if count:
        counts = (kernel_counts[0], n_fixed if n_fixed is not None else kernel_counts[1])
    report = inputs.add_size_fix(bounds.BoundsReport(*counts), size_fix)
    if warn and mode == "warning":
        bounds.warn_if_repaired(report)
    return out, report, batch


def step_forward(emb, params, indices, offsets, per_sample_weights, batch_size_per_feature):
    """`emb.step_forward`'s arrays: `(out, report, indices, offsets, per_sample_weights, runs)`, the inputs as
    checked and repaired once for both halves of the step (int32 ids and offsets, the latter in the fixed-batch
    form when the batch sizes are an array; fp32 weights); `runs`: the batch's sorted runs when
    `BackwardConfig.sort_in_forward` on the kernel path (else None)."""
    out, report, (plan, indices, offsets, per_sample_weights) = checked_forward(
        emb, params, indices, offsets, per_sample_weights, batch_size_per_feature, warn=False)
    runs = None
    if emb.backward_config.sort_in_forward and emb.uses_kernel() and emb.pooling != "none" and indices.shape[0]:
        runs = sorted_runs(emb, plan, indices, offsets, per_sample_weights)
    return out, report, indices, offsets, per_sample_weights, runs


def apply_gradients(emb, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights,
                    batch_size_per_feature, backward_config):
    """The optimizer step: `(params, opt_state)`."""
    emb.check_optimizer(opt)
    emb.check_params(params)
    opt.check_state(opt_state, params)
    plan, indices, offsets, per_sample_weights = inputs.validated(
        emb, params, indices, offsets, per_sample_weights, batch_size_per_feature)
    return _checked_update(emb, plan, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights,
                           backward_config)


def step_update(emb, params, opt_state, opt, residuals, grad_output):
    """`emb.step_update`: the optimizer step on `step_forward`'s checked batch (not checked again), `(params,
    opt_state, invalid_indices)`."""
    indices, offsets, per_sample_weights, batch_size_per_feature, report, runs = residuals
    if inputs.is_concrete(*jax.tree_util.tree_leaves((params, opt_state, opt, residuals, grad_output))):
        # Eager (a layer's `train_step` outside `jit`): one program, as `jit_apply`. Op by op, each kernel that
        # updates a host buffer in place would be a program of its own returning that buffer outside host memory.
        return jit_step_update(params, opt_state, opt, (indices, offsets, per_sample_weights, report, runs),
                               grad_output, emb=emb, static_bpf=batch_size_per_feature)
    emb.check_optimizer(opt)
    emb.check_params(params)
    opt.check_state(opt_state, params)
    plan = emb.plan_for(offsets.shape[0], batch_size_per_feature)
    params, opt_state = _checked_update(emb, plan, params, opt_state, opt, indices, offsets, grad_output,
                                        per_sample_weights, None, runs=runs)
    return params, opt_state, report.invalid_indices


def _checked_update(emb, plan, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights,
                    backward_config, runs=None):
    """The step on a checked batch (`grad_output` checked here). `runs`: its sorted runs when the forward built
    them."""
    grad_output = jnp.asarray(grad_output)
    want = out_shape(emb, plan, indices.shape[0])
    if tuple(grad_output.shape) != want:
        raise ValueError(f"grad_output has shape {tuple(grad_output.shape)}; this batch's output is {want}")
    if not jnp.issubdtype(grad_output.dtype, jnp.floating):
        raise TypeError(f"grad_output must be floating point, got {grad_output.dtype}")
    rule = opt.rule()
    new_w, new_s = _update(emb, plan, rule, opt.hyperparameters(opt_state.count), params,
                           opt.slots(opt_state), indices, offsets, per_sample_weights, grad_output,
                           backward_config, runs=runs)
    return new_w, opt.next_state(opt_state, new_s)


def out_shape(emb, plan, n):
    """The output shape of a batch of `n` ids with feature plan `plan`."""
    if emb.pooling == "none":
        return (n, emb.feature_dims[0])
    return (plan.out_size,) if plan.vbe else (plan.batch[0], sum(emb.feature_dims))


def _lookup_impl(emb, plan, count, params, per_sample_weights, indices, offsets):
    """The differentiable core on validated int32 inputs: `(out, skipped ids)`."""
    check_upper = emb.bounds_check != "none"
    n = indices.shape[0]
    n_bad = jnp.zeros((2,), jnp.int32)  # the kernels' counts: bad ids, malformed offsets entries
    if n == 0:  # every bag is empty: the result is all zeros, no kernel needed
        return jnp.zeros(out_shape(emb, plan, n), emb.output_dtype), n_bad
    if emb.pooling == "none":
        return _sequence(emb, params, plan, indices, offsets, per_sample_weights), n_bad
    if not emb.uses_kernel():
        return reference.pooled_forward(
            params, emb.layout, plan, indices, offsets, per_sample_weights,
            pooling=emb.pooling, output_dtype=emb.output_dtype,
        ), n_bad
    paths = emb.plan(weighted=per_sample_weights is not None, vbe=plan.vbe)
    generic = [f for f, p in enumerate(paths) if p != "histogram"]
    hist = [f for f, p in enumerate(paths) if p != "generic"]
    auto = [f for f, p in enumerate(paths) if p == "auto"]
    long_bags = None
    if auto:  # chosen on the device from this batch's bag lengths: both kernels read the one `[F]` choice
        fixed = np.asarray([p == "histogram" for p in paths], np.int32)
        long_bags = jnp.asarray(fixed) + hist_kernels.long_bags(plan, offsets, auto)
    flat = None
    if generic:
        flat = fwd_kernels.pooled_forward(
            params, emb.layout, plan, indices, offsets, per_sample_weights,
            pooling=emb.pooling, output_dtype=emb.output_dtype, check_upper=check_upper,
            config=emb.kernel_config, interpret=emb.interpret,
            count_invalid=count, features=generic, long_bags=long_bags, short=short_bag_features(emb),
        )
        if count:
            flat, n_bad = flat
    if hist:  # a second launch fills the histogram features' columns in place
        flat = hist_kernels.histogram_forward(
            flat, params, emb.layout, plan, hist, indices, offsets,
            pooling=emb.pooling, check_upper=check_upper, interpret=emb.interpret,
            config=emb.histogram_config, count_invalid=count, long_bags=long_bags,
        )
        if count:
            flat, hist_bad = flat
            n_bad = n_bad + hist_bad
    if not plan.vbe:
        flat = flat.reshape(plan.batch[0] if plan.batch else 0, sum(emb.feature_dims))
    return flat, n_bad


def short_bag_features(emb) -> tuple[int, ...]:
    """Features whose table's `bag_size_hint` says their bags hold at most two ids (the forward gives them
    `ForwardConfig.short_bag_groups` sub-groups of bags per program)."""
    return tuple(f for f, t in enumerate(emb.feature_table_map)
                 if emb.tables[t].bag_size_hint is not None and emb.tables[t].bag_size_hint <= 2)


def _sequence(emb, params, plan, indices, offsets, per_sample_weights):
    if not emb.uses_kernel():
        return reference.sequence_forward(
            params, emb.layout, plan, indices, offsets, per_sample_weights,
            output_dtype=emb.output_dtype,
        )
    _, feat = preprocess.position_features(plan, offsets, indices.shape[0])
    ok = preprocess.valid_lookups(plan, indices, offsets, feat, check_upper=emb.bounds_check != "none")
    row_offset = jnp.asarray(np.asarray(plan.row_offset, np.int32))
    rows = jnp.where(ok, row_offset[feat] + indices, -1)
    if len(emb.layout.dims) == 1:
        return fwd_kernels.sequence_forward(
            params[emb.layout.key(0)], rows, per_sample_weights, dim=emb.layout.dims[0],
            output_dtype=emb.output_dtype, config=emb.kernel_config, interpret=emb.interpret,
        )
    # tables of one dim in device and host buffers: a launch per buffer, each row from one of them
    group = jnp.asarray(np.asarray(plan.group, np.int32))[feat]
    out = None
    for g in range(len(emb.layout.dims)):
        part = fwd_kernels.sequence_forward(
            params[emb.layout.key(g)], jnp.where(group == g, rows, -1), per_sample_weights, dim=emb.layout.dims[0],
            output_dtype=jnp.float32, config=emb.kernel_config, interpret=emb.interpret)
        out = part if out is None else out + part
    return out.astype(emb.output_dtype)


def _histogram_features(emb, plan, per_sample_weights) -> list[int]:
    """Features whose backward takes the histogram kernels in this call (`plan(backward=True)`)."""
    if emb.pooling == "none" or not emb.uses_kernel():
        return []
    paths = emb.plan(weighted=per_sample_weights is not None, vbe=plan.vbe, backward=True)
    return [f for f, p in enumerate(paths) if p == "histogram"]


def sorted_runs(emb, plan, indices, offsets, per_sample_weights, backward_config=None):
    """The sorted runs of the generic features' lookups; None when every feature is a histogram one.

    The histogram features' lookups get the sentinel key (no runs): their
    tables are updated by the histogram backward.
    """
    hist = _histogram_features(emb, plan, per_sample_weights)
    if len(hist) == plan.num_features:
        return None
    plan = runs_lib.without_features(plan, hist)
    cfg = backward_config or emb.backward_config
    return runs_lib.build_runs(emb.layout, plan, indices, offsets, per_sample_weights,
                               pooling=emb.pooling, config=cfg, sequence=emb.pooling == "none",
                               interpret=emb.interpret, segment_bounds=bwd_kernels.segment_bounds(emb.layout, cfg))


def _update(emb, plan, opt, hyper, params, slots, indices, offsets, per_sample_weights, grad_output,
            backward_config=None, runs=None):
    """The fused update on validated int32 inputs: (tables, state slots).

    `opt`: a `tbe_jax.optim.KernelRule` (None: store the true gradient); `hyper`:
    the step's `Optimizer.hyperparameters`; `slots`: the state's slots (a tuple of
    dicts like `params`, empty for SGD).

    `runs`: the batch's sorted runs when the forward already built them.
    Histogram features (see `plan()`) are left out of the runs: their tables
    get `counts^T @ grad_output` from the histogram backward kernels.
    """
    slots = tuple(slots or ())
    if indices.shape[0] == 0:
        return params, slots
    if emb.uses_kernel():
        hist = _histogram_features(emb, plan, per_sample_weights)
        g32 = grad_output.astype(jnp.float32)
        if len(hist) < plan.num_features:
            if runs is None:
                runs = sorted_runs(emb, plan, indices, offsets, per_sample_weights, backward_config)
            params, slots = bwd_kernels.fused_update(
                params, slots, emb.layout, runs, g32, opt, hyper,
                config=backward_config or emb.backward_config, interpret=emb.interpret,
            )
        if hist:  # their tables: counts^T x dout, then the optimizer (no sort)
            params, slots = hist_bwd.histogram_update(
                params, slots, emb.layout, plan, hist, indices, offsets, g32, opt, hyper,
                pooling=emb.pooling, config=emb.histogram_config, interpret=emb.interpret,
            )
        host = [emb.layout.key(g) for g in range(len(emb.layout.dims)) if emb.layout.on_host(g)]
        if host and opt is not None:  # buffers in host memory, updated in place, stay there
            params = {k: memory.keep_on_host(v) if k in host else v for k, v in params.items()}
            slots = tuple({k: memory.keep_on_host(v) if k in host else v for k, v in d.items()} for d in slots)
        return params, slots
    return sparse_update.apply_gradients(
        params, slots, emb.layout, plan, indices, offsets, per_sample_weights,
        grad_output, opt, hyper, pooling=emb.pooling,
    )


def static_bpf(bpf):
    return None if isinstance(bpf, vbe.VariableBatchSizes) else (None if bpf is None else inputs.static_sizes(bpf))


def eager_args(indices, offsets, per_sample_weights, bpf):
    """The array arguments of an eager call, as arrays (lists and NumPy arrays converted as the traced path does)."""
    psw = None if per_sample_weights is None else jnp.asarray(per_sample_weights)
    dyn = bpf if isinstance(bpf, vbe.VariableBatchSizes) else None
    return inputs.as_array("indices", indices), inputs.as_array("offsets", offsets), psw, dyn


# Eager calls (outside jit) run as one jitted program each: one compilation per shape instead of one per
# operation (tens of small XLA programs on the reference path and around the kernels).
@functools.partial(jax.jit, static_argnames=("emb", "static_bpf", "warn"))
def jit_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, emb, static_bpf, warn):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return forward(emb, params, indices, offsets, per_sample_weights, bpf, warn)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf"))
def jit_step_forward(indices, offsets, per_sample_weights, dyn_bpf, params, *, emb, static_bpf):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return step_forward(emb, params, indices, offsets, per_sample_weights, bpf)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf", "backward_config"))
def jit_apply(indices, offsets, per_sample_weights, dyn_bpf, params, opt_state, opt, grad_output, *, emb,
              static_bpf, backward_config):
    bpf = dyn_bpf if dyn_bpf is not None else static_bpf
    return apply_gradients(emb, params, opt_state, opt, indices, offsets, grad_output, per_sample_weights, bpf,
                           backward_config)


@functools.partial(jax.jit, static_argnames=("emb", "static_bpf"))
def jit_step_update(params, opt_state, opt, arrays, grad_output, *, emb, static_bpf):
    indices, offsets, per_sample_weights, report, runs = arrays
    return step_update(emb, params, opt_state, opt, (indices, offsets, per_sample_weights, static_bpf, report, runs),
                       grad_output)


# -- differentiation -------------------------------------------------------------
# `jax.grad` through a lookup gives the true (dense) gradient of the tables and of
# the per-sample weights. On the kernel path the table gradient comes from the
# sorted-run kernels (each looked-up row's gradient summed once, in a fixed order,
# and stored into a zero gradient: the dense result is table-sized by definition);
# on the XLA path from the jnp reference VJP. `apply_gradients` and `train_step` run
# the same backward with the optimizer applied instead of the store.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _lookup(emb, plan, count, params, per_sample_weights, indices, offsets):
    return _lookup_impl(emb, plan, count, params, per_sample_weights, indices, offsets)


def _lookup_fwd(emb, plan, count, params, per_sample_weights, indices, offsets):
    out = _lookup_impl(emb, plan, count, params, per_sample_weights, indices, offsets)
    return out, (params, per_sample_weights, indices, offsets)


def _lookup_bwd(emb, plan, count, res, cotangents):
    params, per_sample_weights, indices, offsets = res
    g_out, _ = cotangents
    if indices.shape[0] == 0:
        zeros = jax.tree_util.tree_map(jnp.zeros_like, (params, per_sample_weights))
        return zeros + (None, None)
    if not emb.uses_kernel():
        d_params, d_psw = reference.pooled_backward(
            params, emb.layout, plan, indices, offsets, per_sample_weights, g_out, pooling=emb.pooling
        )
        return d_params, d_psw, None, None
    zeros = {k: jnp.zeros(v.shape, v.dtype) for k, v in params.items()}
    d_params, _ = _update(emb, plan, None, None, zeros, (), indices, offsets, per_sample_weights, g_out)
    d_psw = None
    if per_sample_weights is not None:
        d_psw = reference.per_sample_weight_grad(
            params, emb.layout, plan, indices, offsets, per_sample_weights, g_out, pooling=emb.pooling)
    return d_params, d_psw, None, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
